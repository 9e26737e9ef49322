"""Interval rules: which steps a strategy or an agent checkpoints. Pure functions, no I/O."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["due", "next_multiple", "busy_interval", "median_gap", "persist_due"]


def due(step: int, every: int, *, final: bool = False) -> bool:
    """Whether ``step`` is checkpointed under a fixed interval: each multiple of ``every``, and
    the last step of a run (``final``)."""
    return final or step % every == 0


def next_multiple(step: int, every: int) -> int:
    """The first multiple of ``every`` after ``step``."""
    return (step // every + 1) * every


def median_gap(marks: Sequence[float]) -> float | None:
    """The median time between consecutive marks, or ``None`` with fewer than three marks."""
    if len(marks) < 3:
        return None
    return statistics.median(b - a for a, b in zip(marks, marks[1:]))


def busy_interval(write_seconds: float, step_seconds: float, busy: float) -> int:
    """The persist interval P, in steps, that keeps a writer busy ``busy`` of the time: one write
    of ``write_seconds`` every P steps of ``step_seconds``."""
    return max(1, math.ceil(write_seconds / (busy * max(step_seconds, 1e-9))))


def persist_due(step: int, last: int, interval: int, *, fixed: bool, writing: bool) -> bool:
    """Whether the replica's ``step`` is persisted, the newest one persisted being ``last``
    (-1: none). ``fixed``: the first step at or after each multiple of ``interval``, whatever the
    writer is doing (the write waits for the one before it). Measured: ``interval`` steps after
    the newest write, once no write runs (``writing``: one does), so a write that falls due
    while the writer is busy happens at the first step after it is free."""
    if fixed:
        return step // interval > max(last, 0) // interval
    return not writing and step - last >= interval
