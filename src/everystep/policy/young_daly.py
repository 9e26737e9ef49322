"""The Young/Daly optimum as GoCkpt §3.1 states it.

With step time T_step, a checkpoint that stalls training T_ckpt, a load time T_load and a
failure rate p = 1/MTBF, the fraction of time wasted at interval N steps is

    P(N) = T_ckpt / (N·T_step) + p·N·T_step / 2 + p·T_load

minimised at N* = sqrt(2·T_ckpt / (p·T_step²)), where P* = sqrt(2·p·T_ckpt) + p·T_load.
"""

from __future__ import annotations

import math

__all__ = ["overhead_at", "young_daly_interval", "young_daly_overhead"]


def _check(step_seconds: float, ckpt_seconds: float, mtbf_seconds: float) -> None:
    if step_seconds <= 0 or mtbf_seconds <= 0 or ckpt_seconds < 0:
        raise ValueError(
            f"need step time > 0, MTBF > 0 and checkpoint time >= 0; got {step_seconds}, {mtbf_seconds}, {ckpt_seconds}"
        )


def overhead_at(interval: float, *, step_seconds: float, ckpt_seconds: float, mtbf_seconds: float, load_seconds: float = 0.0) -> float:
    """P(N): wasted time per unit of training time at a checkpoint every ``interval`` steps."""
    _check(step_seconds, ckpt_seconds, mtbf_seconds)
    p = 1.0 / mtbf_seconds
    return ckpt_seconds / (interval * step_seconds) + p * interval * step_seconds / 2 + p * load_seconds


def young_daly_interval(*, step_seconds: float, ckpt_seconds: float, mtbf_seconds: float) -> float:
    """N*, in steps (real-valued; round to a neighbouring integer to use it)."""
    _check(step_seconds, ckpt_seconds, mtbf_seconds)
    return math.sqrt(2 * ckpt_seconds * mtbf_seconds) / step_seconds


def young_daly_overhead(*, ckpt_seconds: float, mtbf_seconds: float, load_seconds: float = 0.0) -> float:
    """P* = sqrt(2·p·T_ckpt) + p·T_load, the least achievable wasted fraction."""
    _check(1.0, ckpt_seconds, mtbf_seconds)
    p = 1.0 / mtbf_seconds
    return math.sqrt(2 * p * ckpt_seconds) + p * load_seconds
