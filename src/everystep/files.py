"""Whether a file or folder that everystep maps or reads from outside its checkpoint directory can
be trusted: it belongs to the running user and no one else can write it; and how a file of a
directory is opened for reading: a regular file only, never through a link, never waiting.

IMPORTANT: a file another user could write (theirs, or group- or world-writable) can hold any
state they like, re-signed; everystep never reads a checkpoint from one, nor writes one into it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["untrusted_file", "untrusted_folder", "open_regular", "read_regular"]


def untrusted_file(st: os.stat_result, *, private: bool = False) -> str | None:
    """Why a file with status ``st`` (from ``fstat`` of a descriptor opened with ``O_NOFOLLOW``)
    cannot be trusted, or ``None``. ``private``: nor may anyone else read it."""
    uid = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        return f"it is not a regular file (mode {stat.filemode(st.st_mode)})"
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (0o077 if private else 0o022):
        return f"its mode {stat.filemode(st.st_mode)} lets others {'read or write' if private else 'write'} it"
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} names (a hard link to another file?)"
    return None


def untrusted_folder(path: Path) -> str | None:
    """Why the folder ``path`` cannot hold a file everystep trusts, or ``None``: it must be a real
    folder (not a symbolic link) owned by this user or root, writable by no one else unless sticky
    (``/dev/shm``, ``/tmp``: others cannot replace what is this user's there)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"it cannot be examined: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid not in (os.geteuid(), 0):
        return f"it is owned by uid {st.st_uid}, neither this user (uid {os.geteuid()}) nor root"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"its mode {stat.filemode(st.st_mode)} lets others replace the files in it"
    return None


def open_regular(path: str | os.PathLike[str], *, limit: int | None = None) -> tuple[BinaryIO, int]:
    """``path`` open for reading, and its size: only a regular file, never through a symbolic link
    and never waiting to open (a FIFO or a device put where a file was). Anything else is a
    :class:`ValueError` naming it, as is a file longer than ``limit``; a missing file is
    :class:`FileNotFoundError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link, not a file everystep wrote: not followed") from None
        raise
    f = open(fd, "rb", buffering=0)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}), not one everystep "
                             "wrote: not read")
        if limit is not None and st.st_size > limit:
            raise ValueError(f"{path} holds {st.st_size} bytes, more than the {limit} expected")
    except BaseException:
        f.close()
        raise
    return f, st.st_size


def read_regular(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``limit`` of them."""
    f, _ = open_regular(path, limit=limit)
    with f:
        return f.read(limit)

