"""``everystep.lock``: the advisory lock a checkpoint directory's one writer holds."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

from ..errors import CheckpointDirectoryError, DirectoryInUseError

__all__ = ["LOCK", "DirectoryLock", "holder", "owner_pid"]

LOCK = "everystep.lock"


class DirectoryLock:
    """``everystep.lock``: an advisory lock the kernel releases when its holder dies."""

    def __init__(self, root: Path) -> None:
        self.fd = -1
        self.path = path = root / LOCK
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (a FIFO there: refused below)
        try:
            try:
                self.fd, self.created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                self.fd, self.created = os.open(path, flags), False
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot open {path} to take the directory for writing: "
                                           f"{e.strerror or e}") from None
        mode = os.fstat(self.fd).st_mode
        if not stat.S_ISREG(mode):
            self.release()
            raise CheckpointDirectoryError(f"{path} is not a regular file (mode {stat.filemode(mode)}), not the lock "
                                           "everystep writes: delete it to go on (nothing was changed)")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = owner_pid(self.fd)
            os.close(self.fd)
            self.fd = -1
            raise DirectoryInUseError.of(root, pid, f"it holds {LOCK}: wait for it to end, or read it with recover, "
                                         "inspect or verify, or choose another directory") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps({"pid": os.getpid()}).encode(), 0)

    def release(self, *, remove: bool = False) -> None:
        """Release the lock; with ``remove``, also delete the lock file if this lock created it."""
        if remove and self.created and self.fd >= 0:
            self.path.unlink(missing_ok=True)  # while still held: no other process holds this file
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = -1

    def __del__(self) -> None:
        self.release()  # a store dropped without close() gives the directory up, as a dead process does


def owner_pid(fd: int) -> int | None:
    try:
        return int(json.loads(os.pread(fd, 4096, 0))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holder(root: Path) -> int | None:
    """The pid of the process that holds ``root``'s lock (0 if it cannot be told), or None when no
    process does. Creates nothing: a reader may ask."""
    try:
        fd = os.open(root / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # (not a lock everystep writes: no process holds it)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return owner_pid(fd) or 0
    finally:
        os.close(fd)
    return None
