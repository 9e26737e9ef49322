"""Deciding, on every rank alike, to stop training early: a job deadline or a preemption signal.

A :class:`StopWatch` tracks the longest step and the longest full-checkpoint write. Once per
step, :meth:`~everystep.Checkpointer.should_stop` asks it whether this rank wants to stop — the
deadline is too close (see :func:`~everystep.policy.deadline_reached`) or a stop signal arrived —
and all ranks agree in one all-reduce on the ``control`` group, so every rank stops after the same
step and the final checkpoint is whole.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from .errors import ConfigError
from .policy import deadline_margin, deadline_reached

__all__ = ["StopWatch", "deadline_from_environment"]


def deadline_from_environment() -> float | None:
    """The job's end as a Unix time, from ``SLURM_JOB_END_TIME`` when the scheduler sets it."""
    value = os.environ.get("SLURM_JOB_END_TIME")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"SLURM_JOB_END_TIME must be a Unix time in seconds, got {value!r}") from None


class StopWatch:
    """Step and checkpoint times, the deadline, and the stop signals received.

    Args:
        deadline: Unix time by which the job must have ended; ``None``: no deadline.
        k1, k2: the buffer kept before the deadline, in longest steps and longest checkpoints.
        signals: signals that ask for a stop (a preemption notice). The first one sets a flag;
            a second one of the same kind gets the handler that was there before.
    """

    def __init__(self, deadline: float | None = None, *, k1: float = 10.0, k2: float = 2.0,
                 signals: Sequence[int] = ()) -> None:
        if k1 < 0 or k2 < 0:
            raise ConfigError(f"k1 and k2 must be non-negative, got {k1} and {k2}")
        self.deadline = deadline
        self.k1, self.k2 = k1, k2
        self.max_step = 0.0
        self.max_checkpoint = 0.0
        self.signalled: str | None = None
        self._last_step_end: float | None = None
        self._previous: dict[int, Any] = {}
        if signals and threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled is not None:  # asked twice: fall back to what was there before
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signalled = signal.Signals(signum).name

    def restore_signals(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def step_ended(self) -> None:
        now = time.monotonic()
        if self._last_step_end is not None:
            self.max_step = max(self.max_step, now - self._last_step_end)
        self._last_step_end = now

    def checkpoint_took(self, seconds: float) -> None:
        self.max_checkpoint = max(self.max_checkpoint, seconds)

    def reason(self) -> str | None:
        """Why this rank wants to stop now, or ``None``."""
        if self.signalled is not None:
            return f"received {self.signalled}"
        if self.deadline is None:
            return None
        left = self.deadline - time.time()
        if deadline_reached(left, self.max_step, self.max_checkpoint, k1=self.k1, k2=self.k2):
            needed = deadline_margin(self.max_step, self.max_checkpoint, k1=self.k1, k2=self.k2)
            return (f"{left:.1f} s left before the deadline, less than the {needed:.1f} s needed for a step, the final "
                    f"checkpoint and the buffer (longest step {self.max_step:.2f} s, longest checkpoint "
                    f"{self.max_checkpoint:.2f} s, k1={self.k1:g}, k2={self.k2:g})")
        return None
