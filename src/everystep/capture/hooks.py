"""Step-boundary detection from the hooks PyTorch already offers, so the training loop is unchanged.

Three events, in this order for each step t:

- ``step_end``: the update of step t is done — after ``optimizer.step()``, or, when a GradScaler is
  attached, after ``scaler.update()`` (which also runs when the scaler skipped the update).
- ``activity``: something of step t+1 is about to change the state — the model's next forward or
  the optimizer's next step, whichever comes first. Until then the user's ``scheduler.step()`` and
  the like complete S_t.
- ``before_update``: ``optimizer.step()`` of step t+1 is about to modify parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepHooks"]


class StepHooks:
    """Registers the hooks on construction; :meth:`remove` restores everything."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any | None,
        step_end: Callable[[], None],
        activity: Callable[[], None],
        before_update: Callable[[], None],
    ) -> None:
        self._handles: list[Any] = []
        self._scaler = scaler
        self._handles.append(model.register_forward_pre_hook(lambda module, args: activity()))

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            activity()
            before_update()

        self._handles.append(optimizer.register_step_pre_hook(pre))
        if scaler is None:
            self._handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: step_end()))
        else:
            original = scaler.update

            def update(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                step_end()
                return result

            scaler.update = update  # instance attribute shadows the method; removed in remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._scaler is not None and "update" in vars(self._scaler):
            del self._scaler.update
        self._scaler = None
