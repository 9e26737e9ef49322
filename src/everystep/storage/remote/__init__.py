"""The remote tier: full checkpoints copied to an object store in the background and brought back
(``tier``), one writer per prefix (``lock``), and the process that uploads (``uploader``)."""

from typing import TYPE_CHECKING

from ..._lazy import exports

if TYPE_CHECKING:
    from .lock import LOCK_KEY, RemoteLock, check_conditional_writes
    from .tier import Pulled, RemoteConfig, RemoteTier
    from .uploader import UploadProcess

__all__ = ["RemoteTier", "RemoteConfig", "Pulled", "RemoteLock", "LOCK_KEY", "check_conditional_writes",
           "UploadProcess"]

__getattr__, __dir__ = exports(__name__, {
    **dict.fromkeys(["RemoteTier", "RemoteConfig", "Pulled"], ".tier"),
    **dict.fromkeys(["RemoteLock", "LOCK_KEY", "check_conditional_writes"], ".lock"),
    "UploadProcess": ".uploader",
})
