"""``full_sync``: a blocking full save every ``every`` steps — the ``torch.save`` baseline.

Training waits while the whole state is serialised straight from the live tensors and made durable.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..storage.tensorfile import tensor_chunks
from ..transport.host import TensorLayout
from ._full import write_full
from .base import StrategyConfig, StrategyContext

__all__ = ["FullSync"]


class FullSync:
    name: ClassVar[str] = "full_sync"
    needs_store: ClassVar[bool] = True
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
        tensors, skeleton = self.ctx.flatten_state(step)
        layout = TensorLayout.of(tensors)
        write_full(self.ctx.store, step, layout, tensor_chunks(layout, tensors), skeleton)
        self._last = step
        self.ctx.committed(step)
        self.ctx.store.retain(self.config.keep)

    def before_update(self, step: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass
