"""The checks of the Checkpointer's arguments' types, each error naming the argument."""

from __future__ import annotations

import math
from typing import Any

import torch

from .state import Stateful

__all__ = ["check_arguments"]


def check_arguments(*, model: Any, optimizer: Any, final: Any, deadline: Any, k1: Any, k2: Any, stop_signals: Any,
                     stagger: Any, full_format: Any, close_timeout: Any = None, **stateful: Any) -> None:
    """Raise TypeError naming the first argument of the Checkpointer that has a wrong type."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for name, value in stateful.items():
        if value is not None and not isinstance(value, Stateful):
            raise TypeError(f"{name} must have state_dict() and load_state_dict(); got {type(value).__name__}")
    if not isinstance(final, bool):
        raise TypeError(f"final must be True or False, got {final!r}")
    for name, value in (("deadline", deadline), ("k1", k1), ("k2", k2), ("close_timeout", close_timeout)):
        if (value is not None or name not in ("deadline", "close_timeout")) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                            or not math.isfinite(value)):
            raise TypeError(f"{name} must be a finite number{' or None' if name in ('deadline', 'close_timeout') else ''}, "
                            f"got {value!r}")
    if isinstance(stop_signals, (str, bytes)) or not all(isinstance(s, int) for s in stop_signals):
        raise TypeError(f"stop_signals must be a sequence of signal numbers (signal.SIGTERM, …), got {stop_signals!r}")
    if stagger is not None and (isinstance(stagger, bool) or not isinstance(stagger, int)):
        raise TypeError(f"stagger must be a whole number of ranks or None, got {stagger!r}")
    if full_format is not None and not isinstance(full_format, str):
        raise TypeError(f"full_format must be 'safetensors', 'dcp' or None, got {full_format!r}")
