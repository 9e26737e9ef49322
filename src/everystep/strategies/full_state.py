"""What the strategies that write the whole state share (``full_sync``, ``checkfreq``, ``async``,
``checkflow``, ``gockpt``, ``gockpt_o``): their options (:class:`FullStateConfig`, the memory tier's, defined
beside it) and the writing of a full checkpoint, to the memory tier where there is one
(:mod:`everystep.strategies.memory_tier`), else to the directory (:class:`FullState`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..recovery import Candidate
from ..storage.formats import RankShare
from ..transport.host import HostBuffer
from .base import Strategy
from .memory_tier import FullStateConfig, MemoryTier

__all__ = ["FullState", "FullStateConfig"]


class FullState(Strategy):
    """A strategy that writes the whole state: it takes ``memory=True`` (:class:`FullStateConfig`)."""

    Config = FullStateConfig
    config: FullStateConfig
    tier: MemoryTier | None
    takes_memory: ClassVar[bool] = True

    def _make_tier(self) -> MemoryTier | None:
        if not self.config.memory or self.ctx.directory is None:
            return None
        return MemoryTier(self.ctx, self.config, self.errors, finish=self._from_memory)

    def _from_memory(self, candidate: Candidate, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Candidate:
        """The state a slot of the memory tier recovers (:data:`~everystep.strategies.memory_tier.Finish`): its candidate, as it is."""
        return candidate

    def _write_full(self, step: int, source: HostBuffer | dict[str, torch.Tensor], skeleton: Any, *,
                    share: RankShare) -> tuple[int, float]:
        """Write this rank's full checkpoint of ``step`` from ``source`` (a host buffer, or tensors):
        to the memory tier where there is one, else to the directory (keeping the newest ``keep``);
        the bytes written and the seconds it took. The caller releases ``source``."""
        if self.tier is not None:
            return self.tier.write(step, source, skeleton)
        manifest, seconds = self.ctx.persist(step, source, skeleton, share=share, keep=self.config.keep)
        return manifest.nbytes, seconds
