"""``checkflow``: Checkflow's schedule of snapshots and offloads, executed inside every step.

The first step is profiled as it runs (:class:`~everystep.capture.profile.StepRecorder`: each leaf
module's forward and backward and the optimizer's step an operator, with its time and the bytes
alive), and a background thread plans it (:func:`~everystep.policy.schedule.plan`: the ILP of
Checkflow's Eqs. 1–12 inside its Algorithm 1) for the link's ``bandwidth``. From then on, in every
step t that checkpoints S_{t-1}, as each operator starts (:class:`~everystep.capture.profile.OperatorHooks`)
the pieces the schedule creates there are *snapshotted* — copied on the device, before the optimizer
updates them — and the pieces it offloads there are copied from their snapshot into a host buffer
and the snapshot freed (on CUDA on a stream of its own into pinned memory). What the schedule does
not cover (buffers the forward changes, scalars such as Adam's ``step``, RNG, the data position)
is copied as S_{t-1} becomes ready. After the update, the host buffer holds S_{t-1} and is written
and committed in the background, as CheckFreq's: on CUDA once an event after the step's offloads
has passed, which the background thread waits for, not the training thread.

With the memory tier the host buffer is the tier's slot, taken at the step's first offload, not as
S_{t-1} becomes ready: the slot is free only once the commit before it is done (its checksums and
header), which was posted at the end of the step before; what is not scheduled is held on the device
until then. A piece the schedule left for later than the
update (the steps ran differently from the profile) is snapshotted before the update all the same
(:attr:`Checkflow.late`), so every checkpoint is consistent.

Until the plan is ready (and where it is infeasible) the whole state is snapshotted at once, as
``async`` does. When the steps' time (a median of five) strays by more than ``replan`` (a fraction)
from what it was when the schedule was new, a step is profiled again and re-planned, with a warning. The bytes of snapshots alive are accounted
(:attr:`Checkflow.peak_snapshot_bytes`) against the plan's (:attr:`Checkflow.planned_snapshot_bytes`).
Under several ranks each rank runs the schedule it planned from its own step, on the part of the
state it writes (its byte range of what data parallelism replicates), and the ranks commit each
checkpoint together as every full checkpoint is committed. With an optimizer stepped after backward.
"""

from __future__ import annotations

import statistics
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .. import tracing
from .._faults import crash_point
from ..background import Worker, settled
from ..capture.profile import OperatorHooks, StepRecorder
from ..errors import ConfigError
from ..layout import TensorLayout
from ..policy.schedule import ScheduleResult, StepProfile, coarsen, drifted, plan
from ..parallelism import DTENSOR_LAYOUTS
from ..storage.formats import RankShare
from ..transport.host import HostBuffer, HostBufferPool, copy_bandwidth, copy_out, snapshot_into
from .full_state import FullState, FullStateConfig

__all__ = ["Checkflow", "CheckflowConfig"]

_WINDOW = 5


@dataclass(kw_only=True, slots=True)
class CheckflowConfig(FullStateConfig):
    quantities: ClassVar[dict[str, str]] = {"bandwidth": "rate", "per_size": "size", "memory_limit": "size"}
    bandwidth: float | None = None
    """Bytes/s of the device-to-host link; ``None``: measured once (timed copies of 16 MiB)."""
    per_size: int = 16 << 20
    """Bytes: tensors are grouped up to this size, and split into pieces of it when the link needs."""
    time_steps: int = 48
    """Operators are merged into about this many time steps for the ILP."""
    memory_limit: int | None = None
    """Device bytes the plan should stay under (relaxed when it cannot)."""
    replan: float = 1.0
    """Re-plan when the steps' time (a median of 5) strays from what it was when the schedule was new
    by more than this fraction."""

    def __post_init__(self) -> None:
        FullStateConfig.__post_init__(self)
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ConfigError(f"bandwidth must be a positive number of bytes per second, got {self.bandwidth}")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise ConfigError(f"memory_limit must be a positive number of bytes (or None), got {self.memory_limit}")
        if self.per_size < 64 or self.time_steps < 2 or self.replan <= 0:
            raise ConfigError(f"per_size must be at least 64 bytes, time_steps at least 2 and replan positive; got "
                              f"{self.per_size}, {self.time_steps}, {self.replan}")


@dataclass(frozen=True)
class _Schedule:
    """A plan, as the hooks execute it."""

    plan: ScheduleResult
    coarse_of: list[int]
    """Fine operator → the time step it belongs to."""
    created: dict[int, list[int]]
    """Time step → pieces snapshotted there."""
    offloaded: dict[int, list[int]]
    ranges: list[list[tuple[str, int, int]]]
    """Per piece: (state key, first element, end element)."""
    keys: frozenset[str]
    """The state keys the schedule covers."""


@dataclass(eq=False)
class _Round:
    """One checkpoint in the making: S_step, taken piece by piece inside the next step."""

    step: int
    buffer: HostBuffer | None
    """Where S_step is taken: a host buffer, or the memory tier's slot (its ``views`` alike); None
    until the slot is taken (:meth:`Checkflow._target`)."""
    tensors: dict[str, torch.Tensor]
    skeleton: Any
    shard: RankShare
    schedule: _Schedule | None
    ranges: list[list[tuple[str, int, int]]] = field(default_factory=list)
    """Per piece of the schedule: the element ranges of it this rank holds, in ``tensors``."""
    done_upto: int = -1
    snapshots: dict[int, list[tuple[torch.Tensor, str, int, int]]] = field(default_factory=dict)
    """Piece → (snapshot, and where in the host buffer it goes: key, first and end element), while held."""
    offloaded: set[int] = field(default_factory=set)
    early: dict[str, torch.Tensor] = field(default_factory=dict)
    """What the schedule does not cover, copied on the device as S_step became ready, until the slot
    it goes to is taken."""


def _local_ranges(schedule: _Schedule, shard: RankShare) -> list[list[tuple[str, int, int]]]:
    """The schedule's pieces as this rank holds them. Under several ranks each rank writes one byte
    range of what data parallelism replicates (``shard.pieces``: a flat slice of each key, from its
    first to its end element), and of a shard several ranks hold (HSDP) a range of its rows
    (``shard.rows``), so a piece's range is cut to what this rank writes and moved to its start."""
    if not shard.pieces and not shard.rows:
        return schedule.ranges
    local = []
    for ranges in schedule.ranges:
        mine = []
        for key, lo, hi in ranges:
            span = shard.span(key)
            if span is not None and max(lo, span[0]) < min(hi, span[1]):
                mine.append((key, max(lo, span[0]) - span[0], min(hi, span[1]) - span[0]))
        local.append(mine)
    return local


class Checkflow(FullState):
    name: ClassVar[str] = "checkflow"
    sharded_layouts: ClassVar[frozenset[str]] = DTENSOR_LAYOUTS
    sharded_refusal: ClassVar[str] = "its profile reads the optimizer's state, which ZeRO-1 keeps in a local optimizer"
    other_world_size: ClassVar[bool] = True
    Config = CheckflowConfig
    config: CheckflowConfig

    def __init__(self, config: CheckflowConfig | None = None) -> None:
        super().__init__(config)
        self.plans: list[ScheduleResult] = []
        """Every plan made (the first, and one per re-plan)."""
        self.late = 0
        """Pieces snapshotted or offloaded later than the schedule said (the step ran differently)."""
        self.peak_snapshot_bytes = 0
        """The most bytes of snapshots held at once, as executed."""
        self.planned_snapshot_bytes = 0
        """The most bytes of snapshots the plan holds at once."""

    def _attach(self) -> None:
        self._pool = HostBufferPool(2)
        self._persister = Worker("everystep-checkflow-persist", self.errors)
        self._planner = Worker("everystep-checkflow-plan", self.errors)
        self._stream = self.ctx.copy_stream()
        self._schedule: _Schedule | None = None
        self._planning: Future[Any] | None = None
        self._recorder: StepRecorder | None = None
        self._recorded = False
        self._baseline: float | None = None
        self._times: list[float] = []
        self._profile_next = True
        self._round: _Round | None = None
        self._op = -1
        self._alive = 0
        self._step_started = 0.0
        model, optimizer = self.ctx.components.model, self.ctx.components.optimizer
        self._operators = OperatorHooks(model, optimizer, self._on_operator)

    # -- the steps -----------------------------------------------------------------------------

    def _on_state_ready(self, step: int, final: bool) -> None:
        self._plan_recorded()
        self._take_plan()
        if self._profile_next and not final:
            self._profile_next = False
            self._recorder = StepRecorder(self.ctx.components.model, self.ctx.components.optimizer)
        self._op = -1
        self._step_started = time.perf_counter()
        if not self._due(step, final):
            return
        share, skeleton = self.ctx.full_share(step)
        tensors = share.local
        schedule = None if final else self._schedule
        covered = schedule.keys if schedule is not None else frozenset(self.ctx.stable_keys(tensors))
        uncovered = [k for k in tensors if k not in covered]  # what changes before the update
        r = _Round(step, None, tensors, skeleton, share, schedule,
                   _local_ranges(schedule, share) if schedule is not None else [])
        if schedule is not None and self.tier is not None:  # (the slot is taken at the first offload)
            with torch.no_grad():
                r.early = {k: tensors[k].detach().clone() for k in uncovered}
            self._alive += sum(t.nbytes for t in r.early.values())
            self._round = r
            return
        buffer = self._target(r)
        snapshot_into(buffer, tensors, uncovered)
        if schedule is None:  # no plan (yet): everything at once, as async does
            snapshot_into(buffer, tensors, [k for k in tensors if k in covered], stream=self._stream)
            self._finish(r)
        else:
            self._round = r

    def _on_operator(self, name: str) -> None:
        self._op += 1
        r = self._round
        if r is None or r.schedule is None:
            return
        s = r.schedule
        upto = s.coarse_of[min(self._op, len(s.coarse_of) - 1)]
        for t in range(r.done_upto + 1, upto + 1):
            for piece in s.created.get(t, ()):
                self._snapshot(r, piece)
            for piece in s.offloaded.get(t, ()):
                self._offload(r, piece)
        r.done_upto = max(r.done_upto, upto)

    def _before_update(self, step: int) -> None:
        r = self._round
        if r is not None and r.step == step - 1 and r.schedule is not None:
            self._finish_snapshots(r)  # nothing the update changes may be left uncopied

    def _on_step_end(self, step: int) -> None:
        r, self._round = self._round, None
        if r is not None and r.step == step - 1:
            self._finish(r)
        elif r is not None:  # a round whose step did not come (it cannot happen in order): keep it
            self._round = r
        seconds = time.perf_counter() - self._step_started
        if self._recorder is not None:
            self._recorded = True  # finished at the next call: its own hooks are running now
        elif r is not None and r.schedule is not None:
            self._times.append(seconds)
            recent = statistics.median(self._times[-_WINDOW:])
            if len(self._times) == _WINDOW:  # the first steps run with this schedule (the profiled one ran slower)
                self._baseline = recent
            elif self._baseline is not None and drifted(recent, self._baseline, self.config.replan):
                warnings.warn(f"checkflow: steps now take {recent:.3g} s (median of {_WINDOW}), against "
                              f"{self._baseline:.3g} s when the schedule was new: profiling the next step to plan again",
                              stacklevel=2)
                self._schedule, self._profile_next = None, True

    # -- snapshot and offload ------------------------------------------------------------------

    def _target(self, r: _Round) -> HostBuffer:
        """Where S_{r.step} goes, taken now if it was not: the memory tier's slot (once the commit
        before it is done; what the schedule does not cover copied in from the device first), or a
        host buffer of the pool."""
        if r.buffer is None:
            if self.tier is None:
                r.buffer = self._pool.acquire(TensorLayout.of(r.tensors))
            else:
                with tracing.span("checkflow takes the memory tier's slot"):
                    r.buffer = self.tier.begin(r.tensors, r.skeleton)  # type: ignore[assignment]
            if r.early:
                copy_out([r.buffer.views[k] for k in r.early], list(r.early.values()), self._stream,  # type: ignore[union-attr]
                         what="checkflow offload")
                self._alive -= sum(t.nbytes for t in r.early.values())
                r.early = {}
        assert r.buffer is not None
        return r.buffer

    def _snapshot(self, r: _Round, piece: int) -> None:
        if piece in r.snapshots or piece in r.offloaded:
            return
        assert r.schedule is not None
        with torch.no_grad():
            held = [(r.tensors[key].detach().reshape(-1)[lo:hi].clone(), key, lo, hi) for key, lo, hi in r.ranges[piece]]
        r.snapshots[piece] = held
        self._alive += sum(t.nbytes for t, _, _, _ in held)
        self.peak_snapshot_bytes = max(self.peak_snapshot_bytes, self._alive)

    def _offload(self, r: _Round, piece: int) -> None:
        held = r.snapshots.pop(piece, None)
        if held is None:
            return
        views = self._target(r).views
        copy_out([views[key].view(-1)[lo:hi] for _, key, lo, hi in held], [snap for snap, _, _, _ in held], self._stream,
                 what="checkflow offload")
        crash_point("checkflow.offload")
        r.offloaded.add(piece)
        self._alive -= sum(t.nbytes for t, _, _, _ in held)

    def _finish_snapshots(self, r: _Round) -> None:
        """Snapshot now, late, what the schedule left uncopied (before the update changes it)."""
        assert r.schedule is not None
        missing = [p for p in range(len(r.schedule.ranges)) if p not in r.snapshots and p not in r.offloaded]
        self.late += len(missing)
        for piece in missing:
            self._snapshot(r, piece)

    def _finish(self, r: _Round) -> None:
        """Offload what is held, then write S_{r.step} in the background (on CUDA once the copies
        are in: an event the background thread waits for)."""
        self._target(r)
        if r.schedule is not None:
            self.late += len(r.snapshots)
            for piece in list(r.snapshots):
                self._offload(r, piece)
        copied = None
        if self._stream is not None:
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._persister.post(f"background write of the checkpoint at step {r.step}", self._persist, r, copied)

    def _persist(self, r: _Round, copied: Any) -> None:
        assert r.buffer is not None
        try:
            if copied is not None:
                copied.synchronize()
            if self.tier is not None:
                self.tier.commit(r.buffer, r.step, r.skeleton)  # type: ignore[arg-type]
            else:
                self._write_full(r.step, r.buffer, r.skeleton, share=r.shard)
        finally:
            if self.tier is None:
                self._pool.release(r.buffer)

    # -- planning ------------------------------------------------------------------------------

    def _plan(self, profile: StepProfile, keys: dict[str, str], sizes: dict[str, int]) -> _Schedule | None:
        """Planner thread: merge, solve, and turn the plan into what the hooks execute (None: no
        feasible schedule)."""
        bandwidth = self.config.bandwidth or copy_bandwidth(self.ctx.device)
        coarse, spans = coarsen(profile, self.config.time_steps, group_bytes=self.config.per_size)
        found = plan(coarse, bandwidth=bandwidth, per_size=self.config.per_size, memory_limit=self.config.memory_limit)
        self.plans.append(found)
        if not found.feasible or found.schedule is None:
            warnings.warn(f"checkflow: no schedule ({found.reason}); every checkpoint is taken at once", stacklevel=2)
            return None
        coarse_of = [i for i, (a, b) in enumerate(spans) for _ in range(a, b)]
        created: dict[int, list[int]] = {}
        offloaded: dict[int, list[int]] = {}
        ranges = []
        for i, (piece, c, s) in enumerate(zip(found.profile.tensors, found.schedule.created, found.schedule.offloaded)):
            created.setdefault(c, []).append(i)
            offloaded.setdefault(s, []).append(i)
            ranges.append([(keys[name], lo // sizes[keys[name]], hi // sizes[keys[name]]) for name, lo, hi in piece.ranges()])
        held = [0] * coarse.steps
        for piece, c, s in zip(found.profile.tensors, found.schedule.created, found.schedule.offloaded):
            for t in range(c, s + 1):
                held[t] += piece.nbytes
        self.planned_snapshot_bytes = max(held)
        return _Schedule(found, coarse_of, created, offloaded, ranges, frozenset(k for rs in ranges for k, _, _ in rs))

    def _keys(self) -> tuple[dict[str, str], dict[str, int]]:
        """The profile's tensor names (``param/I``, ``state/I/NAME``) → keys of the flat state, and
        each key's element size."""
        tensors, _ = self.ctx.flatten_state(0)
        found = {}
        for p in self.ctx.optimizer_keys(tensors):
            if p.key is not None:
                found[f"param/{p.index}"] = p.key
            found.update({f"state/{p.index}/{name}": key for name, key in p.state.items()})
        return found, {k: t.element_size() for k, t in tensors.items()}

    def _plan_recorded(self) -> None:
        """The step recorded is over: plan it in the background."""
        if self._recorder is not None and self._recorded:
            profile, self._recorder, self._recorded = self._recorder.finish(), None, False
            self._planning = self._planner.submit("plan Checkflow's schedule", self._plan, profile, *self._keys())

    def _take_plan(self) -> None:
        """Use a plan made in the background, once it is ready."""
        if self._planning is not None and self._planning.done():
            planning, self._planning = self._planning, None
            if planning.exception() is None and planning.result() is not None:
                self._schedule, self._baseline, self._times = planning.result(), None, []

    # -- end -----------------------------------------------------------------------------------

    def _wait(self) -> None:
        settled(self._planning)
        self._persister.drain()

    def _close(self) -> None:
        self._operators.remove()
        if self._recorder is not None:
            self._recorder.finish()
            self._recorder = None
        self._planner.close()
        self._persister.close()

