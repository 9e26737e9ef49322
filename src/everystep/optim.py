"""Per-layer updates: the optimizer applied to each parameter during backward.

PyTorch's "optimizer step in backward" pattern gives each parameter an optimizer of its own and
steps it from the parameter's post-accumulate-grad hook, so a layer is updated (and its gradient
freed) as soon as its gradient is ready; under DistributedDataParallel the same update runs as
soon as the all-reduce of the gradient's bucket completes (what PyTorch's optimizer-overlap
communication hook does). :class:`OptimizerInBackward` is that pattern as one
``torch.optim.Optimizer``: its ``param_groups`` and ``state`` are those of the per-parameter
optimizers (one group per parameter, shared, not copied), so ``state_dict()``,
``load_state_dict()``, ``zero_grad()`` and LR schedulers work on it as on any optimizer, and a
:class:`~everystep.Checkpointer` sees its step boundaries:

- the step pre-hooks run right before the first update of a backward pass,
- :meth:`register_layer_pre_hook` hooks run right before each update, with the parameters updated,
- the step post-hooks run once the backward pass is complete (every update done).

Example::

    optimizer = everystep.OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    with everystep.Checkpointer("ckpt", model, optimizer, scheduler=scheduler, strategy="lightcheck") as ckpt:
        for step in range(ckpt.restore() + 1, total + 1):
            model(next(batches)).mean().backward()   # updates every parameter; no optimizer.step()
            scheduler.step()

Gradient clipping and a GradScaler need every gradient before any update, so they do not apply.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .capture.hooks import after_backward, reduction_tap
from .errors import ConfigError, EverystepError

__all__ = ["OptimizerInBackward", "LayerPreHook", "stepping"]

LayerPreHook = Callable[["OptimizerInBackward", list[torch.Tensor]], None]
"""Called with the optimizer and the parameters about to be updated, on the thread that updates them."""


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps ``optimizer_class([p], **kwargs)`` for each parameter ``p`` during backward.

    Args:
        params: the parameters, or parameter groups (dicts whose other keys are the group's options,
            as for any optimizer).
        optimizer_class: a ``torch.optim`` optimizer class, or any callable that makes an optimizer
            from a list of one parameter group.
        ddp: a DistributedDataParallel model: the update of each parameter runs once its bucket is
            all-reduced (in a communication hook; one everystep's compression hook, if ``compression``
            is one, else DDP's own all-reduce as a hook), never on an unreduced gradient.
        compression: the everystep DDP compression hook registered on ``ddp``, if any.
        **kwargs: the optimizer's options (``lr``, ``weight_decay``, …).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: Callable[..., torch.optim.Optimizer], *,
                 ddp: torch.nn.parallel.DistributedDataParallel | None = None, compression: Any = None,
                 **kwargs: Any) -> None:
        groups = _groups(params)
        optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p in optimizers:
                    raise ConfigError("params holds a parameter twice: each parameter gets one optimizer")
                optimizers[p] = optimizer_class([{**options, "params": [p]}], **kwargs)
        if not optimizers:
            raise ConfigError("params is empty: OptimizerInBackward needs at least one parameter")
        first = next(iter(optimizers.values()))
        super().__init__(list(optimizers), dict(first.defaults))
        self.optimizers = optimizers
        """Each parameter's own optimizer (their groups and state are this optimizer's)."""
        self.param_groups = [optimizer.param_groups[0] for optimizer in optimizers.values()]
        self._link()
        self._layer_pre_hooks: OrderedDict[int, LayerPreHook] = OrderedDict()
        self._lock = threading.Lock()
        self._in_step = False
        self._handles: list[Any] = []
        if ddp is None:
            for p in optimizers:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_gradient))
        else:
            tap = reduction_tap(ddp, compression)
            if tap is None:
                raise ConfigError("ddp has a communication hook of its own: OptimizerInBackward updates from DDP's "
                                  "all-reduce or from everystep's compression hook (pass it as compression=)")
            tap.observers.append(self._on_bucket)

    def _link(self) -> None:
        """Point each parameter's optimizer at this one's group and state (after construction and
        after ``load_state_dict``, which replaces both)."""
        for optimizer, group in zip(self.optimizers.values(), self.param_groups):
            optimizer.param_groups = [group]
            optimizer.state = self.state  # type: ignore[assignment]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise EverystepError("OptimizerInBackward updates each parameter during backward: remove the call to "
                             "optimizer.step() from the training loop")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optimizers"):
            raise EverystepError("OptimizerInBackward takes its parameters when it is made; make a new one to add some")
        super().add_param_group(param_group)

    def register_layer_pre_hook(self, hook: LayerPreHook) -> RemovableHandle:
        """Call ``hook(optimizer, params)`` right before ``params`` are updated."""
        handle = RemovableHandle(self._layer_pre_hooks)
        self._layer_pre_hooks[handle.id] = hook
        return handle

    def remove_hooks(self) -> None:
        """Stop updating in backward (the gradient hooks are removed)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- during backward -------------------------------------------------------------------------

    def _on_gradient(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook (the backward thread): update ``p`` now."""
        self._begin()
        self._update([p], [p.grad])
        p.grad = None

    def _on_bucket(self, bucket: Any) -> Callable[[torch.Tensor], None]:
        """DDP: a bucket's reduction starts (the backward thread); its parameters are updated from
        the reduced bucket (the thread completing the reduction)."""
        self._begin()
        params = [p for p in bucket.parameters() if p in self.optimizers]

        def reduced(result: torch.Tensor) -> None:
            grads, offset = [], 0
            for p in bucket.parameters():
                if p in self.optimizers:
                    grads.append(result[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            self._update(params, grads)

        return reduced

    def _begin(self) -> None:
        """The first update of a backward pass: the step pre-hooks, and the post-hooks queued for
        the end of the pass."""
        with self._lock:
            if self._in_step:
                return
            self._in_step = True
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if not after_backward(self._end):
            raise EverystepError("OptimizerInBackward updated a parameter outside a backward pass")

    def _end(self) -> None:
        with self._lock:
            self._in_step = False
        self._opt_called = True  # what LR schedulers look for to tell that the optimizer has stepped
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})

    def _update(self, params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        for hook in list(self._layer_pre_hooks.values()):
            hook(self, params)
        for p, grad in zip(params, grads):
            if grad is None:
                continue
            saved, p.grad = p.grad, grad
            try:
                self.optimizers[p].step()
            finally:
                p.grad = saved


def stepping(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose ``step`` writes ``optimizer``'s state: each parameter's own for an
    :class:`OptimizerInBackward` (its ``step`` is never called), else ``optimizer`` itself."""
    if isinstance(optimizer, OptimizerInBackward):
        return list(optimizer.optimizers.values())
    return [optimizer]


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if isinstance(params, torch.Tensor):
        raise ConfigError("params must be an iterable of tensors or of parameter groups, got a tensor")
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]
