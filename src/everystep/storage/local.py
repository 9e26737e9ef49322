"""A store on a local (or network-mounted POSIX) filesystem.

Layout of a checkpoint directory::

    everystep.json          marker: format, version, strategy, world size, full format, checksum
    everystep.lock          held (flock) by the one process that writes here
    objects/<name>          immutable objects (safetensors tensors, JSON records)
    objects/<name>.dcp/     a full checkpoint in the torch.distributed.checkpoint format
    manifests/<name>.json   one per committed checkpoint

A directory is opened for one of three kinds of access: ``write`` (the owner: one process, or rank
0 for a job, holds ``everystep.lock`` for as long as the store is open; a second writer is refused
with the owner's pid), ``shared`` (a process writing on the owner's behalf, its checkpoint agent),
and ``read`` (``recover``, ``inspect``, ``verify``: nothing is created, renamed or deleted, so a
reader works beside a live writer). Garbage collection removes only names everystep writes itself
(``full-000000000012.safetensors``, ``.tmp-…``), only for the owner, and says what it removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from .._faults import crash_point
from ..distributed import Ranks
from ..errors import (
    CheckpointDirectoryError,
    CorruptCheckpointError,
    DirectoryInUseError,
    EverystepError,
    ReadOnlyStoreError,
)
from .base import CHECKSUM_ALGORITHM, Manifest, ManifestRecord, ObjectInfo, checksum, new_hasher
from .retention import plan_retention

__all__ = ["LocalStore", "StoreWriteError", "DirectoryInUseError", "ReadOnlyStoreError", "MARKER", "LOCK", "Access",
           "marker_bytes"]

MARKER = "everystep.json"
LOCK = "everystep.lock"
FORMAT_VERSION = 2
"""Version 2 markers carry a checksum; version 1 (no checksum) is still read."""
Access = Literal["write", "shared", "read"]
_OBJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_OWN_NAME = r"[a-z]+-\d{12}(?:-r\d+)?"
_OWN_OBJECT = re.compile(rf"^{_OWN_NAME}\.[a-z0-9]+$")
_OWN_TMP = re.compile(rf"^\.tmp-{_OWN_NAME}\.[a-z0-9]+(?:-[0-9a-f]{{8}})?$")
_TMP = re.compile(r"^\.tmp-")
log = logging.getLogger("everystep")


class StoreWriteError(EverystepError, OSError):
    """Writing to the store failed (a full disk, a lost mount); the message names the file."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def marker_bytes(marker: dict[str, Any]) -> bytes:
    """The marker file's bytes: ``marker`` with its checksum (any old one replaced)."""
    body = {k: v for k, v in marker.items() if k != "checksum"}
    body["checksum"] = checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(body, indent=1, sort_keys=True).encode()


def marker_bytes_ok(marker: dict[str, Any]) -> bool | None:
    """Whether a marker's checksum matches (None: it has none, as version 1 markers)."""
    if "checksum" not in marker:
        return None
    return json.loads(marker_bytes(marker))["checksum"] == marker["checksum"]


class _Lock:
    """``everystep.lock``: an advisory lock the kernel releases when its holder dies."""

    def __init__(self, root: Path) -> None:
        self.fd = -1
        self.path = path = root / LOCK
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                self.fd, self.created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                self.fd, self.created = os.open(path, flags), False
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot open {path} to take the directory for writing: "
                                           f"{e.strerror or e}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _owner_pid(self.fd)
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


def _owner_pid(fd: int) -> int | None:
    try:
        return int(json.loads(os.pread(fd, 4096, 0))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class LocalStore:
    """Objects and manifests in a directory, each write atomic and durable.

    IMPORTANT: an object or manifest becomes visible only by ``rename`` of a fully written and
    fsynced temporary file, followed by an fsync of its directory; a manifest is written only
    after all its objects are durable. A crash at any instant therefore leaves either the old
    set of checkpoints or the old set plus the new one, never a partial checkpoint.
    """

    def __init__(self, root: Path, marker: dict[str, Any], ranks: Ranks | None = None, *,
                 access: Access = "write") -> None:
        self.root = root
        self.marker = marker
        self.ranks = ranks or Ranks()
        """The job writing here: each rank writes its part of a checkpoint; rank 0 commits and deletes."""
        self.access: Access = access
        self.objects_dir = root / "objects"
        self.manifests_dir = root / "manifests"
        self._lock = threading.Lock()
        self._retention_lock = threading.Lock()
        self._bytes_written = 0
        self._owner: _Lock | None = None
        self.created = False
        """Whether :meth:`open` made this directory an everystep directory (see :meth:`undo_create`)."""

    @property
    def full_format(self) -> str:
        """The format full checkpoints here were written in (``safetensors`` or ``dcp``), from the marker.
        A checkpoint that claims another format is refused: the marker, not a manifest, decides."""
        return str(self.marker.get("full_format") or (self.marker.get("run") or {}).get("full_format") or "safetensors")

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        *,
        strategy: str | None = None,
        ranks: Ranks | None = None,
        create: bool = True,
        extra: dict[str, Any] | None = None,
        other_world: bool = False,
        access: Access = "write",
    ) -> "LocalStore":
        """Open a checkpoint directory, creating it when ``create`` and it is absent or empty.

        Refuses a directory that holds anything but an everystep checkpoint, or one written by
        another strategy (``None`` accepts any) or, unless ``other_world``, another world size, or
        (``extra["full_format"]``) for another full-checkpoint format. With ``access="write"`` the
        directory is taken for writing (rank 0 holds its lock until :meth:`close`), and refused
        with :class:`DirectoryInUseError` while another process holds it; ``"read"`` changes
        nothing and cannot create. Under a job of several ranks every rank opens the directory;
        rank 0 creates and locks it.
        """
        ranks = ranks or Ranks()
        if access not in ("write", "shared", "read"):
            raise ValueError(f"access must be 'write', 'shared' or 'read', got {access!r}")
        path = Path(root)
        if path.exists() and not path.is_dir():
            raise CheckpointDirectoryError(f"{path} is a file, not a checkpoint directory")
        marker_path = path / MARKER
        if ranks.rank != 0:
            ranks.barrier("control")  # rank 0 has created or checked the directory
            return cls(path, cls._read_marker(marker_path), ranks, access=access)
        try:
            return cls._open_as_rank0(path, marker_path, strategy, ranks, create and access == "write", extra,
                                      other_world, access)
        finally:
            ranks.barrier("control")

    @classmethod
    def _open_as_rank0(
        cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks, create: bool,
        extra: dict[str, Any] | None, other_world: bool, access: Access,
    ) -> "LocalStore":
        if not marker_path.exists():
            if not create:
                raise CheckpointDirectoryError(f"no everystep checkpoint directory at {path} (no {MARKER} there)")
            cls._refuse_foreign(path)  # before anything is created there
        owner = cls._take(path) if access == "write" else None
        try:
            store = (cls._create(path, marker_path, strategy, ranks, extra) if not marker_path.exists()
                     else cls._check(path, marker_path, strategy, ranks, extra, other_world, access))
        except BaseException:
            if owner is not None:
                owner.release(remove=not marker_path.exists())
            raise
        store._owner = owner
        return store

    @staticmethod
    def _take(path: Path) -> _Lock:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot create the checkpoint directory {path}: {e.strerror or e}") from None
        return _Lock(path)

    @staticmethod
    def owner(root: str | os.PathLike[str]) -> int | None:
        """The pid of the process that holds ``root`` for writing (0 if it cannot be told), or None
        when no process does. Creates nothing: a reader may ask."""
        try:
            fd = os.open(Path(root) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _owner_pid(fd) or 0
        finally:
            os.close(fd)
        return None

    @staticmethod
    def _refuse_foreign(path: Path) -> None:
        found = sorted(p.name for p in path.iterdir() if p.name != LOCK) if path.is_dir() else []
        if found:
            raise CheckpointDirectoryError(
                f"{path} is not empty and is not an everystep checkpoint directory (found: {', '.join(found[:5])}); "
                "choose an empty or new directory"
            )

    @classmethod
    def _create(cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks,
                extra: dict[str, Any] | None) -> "LocalStore":
        cls._refuse_foreign(path)
        marker = {"format": "everystep", "version": FORMAT_VERSION, "strategy": strategy, "world_size": ranks.world,
                  "full_format": "safetensors"}
        marker.update(extra or {})
        store = cls(path, marker, ranks)
        store.created = True
        try:
            (path / "objects").mkdir(exist_ok=True)
            (path / "manifests").mkdir(exist_ok=True)
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot create the checkpoint directory {path}: {e.strerror or e}") from None
        store._atomic_write(marker_path, marker_bytes(marker))  # last: the directory is everystep's from here on
        if path.parent.exists():
            _fsync_dir(path.parent)
        return store

    @classmethod
    def _check(cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks, extra: dict[str, Any] | None,
               other_world: bool, access: Access) -> "LocalStore":
        marker = cls._read_marker(marker_path)
        if strategy is not None and marker.get("strategy") not in (None, strategy):
            raise CheckpointDirectoryError(
                f"{path} was written by strategy {marker.get('strategy')!r}; this run uses {strategy!r} — "
                f"use strategy {marker.get('strategy')!r} or another directory"
            )
        store = cls(path, marker, ranks, access=access)
        wanted = (extra or {}).get("full_format")
        if wanted is not None and wanted != store.full_format:
            raise CheckpointDirectoryError(
                f"{path} holds full checkpoints in the {store.full_format!r} format; this run asks for {wanted!r} — "
                f"use full_format={store.full_format!r} or another directory"
            )
        if access == "read":
            return store
        for sub in ("objects", "manifests"):
            (path / sub).mkdir(exist_ok=True)
        written = marker.get("world_size", 1)
        if written != ranks.world and strategy is not None:
            if not other_world:
                raise CheckpointDirectoryError(
                    f"{path} was written by {written} process(es); this run has {ranks.world} — strategy "
                    f"{strategy!r} keeps state per rank that cannot be carried to another world size"
                )
            store.marker = {**marker, "world_size": ranks.world}
            store._atomic_write(marker_path, marker_bytes(store.marker))
        return store

    @staticmethod
    def _read_marker(marker_path: Path) -> dict[str, Any]:
        try:
            marker = json.loads(marker_path.read_bytes())
        except (OSError, ValueError) as e:
            raise CheckpointDirectoryError(f"cannot read {marker_path}: {e}") from None
        if not isinstance(marker, dict) or marker.get("format") != "everystep":
            raise CheckpointDirectoryError(f"{marker_path} is not an everystep marker file")
        if marker.get("version") not in (1, FORMAT_VERSION):
            raise CheckpointDirectoryError(
                f"{marker_path.parent} has format version {marker.get('version')}; this everystep reads 1 to {FORMAT_VERSION}"
            )
        if marker["version"] >= 2 and marker_bytes_ok(marker) is not True:
            raise CheckpointDirectoryError(f"{marker_path} fails its checksum (corrupted, or edited by hand)")
        return marker

    def close(self) -> None:
        """Give the directory up for writing (release its lock). The store may still be read."""
        if self._owner is not None:
            self._owner.release()
            self._owner = None

    def undo_create(self) -> None:
        """Make a directory this store just created, and that holds no checkpoint yet, plain again
        (a constructor that failed after opening it leaves it as it found it)."""
        if not self.created or self.access != "write" or self.ranks.rank != 0:
            return
        if any(self.manifests_dir.iterdir()) or any(self.objects_dir.iterdir()):
            return
        (self.root / MARKER).unlink(missing_ok=True)
        for sub in (self.objects_dir, self.manifests_dir):
            sub.rmdir()
        if self._owner is not None:
            self._owner.release(remove=True)
            self._owner = None
        self.created = False

    def _writable(self) -> None:
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
        """Add ``n`` bytes that another process (a checkpoint agent) wrote to this directory."""
        self._count(n)

    def _atomic_write(self, final: Path, data: bytes, what: str = "file") -> None:
        self._write_chunks(final, [memoryview(data)], hasher=None, what=what)

    def _write_chunks(self, final: Path, chunks: Iterable[bytes | memoryview], hasher: Any, what: str) -> int:
        """Write ``final`` atomically; crash points are ``store.<what>.mid_write`` and ``.before_rename``."""
        self._writable()
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        total = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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
                os.fsync(fd)
            finally:
                os.close(fd)
            crash_point(f"store.{what}.before_rename")
            os.rename(tmp, final)
            _fsync_dir(final.parent)
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

    def _os_write(self, fd: int, view: memoryview) -> int:
        """One write(2); a seam for fault-injection tests."""
        return os.write(fd, view)

    def write_object(self, name: str, chunks: Iterable[bytes | memoryview]) -> ObjectInfo:
        if not _OBJECT_NAME.match(name):
            raise ValueError(f"invalid object name {name!r}")
        hasher = new_hasher()
        n = self._write_chunks(self.objects_dir / name, chunks, hasher, what="object")
        return ObjectInfo(name=name, nbytes=n, checksum=f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}")

    def install_directory(self, tmp: Path, name: str) -> None:
        """Move a fully written and fsynced directory of objects (a DCP checkpoint) into place."""
        self._writable()
        final = self.objects_dir / name
        try:
            for path in (tmp, *tmp.iterdir()):
                if path.is_dir():
                    _fsync_dir(path)
            os.rename(tmp, final)
            _fsync_dir(self.objects_dir)
        except OSError as e:
            raise StoreWriteError(e.errno, f"installing {final} failed: {e.strerror or e}") from e

    def commit(self, manifest: Manifest) -> None:
        crash_point("store.commit.before_manifest")
        self._atomic_write(self.manifests_dir / f"{manifest.name}.json", manifest.to_bytes(), what="manifest")

    # -- reading -----------------------------------------------------------------------------

    def read_object(self, info: ObjectInfo) -> bytearray:
        path = self.objects_dir / info.name
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

    def manifests(self) -> list[ManifestRecord]:
        records = []
        for path in sorted(self.manifests_dir.glob("*.json")):
            if _TMP.match(path.name):
                continue
            name = path.name[: -len(".json")]
            try:
                records.append(ManifestRecord(name, Manifest.from_bytes(path.read_bytes())))
            except FileNotFoundError:
                continue  # discarded since the listing (a reader beside a live writer)
            except (OSError, ValueError, KeyError, TypeError) as e:
                records.append(ManifestRecord(name, None, f"manifest {path} is unreadable: {e}"))
        return records

    # -- removing ----------------------------------------------------------------------------

    def retain(self, keep: int) -> list[str]:
        """Discard what the newest ``keep`` full checkpoints and the newer differentials do not
        need (see :func:`plan_retention`); returns the names discarded. Several writer threads may
        call it; one plans and deletes at a time.

        IMPORTANT: call only after the newest checkpoint is committed, so that deleting an older
        one never leaves fewer recoverable points than before. Only rank 0 deletes.
        """
        self._writable()
        if self.ranks.rank != 0:
            return []
        with self._retention_lock:
            committed = [r.manifest for r in self.manifests() if r.manifest is not None]
            doomed = plan_retention(committed, keep=keep)
            for name in doomed:
                self.discard(name)
        return doomed

    def discard(self, manifest_name: str) -> None:
        """Uncommit a checkpoint (its manifest goes first), then delete the objects only it used."""
        self._writable()
        path = self.manifests_dir / f"{manifest_name}.json"
        try:
            manifest = Manifest.from_bytes(path.read_bytes())
            names = {o.name for o in manifest.objects.values()}
        except (OSError, ValueError, KeyError, TypeError):
            names = set()
        path.unlink(missing_ok=True)
        _fsync_dir(self.manifests_dir)
        still_used = self._referenced()
        for name in names - still_used:
            (self.objects_dir / name).unlink(missing_ok=True)
        for folder in {name.split("/", 1)[0] for name in names if "/" in name}:
            if not any(n.startswith(folder + "/") for n in still_used):
                shutil.rmtree(self.objects_dir / folder, ignore_errors=True)

    def committed(self, manifest_name: str) -> bool:
        """Whether the checkpoint ``manifest_name`` is still committed (a writer may discard it
        while a reader reads it)."""
        return (self.manifests_dir / f"{manifest_name}.json").exists()

    def _referenced(self) -> set[str]:
        return {o.name for r in self.manifests() if r.manifest for o in r.manifest.objects.values()}

    def collect_garbage(self) -> list[str]:
        """Delete what a crash left: everystep's own temporaries, and its own objects that no
        manifest names. Only the owner (``access="write"``) collects, and only when no write is in
        flight (at open). Files of other names are never touched, nor the objects of a checkpoint
        whose manifest is unreadable (it may be repaired; ``verify`` reports it). Returns the
        names removed, which are also logged.
        """
        self._writable()
        if self.access != "write":
            return []
        records = self.manifests()
        used = {o.name for r in records if r.manifest for o in r.manifest.objects.values()}
        used |= {name.split("/", 1)[0] for name in used if "/" in name}
        unreadable = tuple(r.name for r in records if r.manifest is None)
        removed = []
        for directory, own in ((self.objects_dir, _OWN_OBJECT), (self.manifests_dir, None)):
            for path in directory.iterdir():
                name = path.name
                orphan = own is not None and own.match(name) and name not in used and not name.startswith(unreadable)
                if not (orphan or _OWN_TMP.match(name)):
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(str(path.relative_to(self.root)))
        if removed:
            log.warning("removed %d file(s) an interrupted run left in %s: %s", len(removed), self.root,
                        ", ".join(sorted(removed)))
        return removed

    def stored_files(self) -> list[str]:
        """Every file under ``objects/``, as an object name (``a.safetensors``, ``full-….dcp/__0_0.distcp``)."""
        return sorted(str(p.relative_to(self.objects_dir)) for p in self.objects_dir.rglob("*") if not p.is_dir())
