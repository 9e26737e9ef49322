"""Failure injection for training runs: SIGKILL during a chosen step, at a point drawn from the seed.

A planned kill is armed after a commit: at the start of the step it is planned for, every rank first
waits for the checkpoints already started and records what is recoverable, then for every other
rank to have done so (``settle``), so that what a restart must recover is known before the kill
(the checkpoint of the step before is still to be written, and is in flight when the kill lands
later in the step).
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass

from ... import _faults

__all__ = ["FailurePlan", "Injector", "POINTS"]

POINTS = ("start", "forward", "backward", "update", "write")
"""Where in a step the kill lands; ``write`` is the middle of the next checkpoint write."""


@dataclass(frozen=True, kw_only=True)
class FailurePlan:
    steps: tuple[int, ...]
    mode: str = "software"
    seed: int = 0
    world: int = 1
    """Ranks in the job; one of them, drawn from the seed, is killed at each planned step."""

    def __post_init__(self) -> None:
        if self.mode not in ("software", "hardware"):
            raise ValueError(f"failure mode must be 'software' or 'hardware', got {self.mode!r}")

    def point(self, step: int) -> str:
        return random.Random(f"{self.seed}/{step}").choice(POINTS)

    def victim(self, step: int) -> int:
        return random.Random(f"{self.seed}/{step}/rank").randrange(self.world)


def kill(mode: str) -> None:
    """Software: only this process dies. Hardware: every process of the job (agents included)."""
    if mode == "hardware":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    _faults.kill_self()


class Injector:
    """Called by the training loop at named points; kills at the planned one. ``settle(step)``, where
    given, is called on every rank as the planned step starts, before anything is armed."""

    def __init__(self, plan: FailurePlan | None, rank: int = 0, *, settle: Callable[[int], None] | None = None) -> None:
        self.plan = plan
        self.target: int | None = min(plan.steps) if plan and plan.steps else None
        self._settle_at = self.target if settle is not None else None  # on every rank, the victim's or not
        self._settle = settle
        if plan is not None and self.target is not None and plan.victim(self.target) != rank:
            self.target = None  # another rank dies; the supervisor ends this one
        self._fallback_at: int | None = None

    def point(self, step: int, where: str) -> None:
        if step == self._settle_at and where == "start":
            self._settle_at = None
            self._settle(step)  # type: ignore[misc]
        if self.target is None or self.plan is None:
            return
        if self._fallback_at is not None and step >= self._fallback_at and where == "forward":
            kill(self.plan.mode)  # no write came along during the failure step: die now
        if step != self.target:
            return
        chosen = self.plan.point(step)
        if chosen == "write" and where == "start":
            _faults.arm("store.object.mid_write", action=lambda: kill(self.plan.mode))  # type: ignore[union-attr]
            self._fallback_at = step + 1
        elif chosen == where:
            kill(self.plan.mode)

    def finish(self) -> None:
        """At the end of training: a planned kill that found no later point to land on lands here."""
        if self._fallback_at is not None and self.plan is not None:
            kill(self.plan.mode)
