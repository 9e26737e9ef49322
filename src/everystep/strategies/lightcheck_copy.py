"""One LightCheck copy of the state into a slot of its region, as the training thread and the copy
and commit threads see it (:mod:`everystep.strategies.lightcheck`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..storage.region_map import RegionLayout
from ..tree import local_shard

__all__ = ["Copy", "Progress", "CopyOrder"]


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
