"""An object store on a local (or network-mounted POSIX) filesystem.

Layout of a checkpoint directory (the marker and the lock belong to
:class:`~everystep.storage.directory.CheckpointDirectory`, the manager above this store)::

    everystep.json          marker: format, version, strategy, world size, full format, checksum
    everystep.lock          held (flock) by the one process that writes here
    objects/<name>          immutable objects (safetensors tensors, JSON records)
    objects/<name>.dcp/     a full checkpoint in the torch.distributed.checkpoint format
    manifests/<name>.json   one per committed checkpoint

A write goes to ``.tmp-<name>-<random>`` beside its final name and is renamed into place when it
is durable; what an interrupted write leaves is listed by :meth:`LocalStore.interrupted_writes`.
The file of an object a discarded checkpoint alone used is kept (as ``.tmp-<its name>-<random>``)
and written over by the next object, instead of deleted and allocated anew; :meth:`LocalStore.close`
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
from typing import Any, TypeVar

from .._faults import crash_point
from ..distributed import Ranks
from ..errors import (
    CheckpointDirectoryError,
    CorruptCheckpointError,
    EverystepError,
    ReadOnlyStoreError,
)
from .base import (
    CHECKSUM_ALGORITHM,
    Access,
    Manifest,
    ManifestRecord,
    ObjectInfo,
    check_manifest_name,
    check_object_name,
    new_hasher,
)

__all__ = ["LocalStore", "StoreWriteError", "fsync_dir"]

T = TypeVar("T")
_OBJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TMP = re.compile(r"^\.tmp-(?P<final>.+?)(?:-[0-9a-f]{8})?$")


class StoreWriteError(EverystepError, OSError):
    """Writing to the store failed (a full disk, a lost mount); the message names the file."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _identity(path: Path | str) -> tuple[int, int, int]:
    """What tells a file apart from a rewrite of it: inode, size, modification time."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class LocalStore:
    """Objects and manifests in a directory, each write atomic and durable.

    IMPORTANT: an object or manifest becomes visible only by ``rename`` of a fully written and
    fsynced temporary file, followed by an fsync of its directory; a manifest is written only
    after all its objects are durable. A crash at any instant therefore leaves either the old
    set of checkpoints or the old set plus the new one, never a partial checkpoint.
    """

    def __init__(self, root: Path, ranks: Ranks | None = None, *, access: Access = "write") -> None:
        self.root = root
        self.ranks = ranks or Ranks()
        """The job writing here: each rank writes its part of a checkpoint; rank 0 commits and deletes."""
        self.access: Access = access
        self.objects_dir = root / "objects"
        self.manifests_dir = root / "manifests"
        self._lock = threading.Lock()
        self._bytes_written = 0
        self._parsed: dict[str, tuple[tuple[int, int, int], ManifestRecord]] = {}
        self._spare: Path | None = None
        """The file of a discarded object, for the next object to be written over (see :meth:`discard`)."""

    def prepare(self) -> None:
        """Create the store's folders (a writer, at open)."""
        try:
            self.objects_dir.mkdir(exist_ok=True)
            self.manifests_dir.mkdir(exist_ok=True)
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot create the checkpoint directory {self.root}: {e.strerror or e}") from None

    def unprepare(self) -> None:
        """Remove the store's folders again; they must be empty."""
        for sub in (self.objects_dir, self.manifests_dir):
            sub.rmdir()

    def put_file(self, name: str, data: bytes) -> None:
        """Write the file ``name`` beside the store's folders (the directory's marker), atomically."""
        self._atomic_write(self.root / name, data)

    def check_writable(self) -> None:
        """Raise :class:`ReadOnlyStoreError` if the store was opened for reading."""
        if self.access == "read":
            raise ReadOnlyStoreError(f"{self.root} was opened for reading; nothing may be written or deleted there")

    # -- writing -----------------------------------------------------------------------------

    @property
    def bytes_written(self) -> int:
        with self._lock:
            return self._bytes_written

    def _count(self, n: int) -> None:
        with self._lock:
            self._bytes_written += n

    def count_written_elsewhere(self, n: int) -> None:
        """Add ``n`` bytes written for this directory elsewhere than through this store (a checkpoint
        agent's, lightcheck's region)."""
        self._count(n)

    def _atomic_write(self, final: Path, data: bytes, what: str = "file") -> None:
        self._write_chunks(final, [memoryview(data)], hasher=None, what=what)

    def _write_chunks(self, final: Path, chunks: Iterable[bytes | memoryview], hasher: Any, what: str) -> int:
        """Write ``final`` atomically; crash points are ``store.<what>.mid_write`` and ``.before_rename``.
        An object is written over the spare file, when there is one."""
        self.check_writable()
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        total = 0
        try:
            fd = self._open_spare(tmp) if what == "object" else None
            if fd is None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                for i, chunk in enumerate(chunks):
                    view = memoryview(chunk).cast("B")
                    if hasher is not None:
                        hasher.update(view)
                    while view:
                        n = self._os_write(fd, view)
                        view = view[n:]
                        total += n
                        self._count(n)
                    if i == 0:
                        crash_point(f"store.{what}.mid_write")  # once per write: part written, not durable
                if os.fstat(fd).st_size != total:
                    os.ftruncate(fd, total)  # a spare file longer than the object
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

    def _open_spare(self, tmp: Path) -> int | None:
        """The spare file renamed to ``tmp`` and opened for writing over, if there is one.

        Writing over a file keeps its blocks: no allocation now and no freeing at its deletion,
        which on a small state checkpointed every step cost more than the data's own write. No
        checkpoint names the spare (its manifest's removal was durable before it became one).
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
                          "deleted", stacklevel=4)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            if e.errno == errno.ELOOP:
                warnings.warn(f"{tmp} was replaced by a symbolic link: not followed, deleted", stacklevel=4)
        for path in (spare, tmp):
            path.unlink(missing_ok=True)
        return None

    def _os_write(self, fd: int, view: memoryview) -> int:
        """One write(2); a seam for fault-injection tests."""
        return os.write(fd, view)

    def write_object(self, name: str, chunks: Iterable[bytes | memoryview]) -> ObjectInfo:
        if not _OBJECT_NAME.match(name):
            raise ValueError(f"invalid object name {name!r}")
        hasher = new_hasher()
        n = self._write_chunks(self.objects_dir / name, chunks, hasher, what="object")
        return ObjectInfo(name=name, nbytes=n, checksum=f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}")

    def write_directory(self, name: str, fill: Callable[[Path], T]) -> T:
        """Write an object that is a directory of files (a DCP checkpoint): ``fill`` writes them into
        the temporary directory it is given; once it returns, every file and the directory are
        fsynced and the directory is renamed into place. Returns what ``fill`` returned.

        Under several ranks every rank calls this at once and ``fill`` writes the rank's files into
        the same temporary directory; it must return only when every rank's files are written
        (a collective), and rank 0 then installs the directory."""
        self.check_writable()
        if not _OBJECT_NAME.match(name):
            raise ValueError(f"invalid object name {name!r}")
        tmp, final = self.objects_dir / f".tmp-{name}", self.objects_dir / name
        if tmp.is_symlink():
            raise StoreWriteError(errno.ELOOP, f"writing {final} failed: {tmp} is a symbolic link, which everystep "
                                  "never makes; delete it")
        if self.ranks.rank != 0:
            return fill(tmp)
        try:
            result = fill(tmp)
            for path in (tmp, *tmp.iterdir()):
                if path.is_dir():
                    fsync_dir(path)
                else:
                    with open(path, "rb") as f:
                        os.fsync(f.fileno())
            old = None
            if final.exists():  # this step's checkpoint, written before and skipped at restore: replaced
                old = self.objects_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(self.objects_dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, StoreWriteError):
                raise StoreWriteError(e.errno, f"writing {final} failed: {e.strerror or e}") from e
            raise
        return result

    def object_path(self, name: str) -> Path:
        """Where the object ``name`` lies (formats that read by path: DCP); ValueError for a name
        everystep does not write (absolute, climbing out), which would lie elsewhere."""
        path = self.objects_dir / check_object_name(name)
        if os.path.commonpath([os.path.normpath(path), self.objects_dir]) != str(self.objects_dir):
            raise ValueError(f"object name {name!r} lies outside {self.objects_dir}")
        return path

    def commit(self, manifest: Manifest) -> None:
        crash_point("store.commit.before_manifest")
        path = self.manifests_dir / f"{manifest.name}.json"
        self._atomic_write(path, manifest.to_bytes(), what="manifest")
        # the writer lists the manifests after each checkpoint (retention): its own need no re-reading
        try:
            identity = _identity(path)
        except FileNotFoundError:
            return  # already discarded by another writer thread's retention: nothing to remember
        self._parsed[manifest.name] = (identity, ManifestRecord(manifest.name, manifest))

    # -- reading -----------------------------------------------------------------------------

    def read_object(self, info: ObjectInfo) -> bytearray:
        try:
            path = self.object_path(info.name)
        except ValueError as e:
            raise CorruptCheckpointError(str(e)) from None
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"object {path} is missing") from None
        if size != info.nbytes:
            raise CorruptCheckpointError(f"object {path} has {size} bytes; its manifest says {info.nbytes} (truncated?)")
        data = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(data), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptCheckpointError(f"object {path} ended after {got} of {size} bytes")
                got += n
        algorithm, _, _ = info.checksum.partition(":")
        if algorithm != CHECKSUM_ALGORITHM:
            raise CorruptCheckpointError(f"object {path} has checksum algorithm {algorithm!r}; expected {CHECKSUM_ALGORITHM}")
        hasher = new_hasher()
        hasher.update(data)
        if f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}" != info.checksum:
            raise CorruptCheckpointError(f"object {path} fails its checksum (corrupted on storage?)")
        return data

    def _known(self, path: Path, name: str) -> Manifest | None:
        """The manifest ``name`` as this store last parsed or wrote it, if its file is the same still."""
        known = self._parsed.get(name)
        if known is None or known[1].manifest is None:
            return None
        return known[1].manifest if known[0] == _identity(path) else None

    def manifests(self) -> list[ManifestRecord]:
        """Every manifest, parsed and verified. A manifest this store already parsed and that is the
        same file still (inode, size, modification time) is not read again: the writer lists the
        directory after each checkpoint, for retention; the manifests it commits are known without a
        read. A new store (a recovery) reads every one. (A rewrite of the same size within one tick of the
        file system's clock is not seen by a store that knows the file; a new store sees it.)"""
        records, parsed = [], {}
        folder = str(self.manifests_dir)  # (strings, not paths: listed after every checkpoint)
        try:
            with os.scandir(folder) as entries:
                filenames = sorted(e.name for e in entries if e.name.endswith(".json") and not _TMP.match(e.name))
        except FileNotFoundError:
            filenames = []
        for filename in filenames:
            name, path = filename[: -len(".json")], os.path.join(folder, filename)
            try:
                identity = _identity(path)
                known = self._parsed.get(name)
                if known is not None and known[0] == identity:
                    record = known[1]
                else:
                    with open(path, "rb") as f:
                        record = ManifestRecord(name, Manifest.from_bytes(f.read(), name=name))
            except FileNotFoundError:
                continue  # discarded since the listing (a reader beside a live writer)
            except (OSError, ValueError, KeyError, TypeError) as e:
                records.append(ManifestRecord(name, None, f"manifest {path} is unreadable: {e}"))
                continue
            parsed[name] = (identity, record)
            records.append(record)
        self._parsed = parsed
        return records

    # -- removing ----------------------------------------------------------------------------

    def discard(self, manifest_name: str) -> None:
        """Uncommit a checkpoint (its manifest goes first, durably), then delete the objects only it
        used — but one file, kept as the spare for the next object to be written over."""
        self.check_writable()
        path = self.manifests_dir / f"{check_manifest_name(manifest_name)}.json"
        try:
            manifest = self._known(path, manifest_name) or Manifest.from_bytes(path.read_bytes(), name=manifest_name)
            names = {o.name for o in manifest.objects.values()}
        except (OSError, ValueError, KeyError, TypeError):
            names = set()
        path.unlink(missing_ok=True)
        fsync_dir(self.manifests_dir)
        still_used = self._referenced()
        for name in sorted(names - still_used):
            self._retire(self.object_path(name))
        for folder in {name.split("/", 1)[0] for name in names if "/" in name}:
            if not any(n.startswith(folder + "/") for n in still_used):
                self._remove(self.object_path(folder))

    def _retire(self, path: Path) -> None:
        """Keep the file of a discarded object as the spare, or delete it when there is one already."""
        if self._spare is not None or path.parent != self.objects_dir:  # (read unlocked: a hint)
            path.unlink(missing_ok=True)
            return
        spare = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, spare)
        except OSError:
            path.unlink(missing_ok=True)
            return
        with self._lock:
            if self._spare is None:
                self._spare, spare = spare, None
        if spare is not None:
            spare.unlink(missing_ok=True)

    def close(self) -> None:
        """Delete the spare file (the store may still be read)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.unlink(missing_ok=True)

    def committed(self, manifest_name: str) -> bool:
        """Whether the checkpoint ``manifest_name`` is still committed (a writer may discard it
        while a reader reads it)."""
        return (self.manifests_dir / f"{manifest_name}.json").exists()

    def _referenced(self) -> set[str]:
        return {o.name for r in self.manifests() if r.manifest for o in r.manifest.objects.values()}

    def object_names(self) -> list[str]:
        """The names of the objects stored (not what interrupted writes left)."""
        return sorted(p.name for p in self.objects_dir.iterdir() if not _TMP.match(p.name))

    def delete_object(self, name: str) -> str:
        """Delete an object that no manifest names; returns its path relative to the root."""
        self.check_writable()
        return self._remove(self.objects_dir / name)

    def interrupted_writes(self) -> list[tuple[str, str]]:
        """What interrupted writes left: (a token for :meth:`delete_leftover`, the final name it was
        being written under) for each."""
        found = []
        for folder in (self.objects_dir, self.manifests_dir):
            for path in folder.iterdir():
                m = _TMP.match(path.name)
                if m is not None:
                    found.append((str(path.relative_to(self.root)), m["final"]))
        return found

    def delete_leftover(self, token: str) -> str:
        """Delete what an interrupted write left; returns its path relative to the root."""
        self.check_writable()
        path = self.root / token
        if path.parent not in (self.objects_dir, self.manifests_dir) or not _TMP.match(path.name):
            raise ValueError(f"{token!r} is not a leftover of this store")
        return self._remove(path)

    def _remove(self, path: Path) -> str:
        """Delete ``path``, a file or folder of this store (a symbolic link is removed, not followed)."""
        if os.path.commonpath([os.path.normpath(path), self.root]) != str(self.root) or path == self.root:
            raise ValueError(f"{path} is not inside {self.root}: not deleted")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        return str(path.relative_to(self.root))

    def stored_files(self) -> list[str]:
        """Every file under ``objects/``, as an object name (``a.safetensors``, ``full-….dcp/__0_0.distcp``)."""
        found = []  # (os.walk passes over a folder deleted while it walks: a reader beside a live writer)
        for folder, _, files in os.walk(self.objects_dir):
            found += [os.path.relpath(os.path.join(folder, f), self.objects_dir) for f in files]
        return sorted(found)
