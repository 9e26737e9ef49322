"""The checkpoint directory: a manager above the catalog of checkpoints.

The catalog (:class:`~everystep.storage.catalog.Catalog`) keeps objects and manifests in a store
(:class:`~everystep.storage.stores.local.LocalStore`), each write atomic and durable. Everything about the
directory as a whole lives here:

- identity: the marker ``everystep.json`` (format, version, strategy, world size, full-checkpoint
  format, checksum), checked at open, so that a run never mixes its checkpoints with another
  configuration's;
- ownership: one writer at a time holds ``everystep.lock`` (a second is refused with the
  owner's pid); ``shared`` access writes on the owner's behalf (its checkpoint agent), and
  ``read`` access creates, renames and deletes nothing, so a reader works beside a live writer;
- retention: what the newest ``keep`` full checkpoints and the newer differentials do not need
  is discarded (:func:`~everystep.storage.retention.plan_retention`);
- garbage collection of everystep's own leftovers only (``full-000000000012.safetensors`` that no
  manifest names, interrupted writes), by the owner, logged.

Objects and manifests are read and written through ``directory.catalog``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from ..distributed import Ranks
from ..errors import CheckpointDirectoryError
from ..files import read_regular
from .base import Access, Manifest, ManifestRecord, checksum
from .stores.location import is_remote, open_remote
from .catalog import MANIFESTS, OBJECTS, PINNED, Catalog
from .dirlock import LOCK, DirectoryLock, holder
from .hosts import (PROBE, Hosts, agree_across_hosts, agree_markers, check_restored_across_hosts, discard_hidden,
                    listing, probe, readers_hosts)
from .stores.local import LocalStore, fsync_dir
from .retention import plan_retention

_LEFT_BEFORE_MARKER = re.compile(r"region-r\d+\.owner|memory-r\d+\.json")
"""What a run writes before its directory's marker: a region's claim, a memory tier's record."""

__all__ = ["CheckpointDirectory", "MARKER", "LOCK", "FORMAT_VERSION", "marker_bytes", "parse_marker", "collect_garbage"]

MARKER = "everystep.json"
MARKER_LIMIT = 1 << 20
"""The most bytes a marker is read of: a marker is a few hundred."""
FORMAT_VERSION = 2
"""Version 2 markers carry a checksum; version 1 (no checksum) is still read."""
_OWN_NAME = r"[a-z]+-\d{12}(?:-r\d+)?"
_OWN_OBJECT = re.compile(rf"^{_OWN_NAME}\.[a-z0-9]+$")
log = logging.getLogger("everystep")


def marker_bytes(marker: dict[str, Any]) -> bytes:
    """The marker file's bytes: ``marker`` with its checksum (any old one replaced)."""
    body = {k: v for k, v in marker.items() if k != "checksum"}
    body["checksum"] = checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(body, indent=1, sort_keys=True).encode()


def parse_marker(data: bytes, where: str) -> dict[str, Any]:
    """A directory's marker from its bytes (``where``: named in errors), checked: everystep's, of a
    version this code reads, its checksum right, its world size and names of the types they have."""
    try:
        marker = json.loads(data)
    except ValueError as e:
        raise CheckpointDirectoryError(f"cannot read {where}: {e}") from None
    if not isinstance(marker, dict) or marker.get("format") != "everystep":
        raise CheckpointDirectoryError(f"{where} is not an everystep marker file")
    if marker.get("version") not in (1, FORMAT_VERSION):
        raise CheckpointDirectoryError(
            f"{where} has format version {marker.get('version')}; this everystep reads 1 to {FORMAT_VERSION}"
        )
    if marker["version"] >= 2 and marker_bytes_ok(marker) is not True:
        raise CheckpointDirectoryError(f"{where} fails its checksum (corrupted, or edited by hand)")
    world = marker.get("world_size", 1)
    if type(world) is not int or world < 1:
        raise CheckpointDirectoryError(f"{where} names world size {world!r}, not a positive number of processes")
    if any(not isinstance(marker.get(k), (str, type(None))) for k in ("strategy", "full_format")):
        raise CheckpointDirectoryError(f"{where} names its strategy or full-checkpoint format by no name")
    return marker


def marker_bytes_ok(marker: dict[str, Any]) -> bool | None:
    """Whether a marker's checksum matches (None: it has none, as version 1 markers)."""
    if "checksum" not in marker:
        return None
    return json.loads(marker_bytes(marker))["checksum"] == marker["checksum"]


class CheckpointDirectory:
    """An everystep checkpoint directory, opened for one kind of access (see the module docstring)."""

    def __init__(self, catalog: Catalog, marker: dict[str, Any]) -> None:
        self.catalog = catalog
        self.marker = marker
        self._owner: DirectoryLock | None = None
        self._retention_lock = threading.Lock()
        self.created = False
        """Whether :meth:`open` made this directory an everystep directory (see :meth:`undo_create`)."""
        self._marker_unwritten = False

    def agree_hosts(self) -> dict[str, Any] | None:
        """Collective at a restore under node-local directories: what every host holds, agreed
        (:func:`~everystep.storage.hosts.agree_across_hosts`), for :meth:`check_restored`; None for
        a directory of one host."""
        return agree_across_hosts(self.catalog) if self.catalog.hosts is not None else None

    def check_restored(self, step: int, held: dict[str, Any] | None) -> None:
        """Collective after a restore under several ranks: every rank restored ``step``, and none is
        restored from nothing where a host holds a checkpoint (``held``: :meth:`agree_hosts`'s;
        :func:`~everystep.storage.hosts.check_restored_across_hosts`)."""
        if self.ranks.distributed:
            check_restored_across_hosts(self.catalog, step, held)

    @property
    def root(self) -> Path:
        return self.catalog.root

    @property
    def ranks(self) -> Ranks:
        """The job writing here: each rank writes its part of a checkpoint; rank 0 commits and deletes."""
        return self.catalog.ranks

    @property
    def access(self) -> Access:
        return self.catalog.access

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
        new_full_format: str = "safetensors",
    ) -> "CheckpointDirectory":
        """Open a checkpoint directory, creating it when ``create`` and it is absent or empty (its full
        checkpoints in ``new_full_format`` unless ``extra["full_format"]`` asks for one).

        Under several ranks writing, whether every rank sees one directory or each host its own
        (node-local disks) is found out first (:mod:`~everystep.storage.hosts`). Refuses a directory
        that holds anything but an everystep checkpoint, or one written by
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
        if is_remote(str(root)):
            return cls._open_remote(str(root), access)
        path = Path(root)
        if path.exists() and not path.is_dir():
            raise CheckpointDirectoryError(f"{path} is a file, not a checkpoint directory")
        marker_path = path / MARKER
        if ranks.distributed and access == "write":
            hosts = probe(path, ranks, create=create)
            if hosts is not None:
                return cls._open_node_local(path, marker_path, hosts, strategy, ranks, create, extra, other_world)
        if ranks.distributed and access == "read":  # (a reader changes nothing: no probe, no barrier to create)
            return cls._open_reading(path, marker_path, strategy, ranks, extra, other_world)
        if ranks.rank != 0:
            ranks.barrier("control")  # rank 0 has created or checked the directory
            return cls(Catalog(LocalStore(path, access=access), ranks), cls._read_marker(marker_path))
        try:
            return cls._open_as_rank0(path, marker_path, strategy, ranks, create and access == "write", extra,
                                      other_world, access, new_full_format)
        finally:
            ranks.barrier("control")

    @classmethod
    def _open_node_local(cls, path: Path, marker_path: Path, hosts: Hosts, strategy: str | None, ranks: Ranks,
                         create: bool, extra: dict[str, Any] | None, other_world: bool) -> "CheckpointDirectory":
        """Open ``path`` for writing on every host at once (collective): each host's first rank
        creates or checks its own directory and takes its lock, as rank 0 does a shared one, once the
        hosts' markers agree (:func:`~everystep.storage.hosts.agree_markers`)."""
        lead = ranks.rank == next(g for g in hosts if ranks.rank in g)[0]
        marker, error, directory = None, None, None
        try:
            marker = cls._read_marker(marker_path) if lead and marker_path.exists() else None
        except BaseException as e:  # (raised on every rank by the exchange)
            error = e
        full_format = agree_markers(path, hosts, ranks, marker, error, (extra or {}).get("full_format"))
        try:
            if lead:
                directory = cls._open_as_rank0(path, marker_path, strategy, ranks, create, extra, other_world, "write",
                                               full_format)
        except BaseException as e:
            error = e
        try:
            ranks.exchange("control", {}, error, f"opening {path} on every host")
            directory = directory or cls(Catalog(LocalStore(path), ranks), cls._read_marker(marker_path))
        except BaseException:
            if directory is not None:
                directory.close()
            raise
        directory.catalog.hosts = hosts
        return directory

    @classmethod
    def _open_reading(cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks,
                      extra: dict[str, Any] | None, other_world: bool) -> "CheckpointDirectory":
        """Open ``path`` for reading on every rank at once (collective), each rank checking its own:
        ranks whose directories list different checkpoints or objects (each host's own disk) read as
        under node-local directories (:func:`~everystep.storage.hosts.readers_hosts`)."""
        directory, error, listed = None, None, None
        try:
            directory = cls._open_as_rank0(path, marker_path, strategy, ranks, False, extra, other_world, "read",
                                           "safetensors")
            listed = listing(directory.catalog)
        except BaseException as e:  # (raised on every rank by the exchange)
            error = e
        reports = ranks.exchange("control", {"listing": listed}, error, f"opening {path} for reading on every rank")
        assert directory is not None
        directory.catalog.hosts = readers_hosts([r["listing"] for r in reports])
        return directory

    @property
    def remote(self) -> bool:
        """Whether this is a remote tier's prefix (``s3://…``: full checkpoints only, read only)."""
        return is_remote(str(self.root))

    @classmethod
    def _open_remote(cls, url: str, access: Access) -> "CheckpointDirectory":
        """The checkpoints a remote tier uploaded to ``url`` (:mod:`everystep.storage.remote.tier`), for
        reading: ``inspect``, ``verify`` and ``recover`` take the URL."""
        if access != "read":
            raise CheckpointDirectoryError(f"{url} is read here, never written: a job writes to a local directory and "
                                           "uploads there with remote= (--remote)")
        try:
            store = open_remote(url, access="read")
        except ValueError as e:  # a URL that is not one: said in one line, as training says it
            raise CheckpointDirectoryError(str(e)) from None
        try:
            data = store.get(MARKER)
        except FileNotFoundError:
            raise CheckpointDirectoryError(f"no everystep checkpoints at {url} (no {MARKER} there)") from None
        return cls(Catalog(store, Ranks()), parse_marker(bytes(data), f"{url}/{MARKER}"))

    @classmethod
    def _open_as_rank0(
        cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks, create: bool,
        extra: dict[str, Any] | None, other_world: bool, access: Access, new_full_format: str,
    ) -> "CheckpointDirectory":
        if not marker_path.exists():
            if not create:
                raise CheckpointDirectoryError(f"no everystep checkpoint directory at {path} (no {MARKER} there)")
            cls._refuse_foreign(path)  # before anything is created there
        owner = cls._take(path) if access == "write" else None
        try:
            directory = (cls._create(path, marker_path, strategy, ranks, {"full_format": new_full_format, **(extra or {})})
                         if not marker_path.exists()
                         else cls._check(path, marker_path, strategy, ranks, extra, other_world, access))
        except BaseException:
            if owner is not None:
                owner.release(remove=not marker_path.exists())
            raise
        directory._owner = owner
        return directory

    @staticmethod
    def _take(path: Path) -> DirectoryLock:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot create the checkpoint directory {path}: {e.strerror or e}") from None
        return DirectoryLock(path)

    @staticmethod
    def owner(root: str | os.PathLike[str]) -> int | None:
        """The pid of the process that holds ``root`` for writing (0 if it cannot be told), or None
        when no process does. Creates nothing: a reader may ask."""
        if is_remote(str(root)):
            from .remote.lock import LOCK_KEY

            return None if open_remote(str(root), access="read").age(LOCK_KEY) is None else 0
        return holder(Path(root))

    @staticmethod
    def _refuse_foreign(path: Path) -> None:
        """Refuse a folder that holds files of anything but everystep (a run that died before its
        marker was written may have left a region's claim or a memory tier's record: its own)."""
        found = sorted(p.name for p in path.iterdir() if p.name != LOCK and not p.name.startswith(PROBE)
                       and not _LEFT_BEFORE_MARKER.fullmatch(p.name)) if path.is_dir() else []
        if found:
            raise CheckpointDirectoryError(
                f"{path} is not empty and is not an everystep checkpoint directory (found: {', '.join(found[:5])}); "
                "choose an empty or new directory"
            )

    @classmethod
    def _create(cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks,
                extra: dict[str, Any] | None) -> "CheckpointDirectory":
        cls._refuse_foreign(path)
        marker = {"format": "everystep", "version": FORMAT_VERSION, "strategy": strategy, "world_size": ranks.world,
                  "full_format": "safetensors"}
        marker.update(extra or {})
        directory = cls(Catalog(LocalStore(path), ranks), marker)
        directory.created = True
        directory._make_folders()
        directory.put_file(MARKER, marker_bytes(marker))  # last: the directory is everystep's from here on
        if path.parent.exists():
            fsync_dir(path.parent)
        return directory

    @classmethod
    def _check(cls, path: Path, marker_path: Path, strategy: str | None, ranks: Ranks, extra: dict[str, Any] | None,
               other_world: bool, access: Access) -> "CheckpointDirectory":
        marker = cls._read_marker(marker_path)
        if strategy is not None and marker.get("strategy") not in (None, strategy):
            raise CheckpointDirectoryError(
                f"{path} was written by strategy {marker.get('strategy')!r}; this run uses {strategy!r} — "
                f"use strategy {marker.get('strategy')!r} or another directory"
            )
        directory = cls(Catalog(LocalStore(path, access=access), ranks), marker)
        wanted = (extra or {}).get("full_format")
        if wanted is not None and wanted != directory.full_format:
            raise CheckpointDirectoryError(
                f"{path} holds full checkpoints in the {directory.full_format!r} format; this run asks for {wanted!r} — "
                f"use full_format={directory.full_format!r} or another directory"
            )
        if access == "read":
            return directory
        directory._make_folders()
        written = marker.get("world_size", 1)
        if written != ranks.world and strategy is not None:
            if not other_world:
                raise CheckpointDirectoryError(
                    f"{path} was written by {written} process(es); this run has {ranks.world} — strategy "
                    f"{strategy!r} keeps state per rank that cannot be carried to another world size"
                )
            # written once training starts from what is here (:meth:`write_marker`): a run refused
            # before then (a restore that does not fit) changes nothing
            directory.marker, directory._marker_unwritten = {**marker, "world_size": ranks.world}, True
        return directory

    @staticmethod
    def _read_marker(marker_path: Path) -> dict[str, Any]:
        try:  # (a regular file only, of a marker's size: not a FIFO, not a link to /dev/zero)
            data = read_regular(marker_path, limit=MARKER_LIMIT)
        except (OSError, ValueError) as e:
            raise CheckpointDirectoryError(f"cannot read {marker_path}: {e}") from None
        return parse_marker(data, str(marker_path))

    def _make_folders(self) -> None:
        """The catalog's folders, made by a writer at open (the store would make them at its first write)."""
        try:
            for folder in (OBJECTS, MANIFESTS):
                (self.root / folder).mkdir(exist_ok=True)
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot create the checkpoint directory {self.root}: {e.strerror or e}") from None

    def put_file(self, name: str, data: bytes) -> None:
        """Write the file ``name`` beside the catalog's folders (the marker, a region's claim), atomically."""
        self.catalog.store.put(name, [data])

    def write_marker(self) -> None:
        """Write what :meth:`open` changed of the marker (the world size of a job that carries the
        checkpoints to another), once training starts from what the directory holds; under
        node-local disks, discard what not every host holds (:func:`~everystep.storage.hosts.discard_hidden`)."""
        for name in discard_hidden(self.catalog):
            log.warning("discarded %s from %s: not every host's directory holds it", name, self.root)
        if self._marker_unwritten:
            self.put_file(MARKER, marker_bytes(self.marker))
            self._marker_unwritten = False

    def close(self) -> None:
        """Give the directory up for writing (release its lock). The store may still be read."""
        self.catalog.close()
        if self._owner is not None:
            self._owner.release()
            self._owner = None

    def undo_create(self) -> None:
        """Make a directory this store just created, and that holds no checkpoint yet, plain again
        (a constructor that failed after opening it leaves it as it found it)."""
        if not self.created or self.access != "write" or not self.catalog.leads:
            return
        if self.catalog.object_names() or self.catalog.manifests():
            return
        for key in (MARKER, OBJECTS.rstrip("/"), MANIFESTS.rstrip("/")):
            self.catalog.store.delete(key)
        if self._owner is not None:
            self._owner.release(remove=True)
            self._owner = None
        self.created = False

    def fulls(self, records: list[ManifestRecord] | None = None) -> list[Manifest]:
        """The full checkpoints' manifests, newest first, as listed (``records``: a listing already
        made), not yet verified."""
        listed = self.catalog.manifests() if records is None else records
        return sorted((r.manifest for r in listed if r.manifest and r.manifest.kind == "full"), key=lambda m: -m.step)

    def newest_full_step(self, records: list[ManifestRecord] | None = None) -> int:
        """The step of the newest full checkpoint listed (not yet verified); -1 when there is none."""
        found = self.fulls(records)
        return found[0].step if found else -1

    def retain(self, keep: int) -> list[str]:
        """Discard what the newest ``keep`` full checkpoints and the newer differentials do not
        need (see :func:`plan_retention`); returns the names discarded. Several writer threads may
        call it; one plans and deletes at a time.

        IMPORTANT: call only after the newest checkpoint is committed, so that deleting an older
        one never leaves fewer recoverable points than before. Only rank 0 deletes (each host's
        first rank in its own directory, under node-local disks).
        """
        self.catalog.check_writable()
        if not self.catalog.leads:
            return []
        with self._retention_lock:
            committed = [r.manifest for r in self.catalog.manifests() if r.manifest is not None]
            doomed = plan_retention(committed, keep=keep, pinned=self._pinned())
            for name in doomed:
                self.catalog.discard(name)
        return doomed

    def pin(self, names: list[str]) -> None:
        """Have retention keep the checkpoints ``names`` (and what they require), in every process
        that applies it, until the next call (``[]``: none): the remote tier pins the one it uploads
        while it reads it. The directory's writer (rank 0) only."""
        self.catalog.check_writable()
        if names:
            self.catalog.store.put(PINNED, [json.dumps({"manifests": names}).encode()])
        else:
            self.catalog.store.delete(PINNED)

    def pin_newest(self, newer_than: int) -> Manifest | None:
        """Pin the job's newest full checkpoint (rank 0's manifest; see :meth:`pin`) if its step is
        above ``newer_than``, and return it; None, and nothing pinned, when there is none that new.
        Listed and pinned under the lock :meth:`retain` holds, so that no retention in this process
        discards it in between. (One in another process, an agent's, may have read the pins just
        before: a reader of what was pinned checks :meth:`Catalog.committed` when an object is missing.)"""
        with self._retention_lock:
            newest = [m for m in self.fulls() if m.rank == 0]  # (a rank's own part is not the full state)
            if not newest or newest[0].step <= newer_than:
                return None
            self.pin([newest[0].name])
            return newest[0]

    def _pinned(self) -> list[str]:
        """The names :meth:`pin` gave here, and under node-local disks those rank 0 had pinned at the
        newest commit."""
        return self.catalog.pinned() + self.catalog.job_pins

    def collect_garbage(self) -> list[str]:
        """Delete what a crash left: everystep's own temporaries, its own objects that no manifest
        names, and a pin an interrupted upload left (:meth:`pin`). Only the owner
        (``access="write"``) collects, and only when no write is in flight (at open). Files of other
        names are never touched, nor the objects of a checkpoint whose manifest is unreadable (it
        may be repaired; ``verify`` reports it). Returns the names removed, which are also logged.
        """
        if self.access != "write":
            self.catalog.check_writable()
            return []
        if self.catalog.pinned():
            self.pin([])
        return collect_garbage(self.catalog)


def collect_garbage(catalog: Catalog) -> list[str]:
    """Delete what an interrupted writer left in ``catalog``'s store — everystep's own temporaries
    (or uploads in progress), and its own objects that no manifest names — and log it; the names
    removed. Only the store's one writer may call it, when it has no write in flight."""
    records = catalog.manifests()
    used = {o.name for r in records if r.manifest for o in r.manifest.objects.values()}
    used |= {name.split("/", 1)[0] for name in used if "/" in name}
    unreadable = tuple(r.name for r in records if r.manifest is None)
    orphans = [name for name in catalog.object_names()
               if _OWN_OBJECT.match(name) and name not in used and not name.startswith(unreadable)]
    leftovers = [token for token, final in catalog.interrupted_writes() if _OWN_OBJECT.match(final.rsplit("/", 1)[-1])]
    removed = [catalog.delete_leftover(token) for token in leftovers]  # first: a deleted object may be kept as a spare
    removed += [catalog.delete_object(name) for name in orphans]
    if removed:
        log.warning("removed %d file(s) an interrupted run left in %s: %s", len(removed), catalog.root,
                    ", ".join(sorted(removed)))
    return removed
