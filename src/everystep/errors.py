"""Exceptions raised by everystep. Each message names the thing, what was expected, what was found."""

from __future__ import annotations

__all__ = [
    "EverystepError",
    "CheckpointDirectoryError",
    "CorruptCheckpointError",
    "StateMismatchError",
    "NoValidCheckpointError",
    "BackgroundWriteError",
    "UnclosedCheckpointerWarning",
    "ConfigError",
]


class EverystepError(Exception):
    """Base class of every error everystep raises on purpose."""


class ConfigError(EverystepError, ValueError):
    """An option has a value that cannot work."""


class CheckpointDirectoryError(EverystepError):
    """The checkpoint directory is missing, foreign, or was written by another configuration."""


class CorruptCheckpointError(EverystepError):
    """A stored object fails its checksum, is truncated, or cannot be parsed."""


class StateMismatchError(EverystepError):
    """A checkpoint does not fit the model, optimizer or other component it is restored into."""


class NoValidCheckpointError(EverystepError):
    """Checkpoints exist, but none of them verifies."""


class BackgroundWriteError(EverystepError):
    """Checkpoint work running in the background failed; raised in the training thread."""


class UnclosedCheckpointerWarning(ResourceWarning):
    """A Checkpointer was garbage-collected without close(): work in flight may have been lost."""
