"""Where checkpoints live: the Store protocol and a local-filesystem store, the catalog of checkpoints
over a store, the directory manager above it, tensor files, retention."""

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from .base import Manifest, ManifestRecord, ObjectInfo, Reader, Store
    from .catalog import Catalog
    from .directory import CheckpointDirectory
    from .local import LocalStore, StoreWriteError
    from .retention import plan_retention

__all__ = ["Manifest", "ManifestRecord", "ObjectInfo", "Reader", "Store", "Catalog", "CheckpointDirectory", "LocalStore",
           "StoreWriteError", "plan_retention"]

__getattr__, __dir__ = exports(__name__, {
    **dict.fromkeys(["Manifest", "ManifestRecord", "ObjectInfo", "Reader", "Store"], ".base"), "Catalog": ".catalog",
    "CheckpointDirectory": ".directory", "LocalStore": ".local", "StoreWriteError": ".local",
    "plan_retention": ".retention",
})
