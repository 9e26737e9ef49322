"""Checkpoints made of a :class:`~everystep.storage.base.Store`'s values: objects and manifests.

An *object* is an immutable value under ``objects/`` (a tensor file, a JSON record, or a directory of
files another format's writer made), with a size and a checksum; a *manifest* is the JSON record under
``manifests/`` that names a checkpoint's objects. Call order for one checkpoint:

1. ``write_object`` (or ``write_directory``) once per object; each is durable when it returns, but
   no checkpoint yet.
2. ``commit(manifest)``; the checkpoint is visible to recovery exactly when this returns.

Readers call ``manifests()`` and then ``read_object`` for the objects of the manifest they want, each
verified against the manifest's size and checksum. ``discard(manifest)`` removes a checkpoint: the
manifest first, durably, then the objects no other manifest names. A catalog over a store opened with
``access="read"`` refuses every change (``check_writable`` says so). All of this holds over any store,
since it asks of a store only that each put be atomic and durable.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from .._faults import crash_point
from ..distributed import Ranks
from ..errors import ReadOnlyStoreError
from .base import (
    CHECKSUM_ALGORITHM,
    Access,
    Manifest,
    ManifestRecord,
    ObjectFile,
    ObjectInfo,
    Store,
    check_manifest_name,
    check_object,
    check_object_name,
    fetch_object,
    new_hasher,
    read_verified,
)

__all__ = ["Catalog", "Supplemented", "OBJECTS", "MANIFESTS", "PINNED"]

T = TypeVar("T")
OBJECTS = "objects/"
MANIFESTS = "manifests/"
PINNED = "pinned.json"
"""The checkpoints retention keeps beside the newest: the one the remote tier is uploading
(:meth:`CheckpointDirectory.pin <everystep.storage.directory.CheckpointDirectory.pin>`). A file,
because retention runs in several processes (the persist thread's, a writer's, an agent's), and
each reads it."""


def _manifest_key(name: str) -> str:
    return f"{MANIFESTS}{check_manifest_name(name)}.json"


def _new_object_key(name: str) -> str:
    """The key of a new object: a name everystep writes, and a plain file name (no folder: an object's
    own files are written by ``write_directory``'s ``fill``)."""
    if "/" in name:
        raise ValueError(f"invalid object name {name!r}")
    return OBJECTS + check_object_name(name)


class Catalog:
    """The objects and manifests of one checkpoint directory, kept in ``store`` (see the module docstring)."""

    def __init__(self, store: Store, ranks: Ranks | None = None) -> None:
        self.store = store
        self.ranks = ranks or Ranks()
        """The job writing here: each rank writes its part of a checkpoint; rank 0 commits and deletes."""
        self._lock = threading.Lock()
        self._bytes_written = 0
        self._bytes_read = 0
        self._parsed: dict[str, tuple[str, ManifestRecord]] = {}
        """Each manifest as last parsed or committed, with its value's version."""
        self.hosts: tuple[tuple[int, ...], ...] | None = None
        """Where the job's ranks keep their own directories (node-local disks,
        :mod:`~everystep.storage.hosts`): the ranks of each, rank 0's first; None: one directory for all."""
        self._hidden: set[str] = set()
        self.job_pins: list[str] = []
        """Under node-local disks: the checkpoints rank 0 had pinned at the newest commit (its
        directory's :meth:`pinned`), which retention keeps here too."""

    @property
    def root(self) -> Path:
        return self.store.root

    @property
    def access(self) -> Access:
        return self.store.access

    def check_writable(self) -> None:
        """Raise :class:`ReadOnlyStoreError` if the store was opened for reading."""
        if self.access == "read":
            raise ReadOnlyStoreError(f"{self.root} was opened for reading; nothing may be written or deleted there")

    @property
    def group(self) -> tuple[int, ...]:
        """The ranks that keep their parts in this catalog's directory (every rank where it is shared)."""
        if self.hosts is None:
            return tuple(range(self.ranks.world))
        return next(g for g in self.hosts if self.ranks.rank in g)

    @property
    def leads(self) -> bool:
        """Whether this rank commits manifests and deletes here: rank 0, or the first rank of its
        host where each host keeps its own directory."""
        return self.ranks.rank == self.group[0]

    def hide(self, names: set[str]) -> None:
        """Leave the manifests ``names`` out of :meth:`manifests` (node-local disks: checkpoints that
        not every host holds), until one of them is committed again."""
        self._hidden = set(names)

    @property
    def hidden(self) -> frozenset[str]:
        """What :meth:`hide` leaves out."""
        return frozenset(self._hidden)

    def pinned(self) -> list[str]:
        """The checkpoints retention keeps beside the newest here (``pinned.json``, see
        :meth:`CheckpointDirectory.pin <everystep.storage.directory.CheckpointDirectory.pin>`)."""
        try:
            found = json.loads(bytes(self.store.get(PINNED)))
        except (FileNotFoundError, ValueError):
            return []
        names = found.get("manifests") if isinstance(found, dict) else None
        return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []

    def where(self, key: str) -> str:
        """A key as messages name it."""
        return f"{self.root}/{key}"

    # -- writing -----------------------------------------------------------------------------

    @property
    def bytes_written(self) -> int:
        with self._lock:
            return self._bytes_written

    @property
    def bytes_read(self) -> int:
        """The bytes of objects read (and verified) through this catalog: what recoveries took from storage."""
        with self._lock:
            return self._bytes_read

    def count_written_elsewhere(self, n: int) -> None:
        """Add ``n`` bytes written for this directory elsewhere than through this catalog (a checkpoint
        agent's, lightcheck's region)."""
        with self._lock:
            self._bytes_written += n

    def _counted(self, chunks: Iterable[bytes | memoryview], hasher: object | None) -> Iterator[memoryview]:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if hasher is not None:
                hasher.update(view)  # type: ignore[attr-defined]
            yield view
            self.count_written_elsewhere(view.nbytes)

    def write_object(self, name: str, chunks: Iterable[bytes | memoryview]) -> ObjectInfo:
        """Write the object ``name`` (a plain file name); durable when it returns."""
        hasher = new_hasher()
        nbytes = self.store.put(_new_object_key(name), self._counted(chunks, hasher))
        return ObjectInfo(name=name, nbytes=nbytes, checksum=f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}")

    def put_object(self, info: ObjectInfo, data: bytes | bytearray | memoryview) -> int:
        """Store the bytes of an object another catalog holds, verified there against ``info``
        (:meth:`read_object`), under its name, over one of that name; durable when it returns. The
        bytes written."""
        self.check_writable()
        return self.store.put(OBJECTS + check_object_name(info.name), self._counted([data], None))

    def has_object(self, name: str) -> bool:
        """Whether an object (a file of a directory object too) of that name is stored."""
        key = OBJECTS + check_object_name(name)
        return key in self.store.list(key)

    def write_directory(self, name: str, fill: Callable[[Path], T]) -> T:
        """An object that is a directory of files (a DCP checkpoint), which ``fill`` writes into the
        folder it is given; under several ranks every rank calls it at once (see
        :meth:`Store.put_directory <everystep.storage.base.Store.put_directory>`), rank 0 leading."""
        self.check_writable()
        return self.store.put_directory(_new_object_key(name), fill, lead=self.ranks.rank == 0)

    def commit(self, manifest: Manifest) -> None:
        """Make the checkpoint ``manifest`` names visible: its objects must be durable already."""
        crash_point("store.commit.before_manifest")
        key = _manifest_key(manifest.name)
        self.store.put(key, self._counted([manifest.to_bytes()], None))
        self._hidden.discard(manifest.name)
        # the writer lists the manifests after each checkpoint (retention): its own need no re-reading
        version = self.store.list(key).get(key)
        if version is not None:  # (None: already discarded by another writer thread's retention)
            self._parsed[manifest.name] = (version, ManifestRecord(manifest.name, manifest))

    # -- reading -----------------------------------------------------------------------------

    def object_path(self, name: str) -> Path:
        """A local path holding the object ``name`` (formats that read by path: DCP); ValueError for a
        name everystep does not write (absolute, climbing out), which would lie elsewhere."""
        return self.store.fetch(OBJECTS + check_object_name(name))

    def read_object(self, info: ObjectInfo) -> bytearray:
        """The object's bytes, after its size and checksum are verified."""
        key = OBJECTS + info.name
        data = read_verified(self.store, key, info, self.where(key))
        with self._lock:
            self._bytes_read += len(data)
        return data

    def open_object(self, info: ObjectInfo) -> ObjectFile | None:
        """The object as a file to read once, where the store holds it as one (a local store), its
        size checked — its reader hashes what it reads against ``info.checksum`` before using any of
        it (:func:`~everystep.storage.formats.tensorfile.read_object_tensors`); None from another
        store, whose objects are read whole (:meth:`read_object`)."""
        from .stores.local import LocalStore

        if not isinstance(self.store, LocalStore):
            return None
        key, store = OBJECTS + info.name, self.store
        where = self.where(key)
        f, size = fetch_object(lambda: store.open_value(key, limit=info.nbytes), info, where)
        try:
            check_object(info, where, size)
        except BaseException:
            f.close()
            raise
        with self._lock:
            self._bytes_read += size
        return ObjectFile(f, size, where)

    def manifests(self) -> list[ManifestRecord]:
        """Every manifest, parsed and verified. A manifest this catalog already parsed or committed, and
        whose value has the same version still, is not read again: the writer lists the manifests after
        each checkpoint, for retention. A new catalog (a recovery) reads every one."""
        records, parsed = [], {}
        for key, version in self.store.list(MANIFESTS).items():
            filename = key[len(MANIFESTS):]
            if "/" in filename or not filename.endswith(".json"):
                continue
            name = filename[: -len(".json")]
            if name in self._hidden:
                continue
            known = self._parsed.get(name)
            if known is not None and known[0] == version:
                record = known[1]
            else:
                try:
                    record = ManifestRecord(name, Manifest.from_bytes(bytes(self.store.get(key)), name=name))
                except FileNotFoundError:
                    continue  # discarded since the listing (a reader beside a live writer)
                except (OSError, ValueError, KeyError, TypeError) as e:
                    records.append(ManifestRecord(name, None, f"manifest {self.where(key)} is unreadable: {e}"))
                    continue
            parsed[name] = (version, record)
            records.append(record)
        self._parsed = parsed
        return records

    def committed(self, manifest_name: str) -> bool:
        """Whether the checkpoint is still committed (a writer may discard it while a reader reads it)."""
        key = _manifest_key(manifest_name)
        return key in self.store.list(key)

    # -- removing ----------------------------------------------------------------------------

    def discard(self, manifest_name: str) -> None:
        """Uncommit a checkpoint (its manifest goes first, durably), then delete the objects no other
        manifest names."""
        self.check_writable()
        key = _manifest_key(manifest_name)
        known = self._parsed.get(manifest_name)
        try:
            manifest = (known[1].manifest if known and known[0] == self.store.list(key).get(key) else None) \
                or Manifest.from_bytes(bytes(self.store.get(key)), name=manifest_name)
            names = {o.name for o in manifest.objects.values()}
        except (OSError, ValueError, KeyError, TypeError):
            names = set()
        self.store.delete(key)
        crash_point("store.retention.uncommitted")  # (its objects still there: garbage a restart collects)
        still_used = {o.name for r in self.manifests() if r.manifest for o in r.manifest.objects.values()}
        for name in sorted(names - still_used):  # (not durably: one a crash brings back is garbage collected)
            self.store.delete(OBJECTS + name, durable=False)
        for folder in {name.split("/", 1)[0] for name in names if "/" in name}:
            if not any(n.startswith(folder + "/") for n in still_used):
                self.store.delete(OBJECTS + folder, durable=False)

    def close(self) -> None:
        """Release what the store keeps: for the writes to come, or what it fetched to read (the
        catalog may still be read)."""
        self.store.close()

    # -- for the directory above: what is stored, and what a crash left ------------------------

    def object_names(self) -> list[str]:
        """The names of the objects stored (a directory object once), not what interrupted writes left."""
        return sorted({key[len(OBJECTS):].split("/", 1)[0] for key in self.store.list(OBJECTS)})

    def stored_files(self) -> list[str]:
        """Every value under ``objects/``, as an object name (``a.safetensors``,
        ``full-….dcp/__0_0.distcp``), what interrupted writes left there among them."""
        listed = [key[len(OBJECTS):] for key in self.store.list(OBJECTS)]
        left = [key[len(OBJECTS):] for key, _ in self.store.leftovers() if key.startswith(OBJECTS)]
        return sorted(listed + left)

    def delete_object(self, name: str) -> str:
        """Delete an object that no manifest names; returns its key."""
        self.check_writable()
        key = OBJECTS + check_object_name(name)
        self.store.delete(key)
        return key

    def interrupted_writes(self) -> list[tuple[str, str]]:
        """What interrupted writes left: (a token for :meth:`delete_leftover`, the key it was being written
        under) for each."""
        return self.store.leftovers()

    def delete_leftover(self, token: str) -> str:
        """Delete what an interrupted write left; returns its key."""
        self.check_writable()
        if token not in {t for t, _ in self.store.leftovers()}:
            raise ValueError(f"{token!r} is not a leftover of the store at {self.root}")
        self.store.delete(token)
        return token


class Supplemented:
    """A catalog, but for the objects ``data`` holds (by name: their info and bytes, verified
    already), read from those bytes: a :class:`~everystep.storage.base.Reader` over what a pull
    downloaded, or what other hosts sent (:func:`~everystep.storage.hosts.gather_from_hosts`)."""

    def __init__(self, catalog: Catalog, data: dict[str, tuple[ObjectInfo, bytearray]]) -> None:
        self._catalog, self._data = catalog, data

    def __getattr__(self, name: str) -> object:
        return getattr(self._catalog, name)

    def read_object(self, info: ObjectInfo) -> bytearray:
        found = self._data.get(info.name)
        return found[1] if found is not None and found[0] == info else self._catalog.read_object(info)

    def open_object(self, info: ObjectInfo) -> ObjectFile | None:
        found = self._data.get(info.name)
        return self._catalog.open_object(info) if found is None or found[0] != info else None
