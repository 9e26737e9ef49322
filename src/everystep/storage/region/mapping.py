"""The region's file, mapped: where each tensor lies in a slot's data section, a slot's area mapped
into memory, and the records of a slot (see :mod:`everystep.storage.region.slots`)."""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..._memory import pin_in_place, unregister_host
from ...background import in_shares
from ...layout import LayoutEntry, shape_overflows
from ..base import checksum
from .hashing import HASH_THREADS

__all__ = ["ALIGN", "PAGE", "RegionLayout", "LayoutCodes", "Area", "RegionSlot", "SlotWriter", "SlotMeta", "on_volatile_memory", "round_up",
           "read_out", "CopiedKeys", "HASH_THREADS"]

ALIGN = 128
"""Tensors of more than this many bytes start at multiples of it."""
PAGE = mmap.ALLOCATIONGRANULARITY
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def on_volatile_memory(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem in memory (tmpfs, ramfs): it survives the process, not the host."""
    try:
        target = os.path.realpath(path)
        best, kind = "", ""
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and (target == fields[1] or target.startswith(fields[1].rstrip("/") + "/")) \
                        and len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
        return kind in ("tmpfs", "ramfs")
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """Where each tensor lies in a slot's data section (offsets from its start): in copy order,
    those of more than :data:`ALIGN` bytes at aligned offsets, then the small ones packed."""

    entries: tuple[LayoutEntry, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], order: Sequence[str] | None = None) -> "RegionLayout":
        order = list(tensors) if order is None else list(order)
        entries, offset = [], 0
        sizes = {k: tensors[k].numel() * tensors[k].element_size() for k in order}
        for key in (k for k in order if sizes[k] > ALIGN):
            offset = round_up(offset, ALIGN)
            entries.append(LayoutEntry(key, tensors[key].dtype, tuple(tensors[key].shape), offset, sizes[key]))
            offset += sizes[key]
        for key in (k for k in order if sizes[k] <= ALIGN):
            offset = round_up(offset, tensors[key].element_size())
            entries.append(LayoutEntry(key, tensors[key].dtype, tuple(tensors[key].shape), offset, sizes[key]))
            offset += sizes[key]
        return cls(tuple(entries), offset)

    def to_json(self, checksums: dict[str, str] | None = None) -> list[list[Any]]:
        """A row per tensor: key, dtype, shape, offset, size, and its checksum if ``checksums`` are given
        (a writer that commits a layout again and again encodes the rows without them once, and the
        checksums apart: :meth:`from_json` reads both)."""
        if checksums is None:
            return [[e.key, str(e.dtype).removeprefix("torch."), list(e.shape), e.offset, e.nbytes] for e in self.entries]
        return [[e.key, str(e.dtype).removeprefix("torch."), list(e.shape), e.offset, e.nbytes, checksums[e.key]]
                for e in self.entries]

    @classmethod
    def from_json(cls, rows: list[list[Any]], data_nbytes: int, checksums: list[str] | None = None
                  ) -> tuple["RegionLayout", dict[str, str]]:
        """Parse :meth:`to_json`'s rows (with ``checksums``, the list of the rows' checksums in their
        order: rows without them); ValueError for anything but what it writes."""
        entries, sums = [], {}
        if not isinstance(rows, list):
            raise ValueError("its tensors are not a list")
        if checksums is not None and (not isinstance(checksums, list) or len(checksums) != len(rows)):
            raise ValueError("its checksums are not one per tensor")
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != (6 if checksums is None else 5):
                raise ValueError(f"{row!r} does not describe a tensor")
            key, dtype, shape, offset, nbytes, digest = row if checksums is None else (*row, checksums[i])
            if not isinstance(key, str) or not isinstance(digest, str) or key in sums:
                raise ValueError(f"{row!r} does not describe a tensor of its own")
            if dtype not in _DTYPES:
                raise ValueError(f"tensor {key!r} has an unknown dtype {dtype!r}")
            if not isinstance(shape, list) or not all(type(v) is int and v >= 0 for v in (*shape, offset, nbytes)):
                raise ValueError(f"tensor {key!r} has a shape, offset or size that is not whole numbers")
            dt, shape = _DTYPES[dtype], tuple(shape)
            if shape_overflows(shape, dt.itemsize):
                raise ValueError(f"tensor {key!r} has a shape {list(shape)} no tensor can have (its strides overflow)")
            if nbytes != math.prod(shape) * dt.itemsize or offset + nbytes > data_nbytes or offset % dt.itemsize:
                raise ValueError(f"tensor {key!r} does not fit its slot ({offset}+{nbytes} of {data_nbytes} bytes)")
            entries.append(LayoutEntry(key, dt, shape, offset, nbytes))
            sums[key] = digest
        return cls(tuple(entries), data_nbytes), sums


@dataclass(frozen=True, slots=True, eq=False)
class LayoutCodes:
    """What a writer hands on for each commit of one layout, made once for it: the tensors' keys and
    their ``(offset, size)`` ranges in the data section, in order, and their rows as JSON
    (:meth:`RegionLayout.to_json` without checksums)."""

    layout: RegionLayout
    keys: list[str]
    ranges: list[tuple[int, int]]
    rows: bytes

    @classmethod
    def of(cls, layout: RegionLayout) -> "LayoutCodes":
        return cls(layout, [e.key for e in layout.entries], [(e.offset, e.nbytes) for e in layout.entries],
                   json.dumps(layout.to_json(), separators=(",", ":")).encode())


CopiedKeys = bool | Callable[[str], bool]
"""Which of a slot's tensors a read copies out (:meth:`~everystep.storage.region.slots.Region.read_slot`):
all, none, or those whose key passes the test."""


def read_out(pool: Executor, data: torch.Tensor, entries: Sequence[LayoutEntry], copy: CopiedKeys
             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each entry of ``data`` (a slot's data section, uint8) and its checksum: copied into a tensor
    of its own and hashed on the copy (while it is in cache) where ``copy`` says so (True, or a test
    of its key), else a view of ``data`` hashed where it lies. The entries are shared out by the
    work they take between ``pool``'s threads and this one (a copy and a hash release the GIL).

    IMPORTANT: the copies are allocated here, not on the pool's threads: there glibc takes them from
    a heap of the thread's own, and filling memory so taken ran up to ten times slower (a restore
    of gpt2-small's 281 MB took 250–350 ms instead of 55 in one run of three)."""
    copied = {e.key for e in entries if copy is True or copy and copy(e.key)}
    tensors = {e.key: torch.empty(e.shape, dtype=e.dtype) if e.key in copied
               else data[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries}
    flat = memoryview(data.numpy()) if len(data) else memoryview(b"")

    def one(i: int) -> str:
        e = entries[i]
        if e.key in copied and e.nbytes:
            raw = tensors[e.key].view(-1).view(torch.uint8)
            raw.copy_(data[e.offset:e.offset + e.nbytes])
            return checksum(memoryview(raw.numpy()))
        return checksum(flat[e.offset:e.offset + e.nbytes])

    work = [e.nbytes * (3 if e.key in copied else 1) for e in entries]  # (a copy takes about three hashes)
    sums = in_shares(pool, work, one, HASH_THREADS + 1)
    return tensors, {e.key: digest for e, digest in zip(entries, sums)}


class Area:
    """One slot's area, mapped: ``meta`` then ``data``; ``bytes`` is a uint8 tensor over the mapping."""

    def __init__(self, fd: int, offset: int, nbytes: int, meta_nbytes: int, *, writable: bool) -> None:
        self.offset, self.nbytes, self.meta_nbytes = offset, nbytes, meta_nbytes
        self.private = not writable
        """Mapped copy-on-write: what is written into it stays in this process."""
        self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED if writable else mmap.MAP_PRIVATE,
                            mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = False
        self.refused: str | None = None
        """Why the mapping could not be pinned for DMA (None: pinned, or not tried)."""
        self._tried = False
        self._views: tuple[RegionLayout, dict[str, torch.Tensor]] | None = None

    def views(self, layout: "RegionLayout") -> dict[str, torch.Tensor]:
        """A typed view of the data section per tensor of ``layout`` (made once per layout)."""
        if self._views is None or self._views[0] != layout:
            self._views = (layout, {e.key: self.data_view(e) for e in layout.entries})
        return self._views[1]

    def overlaps(self, offset: int, nbytes: int) -> bool:
        return offset < self.offset + self.nbytes and self.offset < offset + nbytes

    def data_view(self, entry: LayoutEntry) -> torch.Tensor:
        start = self.meta_nbytes + entry.offset
        return self.bytes[start:start + entry.nbytes].view(entry.dtype).view(entry.shape)

    def register(self) -> bool:
        """Pin the mapping for DMA from the GPU (False where the driver refuses)."""
        if not self._tried:
            self._tried = True
            self.refused = pin_in_place(self.bytes[:self.nbytes])
            self.registered = self.refused is None
        return self.registered

    def close(self) -> None:
        if self.registered:
            unregister_host(self.bytes)
            self.registered = False
        del self.bytes
        try:
            self.mm.close()
        except BufferError:
            pass  # tensors over the mapping are still referenced: it closes when the last one goes


@dataclass(frozen=True, slots=True)
class RegionSlot:
    """A slot whose header says complete (its data not yet verified)."""

    slot: int
    step: int
    generation: int
    area_offset: int
    area_nbytes: int
    meta_nbytes: int
    meta_digest: bytes


@dataclass(eq=False)
class SlotWriter:
    """A slot being written: copy into ``views``, then :meth:`Region.commit`."""

    slot: int
    layout: RegionLayout
    views: dict[str, torch.Tensor]
    area: Area
    generation: int


@dataclass(frozen=True, eq=False)
class SlotMeta:
    """A slot's verified metadata: where its data starts in its area, its layout, its checksums."""

    where: str
    area: Area
    meta: dict[str, Any]
    base: int
    layout: RegionLayout
    sums: dict[str, str]
