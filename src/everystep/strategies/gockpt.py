"""``gockpt`` and ``gockpt_o``: GoCkpt's full checkpoint spread over K steps, made consistent from gradients.

A checkpoint that starts after step N is not copied in one go. The parameters with their
optimizer state are cut into K parts (:class:`~everystep.policy.parts.PartPlan`: chunks of about
``chunk_bytes``, a chunk of a parameter always with the same elements of its state); part k is
copied from S_{N+k-1} by a background thread while step N+k computes, and the update of step N+k
waits only for that part. Each part so arrives at another version. At each step N+j (j = 1..K) the
gradients that update consumes (after clipping and unscaling) are copied for the parts already
copied (1..j), and a pool of ``threads`` threads applies them to those parts with the same
optimizer and the step's group settings (:func:`everystep.replay.replay_step`, the project's one
replay): once step N+K's gradients are applied, every part holds S_{N+K}. A step a GradScaler
skipped has no update, so nothing is applied for it. What is not a part (model buffers, RNG, the
data position, the schedule, the scaler) is copied at S_{N+K}, and the consistent checkpoint is
written and committed as any full one, in the background.

``gockpt`` copies the gradients on the training thread right before the update (the stall GoCkpt's
analysis counts, i/K of the parameters at step N+i). ``gockpt_o`` (GoCkpt-O) copies them in the
background while the update and the next forward run — a gradient stays as it is until the next
backward when ``zero_grad`` drops it (``set_to_none=True``, PyTorch's default) — and the next
update waits for that copy; a gradient changed in place before it was copied is an error, never a
silent inconsistency.

The gradients are applied as they arrive, not all after the last part: each step's are dropped
once applied (at most two steps' worth are held), and the reconstruction is over one step after the
last part is copied. ``parts`` (K) defaults to the smallest number of parts whose copy fits under a
step (measured: the steps before the first checkpoint, and timed warm copies of 16 MiB), at most 7
(:func:`~everystep.policy.parts.choose_parts`).

Exactness (I1): on the CPU the reconstruction is bitwise — the same optimizer class, the same
kernels, and updates element by element, which do not depend on where a chunk starts (chunk
boundaries fall on whole SIMD vectors besides). On CUDA the CPU's arithmetic would differ from the
GPU's, so these strategies refuse a model on a GPU.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .._faults import crash_point
from ..background import Worker, settled
from ..errors import ConfigError, EverystepError
from ..layout import TensorLayout
from ..policy.interval import due
from ..policy.parts import ALIGN, MAX_PARTS, PartPlan, Unit, choose_parts
from ..replay import replay_step
from ..state import group_scalars
from ..storage.full import write_full
from ..storage.sharded import ShardPlan
from ..storage.tensorfile import tensor_chunks
from ..transport.host import copy_bandwidth
from .base import Strategy, StrategyConfig

__all__ = ["GoCkpt", "GoCkptO", "GoCkptConfig"]

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
               torch.optim.Rprop)
"""Optimizers whose update of an element reads only that element's gradient and state (and scalars):
a part of a parameter can be brought forward on its own."""


@dataclass(kw_only=True, slots=True)
class GoCkptConfig(StrategyConfig):
    every: int = 50
    """A checkpoint starts every this many steps; it is complete ``parts`` steps later."""
    parts: int | None = None
    """K, the steps one checkpoint's copy is spread over; ``None``: the smallest K whose copy fits
    under a step, at most 7 (and at most ``every``)."""
    chunk_bytes: int = 4 << 20
    """A parameter and its state are copied in chunks of about this many bytes."""
    threads: int = 4
    """Threads that apply the gradients to the parts copied."""

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if self.parts is not None and not 1 <= self.parts <= self.every:
            raise ConfigError(f"parts must lie in 1..every ({self.every}): a checkpoint spans parts steps and the next "
                              f"starts every steps later; got {self.parts}")
        if self.chunk_bytes < ALIGN * 4:
            raise ConfigError(f"chunk_bytes must be at least {ALIGN * 4}, got {self.chunk_bytes}")
        if self.threads < 1:
            raise ConfigError(f"threads must be at least 1, got {self.threads}")


@dataclass(eq=False)
class _Param:
    """A parameter the optimizer updates, and where its tensors lie in the flat state."""

    tensor: torch.Tensor
    group: int
    key: str
    elementwise: dict[str, str]
    """State name → key, for each state tensor of the parameter's shape (chunked with it)."""
    whole: dict[str, str]
    """State name → key, for the others (scalars such as Adam's step: each chunk has its own)."""


@dataclass(eq=False)
class _Chunk:
    """A chunk's copy, brought forward by its shard's optimizer (whose state it is)."""

    param: int
    start: int
    stop: int
    view: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(eq=False)
class _Spread:
    """One checkpoint in the making: S_start's parts copied over the next K steps."""

    start: int
    params: list[_Param]
    """The parameters and their state's keys as S_start has them."""
    plan: PartPlan
    host: dict[str, torch.Tensor]
    """Host tensors, full shape, for each parameter and each of its element-wise state tensors."""
    copies: list[Future[Any]] = field(default_factory=list)
    shards: list[list[tuple[torch.optim.Optimizer, list[int], list[_Chunk]]]] = field(default_factory=list)
    """Per part copied: per shard, its optimizer, the groups it has, its chunks."""
    applied: list[Future[Any]] = field(default_factory=list)
    gradients: Future[Any] | None = None
    """gockpt_o: the copy of the last update's gradients."""
    apply_seconds: list[float] = field(default_factory=list)

    @property
    def parts(self) -> int:
        return len(self.plan.parts)


class GoCkpt(Strategy):
    name: ClassVar[str] = "gockpt"
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
        optimizer = self.ctx.components.optimizer
        if not isinstance(optimizer, ELEMENTWISE) or type(optimizer).__module__.split(".")[0] != "torch":
            names = ", ".join(c.__name__ for c in ELEMENTWISE)
            raise ConfigError(f"strategy {self.name!r} brings each part of a parameter forward on its own, which needs "
                              f"an optimizer that updates each element from its own gradient and state ({names}); "
                              f"got {type(optimizer).__name__}")
        if any(p.is_cuda for g in optimizer.param_groups for p in g["params"]):
            raise ConfigError(f"strategy {self.name!r} brings the parts forward on the CPU, whose arithmetic differs "
                              "from the GPU's: recovery would not be exact; use checkfreq, lightcheck or lowdiff_plus "
                              "on a GPU")
        self._params: list[_Param] | None = None
        self._spread: _Spread | None = None
        self._last = -1
        self._step_times: list[float] = []
        self._copier = Worker(f"everystep-{self.name}-copy", self.errors)
        self._appliers = [Worker(f"everystep-{self.name}-apply-{i}", self.errors) for i in range(self.config.threads)]
        self._persister = Worker(f"everystep-{self.name}-persist", self.errors)
        self._grad_buffers: queue.Queue[dict[int, torch.Tensor]] = queue.Queue()
        self._grad_buffers_made = 0
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
        if step == self._last:
            return
        self._last = step
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
        if spread.gradients is not None:  # gockpt_o: the previous update's gradients
            settled(spread.gradients)
            spread.gradients = None
        self.gradient_seconds += time.perf_counter() - t0
        j = step - spread.start  # parts 1..j are copied (part j from S_{step-1})
        t1 = time.perf_counter()
        settled(spread.copies[j - 1])
        self.part_wait_seconds += time.perf_counter() - t1
        self.ctx.waited(time.perf_counter() - t0)
        self.errors.raise_pending()
        groups = group_scalars(self.ctx.components.optimizer)
        needed = {c.param for part in spread.shards[:j] for _, _, share in part for c in share}
        grads = {i: (g, g._version if g is not None else 0) for i in needed for g in (spread.params[i].tensor.grad,)}
        if self.overlap_gradients:
            spread.gradients = self._copier.submit(f"copy of the gradients of step {step}", self._copy_gradients,
                                                   spread, step, j, grads, groups)
        else:
            t2 = time.perf_counter()
            self._copy_gradients(spread, step, j, grads, groups)
            self.gradient_seconds += time.perf_counter() - t2

    # -- a checkpoint's parts --------------------------------------------------------------------

    def _begin(self, step: int) -> None:
        """S_step is the first version copied: plan the parts, copy the first."""
        tensors, _ = self.ctx.flatten_state(step)
        params = self._params = self._find_params(tensors)  # (state the optimizer made since is in it)
        units = [Unit(p.key, p.tensor.numel(),
                      p.tensor.element_size() + sum(tensors[k].element_size() for k in p.elementwise.values()))
                 for p in params]
        k = self.config.parts or self._choose_parts(units, tensors)
        plan = PartPlan.of(units, k, self.config.chunk_bytes)
        host = {key: torch.empty_like(tensors[key], device="cpu", memory_format=torch.contiguous_format)
                for p in params for key in (p.key, *p.elementwise.values())}
        self._spread = _Spread(step, params, plan, host)
        self.parts_used.append(len(plan.parts))
        self._copy_part(self._spread, 0)

    def _find_params(self, tensors: dict[str, torch.Tensor]) -> list[_Param]:
        params = []
        for found in self.ctx.optimizer_keys(tensors):
            p = found.param
            if found.key is None:
                raise EverystepError(f"optimizer parameter {found.index} is not among the model's tensors: strategy "
                                     f"{self.name!r} needs the optimizer to train the model's own parameters")
            elementwise = {n: k for n, k in found.state.items() if tensors[k].shape == p.shape and p.numel() > 1}
            params.append(_Param(p, found.group, found.key, elementwise,
                                 {n: k for n, k in found.state.items() if n not in elementwise}))
        return params

    def _choose_parts(self, units: list[Unit], tensors: dict[str, torch.Tensor]) -> int:
        """The smallest K whose copy fits under a step: the steps so far, and the copy bandwidth."""
        times = self._step_times[-6:]
        step_seconds = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        assert self._params is not None
        bandwidth = copy_bandwidth(self._params[0].tensor.device)
        total = sum(u.numel * u.bytes_per_element for u in units)
        k = min(choose_parts(total, bandwidth, step_seconds, MAX_PARTS), self.config.every)
        ranks = self.ctx.ranks
        return max(ranks.all_gather("control", k)) if ranks.distributed else k  # every rank spreads alike

    def _copy_part(self, spread: _Spread, index: int) -> None:
        spread.copies.append(self._copier.submit(f"copy of part {index + 1} of the checkpoint started at step "
                                                 f"{spread.start}", self._copy_chunks, spread, index))

    def _copy_chunks(self, spread: _Spread, index: int) -> None:
        """Copier thread: part ``index`` from the live state, then the optimizers that bring it forward."""
        optimizer = self.ctx.components.optimizer
        chunks = []
        with torch.no_grad():
            for c in spread.plan.parts[index]:
                p = spread.params[c.unit]
                view = spread.host[p.key].view(-1)[c.start:c.stop]
                view.copy_(p.tensor.detach().reshape(-1)[c.start:c.stop])
                chunk = _Chunk(c.unit, c.start, c.stop, view)
                for name, value in optimizer.state.get(p.tensor, {}).items():
                    if name in p.elementwise:
                        chunk.state[name] = spread.host[p.elementwise[name]].view(-1)[c.start:c.stop]
                        chunk.state[name].copy_(value.reshape(-1)[c.start:c.stop])
                    else:  # each chunk brings its own copy forward
                        chunk.state[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
                chunks.append(chunk)
                crash_point("gockpt.copy.chunk")
        spread.shards.append(self._shards(spread.params, chunks))

    def _shards(self, params: list[_Param], chunks: list[_Chunk]) -> list[tuple[torch.optim.Optimizer, list[int],
                                                                               list[_Chunk]]]:
        """The chunks split over the threads by size, each share with an optimizer of the live one's
        class and groups whose state is the chunks'."""
        optimizer = self.ctx.components.optimizer
        shares: list[list[_Chunk]] = [[] for _ in range(min(len(chunks), len(self._appliers)))]
        loads = [0] * len(shares)
        for chunk in sorted(chunks, key=lambda c: c.start - c.stop):
            i = loads.index(min(loads))
            shares[i].append(chunk)
            loads[i] += chunk.stop - chunk.start
        found = []
        for share in shares:
            groups = sorted({params[c.param].group for c in share})
            made = type(optimizer)([{**{k: v for k, v in optimizer.param_groups[g].items() if k != "params"},
                                     "params": [c.view for c in share if params[c.param].group == g]}
                                    for g in groups])
            for c in share:
                made.state[c.view] = c.state
            found.append((made, groups, share))
        return found

    # -- gradients -----------------------------------------------------------------------------

    def _copy_gradients(self, spread: _Spread, step: int, parts: int, grads: dict[int, tuple[torch.Tensor | None, int]],
                        groups: list[dict[str, Any]]) -> None:
        """The gradients of the parts 1..``parts`` consumed by the update of ``step`` into a host
        buffer, then handed to the threads that apply them."""
        buffer = self._grad_buffer()
        with torch.no_grad():
            for part in spread.shards[:parts]:
                for _, _, share in part:
                    for c in share:
                        grad, _ = grads.get(c.param, (None, 0))
                        if grad is not None:
                            buffer[c.param].view(-1)[c.start:c.stop].copy_(grad.reshape(-1)[c.start:c.stop])
        for i, (grad, version) in grads.items():
            if grad is not None and grad._version != version:
                raise EverystepError(
                    f"the gradient of {spread.params[i].key!r} changed in place before {self.name} "
                    "copied it (optimizer.zero_grad(set_to_none=False)?): call zero_grad() with set_to_none=True, "
                    "PyTorch's default, or use strategy gockpt")
        present = {i for i, (g, _) in grads.items() if g is not None}
        futures = [self._appliers[s].submit(f"apply the gradients of step {step}", self._apply, spread, part[s],
                                            buffer, present, groups)
                   for part in spread.shards[:parts] for s in range(len(part))]
        spread.applied = [*futures, self._appliers[0].submit("release a gradient buffer", self._release, futures, buffer)]

    def _apply(self, spread: _Spread, share: tuple[torch.optim.Optimizer, list[int], list[_Chunk]],
               buffer: dict[int, torch.Tensor], present: set[int], groups: list[dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        optimizer, group_index, chunks = share
        replay_step(optimizer, [groups[g] for g in group_index],
                    ((c.view, buffer[c.param].view(-1)[c.start:c.stop] if c.param in present else None) for c in chunks))
        with self._lock:
            spread.apply_seconds.append(time.perf_counter() - t0)

    def _grad_buffer(self) -> dict[int, torch.Tensor]:
        """One of two host buffers for a step's gradients (waiting while both are being applied)."""
        with self._lock:
            make = self._grad_buffers_made < 2 and self._grad_buffers.empty()
            self._grad_buffers_made += make
        if not make:
            return self._grad_buffers.get()
        assert self._params is not None
        return {i: torch.empty(p.tensor.shape, dtype=p.tensor.dtype) for i, p in enumerate(self._params)}

    def _release(self, futures: list[Future[Any]], buffer: dict[int, torch.Tensor]) -> None:
        settled(*futures)
        self._grad_buffers.put(buffer)

    # -- the consistent checkpoint ---------------------------------------------------------------

    def _finish(self, spread: _Spread, step: int) -> None:
        """S_step: every part is copied and brought (or being brought) to it; copy the rest now and
        write the checkpoint in the background."""
        self._spread, self._finished = None, step
        tensors, skeleton = self.ctx.flatten_state(step)
        ours = {k for p in spread.params for k in (p.key, *p.elementwise.values(), *p.whole.values())}
        with torch.no_grad():
            rest = {k: t.detach().clone() for k, t in tensors.items() if k not in ours}
        self._persister.post(f"background write of the checkpoint at step {step}", self._write, spread, step, tensors,
                             rest, skeleton)

    def _write(self, spread: _Spread, step: int, live: dict[str, torch.Tensor], rest: dict[str, torch.Tensor],
               skeleton: Any) -> None:
        settled(spread.gradients)
        settled(*spread.applied)
        if any(f.exception() is not None for f in (*spread.applied, *([spread.gradients] if spread.gradients else []))):
            assert self.ctx.store is not None
            failed = EverystepError(f"the checkpoint of step {step} was not reconstructed: applying the gradients failed")
            plan = ShardPlan.of(live, self.ctx.replicated_keys(live), self.ctx.ranks, split=self.ctx.full_format != "dcp")
            write_full(self.ctx.store, step, None, skeleton, plan=plan, error=failed)  # raises, on every rank
        self.reconstruct_seconds.append(sum(spread.apply_seconds))
        crash_point("gockpt.reconstructed")
        tensors = dict(rest)
        chunks = sorted((c for part in spread.shards for _, _, share in part for c in share),
                        key=lambda c: (c.param, c.start))
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
        self._persist(step, tensors, skeleton)

    def _persist(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any) -> None:
        assert self.ctx.store is not None and self.ctx.directory is not None
        split = self.ctx.full_format != "dcp"
        plan = ShardPlan.of(tensors, self.ctx.replicated_keys(tensors), self.ctx.ranks, split=split)
        t0 = time.perf_counter()
        write_full(self.ctx.store, step, tensor_chunks(TensorLayout.of(plan.local), plan.local), skeleton, plan=plan,
                   tensors=plan.local, format=self.ctx.full_format)
        self.ctx.committed(step, seconds=time.perf_counter() - t0)
        self.ctx.directory.retain(self.config.keep)

    def _write_now(self, step: int) -> None:
        """At close: the state as it is, copied now and written (a spread in flight is dropped)."""
        self._finished = step
        tensors, skeleton = self.ctx.flatten_state(step)
        with torch.no_grad():
            copies = {k: t.detach().clone() for k, t in tensors.items()}
        settled(self._persister.submit(f"write of the last checkpoint at step {step}", self._persist, step, copies,
                                       skeleton))

    def _abandon_spread(self) -> None:
        spread, self._spread = self._spread, None
        if spread is not None:
            for f in [*spread.copies, *spread.applied, *([spread.gradients] if spread.gradients else [])]:
                settled(f)

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
