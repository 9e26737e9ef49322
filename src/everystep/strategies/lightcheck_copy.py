"""One LightCheck copy of the state into a slot of its region, as the training thread and the copy
and commit threads see it (:mod:`everystep.strategies.lightcheck`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..storage.region import RegionLayout
from ..tree import local_shard

__all__ = ["Copy", "Progress", "CopyOrder", "HASH_PART_BYTES", "part_count", "hash_parts"]


@dataclass(eq=False)
class Copy:
    """One step's copy into a slot, as the training thread and the two threads see it."""

    step: int
    final: bool
    ready: Any = None
    """CUDA: the event after which S_step is complete on the device."""
    frozen: dict[int, torch.Tensor] = field(default_factory=dict)
    progress: "Progress" = field(default_factory=lambda: Progress())
    """CPU: how many units' copies are in the slot."""
    events: list[Any] = field(default_factory=list)
    """CUDA: one event per unit, recorded on the copy stream."""
    part_events: list[Any] = field(default_factory=list)
    """CUDA: one event per part of :attr:`CopyOrder.parts`, after which its copies are in the slot."""
    future: Future[Any] | None = None
    """Done once every copy is in the slot (CPU) or issued (CUDA)."""
    commit: Future[Any] | None = None
    """Done once the slot is committed."""


class Progress:
    """How far a copy on the CPU has come, for the training thread that waits on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._units: list[str] | None = None
        self._index: dict[int, int] = {}
        self._done = 0
        self._waited = 0
        self._over = False

    def start(self, units: list[str], index: dict[int, int]) -> None:
        """The units in copy order; ``index``: a parameter's data pointer → its unit's position."""
        with self._cond:
            self._units, self._index = units, index
            self._cond.notify_all()

    def advance(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def end(self) -> None:
        """No more progress will come (done, or failed)."""
        with self._cond:
            self._over = True
            self._cond.notify_all()

    def wait(self, waits: dict[str, float], params: list[torch.Tensor] | None = None) -> int:
        """Wait for each unit in turn, up to the last one holding ``params`` (``None``: every unit),
        adding how long each one kept the caller waiting to ``waits``; the position of that unit."""
        with self._cond:
            t0 = time.perf_counter()
            self._cond.wait_for(lambda: self._units is not None or self._over)
            units = self._units or []
            last = len(units) - 1
            upto = last if params is None else max((self._index.get(local_shard(p).data_ptr(), last) for p in params),
                                                   default=-1)
            for i in range(self._waited, upto + 1):
                self._cond.wait_for(lambda: self._done > i or self._over)
                now = time.perf_counter()
                waits[units[i]] = waits.get(units[i], 0.0) + now - t0
                t0 = now
            self._waited = max(self._waited, upto + 1)
            return upto


@dataclass(frozen=True)
class CopyOrder:
    """What a state of one shape needs, computed once: the copy order and the layouts."""

    units: list[tuple[str, list[str]]]
    index: dict[int, int]
    """A parameter's data pointer → the position of its unit in ``units``."""
    layout: RegionLayout
    replicated: frozenset[str]
    meta_hint: int
    sharded: dict[str, torch.Tensor]
    """Keys whose tensor is this rank's shard of a DTensor, with the live DTensor (its placements)."""
    parts: list[tuple[int, int]]
    """The slot hashed in parts, each once its copies are in: ``(first, stop)`` entries of ``layout``."""
    pieces: list[tuple[int, list[str], bool, int]]
    """The copy order cut where a part's copies end: ``(unit position, keys, whether the unit ends
    with it, how many parts are in once it is)``."""

    @classmethod
    def of(cls, units: list[tuple[str, list[str]]], index: dict[int, int], layout: RegionLayout,
           replicated: frozenset[str], meta_hint: int, sharded: dict[str, torch.Tensor]) -> "CopyOrder":
        parts, pieces = hash_parts(units, layout, part_count(layout.nbytes))
        return cls(units, index, layout, replicated, meta_hint, sharded, parts, pieces)


HASH_PART_BYTES = 256 << 20
"""About how many bytes of a slot each part of its checksums covers: on CUDA each part is hashed as
soon as its copies are in, while the copy stream moves the next, so that only the last part's hash
comes after the copy (gpt2-small's 265 MiB in 2 parts, gpt2-medium's 4 GiB in 16: the last 256 MiB
hashed at the host's 70 GB/s, some 4 ms, where a fixed four parts left 1 GiB, 15 ms and more)."""


def part_count(nbytes: int, part_bytes: int = HASH_PART_BYTES) -> int:
    """The parts a slot of ``nbytes`` is hashed in: one per ``part_bytes``, rounded up, at least one."""
    return max(1, -(-nbytes // part_bytes))


def hash_parts(units: list[tuple[str, list[str]]], layout: RegionLayout, count: int
               ) -> tuple[list[tuple[int, int]], list[tuple[int, list[str], bool, int]]]:
    """``layout``'s entries cut into up to ``count`` runs of about equal bytes, and the copy order of
    ``units`` cut into pieces after the last copy each run needs (the layout puts the small tensors
    last, so a run's last copy is the latest, in copy order, of its entries)."""
    entries = layout.entries
    total, done, stops = sum(e.nbytes for e in entries), 0, []
    for i, e in enumerate(entries[:-1]):
        done += e.nbytes
        if len(stops) < count - 1 and done * count >= total * (len(stops) + 1):
            stops.append(i + 1)
    stops.append(len(entries))
    at = {k: j for j, k in enumerate(k for _, keys in units for k in keys)}
    ends, last, i = [], -1, 0
    for stop in stops:
        for e in entries[i:stop]:
            last = max(last, at[e.key])
        ends.append(last)
        i = stop
    pieces: list[tuple[int, list[str], bool, int]] = []
    j = 0
    for u, (_, keys) in enumerate(units):
        piece: list[str] = []
        for n, k in enumerate(keys):
            piece.append(k)
            if j in ends or n == len(keys) - 1:
                pieces.append((u, piece, n == len(keys) - 1, sum(end <= j for end in ends)))
                piece = []
            j += 1
    return list(zip([0, *stops[:-1]], stops)), pieces
