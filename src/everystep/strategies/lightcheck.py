"""``lightcheck``: LightCheck's layer-wise asynchronous checkpoint into a two-slot region, every step.

After the update of step t, the new state is copied into the slot of the region
(:mod:`everystep.storage.region.slots`) that does not hold the newest checkpoint, while step t+1's
forward and backward compute. With updates in backward the copies go layer by layer, in the order
the next iteration updates the layers (backward order: the last layer first), each layer being a
module's parameters with their optimizer state; with one update of the whole model, which waits for
all of it anyway, in one batched copy. On CUDA the copies run on a side stream into the region's
mapping, registered with the driver so that they move by DMA, with one event per unit; on the CPU a
copy thread copies. A commit thread then has each tensor's checksum computed by the region's hashing
process (:mod:`everystep.storage.region.hashing`), writes the slot's metadata and commits the slot's
header last. The training process's threads make a few hundred Python calls a step at most.

The update of step t+1 waits until S_t is committed: for each unit's copy in turn (how long each
one kept it waiting is in :attr:`LightCheck.layer_waits`, on the CPU), then for the commit
(:attr:`LightCheck.commit_wait_seconds`). With ``wait="copies"`` (the paper's, the default on a
GPU) it waits for the copies alone, and the commit of S_t goes on beside step t+1: the copy of S_t+1
into the other slot waits for it instead, and a failure loses at most two finished steps. With per-layer updates (:class:`~everystep.OptimizerInBackward`:
each layer updated during backward, under DDP once its bucket is all-reduced) each layer's update
waits only for that layer's copy (on CUDA the wait is an event on the GPU, not on the CPU), and the
end of step t+1 waits for the commit of S_t. Either way a failure loses at most the step being
computed and, when it comes before S_t's commit, step t; and the next copy starts only once the
previous slot is committed, so one slot always holds a complete checkpoint. What the next forward
changes (model buffers such as BatchNorm statistics, compression residuals) is copied at once on the
training thread; RNG and the data position are the copies taken as the step ended.

Every ``persist_every`` steps (and at a clean close) a complete slot is also written to the
checkpoint directory as an ordinary crash-safe full checkpoint, in the background: it survives a
host that the region, in volatile memory, does not. The slot is first copied to a host buffer, so
the region goes on; while the previous persist is still writing, the next one waits for it.

Recovery: the newest of the region's complete slots that verifies and the newest verified full
checkpoint on disk. Under several ranks each rank's region holds that rank's whole state, and the
ranks agree on the newest step every rank's region holds (else on the disk's).
"""

from __future__ import annotations

import functools
import json
import operator
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import tracing
from .._faults import crash_point
from ..background import Worker, settled
from ..errors import ConfigError, NoValidCheckpointError
from ..optim import OptimizerInBackward
from ..recovery import Candidate, recover
from ..state import bare_module, local_optimizer
from ..parallelism import SHARDED_LAYOUTS
from ..tree import flatten, local_shard
from ..storage.region import Region, RegionLayout, SlotWriter, open_region, region_path
from .. import peers
from ..storage.formats import RankShare
from ..transport.host import HostBuffer
from .base import Strategy, StrategyConfig
from .lightcheck_copy import Copy, CopyOrder
from .region_tier import RegionTier
from .mirrors import RegionPeers


__all__ = ["LightCheck", "LightCheckConfig", "region_path", "open_region", "ONE_UNIT"]

ONE_UNIT = "(state)"
"""The one copy unit when the whole model is updated at once (:attr:`LightCheck.layer_waits`'s key)."""
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


@dataclass(kw_only=True, slots=True)
class LightCheckConfig(StrategyConfig):
    region: str | None = None
    """The region's file (``{rank}`` in it is replaced by the rank). Default: ``region/rank-R.bin``
    inside the checkpoint directory. On ``/dev/shm`` it outlives the training process, not the host;
    on a disk or a DAX (persistent memory) mount it outlives both, each commit flushed. On a GPU only
    a region on tmpfs is pinned for DMA (Linux does not pin a shared mapping of a disk's file)."""
    persist_every: int = 50
    """Write a complete slot to the checkpoint directory every this many steps (0: never)."""
    flush: bool | None = None
    """Flush (``msync``) each slot before its header; ``None``: unless the region lies on tmpfs."""
    peers: bool = False
    """Mirror each rank's own state (all but the replicated parameters and optimizer state) every
    step into the memory of a rank on another host (:mod:`everystep.peers`), so that a lost host's
    ranks recover from the survivors' memory, not storage. Give ``region`` a path on each host's
    own memory (``/dev/shm/…{rank}…``)."""

    wait: str | None = None
    """What the next update waits for: ``"commit"``, S_t committed (its copies, checksums and
    header: a failure loses at most one finished step); ``"copies"``, the paper's, S_t's copies only
    (on CUDA on the GPU, not the host), the checksums and header going on beside the next step, and
    the next copy into the other slot waiting for them, so that one slot always holds a complete
    checkpoint: a failure loses at most two finished steps. None: ``"copies"`` on a GPU, where the
    hashing of a large state outlasts the copies' DMA; ``"commit"`` on the CPU."""

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if self.persist_every < 0:
            raise ConfigError(f"persist_every must be 0 (never) or a positive number of steps, got {self.persist_every}")
        if self.wait not in (None, "commit", "copies"):
            raise ConfigError(f"wait must be 'commit', 'copies' or None, got {self.wait!r}")


class LightCheck(Strategy):
    name: ClassVar[str] = "lightcheck"
    sharded_layouts: ClassVar[frozenset[str]] = SHARDED_LAYOUTS
    layer_updates: ClassVar[bool] = True
    mirrors_to_peers: ClassVar[bool] = True
    Config = LightCheckConfig
    config: LightCheckConfig
    peers: RegionPeers | None

    def __init__(self, config: LightCheckConfig | None = None) -> None:
        super().__init__(config)
        self.layer_waits: dict[str, float] = {}
        """Seconds the updates waited for each layer's copy (CPU; on CUDA the wait is on the GPU)."""
        self.copy_seconds: list[float] = []
        """CUDA: per checkpoint, the device time from S_t ready to its last copy done."""
        self.hash_seconds: list[float] = []
        """Per checkpoint, the commit thread's time from its start to the last part's checksums
        (on CUDA the copies' time it overlaps included)."""
        self.commit_wait_seconds = 0.0
        """Seconds the updates waited, after the copies, for the checksums and the slot's header."""
        self.held: RegionTier | None = None

    @property
    def region(self) -> Region | None:
        return self.held.region if self.held is not None else None

    @property
    def registered(self) -> bool | None:
        """CUDA: whether the region's mapping is registered for DMA (False: copies through pageable memory)."""
        return self.held.registered if self.held is not None else None

    @property
    def persisted(self) -> int:
        """Checkpoints written from the region to the directory."""
        return self.held.persisted if self.held is not None else 0

    # -- set-up --------------------------------------------------------------------------------

    def _attach(self) -> None:
        directory = self.ctx.directory
        assert directory is not None
        self.held = RegionTier(self.ctx, self.errors, self.config.region, flush=self.config.flush, name="lightcheck",
                               source="region")
        self._pending: Copy | None = None
        self._slot = self.region.next_slot() if self.region is not None and directory.access != "read" else 0
        self._committing: dict[int, Future[Any] | None] = {0: None, 1: None}
        self._orders: dict[Any, CopyOrder] = {}
        self._copier = Worker("everystep-lightcheck-copy", self.errors)
        self._committer = Worker("everystep-lightcheck-commit", self.errors)
        self._stream: Any = None
        self._chosen: Candidate | None = None
        self._use_disk = False
        self._layered = isinstance(self.ctx.components.optimizer, OptimizerInBackward)
        self._mirrored: Future[Any] | None = None
        """The newest step's mirroring (one thread mirrors the steps in turn)."""
        if self.config.peers and directory.access != "read":
            self.peers = RegionPeers.start(self, directory)

    # -- restore -------------------------------------------------------------------------------

    def _agree_restore(self) -> None:
        """Collective: every rank reads and verifies its region's slots, newest first (one process
        stops at the first that verifies); the ranks take the newest step all of them hold, unless
        the disk holds a newer full checkpoint."""
        assert self.ctx.directory is not None
        ranks = self.ctx.directory.ranks
        if self.peers is not None:
            self._chosen = self.peers.recover(self.ctx.directory.newest_full_step())
            self._use_disk = self._chosen is None
            return
        assert self.held is not None
        verified = self.held.candidates(every=ranks.distributed)
        disk = self.ctx.directory.newest_full_step()
        common = set(verified)
        if ranks.distributed:
            for theirs in ranks.all_gather("control", sorted(verified)):
                common &= set(theirs)
        newest = max(common, default=-1)
        self._chosen = verified.get(newest)
        self._use_disk = newest < disk or newest < 0

    def _recover(self) -> Candidate | None:
        """The agreed region slot, unless the directory holds a newer full checkpoint that verifies
        (every rank reads the same directory, so every rank decides alike)."""
        assert self.ctx.directory is not None
        chosen, self._chosen = self._chosen, None  # read and verified while agreeing
        disk = recover(self.ctx.directory, shards=self.ctx.live_shards(), pulled=self.ctx.pulled) \
            if self._use_disk else None
        found = chosen if chosen is not None and (disk is None or disk.step < chosen.step) else disk
        assert self.held is not None
        if found is None and self.held.damaged is not None:
            raise NoValidCheckpointError(f"no valid checkpoint for {self.ctx.directory.root}: {self.held.damaged}, and the "
                                         "directory holds no full checkpoint")
        return found

    def _on_start(self, step: int) -> None:
        assert self.held is not None
        self.held.start(step)
        if self.region is not None and self.region.access != "read":
            self._slot = self.region.next_slot()
        if self.peers is not None:
            self.peers.discard_newer(step)

    # -- every step ----------------------------------------------------------------------------

    def _on_state_ready(self, step: int, final: bool) -> None:
        if not self._due(step, final):
            return
        copy = Copy(step, final, frozen=self._freeze())
        if self._on_cuda():
            if self._stream is None:
                self._stream = self.ctx.copy_stream()
            copy.ready = torch.cuda.Event(enable_timing=True)
            copy.ready.record()
        slot, self._slot = self._slot, 1 - self._slot
        # A sharded state is read here, on the training thread (see StrategyContext.layout); else on the
        # copy thread, off the training path.
        flat = self._flatten(step, self.ctx.boundary) if self.ctx.layout is not None else None
        copy.future = self._copier.submit(f"copy into the region of the state at step {step}", self._copy, copy, slot,
                                          self.ctx.boundary, flat)
        self._pending = copy

    def _on_cuda(self) -> bool:
        return self.ctx.device.type == "cuda"

    def setting(self) -> dict[str, Any]:
        """With the parts its slot is hashed in on CUDA (:func:`~.lightcheck_copy.part_count`), once a copy was laid out."""
        order = next(iter(self._orders.values()), None)
        return {**super().setting(), "wait": "commit" if self._waits_for_commit() else "copies",
                **({"hash_parts": len(order.parts)} if order is not None else {})}

    def _freeze(self) -> dict[int, torch.Tensor]:
        """Copies, taken now, of what the next forward or backward changes: model buffers and
        compression state (by where their data lies)."""
        live = [b for b in bare_module(self.ctx.components.model).buffers()]
        compression = self.ctx.components.compression
        if compression is not None:
            live += list(flatten(compression.state_dict())[0].values())
        with torch.no_grad():
            return {t.data_ptr(): t.detach().clone() for t in live if t.numel()}

    def _copy_order(self, tensors: dict[str, torch.Tensor], skeleton: Any, sharded: dict[str, torch.Tensor]) -> CopyOrder:
        values = tensors.values()
        signature = (tuple(tensors), tuple(map(_DTYPE, values)), tuple(map(_SHAPE, values)))  # (no Python call per tensor)
        found = self._orders.get(signature)
        if found is None:
            units, index = self._units(tensors)
            keys = [k for _, unit in units for k in unit]
            hint = len(json.dumps(skeleton, default=str))
            replicated = frozenset(self.ctx.replicated_keys(tensors, sharded=sharded))
            found = CopyOrder.of(units, index, RegionLayout.of(tensors, keys), replicated, hint, sharded)
            self._orders = {signature: found}
        return found

    def _units(self, tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[str, list[str]]], dict[int, int]]:
        """The copy order: what is not a layer's first, then each layer (a module's parameters and
        their optimizer state) in the order the next iteration updates them (backward order); and
        each parameter's unit, by its data pointer. With one update for the whole model, which
        waits for the whole copy, the units are that order as one: one batched copy, not one per layer."""
        components = self.ctx.components
        module, optimizer = bare_module(components.model), components.optimizer
        owner = {p: name.rpartition(".")[0] or name for name, p in module.named_parameters()}
        unit_of: dict[int, str] = {}
        layers: list[str] = []
        states = local_optimizer(optimizer).state  # (ZeRO-1: this rank's partition's)
        for group in optimizer.param_groups:
            for p in group["params"]:
                layer = owner.get(p, f"param{len(unit_of)}")
                if layer not in layers:
                    layers.append(layer)
                unit_of.setdefault(local_shard(p).data_ptr(), layer)
                for v in states.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.numel():
                        unit_of.setdefault(local_shard(v).data_ptr(), layer)
        members: dict[str, list[str]] = {"(rest)": []}
        for key, t in tensors.items():
            members.setdefault(unit_of.get(t.data_ptr(), "(rest)") if t.numel() else "(rest)", []).append(key)
        units = [(name, members[name]) for name in ["(rest)", *reversed(layers)] if members.get(name)]
        if not self._layered:
            units = [(ONE_UNIT, [k for _, keys in units for k in keys])]
            return units, {ptr: 0 for ptr in unit_of}
        position = {name: i for i, (name, _) in enumerate(units)}
        params = {local_shard(p).data_ptr() for group in optimizer.param_groups for p in group["params"]}
        return units, {ptr: position[layer] for ptr, layer in unit_of.items() if ptr in params and layer in position}

    def _flatten(self, step: int, boundary: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any, dict[str, torch.Tensor]]:
        """S_step flattened: its tensors (DTensors as local shards), skeleton, and DTensors by key."""
        sharded: dict[str, torch.Tensor] = {}
        tensors, skeleton = flatten({"step": step, **self.ctx.components.capture(), **boundary}, sharded=sharded)
        return tensors, skeleton, sharded

    def _copy(self, copy: Copy, slot: int, boundary: dict[str, Any], flat: Any) -> None:
        """Copy thread: S_step into ``slot``, unit by unit; then hand the slot to the commit thread."""
        try:
            tensors, skeleton, sharded = flat if flat is not None else self._flatten(copy.step, boundary)
            for key, t in tensors.items():
                frozen = copy.frozen.get(t.data_ptr()) if t.numel() else None
                if frozen is not None and frozen.shape == t.shape and frozen.dtype == t.dtype:
                    tensors[key] = frozen
            order = self._copy_order(tensors, skeleton, sharded)
            copy.progress.start([name for name, _ in order.units], order.index)
            settled(self._committing[slot])  # the slot's previous commit is done
            # and the other slot's, the step before (with wait="copies" it may still be hashing): a
            # slot is rewritten only while the other one holds a complete checkpoint.
            settled(self._committing[1 - slot])
            if self.peers is not None:
                # and the mirroring of every step before: so that the region always holds a step its
                # buddy's mirror holds too (and this rank's mirror of its wards' part), and a slot is
                # not rewritten while read. The step before's mirroring is started by its commit.
                peers.mirrored(self._mirrored)
            assert self.region is not None
            writer = self.region.begin(order.layout, order.meta_hint, slot=slot)
            if copy.ready is not None:
                self._copy_cuda(copy, writer, tensors, order)
            else:
                self._copy_cpu(copy, writer, tensors, order)
        finally:
            copy.progress.end()
        copy.commit = self._committer.submit(f"commit in the region of the state at step {copy.step}", self._commit,
                                             copy, writer, skeleton, order)
        self._committing[slot] = copy.commit

    def _copy_cpu(self, copy: Copy, writer: SlotWriter, tensors: dict[str, torch.Tensor], order: CopyOrder) -> None:
        half = len(order.units) // 2
        with torch.no_grad():
            for i, (_, keys) in enumerate(order.units):
                if i == half:
                    crash_point("store.object.mid_write")
                crash_point("lightcheck.copy.unit")
                torch._foreach_copy_([writer.views[k] for k in keys], [tensors[k] for k in keys])
                copy.progress.advance()

    def _copy_cuda(self, copy: Copy, writer: SlotWriter, tensors: dict[str, torch.Tensor], order: CopyOrder) -> None:
        assert self.held is not None
        self.held.register(writer, " (on an H200: 16 GB/s, against 52 into pinned memory); a region on tmpfs "
                                   "(region='/dev/shm/…{rank}…') can be pinned")
        stream = self._stream
        stream.wait_event(copy.ready)
        half, previous = len(order.units) // 2, -1
        with torch.no_grad(), torch.cuda.stream(stream), tracing.device_span("lightcheck copy", stream, step=copy.step):
            # Each unit's copies, cut where a part of the slot's hashing ends: an event after each unit
            # (the updates wait on it) and after each part (the commit thread hashes the part once it is in)
            for u, keys, unit_ends, parts_in in order.pieces:
                if u == half and u != previous:
                    crash_point("store.object.mid_write")
                previous = u
                torch._foreach_copy_([writer.views[k] for k in keys], [tensors[k] for k in keys], non_blocking=True)
                if not unit_ends and parts_in == len(copy.part_events):
                    continue
                last = unit_ends and len(copy.events) == len(order.units) - 1
                event = torch.cuda.Event(enable_timing=last)
                event.record(stream)
                copy.part_events.extend([event] * (parts_in - len(copy.part_events)))
                if unit_ends:
                    copy.events.append(event)
                    copy.progress.advance()

    def _commit(self, copy: Copy, writer: SlotWriter, skeleton: Any, order: CopyOrder) -> None:
        """Commit thread: wait for the copies, then checksums, metadata, header. (``copy`` holds the
        frozen copies the side stream reads until its events are done.)"""
        if not copy.events:
            settled(copy.future)
        assert self.region is not None
        sums: dict[str, str] = {}
        t0 = time.perf_counter()
        if copy.part_events:  # CUDA: each part once its copies are in, the rest still moving
            for part, event in zip(order.parts, copy.part_events, strict=True):
                with tracing.span("wait for a part's copies"):
                    event.synchronize()
                with tracing.span("checksums of a part"):
                    sums.update(self.region.checksums(writer, part))
        else:  # the CPU's copies are all in before the commit starts: one question for the whole slot
            with tracing.span("checksums"):
                sums = self.region.checksums(writer)
        self.hash_seconds.append(time.perf_counter() - t0)
        if copy.events:
            copy.events[-1].synchronize()
            self.copy_seconds.append(copy.ready.elapsed_time(copy.events[-1]) / 1e3)
        self.region.commit(writer, copy.step, skeleton, checksums=sums)
        if self.peers is not None:  # off the training path: the slot is not reused until it is done
            self._mirrored = self.peers.submit(copy.step, functools.partial(
                self.peers.own_part, copy.step, writer.views, skeleton, order.replicated))
        assert self.held is not None
        self.held.committed(copy.step, writer.layout.nbytes)  # (the region's bytes count as written)
        if self.region.flush:
            self.ctx.record_durable(copy.step, count=False)
        every = self.config.persist_every
        if copy.final or (every and copy.step % every == 0):
            self._persist(copy.step, writer, skeleton, order)

    # -- persisting to the directory -----------------------------------------------------------

    def _persist(self, step: int, writer: SlotWriter, skeleton: Any, order: CopyOrder) -> None:
        """Copy the committed slot to a host buffer (waiting while the previous persist writes),
        then write it to the directory in the background."""
        shard = RankShare.of(writer.views, set(order.replicated), self.ctx.ranks, split=self.ctx.splits_replicated,
                             sharded=order.sharded)
        assert self.held is not None
        self.held.persist(step, shard.local, functools.partial(self._write, step, skeleton, shard))

    def _write(self, step: int, skeleton: Any, shard: RankShare, buffer: HostBuffer) -> None:
        self.ctx.persist(step, buffer, skeleton, share=shard, keep=self.config.keep, count=False)

    # -- before the next update ----------------------------------------------------------------

    def _waits_for_commit(self) -> bool:
        wait = self.config.wait
        return (wait or ("copies" if self._on_cuda() else "commit")) == "commit"

    def _before_update(self, step: int) -> None:
        """The update may change the state once S_{step-1}'s copies are in the slot (waited for layer
        by layer on the CPU, on CUDA by the stream) and, with ``wait="commit"``, the slot's header is
        written. So a failure at any instant loses at most the step being computed (and with
        ``wait="copies"`` the one before it). (Per-layer updates wait per layer, and for the commit
        at the step's end.)"""
        if not self._layered:
            self._settle()

    def _before_layer_update(self, step: int, params: list[torch.Tensor]) -> None:
        """Per-layer updates: ``params`` may change once their layer's copy is in the slot (on CUDA:
        the update waits on the GPU for the layer's event)."""
        copy = self._pending
        if copy is None:
            return
        t0 = time.perf_counter()
        upto = copy.progress.wait(self.layer_waits, params)
        if copy.ready is not None and 0 <= upto < len(copy.events):
            torch.cuda.current_stream(params[0].device).wait_event(copy.events[upto])
        self.ctx.waited(time.perf_counter() - t0)

    def _on_step_end(self, step: int) -> None:
        if self._layered:
            self._settle()

    def _settle(self) -> None:
        """Wait until the pending copy is committed (its layers in turn, on the CPU, then the commit)."""
        copy, self._pending = self._pending, None
        if copy is None:
            return
        t0 = time.perf_counter()
        if copy.ready is None:
            copy.progress.wait(self.layer_waits)
        settled(copy.future)  # (on CUDA: the copies issued, and their events made)
        copied = time.perf_counter()
        if self._waits_for_commit():
            settled(copy.commit)
            self.commit_wait_seconds += time.perf_counter() - copied
        elif copy.events and not self._layered:
            torch.cuda.current_stream().wait_event(copy.events[-1])  # (the GPU waits, not the host)
        self.ctx.waited(time.perf_counter() - t0)
        self.errors.raise_pending()

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            settled(pending.future)
        self._copier.drain()
        self._committer.drain()
        if self.peers is not None:
            self.peers.worker.drain()
        if self.held is not None:
            self.held.drain()

    def _close(self) -> None:
        for worker in (self._copier, self._committer):
            worker.close()
        if self.peers is not None:
            self.peers.close()
        if self.held is not None:
            self.held.close()
