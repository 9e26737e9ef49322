"""What the differential strategies (``lowdiff``, ``naive_diff``) share: full checkpoints through
CheckFreq's asynchronous path every ``every`` steps (S_0 first, so that a chain can start at 0), a
writer thread for the differentials, and recovery as the newest verified full checkpoint plus the
verified chain of differentials after it (:func:`~everystep.recovery.recover_chain`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar

from ..background import Worker
from ..policy.interval import due
from ..recovery import Candidate, Link, recover_chain
from .base import Strategy
from .checkfreq import CheckFreq, CheckFreqConfig

__all__ = ["Differential"]


class Differential(Strategy):
    """A strategy whose checkpoints are full ones and the differentials after each (of manifest kind
    ``kind``), written by ``self._writer``; ``self._base`` is the step of the full checkpoint the
    differentials written now start from."""

    needs_restore: ClassVar[bool] = True
    kind: ClassVar[str]

    def _attach_full(self, every: int, writer: Worker) -> None:
        self._base = 0
        self.full = CheckFreq(CheckFreqConfig(every=every, keep=self.config.keep))
        self.full.attach(self.ctx)
        self._writer = writer

    def _on_start(self, step: int) -> None:
        """A fresh run writes S_0 as the first full checkpoint, so that a chain can start at 0."""
        self.full.on_start(step)
        if step == 0:
            self.full.on_state_ready(0, final=True)
            self.full.wait()
            self._base = 0

    def _full_if_due(self, step: int, every: int, final: bool) -> bool:
        """Start the full checkpoint of ``step`` when one is due (the final one is the differentials'),
        and start the next chain from it."""
        if not due(step, every) or final:
            return False
        self.full.on_state_ready(step)
        self._base = step
        return True

    def _before_update(self, step: int) -> None:
        self.full.before_update(step)

    def _wait(self) -> None:
        self._writer.drain()
        self.full.wait()

    def _close(self) -> None:
        try:
            self._writer.close()
        finally:
            self.full.close()

    def _recover_chain(self, apply: Callable[[Iterator[Link]], None], source: Callable[[int, int], str]) -> Candidate | None:
        """The newest verified full checkpoint, whose replay applies ``apply`` to the chain of
        differentials after it; ``source(full step, step reached)`` says what was recovered."""
        assert self.ctx.directory is not None
        found = recover_chain(self.ctx.directory, self.ctx.components, self.kind, apply, source, self.ctx.pulled)
        if found is not None:
            self._base = found.step
        return found
