"""Wasted time of a long job under exponential failures: Monte Carlo and analytic models.

A strategy is described by :class:`StrategyCosts`: its step time with checkpointing on, the
interval between checkpoints, how many further steps a checkpoint needs before it is durable
(``lag``), and its recovery time. A failure rolls progress back to the newest durable
checkpoint and costs the recovery time, during which another failure may strike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError

__all__ = ["StrategyCosts", "simulate", "analytic_ratio", "exact_expected_seconds"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyCosts:
    name: str
    step_seconds: float
    """A training step with this strategy's checkpointing on."""
    base_step_seconds: float
    """A training step without checkpointing (useful work per step)."""
    interval: int = 1
    lag: int = 0
    recovery_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.step_seconds <= 0 or self.base_step_seconds <= 0 or self.interval < 1 or self.lag < 0:
            raise ValueError(f"invalid costs for {self.name}: {self}")


def _durable(reached: int, start: int, c: StrategyCosts) -> int:
    """The newest durable step once ``reached`` steps are complete, having restarted at ``start``."""
    newest = (reached - c.lag) // c.interval * c.interval
    return max(start, newest)


MAX_FAILURES = 100_000
"""A simulated job that fails more often than this has no useful ratio to report."""


def simulate(c: StrategyCosts, *, mtbf_seconds: float, job_steps: int, trials: int = 200, seed: int = 0) -> dict[str, float]:
    """Monte Carlo over ``trials`` jobs of ``job_steps`` steps; returns mean wall time and ratios."""
    if mtbf_seconds <= 0 or job_steps < 1 or trials < 1:
        raise ValueError("need mtbf_seconds > 0, job_steps >= 1, trials >= 1")
    rng = np.random.default_rng(seed)
    walls, failures = np.empty(trials), np.empty(trials)
    for i in range(trials):
        wall, done, n_fail = 0.0, 0, 0
        next_failure = rng.exponential(mtbf_seconds)
        while done < job_steps:
            # run from `done` until the job ends or the failure strikes
            needed = (job_steps - done) * c.step_seconds
            if next_failure >= needed:
                wall += needed
                next_failure -= needed
                done = job_steps
                break
            reached = done + int(next_failure // c.step_seconds)
            wall += next_failure
            n_fail += 1
            if n_fail > MAX_FAILURES:
                raise ConfigError(f"a simulated job of {job_steps} steps failed {MAX_FAILURES} times without finishing "
                                  f"at an MTBF of {mtbf_seconds:g} s: give a longer MTBF (or fewer GPUs)")
            done = _durable(reached, done, c)
            # recover; a failure during recovery restarts it
            while True:
                next_failure = rng.exponential(mtbf_seconds)
                if next_failure >= c.recovery_seconds:
                    wall += c.recovery_seconds
                    next_failure -= c.recovery_seconds
                    break
                wall += next_failure
                n_fail += 1
                if n_fail > MAX_FAILURES:
                    raise ConfigError(f"a simulated recovery of {c.recovery_seconds:g} s failed {MAX_FAILURES} times "
                                      f"at an MTBF of {mtbf_seconds:g} s: give a longer MTBF (or fewer GPUs)")
        walls[i], failures[i] = wall, n_fail
    useful = job_steps * c.base_step_seconds
    mean_wall = float(walls.mean())
    return {
        "mean_wall_seconds": mean_wall,
        "stderr_wall_seconds": float(walls.std(ddof=1) / math.sqrt(trials)) if trials > 1 else 0.0,
        "mean_failures": float(failures.mean()),
        "effective_ratio": useful / mean_wall,
        "wasted_fraction": (mean_wall - useful) / mean_wall,
    }


def exact_expected_seconds(c: StrategyCosts, *, mtbf_seconds: float, job_steps: int) -> float:
    """Exact expectation when ``lag`` is 0 and ``interval`` divides ``job_steps``.

    Each segment of a = interval·step seconds, with restart cost R and failure rate p, takes
    e^(pR)·(e^(pa) − 1)/p on average (failures during recovery included).
    """
    if c.lag or job_steps % c.interval:
        raise ValueError("the exact form needs lag 0 and an interval that divides the job")
    p, a = 1 / mtbf_seconds, c.interval * c.step_seconds
    return job_steps / c.interval * math.exp(p * c.recovery_seconds) * math.expm1(p * a) / p


def analytic_ratio(c: StrategyCosts, *, mtbf_seconds: float) -> float:
    """First-order model (Young/Daly style): effective ratio = 1 / ((1 + o)·(1 + p·(R + (N/2 + lag)·τ))).

    o is the steady overhead, τ the step time with checkpointing, N the interval.
    """
    p = 1 / mtbf_seconds
    o = c.step_seconds / c.base_step_seconds - 1
    per_failure = c.recovery_seconds + (c.interval / 2 + c.lag) * c.step_seconds
    return 1 / ((1 + o) * (1 + p * per_failure))
