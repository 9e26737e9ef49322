"""The memory tier of the strategies that write the whole state (``memory=True``).

Without it, ``full_sync``, ``checkfreq``, ``async`` and ``checkflow`` write each checkpoint to the
directory, and every step needs a disk that takes the whole state every step (gpt2-small on a GPU:
11 GB/s). With it, each checkpoint goes to a two-slot region in memory that outlives the training
process (:mod:`everystep.storage.region.slots`, by default in ``/dev/shm``: one file per run and rank),
and the directory receives the newest complete slot every ``persist_every`` steps — by default as
often as keeps the disk busy ``busy`` of the time, from the measured write and the measured step,
as the checkpoint agent decides its interval (:func:`~everystep.policy.interval.busy_interval`).

The checkpoint of step t goes into the slot that does not hold the newest complete one — taken
straight into it by ``checkfreq``, ``async`` and ``checkflow`` (:meth:`MemoryTier.begin`; on CUDA by
DMA into the mapping, registered with the driver), copied into it by the others
(:meth:`MemoryTier.write`) — its checksums computed by the region's hashing process, and its header
committed last, on the thread that wrote to the directory before (a persist thread; ``full_sync``:
the training thread). A slot is begun only once the other's commit is done, so one of them always
holds a complete checkpoint.
A persist copies the committed slot to a host buffer and writes it from there on a thread of its
own, so the region goes on; it never holds the region back. A persist due while the previous one
still writes waits for it when ``persist_every`` is set, and comes at the first step after it
otherwise.

What each failure loses: a crash of the training process, what was not committed in the region
(the steps between checkpoints, and the one being written); the host (the region in its memory
with it), what was not persisted: up to ``persist_every`` checkpoints. A clean close persists the
newest slot. Recovery takes the newest of the region's newest slot that verifies and the
directory's newest checkpoint that verifies; a region of another run is refused by name, a damaged
slot skipped with a warning naming it, as ``lightcheck``'s region.

One process: under several, each rank's checkpoint is its share of the state, and a lost rank's
share would need the others' regions (``lightcheck`` holds each rank's whole state, and mirrors it
to peers).
"""

from __future__ import annotations

import functools
import json
import operator
import os
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._faults import crash_point
from ..background import BackgroundErrors
from ..errors import ConfigError, NoValidCheckpointError
from ..policy.interval import busy_interval, median_gap, persist_due
from ..recovery import Candidate
from ..spread import commit_spread
from ..storage.region import RegionLayout, SlotWriter, memory_path, memory_place, own_memory_folder, record_memory
from ..storage.formats import RankShare
from ..transport.host import HostBuffer
from .base import StrategyConfig
from .context import StrategyContext
from .region_tier import Finish, RegionTier

__all__ = ["FullStateConfig", "MemoryTier"]


@dataclass(kw_only=True, slots=True)
class FullStateConfig(StrategyConfig):
    """Options of a strategy that writes the whole state: its memory tier."""

    memory: bool = False
    """Write each checkpoint to a region in memory that outlives the training process, and the
    newest one to the directory every ``persist_every`` steps (:mod:`everystep.strategies.memory_tier`)."""
    region: str | None = None
    """``memory=True``: the region's file (``{rank}`` in it is replaced by the rank). Default:
    ``/dev/shm/everystep-UID/`` and a name drawn from the checkpoint directory's path, recorded in the
    directory (:func:`~everystep.storage.region.paths.memory_place`: found again once it is moved)."""
    persist_every: int | None = None
    """``memory=True``: write the newest checkpoint to the directory every this many steps; None:
    as often as keeps the disk busy ``busy`` of the time (measured)."""
    busy: float = 0.25
    """``memory=True`` and ``persist_every=None``: the share of the time the directory's writes may take."""

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if self.persist_every is not None and self.persist_every < 1:
            raise ConfigError(f"persist_every must be a positive number of steps or None (measured), "
                              f"got {self.persist_every}")
        if not 0 < self.busy <= 1:
            raise ConfigError(f"busy must be a share of the time in (0, 1], got {self.busy}")
        if not self.memory:
            given = [name for name, default in (("region", None), ("persist_every", None), ("busy", 0.25))
                     if getattr(self, name) != default]
            if given:
                raise ConfigError(f"{', '.join(given)} configure the memory tier: give memory=True as well")

    def check_job(self, world: int, full_format: str) -> None:
        if self.memory and world != 1:
            raise ConfigError("memory=True serves one training process: under several, use strategy='lightcheck' "
                              "(each rank's whole state in its region, mirrored to a peer with peers=True)")

_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


class MemoryTier:
    """A strategy's memory tier (see the module docstring): made at attach when ``memory=True``."""

    def __init__(self, ctx: StrategyContext, config: FullStateConfig, errors: BackgroundErrors,
                 finish: Finish | None = None) -> None:
        directory = ctx.directory
        assert directory is not None
        self.ctx, self.config, self._finish = ctx, config, finish
        config.check_job(ctx.ranks.world, ctx.full_format)
        if config.region is None:  # (where the directory's record says, if it moved since the tier was made)
            self.path, passed_over = memory_place(directory.root, ctx.ranks.rank, ctx.ranks.world)
            if passed_over is not None:
                warnings.warn(f"{directory.root}: {passed_over}", stacklevel=3)
        else:
            self.path = memory_path(directory.root, config.region, ctx.ranks.rank, ctx.ranks.world)
        if config.region is None and directory.access != "read":  # (a reader makes nothing)
            self.path = own_memory_folder(self.path)
        self.held = RegionTier(ctx, errors, str(self.path), flush=None, name="tier", source="memory")
        self.region = self.held.region
        if config.region is None and directory.access != "read" and self.region is not None:
            record_memory(directory, ctx.ranks.rank, self.path)
        self._idle = threading.Event()
        """Set while no slot is being written: the other slot holds the newest complete checkpoint."""
        self._idle.set()
        self._layouts: dict[Any, tuple[RegionLayout, int]] = {}
        self._writing: Future[Any] | None = None
        self._chosen: Candidate | None = None
        self._marks: deque[float] = deque(maxlen=16)
        self._write_seconds: float | None = None
        self.last_persisted = -1
        """The newest step written to the directory (or found there at the start)."""

    @property
    def damaged(self) -> str | None:
        """Why the region holds no checkpoint that verifies, where it holds a damaged one."""
        return self.held.damaged

    @property
    def persisted(self) -> int:
        """Checkpoints written to the directory by this tier."""
        return self.held.persisted

    @property
    def registered(self) -> bool | None:
        """CUDA: whether the region's mapping is registered for DMA (False: copies through pageable memory)."""
        return self.held.registered

    # -- restore -------------------------------------------------------------------------------

    def agree(self) -> None:
        """Read the region's newest slot that verifies (one process: nothing to agree on)."""
        self._chosen = next(iter(self.held.candidates(every=False, finish=self._finish).values()), None)

    def recover(self, own: Callable[[], Candidate | None]) -> Candidate | None:
        """The region's slot read by :meth:`agree`, unless the strategy's own recovery (``own``: the
        directory's) finds a newer state that verifies; a damaged region is named where nothing else
        is found."""
        assert self.ctx.directory is not None
        chosen, self._chosen = self._chosen, None
        if chosen is not None and chosen.step >= self.ctx.directory.newest_full_step():
            return chosen
        disk = own()
        if disk is None and chosen is None and self.damaged is not None:  # (as a directory whose every checkpoint fails)
            raise NoValidCheckpointError(f"no valid checkpoint for {self.ctx.directory.root}: its memory tier holds "
                                         f"none ({self.damaged}), and the directory holds no full checkpoint; nothing "
                                         f"was changed: to start over, delete {self.path}")
        return chosen if disk is None or (chosen is not None and chosen.step > disk.step) else disk

    def on_start(self, step: int) -> None:
        assert self.ctx.directory is not None
        self.held.start(step)
        self.last_persisted = min(step, self.ctx.directory.newest_full_step())

    # -- every checkpoint ----------------------------------------------------------------------

    def write(self, step: int, source: HostBuffer | dict[str, torch.Tensor], skeleton: Any,
              meta: dict[str, Any] | None = None) -> tuple[int, float]:
        """Copy the checkpoint of ``step`` (``source``: a host buffer or tensors) into the next slot
        and commit it (:meth:`begin`, a copy, :meth:`commit`). The bytes and the seconds it took."""
        t0 = time.perf_counter()
        tensors = source.views if isinstance(source, HostBuffer) else source
        writer = self.begin(tensors, skeleton, meta)
        keys = list(tensors)
        try:
            with torch.no_grad():
                torch._foreach_copy_([writer.views[k] for k in keys], [tensors[k] for k in keys])
        except BaseException:
            self.abort()
            raise
        nbytes, _ = self.commit(writer, step, skeleton, meta)
        return nbytes, time.perf_counter() - t0

    def begin(self, tensors: dict[str, torch.Tensor], skeleton: Any, meta: dict[str, Any] | None = None) -> SlotWriter:
        """The slot to copy a checkpoint of ``tensors`` into, marked *writing*: the one that does not
        hold the newest complete checkpoint, once the commit before is done. Its ``views`` take the
        copies (on CUDA by DMA: the mapping is registered where it can be); :meth:`commit` follows,
        on any thread, with the same ``meta`` (its size is room in the slot's metadata). (A strategy
        snapshotting straight into the region calls it for its buffer.)"""
        assert self.region is not None
        self._idle.wait()
        layout, hint = self._layout(tensors, skeleton)
        if meta:  # (a spread checkpoint's description: tens of kilobytes where the parts are many chunks)
            hint += len(json.dumps(meta, default=str))
        writer = self.region.begin(layout, hint)
        self._idle.clear()
        if self.ctx.device.type == "cuda":  # (each slot's area is registered once)
            self.held.register(writer)
        return writer

    def abort(self) -> None:
        """The slot :meth:`begin` gave will not be committed (its copy failed): it stays marked
        *writing*, not a checkpoint, and the next :meth:`begin` may go on."""
        self._idle.set()

    def commit(self, writer: SlotWriter, step: int, skeleton: Any, meta: dict[str, Any] | None = None
               ) -> tuple[int, float]:
        """Commit the slot :meth:`begin` gave, its copies done, as the checkpoint of ``step`` (``meta``:
        what the slot records beside it: a spread checkpoint's description); start its persist where
        one is due. The bytes and the seconds the commit took."""
        assert self.region is not None
        t0 = time.perf_counter()
        try:
            self.region.commit(writer, step, skeleton, meta)
        finally:
            self._idle.set()
        self.held.committed(step, writer.layout.nbytes)
        self._marks.append(time.monotonic())
        if self._persist_due(step):
            self._persist(step, writer.views, skeleton, meta or {})
        return writer.layout.nbytes, time.perf_counter() - t0

    def _layout(self, tensors: dict[str, torch.Tensor], skeleton: Any) -> tuple[RegionLayout, int]:
        """The slot's layout for ``tensors`` and about how many bytes its metadata needs, made once
        per layout (no Python call per tensor to find it again)."""
        values = tensors.values()
        signature = (tuple(tensors), tuple(map(_DTYPE, values)), tuple(map(_SHAPE, values)))
        found = self._layouts.get(signature)
        if found is None:
            found = RegionLayout.of(tensors), len(json.dumps(skeleton, default=str))
            self._layouts = {signature: found}
        return found

    def interval(self) -> int:
        """Steps between persists: ``persist_every``, or the one that keeps the disk busy ``busy``
        of the time (1 until a write is measured; none until three checkpoints give the step's time)."""
        if self.config.persist_every is not None:
            return self.config.persist_every
        if self._write_seconds is None:
            return 1
        gap = median_gap(list(self._marks))
        if gap is None:
            return 1 << 30
        return busy_interval(self._write_seconds, gap / self.config.every, self.config.busy)

    def _persist_due(self, step: int) -> bool:
        writing = self._writing is not None and not self._writing.done()
        return persist_due(step, self.last_persisted, self.interval(), fixed=self.config.persist_every is not None,
                           writing=writing)

    def _persist(self, step: int, views: dict[str, torch.Tensor], skeleton: Any, meta: dict[str, Any]) -> None:
        """Write the committed slot to the directory (:meth:`RegionTier.persist`)."""
        self.last_persisted = step
        self._writing = self.held.persist(step, views, functools.partial(self._write, step, skeleton, meta))

    def _write(self, step: int, skeleton: Any, meta: dict[str, Any], buffer: HostBuffer) -> None:
        t0 = time.perf_counter()
        share = RankShare.of(buffer.views, set(), self.ctx.ranks, split=self.ctx.splits_replicated)
        crash_point("tier.persist")
        if meta.get("spread") is not None:  # a spread checkpoint (GoCkpt's, brought forward at recovery)
            assert self.ctx.catalog is not None
            self.ctx.persist_record(step, functools.partial(commit_spread, self.ctx.catalog, step, dict(buffer.views),
                                                            skeleton, meta["spread"]), keep=self.config.keep, count=False)
        else:
            self.ctx.persist(step, buffer, skeleton, share=share, keep=self.config.keep, count=False)
        self._write_seconds = time.perf_counter() - t0

    # -- the end -------------------------------------------------------------------------------

    def wait(self) -> None:
        self.held.drain()

    def report(self) -> dict[str, int]:
        """What a run summary says of the tier: its persist interval now, and the persists made."""
        return {"persist_interval": self.interval(), "persisted": self.persisted}

    def finish(self) -> None:
        """A clean close: the region's newest slot that verifies is written to the directory if it
        is not there yet (one this run committed, or the one it started from)."""
        self.held.drain()
        if self.region is None or self.region.access == "read":
            return
        found = self.region.newest(warn=False)
        if found is None or found[0].step <= self.last_persisted:
            return
        slot, tensors, meta = found
        self._persist(slot.step, tensors, meta["skeleton"], meta["meta"])
        self.held.drain()

    def close(self, *, clean: bool = False) -> None:
        """Release the region; after a clean close (``clean``: :meth:`finish` done) one in the default
        place is deleted, its memory freed: the directory holds its newest checkpoint."""
        newest = max((s.step for s in self.region.slots(warn=False)), default=-1) if self.region is not None else -1
        self.held.close()
        if self.region is None:
            return
        if clean and self.config.region is None and self.region.access != "read" and newest <= self.last_persisted:
            self.path.unlink(missing_ok=True)
            spare = self.path.parent.parent.name != f"everystep-{os.geteuid()}"  # (made in its stead: its own)
            for folder in (self.path.parent, self.path.parent.parent)[:1 + spare]:
                try:
                    folder.rmdir()  # (another rank's may still be there)
                except OSError:
                    break
