"""A region a strategy keeps its checkpoints in, beside the checkpoint directory.

``lightcheck`` (every step, its slots written by its copy and commit threads) and the memory tier
of the full-state strategies (``memory=True``, :mod:`.memory_tier`) each hold one
:class:`RegionTier`, which does what both need of their region (:mod:`everystep.storage.region.slots`):

- open it (or, for a reader, skip one it cannot read, keeping why: :attr:`RegionTier.damaged`);
- read back its slots that verify, as candidates for the restore (:func:`region_candidates`);
- at the start, discard the slots past the restored step and make the pages the restore lent
  this process's own (:meth:`RegionTier.start`);
- register a slot's area for the GPU's DMA, and say once where it cannot be
  (:meth:`RegionTier.register`);
- count a committed slot as written and in memory (:meth:`RegionTier.committed`);
- persist a committed slot to the directory: copied to a host buffer on the calling thread, so that
  the region goes on, then written from there on a thread of its own (:meth:`RegionTier.persist`).

When to commit, which slot to write and when to persist is each strategy's own.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import torch

from ..background import BackgroundErrors, Worker
from ..errors import CorruptCheckpointError
from ..layout import TensorLayout
from ..optim import stepping
from ..recovery import Candidate
from ..storage.region import Region, UnreadableRegionError, SlotWriter, open_region
from ..transport.host import HostBuffer, HostBufferPool, snapshot_into
from ..tree import unflatten
from .context import LiveShards, LoadFate, StrategyContext, as_shards

__all__ = ["RegionTier", "Finish", "region_candidates"]

Finish = Callable[[Candidate, dict[str, torch.Tensor], dict[str, Any]], Candidate]
"""What makes a slot's candidate the state to recover: given it, the slot's tensors and the meta it
was committed with (GoCkpt: a spread checkpoint's parts brought forward); may raise
:class:`~everystep.errors.CorruptCheckpointError`."""


class RegionTier:
    """A strategy's region (see the module docstring). ``path``: the region's file (None: the
    directory's default); ``flush``: as :func:`~everystep.storage.region.paths.open_region`;
    ``name``: the persist thread's (``everystep-NAME-persist``); ``source``: what its candidates
    say they come from."""

    def __init__(self, ctx: StrategyContext, errors: BackgroundErrors, path: str | None, *, flush: bool | None,
                 name: str, source: str) -> None:
        assert ctx.directory is not None
        self.ctx, self.source = ctx, source
        self.damaged: str | None = None
        """Why the region holds no checkpoint that verifies, where it holds a damaged one."""
        self.region: Region | None
        try:
            self.region = open_region(ctx.directory, path, flush=flush)
        except UnreadableRegionError as e:  # a reader's: a writer remakes it or refuses
            warnings.warn(f"skipping {e}", stacklevel=4)
            self.region, self.damaged = None, str(e)
        self.registered: bool | None = None
        """CUDA: whether the region's mapping is registered for DMA (False: copies through pageable memory)."""
        self.persisted = 0
        """Checkpoints written from the region to the directory."""
        self._staging = HostBufferPool(1, pin=False)
        self._persister = Worker(f"everystep-{name}-persist", errors)

    # -- restore -------------------------------------------------------------------------------

    def candidates(self, *, every: bool, finish: Finish | None = None) -> dict[int, Candidate]:
        """The region's slots that verify, by step, newest first (:func:`region_candidates`)."""
        if self.region is None:
            return {}
        found, damaged = region_candidates(self.region, self.ctx.live_shards(), every=every, source=self.source,
                                           finish=finish)
        self.damaged = self.damaged or damaged
        return found

    def start(self, step: int) -> None:
        """Training goes on from ``step``: slots past it belong to a run that ended, and what the
        restore lent becomes this process's own (leaving the file beside training)."""
        if self.region is not None and self.region.access != "read":
            self.region.discard_newer(step)
            self.region.lending.start(stepping(self.ctx.components.optimizer))

    # -- every checkpoint ----------------------------------------------------------------------

    def register(self, writer: SlotWriter, advice: str = "") -> None:
        """Register ``writer``'s slot for the GPU's DMA (once per slot's area); the first refusal is
        warned about, with ``advice``."""
        assert self.region is not None
        refused = self.region.register(writer)
        if refused is not None and self.registered is None:
            warnings.warn(f"the region {self.region.path} cannot be pinned for the GPU's DMA ({refused}); its copies "
                          f"go through pageable memory{advice}", RuntimeWarning, stacklevel=4)
        self.registered = refused is None

    def committed(self, step: int, nbytes: int) -> None:
        """The slot of ``step`` is committed: its bytes count as written, and the step is in memory."""
        assert self.ctx.catalog is not None
        self.ctx.catalog.count_written_elsewhere(nbytes)
        self.ctx.in_memory(step)

    def persist(self, step: int, tensors: dict[str, torch.Tensor], write: Callable[[HostBuffer], None]) -> Future[Any]:
        """Copy ``tensors`` (a committed slot's, or this rank's share of them) to the host buffer,
        waiting while the previous persist writes from it, then ``write`` it to the directory on the
        tier's thread."""
        buffer = self._staging.acquire(TensorLayout.of(tensors))
        try:
            snapshot_into(buffer, tensors)
        except BaseException:
            self._staging.release(buffer)
            raise
        return self._persister.submit(f"background write of the checkpoint at step {step}", self._write, write, buffer)

    def _write(self, write: Callable[[HostBuffer], None], buffer: HostBuffer) -> None:
        try:
            write(buffer)
            self.persisted += 1
        finally:
            self._staging.release(buffer)

    # -- the end -------------------------------------------------------------------------------

    def drain(self) -> None:
        """Wait for the persists posted."""
        self._persister.drain()

    def close(self) -> None:
        self._persister.close()
        if self.region is not None:
            self.region.close()


def region_candidates(region: Region, live: LiveShards, *, every: bool, source: str, finish: Finish | None = None
                      ) -> tuple[dict[int, Candidate], str | None]:
    """The region's slots that verify, by step, newest first — only the newest one unless ``every``
    — each skipped one warned about; and, where complete slots exist and none verifies, why the
    region holds nothing to recover. ``finish``: applied to each candidate (:data:`Finish`).

    What the live objects keep (the optimizer's state, the other components') is copied out of the
    slot as it is hashed, but for the state a fresh optimizer's load keeps as it is given
    (:attr:`LoadFate.KEPT`), which the writer lends (:meth:`Region.read_slot
    <everystep.storage.region.slots.Region.read_slot>`; its pages become the process's own once the
    restore is done: :meth:`RegionTier.start`). The model's tensors, which a restore copies into the
    live model, the optimizer's state that its load copies onto a GPU (:attr:`LoadFate.MOVED`)
    and that which goes into the live optimizer's own tensors (:attr:`LoadFate.IN_PLACE`; the
    candidate's ``borrowed``) are views of the slot's private mapping (what is written into them
    stays in this process) verified where they lie, by the region's writer, which holds its lock:
    no other process rewrites a slot. A reader, and a sharded job (whose model holds DTensors),
    read copies of all."""
    found: dict[int, Candidate] = {}
    t0 = time.perf_counter()
    complete = region.slots(warn=False)
    viewed = (LoadFate.IN_PLACE, LoadFate.MOVED)  # (what the load copies: read as views of the slot)
    copy = True if len(live) else lambda key: not key.startswith("/model/") and live.fate(key) not in viewed
    lend = None if len(live) else lambda key: live.fate(key) is LoadFate.KEPT
    for slot, tensors, meta in region.verified(copy=copy, lend=lend):
        if any(live.shapes.get(k, tuple(t.shape)) != tuple(t.shape) for k, t in tensors.items()):
            warnings.warn(f"skipping the region's slot of step {slot.step}: its tensors are not this rank's "
                          "(written under another layout or world size)", stacklevel=3)
            continue
        if len(live):  # (no live DTensor: nothing to place)
            as_shards(tensors, live)
        borrowed = frozenset() if len(live) else frozenset(k for k in tensors if live.fate(k) is LoadFate.IN_PLACE)
        found[slot.step] = Candidate(step=slot.step, tree=unflatten(meta["skeleton"], tensors), source=source,
                                     manifest=None, seconds=time.perf_counter() - t0, borrowed=borrowed)
        if finish is not None:
            try:
                found[slot.step] = finish(found[slot.step], tensors, meta["meta"])
            except CorruptCheckpointError as e:
                del found[slot.step]
                warnings.warn(f"skipping the region's slot of step {slot.step}: {e}", stacklevel=3)
                continue
        if not every:
            break
        t0 = time.perf_counter()
    damaged = None
    if complete and not found:
        damaged = f"none of the {len(complete)} complete slot(s) of the region {region.path} verifies"
    return found, damaged
