"""A :class:`~everystep.storage.base.Store` on a local (or network-mounted POSIX) filesystem.

A key is a path under the store's root (``objects/full-000000000012.safetensors``). A value is
written to ``.tmp-<name>-<random>`` beside its final name, fsynced, renamed into place and its
folder fsynced; :meth:`LocalStore.leftovers` lists what an interrupted write left. The file of a
deleted object (a top-level file of ``objects/``) is kept as ``.tmp-<its name>-<random>`` and
written over by the next object put, instead of deleted and allocated anew; :meth:`LocalStore.close`
deletes it. A store opened with ``access="read"`` creates, renames and deletes nothing.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, TypeVar

from ..._faults import crash_point
from ...errors import CheckpointDirectoryError, EverystepError, ReadOnlyStoreError
from ...files import open_regular
from ..base import Access

__all__ = ["LocalStore", "StoreWriteError", "check_own_folder", "fsync_dir"]

T = TypeVar("T")
_PART = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.][A-Za-z0-9_.\-]*$")
"""A name in a key: letters, digits, ``_.-``, never ``.`` or ``..`` (a DCP folder holds ``.metadata``)."""
_TMP = re.compile(r"^\.tmp-(?P<final>.+?)(?:-[0-9a-f]{8})?$")
_SPARE_FOLDER = "objects"
"""The folder whose top-level files are written over once deleted (see :meth:`LocalStore._open_spare`)."""


class StoreWriteError(EverystepError, OSError):
    """Writing to the store failed (a full disk, a lost mount); the message names the file."""


def check_own_folder(path: Path) -> None:
    """Refuse (:class:`CheckpointDirectoryError`) a folder of the store that is a symbolic link, not a
    folder, another user's or writable by others: everything written or deleted there would land
    where it points, or be another user's to change. An absent folder passes (it is made at its
    first write)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    why = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode)
           else f"owned by uid {st.st_uid}, not this user ({os.geteuid()})" if st.st_uid != os.geteuid()
           else "writable by others" if st.st_mode & stat.S_IWOTH else None)
    if why is not None:
        raise CheckpointDirectoryError(f"{path} is {why}: a checkpoint directory's own folders must be plain folders "
                                       "of this user's that others cannot write — move it away (nothing was changed)")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _version(st: os.stat_result) -> str:
    """What tells a file apart from a rewrite of it: inode, size, modification time."""
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


class LocalStore:
    """Values in files under ``root``, each write atomic and durable (see the module docstring).

    IMPORTANT: a value becomes visible only by ``rename`` of a fully written and fsynced temporary
    file, followed by an fsync of its folder: a crash at any instant leaves the old value or the new.
    """

    def __init__(self, root: Path, *, access: Access = "write") -> None:
        self.root = Path(root)
        self._prefix = f"{self.root}/"
        self.access: Access = access
        self._lock = threading.Lock()
        self._spare: Path | None = None
        """The file of a deleted object, for the next object to be written over."""

    def _check_writable(self) -> None:
        if self.access == "read":
            raise ReadOnlyStoreError(f"{self.root} was opened for reading; nothing may be written or deleted there")

    def _path(self, key: str, *, leftover: bool = False) -> Path:
        """The file of ``key``; ValueError for a key that is not a relative path of plain names inside
        the root (``leftover``: the last name may be a temporary's)."""
        parts = key.split("/") if isinstance(key, str) else []
        # each name plain (never empty, ``.`` or ``..``): the path cannot leave the root
        if not (parts and all(_PART.match(p) and not _TMP.match(p) for p in parts[:-1]) and _PART.match(parts[-1])
                and (leftover or not _TMP.match(parts[-1]))):
            raise ValueError(f"{key!r} is not a key of the store at {self.root}")
        if len(parts) > 1:
            check_own_folder(self.root / parts[0])
        return Path(f"{self._prefix}{key}")

    # -- writing -----------------------------------------------------------------------------

    def put(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Crash points: ``store.<what>.mid_write`` and ``.before_rename``, ``what`` being ``object``,
        ``manifest`` or ``file`` by the key's folder."""
        self._check_writable()
        final = self._path(key)
        what = {"objects": "object", "manifests": "manifest"}.get(key.split("/", 1)[0], "file") if "/" in key else "file"
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        total = 0
        try:
            fd = self._open_spare(tmp) if what == "object" and final.parent.name == _SPARE_FOLDER else None
            if fd is None:
                fd = self._create(tmp)
            try:
                for i, chunk in enumerate(chunks):
                    view = memoryview(chunk).cast("B")
                    while view:
                        n = self._os_write(fd, view)
                        view = view[n:]
                        total += n
                    if i == 0:
                        crash_point(f"store.{what}.mid_write")  # once per write: part written, not durable
                if os.fstat(fd).st_size != total:
                    os.ftruncate(fd, total)  # a spare file longer than the value
                os.fsync(fd)
            finally:
                os.close(fd)
            crash_point(f"store.{what}.before_rename")
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            if isinstance(e, StoreWriteError):
                raise
            hint = " — free space or choose another --dir" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise StoreWriteError(e.errno, f"writing {final} failed: {e.strerror or e}{hint}") from e
        return total

    @staticmethod
    def _create(tmp: Path) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            tmp.parent.mkdir(parents=True, exist_ok=True)  # a store's first value in this folder
            return os.open(tmp, flags, 0o644)

    def _open_spare(self, tmp: Path) -> int | None:
        """The spare file renamed to ``tmp`` and opened for writing over, if there is one.

        Writing over a file keeps its blocks: no allocation now and no freeing at its deletion,
        which on a small state checkpointed every step cost more than the data's own write. Nothing
        names the spare (it was deleted as a value before it became one).
        """
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        fd = None
        try:
            os.rename(spare, tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                return fd
            os.close(fd)
            warnings.warn(f"{tmp} was replaced by a file everystep did not write (a hard link): not written over, "
                          "deleted", stacklevel=5)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            if e.errno == errno.ELOOP:
                warnings.warn(f"{tmp} was replaced by a symbolic link: not followed, deleted", stacklevel=5)
        for path in (spare, tmp):
            path.unlink(missing_ok=True)
        return None

    def _os_write(self, fd: int, view: memoryview) -> int:
        """One write(2); a seam for fault-injection tests."""
        return os.write(fd, view)

    def put_directory(self, key: str, fill: Callable[[Path], T], *, lead: bool = True) -> T:
        """``fill`` writes into ``.tmp-<name>`` beside the final folder; once it returns, every file and
        the folder are fsynced and the folder renamed into place (by the ``lead`` caller alone: the
        others fill the same folder and return)."""
        self._check_writable()
        final = self._path(key)
        tmp = final.parent / f".tmp-{final.name}"
        if tmp.is_symlink():
            raise StoreWriteError(errno.ELOOP, f"writing {final} failed: {tmp} is a symbolic link, which everystep "
                                  "never makes; delete it")
        if not lead:
            return fill(tmp)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            result = fill(tmp)
            for path in (tmp, *tmp.iterdir()):
                if path.is_dir():
                    fsync_dir(path)
                else:
                    with open(path, "rb") as f:
                        os.fsync(f.fileno())
            old = None
            if final.exists():  # this key's value, written before: replaced
                old = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(final.parent)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, StoreWriteError):
                raise StoreWriteError(e.errno, f"writing {final} failed: {e.strerror or e}") from e
            raise
        return result

    # -- reading -----------------------------------------------------------------------------

    def open_value(self, key: str, *, limit: int | None = None) -> tuple[BinaryIO, int]:
        """The value's file, open for reading, and its size. Only a regular file is opened, never
        through a symbolic link and never waiting to open (a FIFO put where a value was): anything
        else is a ValueError naming it, as is a file longer than ``limit``."""
        return open_regular(self._path(key), limit=limit)

    def get(self, key: str, *, limit: int | None = None) -> bytearray:
        """The value's bytes, from :meth:`open_value`'s file."""
        f, size = self.open_value(key, limit=limit)
        with f:
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    return data[:got]  # shortened while read: the caller's size check says so
                got += n
        return data

    def fetch(self, key: str) -> Path:
        return self._path(key)

    def list(self, prefix: str) -> dict[str, str]:
        """Listed with ``os.scandir`` (a folder deleted while it is walked is passed over: a reader
        beside a live writer); a value is a file, and a folder's files are listed as keys of their own."""
        folder, _, start = prefix.rpartition("/")
        if folder and not all(_PART.match(p) for p in folder.split("/")):
            raise ValueError(f"{prefix!r} is not a prefix of keys of the store at {self.root}")
        if folder:
            check_own_folder(self.root / folder.split("/")[0])
        found: dict[str, str] = {}
        pending = [(str(self.root.joinpath(*folder.split("/")) if folder else self.root), folder, start)]
        while pending:
            where, key, start = pending.pop()
            try:
                with os.scandir(where) as entries:
                    for e in entries:
                        if not e.name.startswith(start) or _TMP.match(e.name) or not _PART.match(e.name):
                            continue
                        name = f"{key}/{e.name}" if key else e.name
                        try:
                            if e.is_dir(follow_symlinks=False):
                                pending.append((e.path, name, ""))
                            else:
                                found[name] = _version(e.stat(follow_symlinks=False))
                        except FileNotFoundError:
                            continue  # deleted since the listing
            except (FileNotFoundError, NotADirectoryError):
                continue
        return dict(sorted(found.items()))

    def leftovers(self) -> list[tuple[str, str]]:
        """The temporaries in the root's folders (a deleted object's spare among them)."""
        found = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink() and _PART.match(p.name)) \
                if self.root.is_dir() else []:
            for path in folder.iterdir():
                m = _TMP.match(path.name)
                if m is not None:
                    found.append((f"{folder.name}/{path.name}", f"{folder.name}/{m['final']}"))
        return sorted(found)

    # -- removing ----------------------------------------------------------------------------

    def delete(self, key: str, *, durable: bool = True) -> None:
        """``durable``: its folder is fsynced. A top-level file of ``objects/`` is kept as the spare when
        there is none (see the module docstring); a symbolic link is removed, not followed."""
        self._check_writable()
        path = self._path(key, leftover=True)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif not (path.parent.name == _SPARE_FOLDER and path.parent.parent == self.root and not _TMP.match(path.name)
                  and self._retire(path)):
            path.unlink(missing_ok=True)
        if durable:
            try:
                fsync_dir(path.parent)
            except FileNotFoundError:
                pass

    def _retire(self, path: Path) -> bool:
        """Keep the file of a deleted object as the spare; False when there is one already."""
        if self._spare is not None:  # (read unlocked: a hint)
            return False
        spare = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        with self._lock:
            if self._spare is None:
                self._spare, spare = spare, None
        if spare is not None:
            spare.unlink(missing_ok=True)
        return True

    def close(self) -> None:
        """Delete the spare file."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.unlink(missing_ok=True)
