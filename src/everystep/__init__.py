"""everystep: checkpointing cheap enough to run every training iteration, with exact recovery."""

from typing import TYPE_CHECKING

from ._lazy import exports

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .errors import (
        BackgroundWriteError,
        CheckpointDirectoryError,
        ConfigError,
        CorruptCheckpointError,
        DirectoryInUseError,
        EverystepError,
        NoValidCheckpointError,
        PeerFailedError,
        StateMismatchError,
        UnclosedCheckpointerWarning,
    )
    from .optim import OptimizerInBackward
    from .storage.remote import RemoteConfig
    from .state import TrainingComponents
    from .strategies import STRATEGIES
    from .tree import state_hash

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "OptimizerInBackward",
    "RemoteConfig",
    "TrainingComponents",
    "state_hash",
    "STRATEGIES",
    "EverystepError",
    "BackgroundWriteError",
    "CheckpointDirectoryError",
    "ConfigError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "NoValidCheckpointError",
    "PeerFailedError",
    "StateMismatchError",
    "UnclosedCheckpointerWarning",
]

__getattr__, __dir__ = exports(__name__, {
    "Checkpointer": ".checkpointer", "OptimizerInBackward": ".optim", "RemoteConfig": ".storage.remote",
    "TrainingComponents": ".state",
    "state_hash": ".tree", "STRATEGIES": ".strategies",
    **{name: ".errors" for name in __all__ if name.endswith(("Error", "Warning"))},
})
"""Each name is imported at its first use (``from everystep import Checkpointer`` imports PyTorch;
``import everystep.storage.stores.s3`` does not)."""
