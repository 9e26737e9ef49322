"""``full_sync``: a blocking full save every ``every`` steps — the ``torch.save`` baseline.

Training waits while the whole state is serialised straight from the live tensors and made durable.
"""

from __future__ import annotations

from typing import ClassVar

from ..parallelism import SHARDED_LAYOUTS
from .full_state import FullState, FullStateConfig

__all__ = ["FullSync"]


class FullSync(FullState):
    name: ClassVar[str] = "full_sync"
    other_world_size: ClassVar[bool] = True
    layer_updates: ClassVar[bool] = True
    sharded_layouts: ClassVar[frozenset[str]] = SHARDED_LAYOUTS
    Config = FullStateConfig
    config: FullStateConfig

    def _on_state_ready(self, step: int, final: bool) -> None:
        if not self._due(step, final):
            return
        share, skeleton = self.ctx.full_share(step)
        self._write_full(step, share.local, skeleton, share=share)
