"""``none``: no checkpointing at all; the reference every overhead is measured against."""

from __future__ import annotations

from typing import ClassVar

from ..parallelism import LAYOUTS
from .base import Strategy

__all__ = ["NoCheckpoint"]


class NoCheckpoint(Strategy):
    name: ClassVar[str] = "none"
    needs_store: ClassVar[bool] = False
    layer_updates: ClassVar[bool] = True
    sharded_layouts: ClassVar[frozenset[str]] = frozenset(LAYOUTS)  # it captures nothing
