"""``full_sync``: a blocking full save every ``every`` steps — the ``torch.save`` baseline.

Training waits while the whole state is serialised straight from the live tensors and made durable.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from ..storage.tensorfile import tensor_chunks
from ..transport.host import TensorLayout
from ..storage.full import write_full
from .base import StrategyConfig, StrategyContext

__all__ = ["FullSync"]


class FullSync:
    name: ClassVar[str] = "full_sync"
    needs_store: ClassVar[bool] = True
    other_world_size: ClassVar[bool] = True
    """Only the full state is stored: a job of another size can resume from it."""
    Config = StrategyConfig

    def __init__(self, config: StrategyConfig | None = None) -> None:
        self.config = config or StrategyConfig()
        self._last = -1

    def attach(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        pass

    def on_state_ready(self, step: int, *, final: bool = False) -> None:
        if step == self._last or (step % self.config.every and not final):
            return
        assert self.ctx.store is not None
        t0 = time.perf_counter()
        plan, skeleton = self.ctx.full_plan(step)
        layout = TensorLayout.of(plan.local)
        write_full(self.ctx.store, step, tensor_chunks(layout, plan.local), skeleton, plan=plan, tensors=plan.local,
                   format=self.ctx.full_format)
        self._last = step
        self.ctx.committed(step, seconds=time.perf_counter() - t0)
        self.ctx.store.retain(self.config.keep)

    def before_update(self, step: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass
