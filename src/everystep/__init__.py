"""everystep: checkpointing cheap enough to run every training iteration, with exact recovery."""

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
from .state import TrainingComponents
from .tree import state_hash
from .strategies import STRATEGIES

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "OptimizerInBackward",
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
