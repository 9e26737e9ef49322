"""``none``: no checkpointing at all; the reference every overhead is measured against."""

from __future__ import annotations

from typing import Any, ClassVar

from .base import StrategyConfig, StrategyContext

__all__ = ["NoCheckpoint"]


class NoCheckpoint:
    name: ClassVar[str] = "none"
    needs_store: ClassVar[bool] = False
    Config = StrategyConfig

    def __init__(self, config: StrategyConfig | None = None) -> None:
        self.config = config or StrategyConfig()

    def attach(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        pass

    def on_state_ready(self, step: int, *, final: bool = False) -> None:
        pass

    def before_update(self, step: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass
