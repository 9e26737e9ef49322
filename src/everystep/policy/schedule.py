"""Checkflow's schedule: when to snapshot and when to offload each checkpointed tensor, as an ILP.

A training step is a sequence of T operators (:class:`StepProfile`): operator t runs for ``τ_t``
seconds with ``resident_t`` bytes of tensors alive on the device. Each tensor to checkpoint
(:class:`Tensor`: a parameter or optimizer state, or a group or a piece of them) is checkpointed in
two actions: a *snapshot* (a copy on the device), made before the tensor's update, and an *offload*
(the copy moved to the host, then freed). Binary variables C, P, S say, per snapshot and operator,
whether it is created, preserved or offloaded there (Checkflow's Eqs. 1–8); the bytes offloaded at an
operator fit the link's bandwidth over its time (Eq. 9); and the objective is the peak of device
memory, tensors alive plus snapshots held (Eqs. 10–12). Solved with HiGHS (``scipy.optimize.milp``).

:func:`plan` is Algorithm 1: when the bandwidth constraint makes the model infeasible, tensors larger
than ``per_size`` are split into ``ceil(size / per_size)`` pieces and it solves again; when a memory
limit makes it infeasible, the limit is relaxed. :func:`check` verifies any schedule against
constraints (2)–(11) and gives its peak; :func:`coarsen` merges operators into fewer time steps and
groups the tensors updated in the same one, which keeps real models to a size that solves in seconds.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["Tensor", "StepProfile", "Schedule", "ScheduleResult", "plan", "solve", "check", "coarsen", "split"]


@dataclass(frozen=True)
class Tensor:
    name: str
    nbytes: int
    updated_at: int
    """The operator (0-based) that updates it: its snapshot must be made at an earlier one."""
    members: tuple[tuple[str, int], ...] = ()
    """What it holds, as (name, bytes) laid end to end (a group of tensors); empty: itself."""
    offset: int = 0
    """A piece of a split: where its bytes start in ``members``."""

    def ranges(self) -> list[tuple[str, int, int]]:
        """(member, first byte, end byte) of each member this holds bytes of."""
        members = self.members or ((self.name, self.nbytes + self.offset),)
        found, at = [], 0
        for name, size in members:
            lo, hi = max(at, self.offset), min(at + size, self.offset + self.nbytes)
            if lo < hi:
                found.append((name, lo - at, hi - at))
            at += size
        return found


@dataclass(frozen=True)
class StepProfile:
    times: tuple[float, ...]
    """τ_t: seconds each operator runs."""
    resident: tuple[int, ...]
    """Bytes alive on the device at each operator (activations, weights, optimizer state)."""
    tensors: tuple[Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.times) != len(self.resident) or not self.times:
            raise ValueError(f"times and resident must have one entry per operator; got {len(self.times)} and "
                             f"{len(self.resident)}")
        bad = [t.name for t in self.tensors if not 1 <= t.updated_at < len(self.times)]
        if bad:
            raise ValueError(f"tensors updated at the first operator or past the last leave no room for a snapshot: "
                             f"{', '.join(bad[:3])}")

    @property
    def steps(self) -> int:
        return len(self.times)


@dataclass(frozen=True)
class Schedule:
    """Per tensor, the operator that creates its snapshot and the one that offloads it (the
    snapshot is held from one to the other, both included)."""

    created: tuple[int, ...]
    offloaded: tuple[int, ...]


@dataclass(frozen=True)
class ScheduleResult:
    feasible: bool
    profile: StepProfile
    """What was solved: the tensors after any splitting."""
    schedule: Schedule | None
    peak: int | None
    """Device bytes at the busiest operator, snapshots included."""
    splits: int
    """How many times Algorithm 1 split the tensors."""
    memory_limit: int | None
    """The limit the schedule meets (raised from the one asked for, if that was relaxed)."""
    seconds: float
    """Solver time, all attempts."""
    reason: str = ""


def solve(profile: StepProfile, *, bandwidth: float, memory_limit: int | None = None,
          time_limit: float = 60.0) -> tuple[str, Schedule | None, int | None]:
    """One ILP (Eqs. 1–12): ``("optimal", schedule, peak)``, or ``("infeasible", None, None)``."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    n, steps = len(profile.tensors), profile.steps
    # Variables: C, P, S, alpha for each (tensor, operator), then peak.
    block = n * steps
    C, P, S, A = (k * block for k in range(4))
    peak = 4 * block
    nvar = peak + 1

    def v(base: int, e: int, t: int) -> int:
        return base + e * steps + t

    rows: list[tuple[dict[int, float], float, float]] = []
    for e, tensor in enumerate(profile.tensors):
        for t in range(steps):
            rows.append(({v(C, e, t): 1, v(P, e, t): 1, v(S, e, t): 1}, -np.inf, 1))  # (2)
            for x in (C, P, S):
                rows.append(({v(A, e, t): 1, v(x, e, t): -1}, 0, np.inf))  # (11)
            if t:
                rows.append(({v(P, e, t): 1, v(C, e, t - 1): -1, v(P, e, t - 1): -1}, -np.inf, 0))  # (3)
                rows.append(({v(S, e, t): 1, v(C, e, t - 1): -1, v(P, e, t - 1): -1}, -np.inf, 0))  # (7)
        rows.append(({v(S, e, t): 1 for t in range(steps)}, 1, 1))  # (4)
        rows.append(({v(C, e, t): 1 for t in range(steps)}, 1, 1))
        rows.append(({v(C, e, t): 1 for t in range(tensor.updated_at)}, 1, np.inf))  # (8): before the update
    for t in range(steps):
        rows.append(({v(S, e, t): tensor.nbytes for e, tensor in enumerate(profile.tensors)}, -np.inf,
                     bandwidth * profile.times[t]))  # (9)
        rows.append(({**{v(A, e, t): -tensor.nbytes for e, tensor in enumerate(profile.tensors)}, peak: 1},
                     profile.resident[t], np.inf))  # (10)
    matrix = lil_matrix((len(rows), nvar))
    lower, upper = np.empty(len(rows)), np.empty(len(rows))
    for i, (coefficients, lo, hi) in enumerate(rows):
        for j, value in coefficients.items():
            matrix[i, j] = value
        lower[i], upper[i] = lo, hi
    lo_var, hi_var = np.zeros(nvar), np.ones(nvar)
    for e in range(n):
        hi_var[v(P, e, 0)] = 0  # (5); (6) holds throughout: parameters and optimizer state stay on the device
        hi_var[v(S, e, 0)] = 0  # (7) at the first operator, which the paper leaves out: nothing is held before it
    hi_var[peak] = np.inf if memory_limit is None else memory_limit
    integrality = np.ones(nvar)
    integrality[A:A + block] = 0  # alpha is bounded by binaries; minimising keeps it at their max
    integrality[peak] = 0
    cost = np.zeros(nvar)
    cost[peak] = 1  # (12)
    result = milp(cost, constraints=LinearConstraint(matrix.tocsr(), lower, upper), integrality=integrality,
                  bounds=Bounds(lo_var, hi_var), options={"time_limit": time_limit, "presolve": True})
    if result.status != 0 or result.x is None:
        return ("infeasible" if result.status == 2 else "unsolved"), None, None
    x = np.round(result.x[:peak]).astype(int)
    created = tuple(int(np.argmax(x[C + e * steps:C + (e + 1) * steps])) for e in range(n))
    offloaded = tuple(int(np.argmax(x[S + e * steps:S + (e + 1) * steps])) for e in range(n))
    schedule = Schedule(created, offloaded)
    return "optimal", schedule, check(profile, schedule, bandwidth=bandwidth)


def check(profile: StepProfile, schedule: Schedule, *, bandwidth: float) -> int:
    """The schedule's peak device bytes; ValueError naming the first constraint it breaks."""
    steps = profile.steps
    if len(schedule.created) != len(profile.tensors) or len(schedule.offloaded) != len(profile.tensors):
        raise ValueError("the schedule must give every tensor one snapshot and one offload (4)")
    held = np.zeros(steps)
    offload = np.zeros(steps)
    for tensor, c, s in zip(profile.tensors, schedule.created, schedule.offloaded):
        if not 0 <= c < steps or not 0 <= s < steps:
            raise ValueError(f"{tensor.name}: operators {c}, {s} outside 0..{steps - 1}")
        if c >= tensor.updated_at:
            raise ValueError(f"{tensor.name}: snapshot at operator {c}, not before its update at {tensor.updated_at} (8)")
        if s <= c:
            raise ValueError(f"{tensor.name}: offloaded at {s}, not after its snapshot at {c} (2, 7)")
        held[c:s + 1] += tensor.nbytes
        offload[s] += tensor.nbytes
    over = [t for t in range(steps) if offload[t] > bandwidth * profile.times[t] * (1 + 1e-9) + 1e-6]
    if over:
        t = over[0]
        raise ValueError(f"operator {t} offloads {offload[t]:.0f} bytes, more than the link moves in its "
                         f"{profile.times[t]:.3g} s (9)")
    return int(max(r + h for r, h in zip(profile.resident, held)))


SPLIT_ALIGN = 64
"""Pieces start on multiples of this many bytes (never inside an element)."""


def split(profile: StepProfile, per_size: int) -> StepProfile:
    """Algorithm 1's SPLITCHECKPOINTS: each tensor over ``per_size`` bytes becomes
    ``ceil(size / per_size)`` pieces of nearly equal size, cut on :data:`SPLIT_ALIGN` bytes (on any
    byte when ``per_size`` is smaller than that)."""
    align = SPLIT_ALIGN if per_size >= SPLIT_ALIGN else 1
    pieces = []
    for tensor in profile.tensors:
        k = max(1, math.ceil(tensor.nbytes / per_size))
        if k == 1:
            pieces.append(tensor)
            continue
        cuts = sorted({min(tensor.nbytes, tensor.nbytes * i // k // align * align) for i in range(k)}
                      | {tensor.nbytes})
        members = tensor.members or ((tensor.name, tensor.nbytes + tensor.offset),)
        pieces += [replace(tensor, name=f"{tensor.name}[{i}/{len(cuts) - 1}]", nbytes=b - a, members=members,
                           offset=tensor.offset + a) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return replace(profile, tensors=tuple(pieces))


MAX_PIECES = 4096
"""Splitting stops before the ILP would hold more tensors than this (its size grows with them)."""


def drifted(recent: float, baseline: float, replan: float) -> bool:
    """Whether a step time of ``recent`` seconds strays from ``baseline`` by more than the factor
    ``1 + replan``, slower or faster (``replan`` 1: twice as slow, or half the time)."""
    return recent > baseline * (1 + replan) or recent * (1 + replan) < baseline


def plan(profile: StepProfile, *, bandwidth: float, per_size: int, memory_limit: int | None = None,
         relax: float = 1.25, time_limit: float = 60.0) -> ScheduleResult:
    """Algorithm 1: solve; split on a bandwidth infeasibility, relax the memory limit on a memory
    one; infeasible when splitting changes nothing any more, or would make more than
    :data:`MAX_PIECES` pieces."""
    for name, value in (("bandwidth", bandwidth), ("per_size", per_size), ("relax", relax - 1),
                        ("memory_limit", 1 if memory_limit is None else memory_limit)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if memory_limit is not None:  # under the bytes alive without checkpointing, no schedule can be
        memory_limit = max(memory_limit, max(profile.resident))
    t0, splits = time.perf_counter(), 0
    while True:
        status, schedule, peak = solve(profile, bandwidth=bandwidth, memory_limit=memory_limit, time_limit=time_limit)
        if status == "optimal":
            return ScheduleResult(True, profile, schedule, peak, splits, memory_limit, time.perf_counter() - t0)
        if status != "infeasible":
            return ScheduleResult(False, profile, None, None, splits, memory_limit, time.perf_counter() - t0,
                        f"the solver stopped without a schedule ({status}, time limit {time_limit:g} s)")
        if memory_limit is not None and solve(profile, bandwidth=bandwidth, time_limit=time_limit)[0] == "optimal":
            memory_limit = max(int(memory_limit * relax), memory_limit + 1)  # the limit, not the link, is what fails
            continue
        finer = split(profile, per_size)
        if len(finer.tensors) > MAX_PIECES:
            return ScheduleResult(False, profile, None, None, splits, memory_limit, time.perf_counter() - t0,
                        f"the link ({bandwidth / 1e9:.3g} GB/s) cannot offload every snapshot within the step in "
                        f"pieces of {len(profile.tensors)} or fewer, and pieces of {per_size} bytes would make "
                        f"{len(finer.tensors)}, more than the {MAX_PIECES} the planner takes")
        if len(finer.tensors) == len(profile.tensors):
            return ScheduleResult(False, profile, None, None, splits, memory_limit, time.perf_counter() - t0,
                        f"the link ({bandwidth / 1e9:.3g} GB/s) cannot offload every snapshot within the step, "
                        f"even in pieces of {per_size} bytes")
        profile, splits = finer, splits + 1


def coarsen(profile: StepProfile, steps: int, group_bytes: int | None = None) -> tuple[StepProfile, list[tuple[int, int]]]:
    """About ``steps`` time steps: consecutive operators merged (times summed, the most bytes alive
    kept), cut at the operators that update tensors so that a snapshot's deadline stays exact; the
    tensors updated in the same merged step are grouped, in order, into groups of at most
    ``group_bytes`` (one group if None; a tensor larger than that alone). Returns the coarse profile
    and, per merged step, the operators it spans."""
    updates = sorted({t.updated_at for t in profile.tensors})
    cuts = sorted({0, *updates, profile.steps})
    spans: list[tuple[int, int]] = []
    for a, b in zip(cuts, cuts[1:]):  # within a stretch between updates, merge evenly
        room = max(1, round((steps - len(cuts) + 1) * (b - a) / profile.steps)) if steps > len(cuts) else 1
        k = min(b - a, room)
        bounds = [a + (b - a) * i // k for i in range(k + 1)]
        spans += list(zip(bounds, bounds[1:]))
    index = {}
    for i, (a, b) in enumerate(spans):
        for t in range(a, b):
            index[t] = i
    groups: list[tuple[int, list[Tensor]]] = []
    for tensor in sorted(profile.tensors, key=lambda t: index[t.updated_at]):
        at = index[tensor.updated_at]
        last = groups[-1] if groups else None
        if last is None or last[0] != at or (group_bytes is not None
                                              and sum(t.nbytes for t in last[1]) + tensor.nbytes > group_bytes):
            groups.append((at, []))
        groups[-1][1].append(tensor)
    tensors = tuple(Tensor(f"{g[0].name}+{len(g) - 1}", sum(t.nbytes for t in g), at,
                           members=tuple(m for t in g for m in (t.members or ((t.name, t.nbytes),))))
                    if len(g) > 1 else replace(g[0], updated_at=at) for at, g in groups)
    coarse = StepProfile(tuple(sum(profile.times[a:b]) for a, b in spans),
                         tuple(max(profile.resident[a:b]) for a, b in spans), tensors)
    return coarse, spans
