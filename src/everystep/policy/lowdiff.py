"""LowDiff's configuration model (its Eq. 8–10), dimensionally consistent.

The paper adds the lost work b/2 (iterations) to load and merge times (seconds), which holds only
when an iteration takes one second. With the iteration time τ explicit, f full checkpoints per
iteration and b differentials per batched write, over a job of T seconds on N GPUs:

    T_w(f, b) = N·T/M · (b·τ/2 + R_F + R_D/2 · (1/(f·b) − 1)) + N·T·S·f / (W·τ)

Setting both partial derivatives to zero gives

    f* = (R_D·W²·τ³ / (4·S²·M²))^(1/3),    b* = (2·S·M·R_D / (W·τ³))^(1/3)

which is the paper's Eq. 10 when τ = 1. The full-checkpoint interval is F* = 1/f* iterations.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LowDiffCosts", "lowdiff_wasted_time", "lowdiff_optimum", "lowdiff_integer_optimum"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LowDiffCosts:
    """Inputs of the model, in seconds and bytes."""

    iteration_seconds: float
    """τ: one training iteration."""
    mtbf_seconds: float
    """M: mean time between failures of the whole job."""
    write_bandwidth: float
    """W: bytes per second to storage."""
    full_bytes: float
    """S: one full checkpoint."""
    load_seconds: float
    """R_F: loading a full checkpoint."""
    merge_seconds: float
    """R_D: merging one batched differential into the state during recovery."""
    gpus: int = 1
    """N: GPUs that wait during a recovery."""
    job_seconds: float = 1.0
    """T: the job's run time (T_w scales with it; the optimum does not)."""

    def __post_init__(self) -> None:
        for name in ("iteration_seconds", "mtbf_seconds", "write_bandwidth", "full_bytes", "merge_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.load_seconds < 0 or self.gpus < 1 or self.job_seconds <= 0:
            raise ValueError("load_seconds must be >= 0, gpus >= 1 and job_seconds > 0")


def lowdiff_wasted_time(c: LowDiffCosts, f: float, b: float) -> float:
    """T_w(f, b) in GPU-seconds; f in full checkpoints per iteration, b in iterations per batch."""
    if f <= 0 or b <= 0:
        raise ValueError(f"f and b must be positive, got f={f}, b={b}")
    tau, failures = c.iteration_seconds, c.job_seconds / c.mtbf_seconds
    recovery = b * tau / 2 + c.load_seconds + c.merge_seconds / 2 * (1 / (f * b) - 1)
    steady = c.job_seconds * c.full_bytes * f / (c.write_bandwidth * tau)
    return c.gpus * (failures * recovery + steady)


def lowdiff_optimum(c: LowDiffCosts) -> tuple[float, float]:
    """The real-valued optimum (f*, b*)."""
    tau, s, m, w, rd = c.iteration_seconds, c.full_bytes, c.mtbf_seconds, c.write_bandwidth, c.merge_seconds
    f = (rd * w**2 * tau**3 / (4 * s**2 * m**2)) ** (1 / 3)
    b = (2 * s * m * rd / (w * tau**3)) ** (1 / 3)
    return f, b


def lowdiff_integer_optimum(c: LowDiffCosts, *, max_interval: int = 1_000_000) -> tuple[int, int]:
    """(F, b) in whole iterations, 1 <= b <= F <= max_interval, minimising T_w.

    Starts from the rounded real optimum and moves to the best neighbouring integer pair until
    none is better; T_w is convex in (1/F, b) near the optimum, so this ends at the integer optimum.
    """
    f, b = lowdiff_optimum(c)
    clamp = lambda F, B: (min(max_interval, max(1, F)), min(max(1, B), min(max_interval, max(1, F))))  # noqa: E731
    best = clamp(round(1 / f), round(b))
    cost = lowdiff_wasted_time(c, 1 / best[0], best[1])
    while True:
        neighbours = {clamp(best[0] + dF, best[1] + dB) for dF in (-1, 0, 1) for dB in (-1, 0, 1)}
        step = min(neighbours, key=lambda fb: lowdiff_wasted_time(c, 1 / fb[0], fb[1]))
        step_cost = lowdiff_wasted_time(c, 1 / step[0], step[1])
        if step_cost >= cost:
            return best
        best, cost = step, step_cost
