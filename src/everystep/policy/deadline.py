"""PyRecover's time-aware exit: stop while there is still time for a final checkpoint."""

from __future__ import annotations

__all__ = ["deadline_margin", "deadline_reached"]


def deadline_margin(max_step: float, max_checkpoint: float, *, k1: float = 10.0, k2: float = 2.0) -> float:
    """Seconds that must remain when a step ends: one more step, one final checkpoint and a buffer
    of ``k1`` longest steps plus ``k2`` longest checkpoints (against a slower step or write)."""
    if min(max_step, max_checkpoint, k1, k2) < 0:
        raise ValueError("step and checkpoint times and the factors k1, k2 must be non-negative")
    return max_step + max_checkpoint + k1 * max_step + k2 * max_checkpoint


def deadline_reached(time_left: float, max_step: float, max_checkpoint: float, *, k1: float = 10.0,
                     k2: float = 2.0) -> bool:
    """True when the time left no longer covers :func:`deadline_margin`."""
    return time_left < deadline_margin(max_step, max_checkpoint, k1=k1, k2=k2)
