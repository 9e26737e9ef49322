"""``gockpt`` and ``gockpt_o``: GoCkpt's full checkpoint spread over K steps, made consistent from gradients.

A checkpoint that starts after step N is cut into K parts (chunks of parameters with the same
elements of their state); part k is copied from S_{N+k-1} while step N+k computes, and the
gradients each later update consumes are copied for the parts already copied. With
``reconstruct="host"`` a pool of threads applies them as they arrive (:func:`~everystep.replay.replay_step`),
so that every part holds S_{N+K} and the checkpoint written is a full one; with ``"device"`` (the
default on a GPU, where the host's arithmetic rounds otherwise) the parts are written as copied, with
the gradients that bring them forward on the training device at recovery
(:mod:`everystep.spread`). ``gockpt`` copies the gradients on the training thread before the update;
``gockpt_o`` copies them in the background, the next update waiting for that copy. The design, its
exactness and its costs: ``docs/strategies.md`` (GoCkpt).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, ClassVar

import torch

from .. import tracing
from .._faults import crash_point
from ..background import Worker, settled
from ..errors import ConfigError, EverystepError
from ..policy.interval import due
from ..policy.parts import MAX_PARTS, PartSplit, Unit, choose_parts
from ..parallelism import SHARDED_LAYOUTS
from ..replay import optimizer_like, replay_step
from ..state import group_scalars, local_optimizer
from ..storage import write_full
from ..spread import spread_state, write_spread
from ..storage.formats import RankShare
from ..layout import TensorLayout
from ..transport.host import HostBuffer, HostBufferPool, copy_bandwidth, snapshot_into
from ..tree import local_shard
from .gockpt_recovery import SpreadRecovery
from .gockpt_config import ELEMENTWISE, Chunk, GoCkptConfig, Param, Spread

__all__ = ["GoCkpt", "GoCkptO", "GoCkptConfig"]

class GoCkpt(SpreadRecovery):
    name: ClassVar[str] = "gockpt"
    sharded_layouts: ClassVar[frozenset[str]] = SHARDED_LAYOUTS
    other_world_size: ClassVar[bool] = True
    Config = GoCkptConfig
    config: GoCkptConfig
    overlap_gradients: ClassVar[bool] = False
    """GoCkpt-O: copy the gradients in the background, while the update and the next forward run."""

    def __init__(self, config: GoCkptConfig | None = None) -> None:
        super().__init__(config)
        self.parts_used: list[int] = []
        """K of each checkpoint started."""
        self.gradient_seconds = 0.0
        """Training thread time spent copying gradients (gockpt) or waiting for their copy (gockpt_o)."""
        self.part_wait_seconds = 0.0
        """Training thread time spent waiting for a part's copy before an update."""
        self.reconstruct_seconds: list[float] = []
        """Per checkpoint: thread time spent applying gradients to its parts, summed over threads."""

    # -- set-up --------------------------------------------------------------------------------

    def _attach(self) -> None:
        optimizer = self._optimizer = local_optimizer(self.ctx.components.optimizer)
        """The optimizer whose state the parts hold (ZeRO-1's: this rank's local one, over its partition)."""
        if not isinstance(optimizer, ELEMENTWISE) or type(optimizer).__module__.split(".")[0] != "torch":
            names = ", ".join(c.__name__ for c in ELEMENTWISE)
            raise ConfigError(f"strategy {self.name!r} brings each part of a parameter forward on its own, which needs "
                              f"an optimizer that updates each element from its own gradient and state ({names}); "
                              f"got {type(optimizer).__name__}")
        on_gpu = self.ctx.device.type == "cuda"
        if on_gpu and self.config.reconstruct == "host":
            raise ConfigError(f"strategy {self.name!r} with reconstruct='host' brings the parts forward on the CPU, whose "
                              "arithmetic differs from the GPU's: recovery would not be exact; use reconstruct='device' (the default on a GPU)")
        self.on_device = self.config.reconstruct == "device" or (self.config.reconstruct is None and on_gpu)
        """The parts are brought forward at recovery, on the training device."""
        if self.on_device and self.ctx.layout is not None:
            raise ConfigError(f"strategy {self.name!r} with reconstruct='device' writes spread checkpoints in everystep's "
                              f"own format, which does not hold the shards of a job sharded with {self.ctx.layout}: "
                              "use reconstruct='host' (on the CPU), or checkfreq")
        self._stream = self.ctx.copy_stream()
        pin = self._stream is not None
        self._part_buffers = HostBufferPool(2, pin=pin)
        """Host memory for the parts of a checkpoint in the making and of the one being written: the
        same buffers from one checkpoint to the next (pinned memory is slow to allocate)."""
        self._gradient_buffers = HostBufferPool(2, pin=pin)
        """Host memory for gradients: ``reconstruct="device"``, those each checkpoint keeps, laid out
        when it begins; ``"host"``, a step's, until the threads have applied them."""
        self._rest_buffers = HostBufferPool(2, pin=pin)
        """The state of S_end that is not a part (buffers, state made since the checkpoint began)."""
        self._params: list[Param] | None = None
        self._spread: Spread | None = None
        self._step_times: list[float] = []
        self._copier = Worker(f"everystep-{self.name}-copy", self.errors)
        self._appliers = [] if self.on_device else [Worker(f"everystep-{self.name}-apply-{i}", self.errors)
                                                     for i in range(self.config.threads)]
        self._persister = Worker(f"everystep-{self.name}-persist", self.errors)
        self._finished = -1
        self._lock = threading.Lock()

    def _on_start(self, step: int) -> None:
        self._finished = step

    # -- the steps -----------------------------------------------------------------------------

    def _on_step_end(self, step: int) -> None:
        self._step_times.append(time.perf_counter())

    def _on_state_ready(self, step: int, final: bool) -> None:
        if final:
            if self._finished != step:
                self._abandon_spread()
                self._write_now(step)
            return
        if not self._first(step):
            return
        spread = self._spread
        if spread is not None:
            k = step - spread.start + 1  # the part copied from S_step
            if k <= spread.parts:
                self._copy_part(spread, k - 1)
                return
            self._finish(spread, step)
        if due(step, self.config.every):
            self._begin(step)

    def _before_update(self, step: int) -> None:
        spread = self._spread
        if spread is None:
            return
        t0 = time.perf_counter()
        if spread.gradient_copies:  # gockpt_o: the previous update's gradients
            settled(spread.gradient_copies[-1])
        self.gradient_seconds += time.perf_counter() - t0
        j = step - spread.start  # parts 1..j are copied (part j from S_{step-1})
        t1 = time.perf_counter()
        settled(spread.copies[j - 1])  # (issued; on CUDA the update waits on the device for the copy)
        self.part_wait_seconds += time.perf_counter() - t1
        self.ctx.waited(time.perf_counter() - t0)
        self.errors.raise_pending()
        copied = spread.copies[j - 1].result()
        if copied is not None:
            torch.cuda.current_stream().wait_event(copied)
        groups = group_scalars(self.ctx.components.optimizer)
        needed = {c.param for part in spread.copied[:j] for c in part}
        grads = {i: (g, g._version if g is not None else 0) for i in needed
                 for g in (local_shard(spread.params[i].tensor.grad),)}
        ready = self._event()
        if self.overlap_gradients:
            spread.gradient_copies.append(self._copier.submit(f"copy of the gradients of step {step}",
                                                              self._copy_gradients, spread, step, j, grads, groups,
                                                              ready))
        else:
            t2 = time.perf_counter()
            self._copy_gradients(spread, step, j, grads, groups, ready)
            self.gradient_seconds += time.perf_counter() - t2

    def _event(self) -> Any:
        """CUDA: an event recorded now on the training thread's stream (what a copy waits for)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def _copy_stream(self, ready: Any) -> Iterator[None]:
        """CUDA: the copies issued inside run on the copy stream, after ``ready``."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            with tracing.device_span(f"{self.name} part copy", self._stream):
                yield

    # -- a checkpoint's parts --------------------------------------------------------------------

    def _begin(self, step: int) -> None:
        """S_step is the first version copied: plan the parts, copy the first."""
        tensors, _ = self.ctx.flatten_state(step)
        params = self._params = self._find_params(tensors)  # (state the optimizer made since is in it)
        units = [Unit(p.key, p.local.numel(),
                      p.local.element_size() + sum(tensors[k].element_size() for k in p.elementwise.values()))
                 for p in params]
        k = self.config.parts or self._choose_parts(units, tensors)
        plan = PartSplit.of(units, k, self.config.chunk_bytes)
        keys = [key for p in params for key in (p.key, *p.elementwise.values())]
        host = self._acquire(self._part_buffers, TensorLayout.of({key: tensors[key] for key in keys}))
        spread = self._spread = Spread(step, params, plan, host.views, held=[(self._part_buffers, host)])
        if self.on_device:
            spread.gradients = self._acquire(self._gradient_buffers, self._gradient_layout(params, plan))
            spread.held.append((self._gradient_buffers, spread.gradients))
        self.parts_used.append(len(plan.parts))
        self._copy_part(spread, 0)

    def _acquire(self, pool: HostBufferPool, layout: TensorLayout) -> HostBuffer:
        """A buffer of ``pool`` for ``layout`` (waiting, counted as such, while two checkpoints hold theirs)."""
        t0 = time.perf_counter()
        buffer = pool.acquire(layout)
        self.ctx.waited(time.perf_counter() - t0)
        return buffer

    @staticmethod
    def _gradient_layout(params: list[Param], plan: PartSplit) -> TensorLayout:
        """Where the gradients of each update of a checkpoint lie: the update after the copy of part j
        keeps the gradients of parts 1..j, under ``"{j}/{chunk index}"``."""
        firsts = [sum(len(part) for part in plan.parts[:k]) for k in range(len(plan.parts))]
        return TensorLayout.planned(
            (f"{j}/{firsts[k] + n}", params[c.unit].local.dtype, (c.stop - c.start,))
            for j in range(1, len(plan.parts) + 1) for k in range(j) for n, c in enumerate(plan.parts[k]))

    @staticmethod
    def _give_back(spread: Spread) -> None:
        """Return to their pools the buffers ``spread`` held (once it is written, or dropped)."""
        while spread.held:
            pool, buffer = spread.held.pop()
            pool.release(buffer)

    def _find_params(self, tensors: dict[str, torch.Tensor]) -> list[Param]:
        """The parameters this rank brings forward: every one, or under ZeRO-1 its partition's (the
        others it copies whole when the checkpoint ends, with the rest of the state)."""
        params = []
        updated = {id(p) for g in self._optimizer.param_groups for p in g["params"]}
        for found in self.ctx.optimizer_keys(tensors):
            if id(found.param) not in updated:
                continue
            p = local_shard(found.param)  # (of a DTensor, this rank's shard: the part it copies)
            if found.key is None:
                raise EverystepError(f"optimizer parameter {found.index} is not among the model's tensors: strategy "
                                     f"{self.name!r} needs the optimizer to train the model's own parameters")
            elementwise = {n: k for n, k in found.state.items() if tensors[k].shape == p.shape and p.numel() > 1}
            params.append(Param(found.param, found.group, found.key, elementwise,
                                 {n: k for n, k in found.state.items() if n not in elementwise}))
        return params

    def _choose_parts(self, units: list[Unit], tensors: dict[str, torch.Tensor]) -> int:
        """The smallest K whose copy fits under a step: the steps so far, and the copy bandwidth."""
        times = self._step_times[-6:]
        step_seconds = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        assert self._params is not None
        bandwidth = copy_bandwidth(self.ctx.device)
        total = sum(u.numel * u.bytes_per_element for u in units)
        k = min(choose_parts(total, bandwidth, step_seconds, MAX_PARTS), self.config.every)
        ranks = self.ctx.ranks
        return max(ranks.all_gather("control", k)) if ranks.distributed else k  # every rank spreads alike

    def _copy_part(self, spread: Spread, index: int) -> None:
        spread.copies.append(self._copier.submit(f"copy of part {index + 1} of the checkpoint started at step "
                                                 f"{spread.start}", self._copy_chunks, spread, index, self._event()))

    def _copy_chunks(self, spread: Spread, index: int, ready: Any) -> Any:
        """Copier thread: part ``index`` from the live state (on CUDA, once the training stream has
        reached ``ready``), then (host) the optimizers that bring it forward. On CUDA, returns an event
        that completes with the copies: the next update waits for it on the device, not the host."""
        optimizer = self._optimizer
        first = sum(len(part) for part in spread.plan.parts[:index])
        chunks = []
        with torch.no_grad(), self._copy_stream(ready):
            for n, c in enumerate(spread.plan.parts[index]):
                p = spread.params[c.unit]
                view = spread.host[p.key].view(-1)[c.start:c.stop]
                view.copy_(p.local.detach().reshape(-1)[c.start:c.stop], non_blocking=True)
                chunk = Chunk(first + n, c.unit, c.start, c.stop, view)
                for name, value in optimizer.state.get(p.tensor, {}).items():
                    if name in p.elementwise:
                        chunk.state[name] = spread.host[p.elementwise[name]].view(-1)[c.start:c.stop]
                        chunk.state[name].copy_(local_shard(value).reshape(-1)[c.start:c.stop], non_blocking=True)
                    elif name in p.whole:  # each chunk brings its own copy forward
                        chunk.state[name] = local_shard(value.detach()).clone() if isinstance(value, torch.Tensor) else value
                    else:
                        raise EverystepError(
                            f"the optimizer made state {name!r} for {p.key!r} after the checkpoint of step "
                            f"{spread.start} began (its first update with a gradient): {self.name} cannot bring "
                            f"that parameter forward; start the run with every parameter updated at step 1, or set "
                            f"every so that no checkpoint begins before")
                chunks.append(chunk)
                crash_point("gockpt.copy.chunk")
            done = self._event()  # (on the copy stream)
        if done is not None:
            spread.events.append(done)
        spread.copied.append(chunks)
        if not self.on_device:
            spread.shards.append(self._shards(spread.params, chunks))
        return done

    def _shards(self, params: list[Param], chunks: list[Chunk]) -> list[tuple[torch.optim.Optimizer, list[int],
                                                                               list[Chunk]]]:
        """The chunks split over the threads by size, each share with an optimizer of the live one's
        class and groups whose state is the chunks'."""
        optimizer = self._optimizer
        shares: list[list[Chunk]] = [[] for _ in range(min(len(chunks), len(self._appliers)))]
        loads = [0] * len(shares)
        for chunk in sorted(chunks, key=lambda c: c.start - c.stop):
            i = loads.index(min(loads))
            shares[i].append(chunk)
            loads[i] += chunk.stop - chunk.start
        found = []
        for share in shares:
            groups = sorted({params[c.param].group for c in share})
            made = optimizer_like(optimizer, {g: [(c.view, c.state) for c in share if params[c.param].group == g]
                                              for g in groups})
            found.append((made, groups, share))
        return found

    # -- gradients -----------------------------------------------------------------------------

    def _copy_gradients(self, spread: Spread, step: int, parts: int, grads: dict[int, tuple[torch.Tensor | None, int]],
                        groups: list[dict[str, Any]], ready: Any) -> None:
        """The gradients of the parts 1..``parts`` consumed by the update of ``step`` into host
        memory (on CUDA, once the training stream has reached ``ready``); then, host: handed to the
        threads that apply them; device: kept for the checkpoint."""
        kept: dict[int, torch.Tensor] = {}
        held = None if self.on_device else self._gradient_buffers.acquire(TensorLayout.planned(
            (str(i), p.local.dtype, tuple(p.local.shape)) for i, p in enumerate(spread.params)))
        buffer = kept if held is None else {i: held.views[str(i)] for i in range(len(spread.params))}
        with torch.no_grad(), self._copy_stream(ready):
            for part in spread.copied[:parts]:
                for c in part:
                    grad, _ = grads.get(c.param, (None, 0))
                    if grad is None:
                        continue
                    if self.on_device:
                        assert spread.gradients is not None
                        target = spread.gradients.views[f"{parts}/{c.index}"]
                        if target.dtype != grad.dtype:  # (a gradient of another dtype than its parameter's)
                            target = torch.empty(c.stop - c.start, dtype=grad.dtype, pin_memory=self._stream is not None)
                        kept[c.index] = target
                    else:
                        target = buffer[c.param].view(-1)[c.start:c.stop]
                    target.copy_(grad.reshape(-1)[c.start:c.stop], non_blocking=True)
            if self._stream is not None:
                for grad, _ in grads.values():
                    if grad is not None:
                        grad.record_stream(self._stream)  # zero_grad may free it before the copy is done
                spread.events.append(self._event())
        for i, (grad, version) in grads.items():
            if grad is not None and grad._version != version:
                raise EverystepError(
                    f"the gradient of {spread.params[i].key!r} changed in place before {self.name} "
                    "copied it (optimizer.zero_grad(set_to_none=False)?): call zero_grad() with set_to_none=True, "
                    "PyTorch's default, or use strategy gockpt")
        if self.on_device:
            with self._lock:
                spread.records.append(({"step": step, "groups": groups}, kept))
            return
        present = {i for i, (g, _) in grads.items() if g is not None}
        futures = [self._appliers[s].submit(f"apply the gradients of step {step}", self._apply, spread, part[s],
                                            buffer, present, groups)
                   for part in spread.shards[:parts] for s in range(len(part))]
        spread.applied = [*futures, self._appliers[0].submit("release a gradient buffer", self._release, futures, held)]

    def _apply(self, spread: Spread, share: tuple[torch.optim.Optimizer, list[int], list[Chunk]],
               buffer: dict[int, torch.Tensor], present: set[int], groups: list[dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        optimizer, group_index, chunks = share
        replay_step(optimizer, [groups[g] for g in group_index],
                    ((c.view, buffer[c.param].view(-1)[c.start:c.stop] if c.param in present else None) for c in chunks))
        with self._lock:
            spread.apply_seconds.append(time.perf_counter() - t0)

    def _release(self, futures: list[Future[Any]], held: HostBuffer) -> None:
        """Host: a step's gradient buffer goes back to its pool once its gradients are applied."""
        settled(*futures)
        self._gradient_buffers.release(held)

    # -- the consistent checkpoint ---------------------------------------------------------------

    def _finish(self, spread: Spread, step: int) -> None:
        """S_step: every part is copied and brought (or being brought) to it; copy the rest now and
        write the checkpoint in the background."""
        self._spread, self._finished = None, step
        tensors, skeleton = self.ctx.flatten_state(step)
        sharded = self.ctx.sharded
        ours = {k for p in spread.params for k in (p.key, *p.elementwise.values(), *(() if self.on_device else p.whole.values()))}
        replicated = self.ctx.replicated_keys(tensors)
        keys = [k for k in tensors if k not in ours]
        buffer = self._acquire(self._rest_buffers, TensorLayout.of({k: tensors[k] for k in keys}))
        spread.held.append((self._rest_buffers, buffer))
        copied = snapshot_into(buffer, tensors, keys, stream=self._stream)
        if copied is not None:  # the next forward and update change them only once they are copied
            torch.cuda.current_stream().wait_event(copied)
            spread.events.append(copied)
        rest = {k: buffer.views[k] for k in keys}
        write = self._write_spread if self.on_device else self._write
        self._persister.post(f"background write of the checkpoint at step {step}", self._written, write, spread, step,
                             tensors, rest, skeleton, replicated, sharded)

    def _written(self, write: Any, spread: Spread, *args: Any) -> None:
        """Persister thread: ``write(spread, *args)``, then the buffers it held go back to their pools."""
        try:
            write(spread, *args)
        finally:
            self._give_back(spread)

    def _write(self, spread: Spread, step: int, live: dict[str, torch.Tensor], rest: dict[str, torch.Tensor],
               skeleton: Any, replicated: set[str], sharded: dict[str, torch.Tensor]) -> None:
        settled(*spread.gradient_copies)
        settled(*spread.applied)
        if any(f.exception() is not None for f in (*spread.applied, *spread.gradient_copies)):
            assert self.ctx.catalog is not None
            failed = EverystepError(f"the checkpoint of step {step} was not reconstructed: applying the gradients failed")
            share = RankShare.of(live, replicated, self.ctx.ranks, split=self.ctx.splits_replicated, sharded=sharded)
            write_full(self.ctx.catalog, step, None, skeleton, share=share, error=failed)  # raises, on every rank
        self.reconstruct_seconds.append(sum(spread.apply_seconds))
        crash_point("gockpt.reconstructed")
        tensors = dict(rest)
        chunks = sorted((c for part in spread.copied for c in part), key=lambda c: (c.param, c.start))
        for i, p in enumerate(spread.params):
            tensors[p.key] = spread.host[p.key]
            tensors.update({k: spread.host[k] for k in p.elementwise.values()})
            mine = [c for c in chunks if c.param == i]
            for name, key in p.whole.items():
                if key not in live:
                    continue
                values = [c.state[name] for c in mine]
                if any(not torch.equal(v, values[0]) for v in values[1:]):
                    raise EverystepError(f"the chunks of {p.key!r} disagree on {name!r} after reconstruction")
                tensors[key] = values[0]
        tensors = {k: tensors[k] for k in live}  # (state the optimizer made after S_start is in ``rest``)
        self._persist(step, tensors, skeleton, replicated, sharded)

    def _write_spread(self, spread: Spread, step: int, live: dict[str, torch.Tensor], rest: dict[str, torch.Tensor],
                      skeleton: Any, replicated: set[str], sharded: dict[str, torch.Tensor]) -> None:
        """Device: the parts as copied, the state of S_step that is not a part, and the gradients
        that bring each part to S_step, as one checkpoint of kind ``spread``."""
        assert self.ctx.catalog is not None and self.ctx.directory is not None
        settled(*spread.gradient_copies)
        for event in spread.events:
            event.synchronize()
        failed = next((f.exception() for f in spread.gradient_copies if f.exception() is not None), None)
        if failed is None:
            crash_point("gockpt.reconstructed")
        state = {k: rest[k] if k in rest else spread.host[k] for k in live}
        parts = {"start": spread.start, "params": spread.params, "copied": spread.copied, "records": spread.records}
        if self.tier is not None:  # (one process) the parts, their gradients and the rest into a slot
            if failed is not None:
                raise failed
            tensors, description = spread_state(state, **parts)
            self.tier.write(step, tensors, skeleton, {"spread": description})
            return
        self.ctx.persist_record(step, functools.partial(write_spread, self.ctx.catalog, step, state, skeleton, replicated,
                                                        distributed=self.ctx.ranks.distributed, error=failed, **parts),
                                keep=self.config.keep)

    def _persist(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, replicated: set[str],
                 sharded: dict[str, torch.Tensor]) -> None:
        assert self.ctx.catalog is not None and self.ctx.directory is not None
        split = self.ctx.splits_replicated
        share = RankShare.of(tensors, replicated, self.ctx.ranks, split=split, sharded=sharded)
        self._write_full(step, share.local, skeleton, share=share)

    def _write_now(self, step: int) -> None:
        """At close: the state as it is, copied now and written (a spread in flight is dropped)."""
        self._finished = step
        tensors, skeleton = self.ctx.flatten_state(step)
        replicated = self.ctx.replicated_keys(tensors)
        with torch.no_grad():
            copies = {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}
        settled(self._persister.submit(f"write of the last checkpoint at step {step}", self._persist, step, copies,
                                       skeleton, replicated, self.ctx.sharded))

    def _abandon_spread(self) -> None:
        spread, self._spread = self._spread, None
        if spread is not None:
            settled(*spread.copies, *spread.applied, *spread.gradient_copies)
            for event in spread.events:
                event.synchronize()
            self._give_back(spread)

    # -- end -----------------------------------------------------------------------------------

    def _wait(self) -> None:
        self._copier.drain()
        for worker in self._appliers:
            worker.drain()
        self._persister.drain()

    def _close(self) -> None:
        for worker in (self._copier, *self._appliers, self._persister):
            worker.close()


class GoCkptO(GoCkpt):
    name: ClassVar[str] = "gockpt_o"
    overlap_gradients: ClassVar[bool] = True
