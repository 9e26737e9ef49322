"""A store on a local (or network-mounted POSIX) filesystem.

Layout of a checkpoint directory::

    everystep.json          marker: format, version, strategy, world size
    objects/<name>          immutable objects (safetensors tensors, JSON records)
    objects/<name>.dcp/     a full checkpoint in the torch.distributed.checkpoint format
    manifests/<name>.json   one per committed checkpoint

Nothing else is ever written there, and nothing is deleted that does not match these names.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._faults import crash_point
from ..distributed import Ranks
from ..errors import CheckpointDirectoryError, CorruptCheckpointError, EverystepError
from .base import CHECKSUM_ALGORITHM, Manifest, ManifestRecord, ObjectInfo, new_hasher
from .retention import plan_retention

__all__ = ["LocalStore", "StoreWriteError", "MARKER"]

MARKER = "everystep.json"
FORMAT_VERSION = 1
_OBJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TMP = re.compile(r"^\.tmp-")


class StoreWriteError(EverystepError, OSError):
    """Writing to the store failed (a full disk, a lost mount); the message names the file."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """Objects and manifests in a directory, each write atomic and durable.

    IMPORTANT: an object or manifest becomes visible only by ``rename`` of a fully written and
    fsynced temporary file, followed by an fsync of its directory; a manifest is written only
    after all its objects are durable. A crash at any instant therefore leaves either the old
    set of checkpoints or the old set plus the new one, never a partial checkpoint.
    """

    def __init__(self, root: Path, marker: dict[str, Any], ranks: Ranks | None = None) -> None:
        self.root = root
        self.marker = marker
        self.ranks = ranks or Ranks()
        """The job writing here: each rank writes its part of a checkpoint; rank 0 commits and deletes."""
        self.objects_dir = root / "objects"
        self.manifests_dir = root / "manifests"
        self._lock = threading.Lock()
        self._retention_lock = threading.Lock()
        self._bytes_written = 0

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
    ) -> "LocalStore":
        """Open a checkpoint directory, creating it when ``create`` and it is absent or empty.

        Refuses a directory that holds anything but an everystep checkpoint, or one written by
        another strategy (``None`` accepts any) or, unless ``other_world``, another world size.
        Under a job of several ranks every rank opens the directory; rank 0 creates it.
        """
        ranks = ranks or Ranks()
        path = Path(root)
        if path.exists() and not path.is_dir():
            raise CheckpointDirectoryError(f"{path} is a file, not a checkpoint directory")
        marker_path = path / MARKER
        if ranks.rank != 0:
            ranks.barrier("control")  # rank 0 has created or checked the directory
            return cls(path, cls._read_marker(marker_path), ranks)
        try:
            return cls._open_as_rank0(path, marker_path, strategy, ranks, create, extra, other_world)
        finally:
            ranks.barrier("control")

    @classmethod
    def _open_as_rank0(
        cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks, create: bool,
        extra: dict[str, Any] | None, other_world: bool,
    ) -> "LocalStore":
        world_size = ranks.world
        if not marker_path.exists():
            if not create:
                raise CheckpointDirectoryError(f"no everystep checkpoint directory at {path} (no {MARKER} there)")
            if path.exists() and any(path.iterdir()):
                found = ", ".join(sorted(p.name for p in path.iterdir())[:5])
                raise CheckpointDirectoryError(
                    f"{path} is not empty and is not an everystep checkpoint directory (found: {found}); "
                    "choose an empty or new directory"
                )
            marker = {"format": "everystep", "version": FORMAT_VERSION, "strategy": strategy, "world_size": world_size}
            marker.update(extra or {})
            path.mkdir(parents=True, exist_ok=True)
            (path / "objects").mkdir(exist_ok=True)
            (path / "manifests").mkdir(exist_ok=True)
            store = cls(path, marker, ranks)
            store._atomic_write(marker_path, json.dumps(marker, indent=1).encode())
            if path.parent.exists():
                _fsync_dir(path.parent)
            return store
        marker = cls._read_marker(marker_path)
        if strategy is not None and marker.get("strategy") not in (None, strategy):
            raise CheckpointDirectoryError(
                f"{path} was written by strategy {marker.get('strategy')!r}; this run uses {strategy!r} — "
                f"use --strategy {marker.get('strategy')} or another directory"
            )
        for sub in ("objects", "manifests"):
            (path / sub).mkdir(exist_ok=True)
        store = cls(path, marker, ranks)
        written = marker.get("world_size", 1)
        if written != world_size and strategy is not None:
            if not other_world:
                raise CheckpointDirectoryError(
                    f"{path} was written by {written} process(es); this run has {world_size} — strategy "
                    f"{strategy!r} keeps state per rank that cannot be carried to another world size"
                )
            store.marker = {**marker, "world_size": world_size}
            store._atomic_write(marker_path, json.dumps(store.marker, indent=1).encode())
        return store

    @staticmethod
    def _read_marker(marker_path: Path) -> dict[str, Any]:
        try:
            marker = json.loads(marker_path.read_bytes())
        except (OSError, ValueError) as e:
            raise CheckpointDirectoryError(f"cannot read {marker_path}: {e}") from None
        if not isinstance(marker, dict) or marker.get("format") != "everystep":
            raise CheckpointDirectoryError(f"{marker_path} is not an everystep marker file")
        if marker.get("version") != FORMAT_VERSION:
            raise CheckpointDirectoryError(
                f"{marker_path.parent} has format version {marker.get('version')}; this everystep reads {FORMAT_VERSION}"
            )
        return marker

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

    def _referenced(self) -> set[str]:
        return {o.name for r in self.manifests() if r.manifest for o in r.manifest.objects.values()}

    def collect_garbage(self) -> list[str]:
        """Delete temporaries and objects no manifest names (left by a crash). Call only when no
        write is in flight, e.g. at open. Returns the names removed."""
        removed, used = [], self._referenced()
        folders = {name.split("/", 1)[0] for name in used if "/" in name}
        for directory in (self.objects_dir, self.manifests_dir):
            for path in directory.iterdir():
                orphan = (directory is self.objects_dir and _OBJECT_NAME.match(path.name) and path.name not in used
                          and path.name not in folders)
                if _TMP.match(path.name) or orphan:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path.name)
        return removed

    def stored_files(self) -> list[str]:
        """Every file under ``objects/``, as an object name (``a.safetensors``, ``full-….dcp/__0_0.distcp``)."""
        return sorted(str(p.relative_to(self.objects_dir)) for p in self.objects_dir.rglob("*") if not p.is_dir())
