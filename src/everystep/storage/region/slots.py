"""A memory-mapped region of two slots, each a complete checkpoint (LightCheck's storage region).

One file, laid out in pages::

    page 0       file header: magic, version, page size, owner (written once, when the file is made)
    page 1, 2    the header of slot 0 and of slot 1, each on its own page
    areas        one per slot, anywhere after the headers: a metadata section, then a data section

A slot's **metadata** (JSON: each tensor's key, dtype, shape, offset, size and checksum; the
skeleton of the state tree; the step) lies apart from its **data**, where tensors of more than 128
bytes start at 128-byte-aligned offsets, in the order they are copied, and the small ones follow,
packed. Tensors are copied straight into the data section (on CUDA by DMA into the mapping,
registered with the driver), never serialised.

Committing a slot, in this order: (1) its header is marked *writing* and flushed, so that the slot
is not taken for a checkpoint while its data changes; (2) the data is copied; (3) each tensor's
checksum is computed — by a process of the writer's own that maps the file
(:mod:`~everystep.storage.region.hashing`) — and the metadata written; (4) where the file survives the host (not tmpfs),
the area is flushed; (5) the header — step, generation, where the area lies, the metadata's size
and checksum, and a checksum of the header itself — is written and flushed last. A crash at any
instant leaves the other slot complete. Recovery takes the complete slot with the newest step
(then generation) whose metadata and every tensor verify; a torn or corrupt slot is skipped with a
warning naming it. Reading maps the file copy-on-write: a reader changes nothing, and nothing read
is unpickled.

A flush is ``mmap.flush`` (``msync``) of the pages concerned, which holds the GIL for the whole
write-back: the training thread waits for it. Releasing the GIL (``msync`` through ctypes, or
``os.fdatasync``) was measured worse: writing back pages written through a mapping write-protects
them, which costs a TLB shootdown per page when another thread of the process runs on another
core — the training thread, once the GIL is free. On gpt2-tiny (2 virtual cores), LightCheck's
overhead went from +56% to +80% and the shootdowns from about one to about 460 a step.

Its complete slots are read as a :class:`~everystep.storage.base.Reader`'s objects through
:attr:`Region.objects` (:mod:`~everystep.storage.region.objects`); writing goes through
:meth:`Region.begin` and :meth:`Region.commit`, since the data is copied into place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from ..._faults import crash_point
from ...distributed import Ranks
from ...errors import (CheckpointDirectoryError, CorruptCheckpointError, DirectoryInUseError, EverystepError,
                      ReadOnlyStoreError)
from ...files import untrusted_file, untrusted_folder
from ...tree import check_skeleton
from ..base import MALFORMED, Access, refuse_constant
from .hashing import RegionHasher, reopened
from .lending import Lending, lending_supported
from .objects import SlotObjects
from .mapping import (HASH_THREADS, PAGE, Area, CopiedKeys, LayoutCodes, RegionLayout, RegionSlot, SlotMeta, SlotWriter,
                      on_volatile_memory, read_out, round_up)

__all__ = ["Region", "UntrustedRegionError", "UnreadableRegionError", "RegionSlot", "SlotWriter"]

_MAGIC = b"EVERYSTEP-REGION"
_VERSION = 1
_FILE_HEADER = struct.Struct("<16sII32s")  # magic, version, page size, owner
_SLOT_MAGIC = b"EVSLOT01"
_SLOT = struct.Struct("<8sIIQQQQQ16s")  # magic, state, slot, step, generation, area offset, area size, meta size, meta digest
_WRITING, _COMPLETE = 1, 2
_AREAS_START = 3 * PAGE


class UntrustedRegionError(CheckpointDirectoryError):
    """The region, or its folder, could be written by someone else than this user."""


class UnreadableRegionError(CorruptCheckpointError):
    """A file at the region's path is not a region everystep can read (its header does not parse)."""


def _digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _flush(view: mmap.mmap, offset: int, nbytes: int) -> None:
    """Write back ``nbytes`` of ``view`` from ``offset`` (a multiple of the page size) and wait,
    holding the GIL (see the module docstring)."""
    view.flush(offset, nbytes)


class Region:
    """The two-slot region in one file (see the module docstring)."""

    def __init__(self, path: Path, fd: int, *, access: Access, ranks: Ranks, flush: bool | None) -> None:
        self.root = path
        self.path = path
        self.ranks = ranks
        self.access: Access = access
        self._in_memory = on_volatile_memory(path)
        self.flush = not self._in_memory if flush is None else flush
        """Whether commits are flushed (``msync``) before the header: the file is meant to survive the host
        (by default, unless it lies in memory)."""
        self._fd = fd
        self._head = b""
        self._where = os.path.abspath(path)  # (the path it was opened at, whatever the working folder later)
        """The file's header as this process opened or made it (:meth:`begin` checks it is still there)."""
        self.owner = ""
        """What the region belongs to, as recorded when it was made."""
        self._lock = threading.Lock()
        self._generation = 0
        self._areas: dict[int, Area] = {}
        self._headers = mmap.mmap(fd, _AREAS_START, mmap.MAP_SHARED if access != "read" else mmap.MAP_PRIVATE,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="everystep-region")
        self._hasher: RegionHasher | None = None
        """The writer's hashing process, started at its first commit."""
        self.bytes_read = 0  # (by read_slot: what a restore read)
        self._codes: LayoutCodes | None = None
        """The layout the writer last committed, with what is made once for it."""
        self.lending = Lending(str(path))
        """The writer's tensors lent out of its slots (:meth:`read_slot`), settled before it writes one."""

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, access: Access = "write", ranks: Ranks | None = None,
             flush: bool | None = None, owner: str = "", remake: bool = False) -> "Region":
        """Open (a writer: create) the region at ``path``. ``flush``: ``None`` flushes unless the file
        lies on tmpfs/ramfs, where a flush cannot make it outlive the host. ``owner``: up to 32
        ASCII characters recorded when the file is made (what it belongs to; :attr:`owner` reads it back).

        Refused with :class:`UntrustedRegionError`: a file or folder another user could write, a
        symbolic link. Raises :class:`UnreadableRegionError` for a file whose header does not parse;
        a writer makes such a file anew only when told to (``remake``), never on its own."""
        path = Path(path)
        folder = untrusted_folder(path.parent)
        if folder is not None and access != "read":
            if not os.path.lexists(path.parent):
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder = untrusted_folder(path.parent)  # made here, or by another rank (the ranks share it) meanwhile
        if folder is not None:
            raise UntrustedRegionError(f"the region's folder {path.parent} cannot be trusted: {folder}; "
                                       "give region= a folder of your own (or /dev/shm)")
        try:
            # (never waiting to open: a FIFO put where the region was is refused below, not waited on)
            if access == "read":
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UntrustedRegionError(f"the region {path} cannot be trusted: it is a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            problem = untrusted_file(st)
            if problem is not None:
                raise UntrustedRegionError(f"the region {path} cannot be trusted: {problem}; a region is this user's "
                                           "own file, mode -rw------- (delete it, or give region= another path)")
            if access != "read":
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise DirectoryInUseError(f"the region {path} is in use by another process: one writer per region "
                                              "(give each run its own region=)", None) from None
            size = st.st_size
            head = os.pread(fd, _FILE_HEADER.size, 0)
            unmade = size == 0 or (size == _AREAS_START and not any(os.pread(fd, _AREAS_START, 0)))
            if access != "read" and (unmade or remake):  # new, or its making was cut short
                os.ftruncate(fd, 0)  # (remade: no slot header survives)
                os.ftruncate(fd, _AREAS_START)
                head = _FILE_HEADER.pack(_MAGIC, _VERSION, PAGE, owner.encode("ascii"))
                os.pwrite(fd, head, 0)
                os.fsync(fd)
                size = _AREAS_START
            if len(head) < _FILE_HEADER.size or size < _AREAS_START:
                raise UnreadableRegionError(f"{path} is not an everystep region (it is {size} bytes)")
            magic, version, page, stored_owner = _FILE_HEADER.unpack(head)
            if magic != _MAGIC or version != _VERSION or page != PAGE:
                raise UnreadableRegionError(f"{path} is not an everystep region of version {_VERSION} "
                                            f"with {PAGE}-byte pages")
            region = cls(path, fd, access=access, ranks=ranks or Ranks(), flush=flush)
            region.owner = stored_owner.rstrip(b"\0").decode("ascii", "replace")
            region._head = head
            return region
        except BaseException:
            os.close(fd)
            raise

    # -- headers ---------------------------------------------------------------------------------

    def _header_bytes(self, slot: int) -> bytes:
        start, stop = (1 + slot) * PAGE, (1 + slot) * PAGE + _SLOT.size + 16
        if os.fstat(self._fd).st_size < stop:  # (cut short by another process: its mapping is gone)
            return bytes(stop - start)
        return self._headers[start:stop]

    def parse_slot(self, slot: int) -> tuple[RegionSlot | None, str | None]:
        """Slot ``slot``'s header: the slot if complete, else None, and why it is no slot header, or None."""
        raw = self._header_bytes(slot)
        if raw == bytes(len(raw)):
            return None, None  # never written
        body, digest = raw[:_SLOT.size], raw[_SLOT.size:]
        if _digest(body) != digest:
            return None, f"slot {slot} of {self.path}: its header fails its checksum (torn or corrupt)"
        magic, state, number, step, generation, offset, nbytes, meta_nbytes, meta_digest = _SLOT.unpack(body)
        if magic != _SLOT_MAGIC or number != slot:
            return None, f"slot {slot} of {self.path}: its header is not a slot header"
        if state != _COMPLETE:
            return None, None  # being written when the writer stopped: not a checkpoint, nothing to warn about
        return RegionSlot(slot, step, generation, offset, nbytes, meta_nbytes, meta_digest), None

    def slots(self, *, warn: bool = True) -> list[RegionSlot]:
        """Slots whose header says complete, newest first (step, then generation)."""
        found = []
        for slot in (0, 1):
            parsed, problem = self.parse_slot(slot)
            if problem and warn:
                warnings.warn(f"skipping {problem}", stacklevel=2)
            if parsed is not None:
                found.append(parsed)
        return sorted(found, key=lambda s: (s.step, s.generation), reverse=True)

    @property
    def objects(self) -> SlotObjects:
        """The complete slots as stored objects: a :class:`~everystep.storage.base.Reader`."""
        return SlotObjects(self)

    def _write_header(self, slot: int, state: int, step: int, generation: int, area: Area, meta_nbytes: int,
                      meta_digest: bytes) -> None:
        body = _SLOT.pack(_SLOT_MAGIC, state, slot, step, generation, area.offset, area.nbytes, meta_nbytes, meta_digest)
        raw = body + _digest(body)
        at = (1 + slot) * PAGE
        half = len(raw) // 2
        self._headers[at:at + half] = raw[:half]
        crash_point("store.region.mid_header")  # a torn header: the checksum of the header catches it
        self._headers[at + half:at + len(raw)] = raw[half:]
        if self.flush:
            _flush(self._headers, at, PAGE)

    # -- writing ---------------------------------------------------------------------------------

    def check_writable(self) -> None:
        if self.access == "read":
            raise ReadOnlyStoreError(f"{self.path} was opened for reading; nothing may be written there")

    def _check_unchanged(self) -> None:
        """Refuse a file another process changed under this writer (cut short, deleted, or replaced
        at its path): its stores into the mapping past the new end would end the process with a
        bus error, or go where no reader looks."""
        st = os.fstat(self._fd)
        end = max((a.offset + a.nbytes for a in self._areas.values()), default=_AREAS_START)
        try:
            here = os.lstat(self._where)
            replaced = (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino)
        except FileNotFoundError:
            replaced = True
        rewritten = os.pread(self._fd, _FILE_HEADER.size, 0) != self._head
        if st.st_size < end or st.st_nlink == 0 or replaced or rewritten:
            what = (f"cut short to {st.st_size} bytes (its slots need {end})" if st.st_size < end
                    else "deleted or replaced at its path" if st.st_nlink == 0 or replaced else "written over")
            raise CheckpointDirectoryError(
                f"the region {self.path} was {what} by another process while this one writes it; it writes no "
                "more slots there. The state this process trains on is its own: close the Checkpointer and start "
                "again, and keep other processes off the region's file")

    def next_slot(self) -> int:
        """The slot a writer takes first: the one not holding the newest complete checkpoint."""
        found = self.slots(warn=False)
        return 1 - found[0].slot if found else 0

    def _area_for(self, slot: int, meta_nbytes: int, data_nbytes: int) -> Area:
        """An area for ``slot`` that overlaps nothing the other slot may hold, mapped; the file grows if needed."""
        need = round_up(meta_nbytes + data_nbytes, PAGE)
        mine = self._areas.get(slot)
        fits = mine is not None and mine.meta_nbytes >= meta_nbytes \
            and mine.nbytes >= round_up(mine.meta_nbytes + data_nbytes, PAGE)
        if fits:
            return mine  # (kept, with its registration for DMA, while the metadata fits its section)
        if mine is not None:
            mine.close()
            del self._areas[slot]
        taken = [a for s, a in self._areas.items() if s != slot]
        other = self.parse_slot(1 - slot)[0]
        spans = [(a.offset, a.nbytes) for a in taken] + ([(other.area_offset, other.area_nbytes)] if other else [])
        offset = _AREAS_START
        for start, size in sorted(spans):
            if offset < start + size and start < offset + need:
                offset = round_up(start + size, PAGE)
        if os.fstat(self._fd).st_size < offset + need:
            # blocks allocated now: a full disk raises ENOSPC here, not SIGBUS at a store into the mapping
            os.posix_fallocate(self._fd, offset, need)
        area = Area(self._fd, offset, need, meta_nbytes, writable=True)
        self._areas[slot] = area
        return area

    def begin(self, layout: RegionLayout, meta_hint: int, *, slot: int | None = None) -> SlotWriter:
        """Mark ``slot`` (default: :meth:`next_slot`) *writing* and return views of its data section
        to copy into. ``meta_hint``: about how many bytes the metadata needs. IMPORTANT: a writer
        that commits slots in the background alternates them itself, and begins a slot only once
        its previous commit is done."""
        self.check_writable()
        self._check_unchanged()
        self.lending.settle()  # (no page lent out of a slot may still be the file's)
        slot = self.next_slot() if slot is None else slot
        with self._lock:
            if self._generation == 0:
                self._generation = max((s.generation for s in self.slots(warn=False)), default=0)
            self._generation += 1
            generation = self._generation
        meta_nbytes = round_up(2 * meta_hint + 64 * len(layout.entries) + PAGE, PAGE)
        area = self._area_for(slot, meta_nbytes, layout.nbytes)
        self._write_header(slot, _WRITING, 0, generation, area, 0, bytes(16))
        return SlotWriter(slot, layout, area.views(layout), area, generation)

    def register(self, writer: SlotWriter) -> str | None:
        """Pin the slot's mapping for DMA from the GPU: None once pinned, else why it could not be.

        Only a region in memory (tmpfs) is tried: Linux (from 6.5) refuses to pin a writable shared
        mapping of a file on a filesystem that writes its pages back, a disk's or a DAX mount's."""
        if not self._in_memory:
            return "it lies on a filesystem that writes its pages back, whose shared mappings Linux does not pin"
        return None if writer.area.register() else writer.area.refused

    def checksums(self, writer: SlotWriter, part: tuple[int, int] | None = None) -> dict[str, str]:
        """Each tensor's checksum (those of the layout's entries ``first`` to ``stop`` for ``part``:
        the rest may still be being copied), computed by the region's hashing process
        (:mod:`~everystep.storage.region.hashing`): the training process's threads only wait for it."""
        codes, area = self._codes_of(writer.layout), writer.area
        if self._hasher is None:
            self._hasher = RegionHasher(self._fd, str(self.path))
        keys = codes.keys if part is None else codes.keys[part[0]:part[1]]
        return dict(zip(keys, self._hasher.sums(codes, codes.ranges, area.offset + area.meta_nbytes,
                                                codes.layout.nbytes, part)))

    def _codes_of(self, layout: RegionLayout) -> LayoutCodes:
        if self._codes is None or self._codes.layout is not layout:
            self._codes = LayoutCodes.of(layout)
        return self._codes

    def commit(self, writer: SlotWriter, step: int, skeleton: Any, meta: dict[str, Any] | None = None,
               checksums: dict[str, str] | None = None) -> None:
        """Make the slot the newest checkpoint: metadata, flush, then the header, flushed last."""
        self.check_writable()
        sums = self.checksums(writer) if checksums is None else checksums
        area, codes = writer.area, self._codes_of(writer.layout)  # (its rows encoded once: a millisecond a step)
        body = json.dumps({"format": "everystep-region-slot", "step": step, "meta_section": area.meta_nbytes,
                           "data_nbytes": codes.layout.nbytes, "checksums": list(map(sums.__getitem__, codes.keys)),
                           "skeleton": skeleton, "meta": meta or {}}, separators=(",", ":")).encode()
        body = body[:-1] + b',"tensors":' + codes.rows + b"}"
        if len(body) > area.meta_nbytes:
            raise EverystepError(f"the metadata of step {step} ({len(body)} bytes) outgrew its section in {self.path} "
                                 f"({area.meta_nbytes} bytes)")
        area.mm[:len(body)] = body
        if self.flush:
            _flush(area.mm, 0, area.nbytes)
        crash_point("store.region.before_header")
        self._write_header(writer.slot, _COMPLETE, step, writer.generation, area, len(body), _digest(body))

    def invalidate(self, s: RegionSlot) -> None:
        """Mark the slot as not a checkpoint (its header says being written), durably."""
        self.check_writable()
        body = _SLOT.pack(_SLOT_MAGIC, _WRITING, s.slot, 0, s.generation, s.area_offset, s.area_nbytes, 0, bytes(16))
        at = (1 + s.slot) * PAGE
        self._headers[at:at + _SLOT.size + 16] = body + _digest(body)
        if self.flush:
            _flush(self._headers, at, PAGE)

    def discard_newer(self, step: int) -> list[int]:
        """Mark every slot holding a step after ``step`` as not a checkpoint (training restarted at
        ``step``, so they belong to a run that no longer leads anywhere); returns their steps."""
        newer = [s for s in self.slots(warn=False) if s.step > step]
        for s in newer:
            self.invalidate(s)
        return [s.step for s in newer]

    # -- reading ---------------------------------------------------------------------------------

    def _read_area(self, slot: RegionSlot) -> Area:
        size = os.fstat(self._fd).st_size
        if slot.area_offset % PAGE or slot.area_offset < _AREAS_START or slot.area_offset + slot.area_nbytes > size \
                or slot.meta_nbytes > slot.area_nbytes or slot.area_nbytes <= 0:
            raise CorruptCheckpointError(f"slot {slot.slot} of {self.path}: its area lies outside the file ({size} bytes)")
        mine = self._areas.get(slot.slot)
        if mine is not None and mine.offset == slot.area_offset and mine.nbytes == slot.area_nbytes:
            return mine
        with self._unlocked() as fd:
            return Area(fd, slot.area_offset, slot.area_nbytes, 0, writable=False)

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[int]:
        """A descriptor of the file for a mapping to keep (Python's keeps a copy of it): an open file
        of its own, which holds none of the writer's locks."""
        fd = reopened(self._fd, str(self.path))
        try:
            yield fd
        finally:
            os.close(fd)

    def slot_metadata(self, slot: RegionSlot) -> "SlotMeta":
        """The slot's metadata, its checksum verified and its layout checked against its area;
        raises :class:`CorruptCheckpointError` naming the slot."""
        area = self._read_area(slot)
        where = f"slot {slot.slot} (step {slot.step}) of {self.path}"
        raw = bytes(area.mm[:slot.meta_nbytes])
        if _digest(raw) != slot.meta_digest:
            raise CorruptCheckpointError(f"{where}: its metadata fails its checksum")
        try:
            meta = json.loads(raw, parse_constant=refuse_constant)
            if not isinstance(meta, dict) or meta.get("format") != "everystep-region-slot" \
                    or meta.get("step") != slot.step or not isinstance(meta.get("meta"), dict):
                raise ValueError("not the metadata of this slot")
            base, data_nbytes = meta["meta_section"], meta["data_nbytes"]
            if type(base) is not int or type(data_nbytes) is not int or base < slot.meta_nbytes or data_nbytes < 0 \
                    or base + data_nbytes > area.nbytes:
                raise ValueError("its data outgrows its area")
            layout, sums = RegionLayout.from_json(meta["tensors"], data_nbytes, meta.get("checksums"))
            check_skeleton(meta["skeleton"], set(sums))
            if not isinstance(meta["skeleton"], dict) or meta["skeleton"].get("step") != slot.step:
                raise ValueError(f"its state is not that of step {slot.step}")
        except MALFORMED as e:
            raise CorruptCheckpointError(f"{where}: unreadable metadata ({type(e).__name__}: {e})") from None
        return SlotMeta(where, area, meta, base, layout, sums)

    def read_slot(self, slot: RegionSlot, *, copy: CopiedKeys = False, lend: Callable[[str], bool] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The slot's tensors and its metadata, after every checksum is verified; raises
        :class:`CorruptCheckpointError` naming the slot.

        The tensors are views of the mapping, valid while the slot is not rewritten: the region's
        writer reads them so. ``copy`` (True, or a test of a tensor's key): each tensor (that passes)
        is copied out into memory of its own and its checksum verified on the copy (a slot rewritten
        meanwhile fails them, and :meth:`newest` sees that its header changed): what a reader beside
        a live writer gets, and what a restore keeps. ``lend``: of those, the ones the writer may
        lend instead, from a private mapping (:mod:`~everystep.storage.region.lending`; :attr:`lending`
        makes their pages the process's own), where the kernel can."""
        m = self.slot_metadata(slot)
        lent = [e for e in m.layout.entries if lend(e.key)] \
            if lend is not None and self.access != "read" and m.area.private and lending_supported() else []
        if lent:
            keys = {e.key for e in lent}
            copy = (lambda key, wanted=copy: key not in keys and (wanted is True or wanted(key))) if copy else False
        data = m.area.bytes[m.base:m.base + m.layout.nbytes]
        self.bytes_read += m.layout.nbytes
        tensors, got = read_out(self._pool, data, m.layout.entries, copy)
        for e in m.layout.entries:
            if got[e.key] != m.sums[e.key]:
                raise CorruptCheckpointError(f"{m.where}: tensor {e.key!r} fails its checksum")
        if lent:
            with self._unlocked() as fd:
                tensors.update(self.lending.lend(fd, m.area.offset, m.area.nbytes, m.base, lent,
                                                 then_drop=m.area))
        return tensors, m.meta

    def verified(self, *, copy: CopiedKeys = False, lend: Callable[[str], bool] | None = None, warn: bool = True
                 ) -> Iterator[tuple[RegionSlot, dict[str, torch.Tensor], dict[str, Any]]]:
        """The complete slots that verify, newest first, each read as :meth:`read_slot` reads it;
        each one skipped is warned about (``warn``). A reader (``access="read"``) always gets copies
        (``copy``: the writer too), and a slot its writer rewrote while it was read is passed over
        without a warning."""
        copy = True if self.access == "read" else copy
        for slot in self.slots(warn=warn):
            try:
                tensors, meta = self.read_slot(slot, copy=copy, lend=lend)
            except CorruptCheckpointError as e:
                if self.access == "read" and self.parse_slot(slot.slot)[0] != slot:
                    continue  # rewritten by the writer while it was read: not corrupt
                if warn:
                    warnings.warn(f"skipping {e}", stacklevel=3)
                continue
            if self.access == "read" and self.parse_slot(slot.slot)[0] != slot:
                continue
            yield slot, tensors, meta

    def newest(self, *, copy: CopiedKeys = False, warn: bool = True
               ) -> tuple[RegionSlot, dict[str, torch.Tensor], dict[str, Any]] | None:
        """The newest complete slot that verifies (see :meth:`verified`), or None."""
        return next(self.verified(copy=copy, warn=warn), None)

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self.lending.detach()  # (what was lent no longer lies in this file: its later changes do not show)
        except EverystepError as e:
            warnings.warn(str(e), stacklevel=2)
        if self._hasher is not None:
            self._hasher.close()
        self._pool.shutdown(wait=True)
        for area in self._areas.values():
            area.close()
        self._areas.clear()
        self._headers.close()
        os.close(self._fd)
