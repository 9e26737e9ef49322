"""Exceptions raised by everystep. Each message names the thing, what was expected, what was found."""

from __future__ import annotations

__all__ = [
    "EverystepError",
    "CheckpointDirectoryError",
    "DirectoryInUseError",
    "ReadOnlyStoreError",
    "RemoteStoreError", "CorruptCheckpointError",
    "StateMismatchError",
    "NoValidCheckpointError",
    "BackgroundWriteError",
    "PeerFailedError",
    "StorageTimeoutError",
    "UnclosedCheckpointerWarning",
    "ConfigError",
    "one_line_warnings",
]


class EverystepError(Exception):
    """Base class of every error everystep raises on purpose."""


class ConfigError(EverystepError, ValueError):
    """An option has a value that cannot work."""


class CheckpointDirectoryError(EverystepError):
    """The checkpoint directory is missing, foreign, or was written by another configuration."""


class DirectoryInUseError(CheckpointDirectoryError):
    """Another process owns the checkpoint directory for writing; ``pid`` is its process id (0: unknown)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid

    @classmethod
    def of(cls, directory: object, pid: int | None, fix: str) -> "DirectoryInUseError":
        """The error for ``directory`` held by process ``pid`` (0 or None: unknown), ending with ``fix``."""
        who = f"process {pid}" if pid else "another process"
        return cls(f"{directory} is in use: {who} is writing checkpoints there; {fix}", pid)


class ReadOnlyStoreError(EverystepError):
    """A store opened for reading was asked to write or delete."""


class RemoteStoreError(EverystepError, OSError):
    """A request to an object store failed (after the client's retries); the message names the
    object's URL and the server's error code, never a credential."""


class CorruptCheckpointError(EverystepError):
    """A stored object fails its checksum, is truncated, or cannot be parsed."""


class StateMismatchError(EverystepError):
    """A checkpoint does not fit the model, optimizer or other component it is restored into."""


class NoValidCheckpointError(EverystepError):
    """Checkpoints exist, but none of them verifies."""


class BackgroundWriteError(EverystepError):
    """Checkpoint work running in the background failed; raised in the training thread."""


class StorageTimeoutError(EverystepError):
    """``close()`` waited ``close_timeout`` seconds for storage and gave up: the message says which
    step is durable and which is only in memory, and where."""


class PeerFailedError(BackgroundWriteError):
    """Another rank's part of a collective step failed; ``failed`` maps each rank that failed to the
    name of its error's class."""

    def __init__(self, message: str, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = failed


class UnclosedCheckpointerWarning(ResourceWarning):
    """A Checkpointer was garbage-collected without close(): work in flight may have been lost."""


def one_line_warnings(rank: str | None = None) -> None:
    """Print this process's warnings as the command line's own one-line ones (``everystep: warning:
    …``, naming ``rank`` where a job has several), not Python's with a file, a line and its source."""
    import warnings

    who = f" (rank {rank})" if rank else ""
    warnings.formatwarning = lambda message, *args, **kwargs: f"everystep: warning{who}: {message}\n"  # type: ignore[assignment]
    quiet_imports()


def quiet_imports() -> None:
    """Leave out what an import says that a user cannot act on: torch imports pynvml where it is
    installed, and the pynvml that DLRover (the ``peers`` extra) needs says at each import that it
    is deprecated."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    # and lm-resiliency (the same extra) offers torchrun a rendezvous handler that torch cannot
    # register, which torch logs with its traceback at each import of torch.distributed.elastic
    logging.getLogger("torch.distributed.elastic.rendezvous.registry").setLevel(logging.ERROR)
