"""``everystep plan``: the optimal interval and expected overhead from a handful of costs."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError
from .policy import (
    LowDiffCosts,
    lowdiff_integer_optimum,
    lowdiff_optimum,
    lowdiff_wasted_time,
    young_daly_interval,
    young_daly_overhead,
)

__all__ = ["plan"]


def plan(
    *,
    step_seconds: float,
    mtbf_seconds: float,
    ckpt_seconds: float | None = None,
    size_bytes: float | None = None,
    bandwidth: float | None = None,
    load_seconds: float = 0.0,
    merge_seconds: float | None = None,
) -> dict[str, Any]:
    if ckpt_seconds is None:
        if size_bytes is None or bandwidth is None:
            raise ConfigError("give --ckpt-seconds, or both --size-bytes and --bandwidth")
        ckpt_seconds = size_bytes / bandwidth
    if step_seconds <= 0 or mtbf_seconds <= 0 or ckpt_seconds < 0 or load_seconds < 0:
        raise ConfigError("step time and MTBF must be positive; checkpoint and load times not negative")
    n = young_daly_interval(step_seconds=step_seconds, ckpt_seconds=ckpt_seconds, mtbf_seconds=mtbf_seconds)
    p_star = young_daly_overhead(ckpt_seconds=ckpt_seconds, mtbf_seconds=mtbf_seconds, load_seconds=load_seconds)
    out: dict[str, Any] = {
        "inputs": {"step_seconds": step_seconds, "ckpt_seconds": ckpt_seconds, "mtbf_seconds": mtbf_seconds,
                   "load_seconds": load_seconds, "size_bytes": size_bytes, "bandwidth": bandwidth,
                   "merge_seconds": merge_seconds},
        "young_daly": {"interval_steps": n, "interval_steps_rounded": max(1, round(n)), "overhead": p_star,
                       "utilisation_loss": p_star / (1 + p_star)},
        "lines": [
            f"Young/Daly: checkpoint every N* = {n:.1f} steps ({n * step_seconds:.1f} s); "
            f"expected overhead P* = {p_star:.2%} (utilisation loss {p_star / (1 + p_star):.2%})",
        ],
    }
    if merge_seconds is not None:
        if size_bytes is None or bandwidth is None:
            raise ConfigError("LowDiff's optimum needs --size-bytes and --bandwidth as well as --merge-seconds")
        costs = LowDiffCosts(iteration_seconds=step_seconds, mtbf_seconds=mtbf_seconds, write_bandwidth=bandwidth,
                             full_bytes=size_bytes, load_seconds=load_seconds, merge_seconds=merge_seconds)
        f, b = lowdiff_optimum(costs)
        F, B = lowdiff_integer_optimum(costs)
        out["lowdiff"] = {"f": f, "b": b, "full_interval": 1 / f, "F": F, "batch": B,
                          "wasted_fraction": lowdiff_wasted_time(costs, 1 / F, B)}
        out["lines"].append(
            f"LowDiff: full checkpoint every F* = {1 / f:.1f} steps, batch b* = {b:.2f} differentials "
            f"(integers: F = {F}, b = {B}; wasted {out['lowdiff']['wasted_fraction']:.2%} of GPU time)"
        )
    return out
