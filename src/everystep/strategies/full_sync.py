"""``full_sync``: a blocking full save every ``every`` steps — the ``torch.save`` baseline.

Training waits while the whole state is serialised straight from the live tensors and made durable.
"""

from __future__ import annotations

import time
from typing import ClassVar

from ..layout import TensorLayout
from ..storage.full import write_full
from ..storage.tensorfile import tensor_chunks
from .base import Strategy

__all__ = ["FullSync"]


class FullSync(Strategy):
    name: ClassVar[str] = "full_sync"
    other_world_size: ClassVar[bool] = True
    layer_updates: ClassVar[bool] = True

    def _on_state_ready(self, step: int, final: bool) -> None:
        if not self._due(step, final):
            return
        assert self.ctx.store is not None
        t0 = time.perf_counter()
        plan, skeleton = self.ctx.full_plan(step)
        layout = TensorLayout.of(plan.local)
        write_full(self.ctx.store, step, tensor_chunks(layout, plan.local), skeleton, plan=plan, tensors=plan.local,
                   format=self.ctx.full_format)
        self._taken = step
        self.ctx.committed(step, seconds=time.perf_counter() - t0)
        self.ctx.directory.retain(self.config.keep)
