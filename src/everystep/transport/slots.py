"""A pool of slots in shared memory, one step each, that another process frees as it reads them.

The training process fills a slot (a step's gradients and the state they cannot rebuild), hands
its index to the reader (a checkpoint agent), and takes the next free one; the reader gives each
slot back when it is done with it. With every slot taken the writer waits: that wait is the
backpressure a slow reader puts on training, and it is bounded by a timeout.
"""

from __future__ import annotations

import queue

import torch

from .._memory import register_host, unregister_host
from ..layout import TensorLayout
from .host import HostBuffer
from .shared import SharedRegion

__all__ = ["SlotPool"]


class SlotPool:
    """Slots of one layout; ``current`` is the slot being filled (``None``: take one first)."""

    def __init__(self) -> None:
        self.buffers: list[HostBuffer] = []
        self.current: int | None = None
        self._free: queue.Queue[int] = queue.Queue()
        self._pinned: list[torch.Tensor] = []

    def make(self, layout: TensorLayout, count: int, *, pin: bool = False) -> list[SharedRegion]:
        """Replace the slots by ``count`` new ones of ``layout``, all free; ``pin``: each registered
        for DMA from a GPU (where the driver allows: else they stay pageable). Returns their regions,
        whose descriptors the caller hands to the reader and then closes."""
        self.release()
        regions = [SharedRegion.holding(layout) for _ in range(count)]
        if pin:
            self._pinned = [r.data for r, _ in regions if r.nbytes and register_host(r.data)]
        self.buffers = [b for _, b in regions]
        self.current = None
        self._free = queue.Queue()
        for i in range(count):
            self._free.put(i)
        return [r for r, _ in regions]

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)

    def take(self, timeout: float) -> bool:
        """Make a free slot current, waiting up to ``timeout`` seconds for one (``queue.Empty`` when
        none came); False when the wait was ended by :meth:`wake`."""
        slot = self._free.get(timeout=timeout)
        if slot < 0:
            return False
        self.current = slot
        return True

    def buffer(self) -> HostBuffer:
        assert self.current is not None
        return self.buffers[self.current]

    def hand_over(self) -> int:
        """The current slot, no longer current: its reader gives it back."""
        assert self.current is not None
        slot, self.current = self.current, None
        return slot

    def give_back(self, slot: int) -> None:
        self._free.put(slot)

    def release(self) -> None:
        """Undo the slots' registration (once nothing copies into them any more)."""
        pinned, self._pinned = self._pinned, []
        for data in pinned:
            unregister_host(data)

    def wake(self) -> None:
        """End one wait in :meth:`take` (the reader is gone)."""
        self._free.put(-1)
