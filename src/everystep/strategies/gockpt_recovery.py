"""Recovering GoCkpt's checkpoints: full ones, and spread ones (the parts as copied, with the
gradients that bring each to the step), whose parts are brought forward on the training device —
from the directory, or from the memory tier (``memory=True``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..recovery import Candidate
from ..spread import bring_forward, recover_spread
from ..storage import malformed
from .full_state import FullState

__all__ = ["SpreadRecovery"]


class SpreadRecovery(FullState):
    """GoCkpt's recovery (:class:`~everystep.strategies.gockpt.GoCkpt` subclasses it)."""

    def _recover(self) -> Candidate | None:
        """The newest checkpoint in the directory that verifies, full or spread; a spread one's parts
        are brought forward here, on the training device."""
        assert self.ctx.directory is not None
        return recover_spread(self.ctx.directory, self.ctx.components.optimizer, self._trained, self.ctx.live_shards(),
                              self.ctx.pulled)

    def _trained(self) -> dict[str, tuple[int, torch.Tensor]]:
        """The live parameters the optimizer trains, by key, with each one's index in its state."""
        live, _ = self.ctx.flatten_state(0)
        return {p.key: (p.index, p.param) for p in self.ctx.optimizer_keys(live) if p.key is not None}

    def _from_memory(self, candidate: Candidate, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Candidate:
        """A spread checkpoint in the memory tier: its parts brought forward on the training device."""
        if meta.get("spread") is None:
            return candidate
        with malformed(f"the spread checkpoint at step {candidate.step}"):
            device = bring_forward(self.ctx.components.optimizer, self._trained(), candidate.step, candidate.tree,
                                   tensors, meta["spread"])
        return dataclasses.replace(candidate, source=f"memory (parts brought forward on {device})")
