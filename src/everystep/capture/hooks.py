"""Hooks PyTorch already offers, so that the training loop stays unchanged.

Step boundaries (:class:`StepHooks`). Three events, in this order for each step t:

- ``step_end``: the update of step t is done — after ``optimizer.step()``, or, when a GradScaler is
  attached, after ``scaler.update()`` (which also runs when the scaler skipped the update).
- ``activity``: something of step t+1 is about to change the state — the model's next forward, the
  first gradient of the next backward, or the optimizer's next step, whichever comes first. Until
  then the user's ``scheduler.step()`` and the like complete S_t.
- ``before_update``: ``optimizer.step()`` of step t+1 is about to modify parameters. When the step
  is given a closure (``optimizer.step(closure)``, as PyTorch Lightning calls it: forward, backward
  and gradient clipping run inside the step), this comes after the closure's first call returns,
  when the gradients the update consumes exist.

Reduced gradients under DistributedDataParallel (:func:`reduction_tap`). DDP takes one
communication hook per model. everystep's own hooks (the compressions of
:mod:`everystep.compress.ddp`, and :class:`AllReduceHook`, DDP's built-in reduction as a hook) are
:class:`ReductionTap` s: an observer sees each bucket when its reduction starts and may ask to see
the reduced bucket the moment its future completes, before DDP copies it into the gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StepHooks", "ReductionTap", "AllReduceHook", "reduction_tap", "after_backward",
           "register_before_update"]

Observer = Callable[[Any], Callable[[torch.Tensor], None] | None]
"""Called with a ``GradBucket`` as its reduction starts (on the thread running backward); returns
what to call with the reduced bucket (on the thread that completes the reduction), or None."""


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
        # First among the forward's pre-hooks: FSDP2's gathers the full parameters into the module, and a
        # checkpoint taken after it (the state's shards, read through state_dict) would swap them out.
        self._handles.append(model.register_forward_pre_hook(lambda module, args: activity(), prepend=True))
        # A forward may bypass the model (through a submodule), and gradients may accumulate over
        # micro-batches before optimizer.step(): the first gradient of a backward is activity too,
        # and it comes before any gradient hook of the parameters (a strategy's copies) runs.
        params = [p for p in model.parameters() if p.requires_grad]
        if params:
            self._handles.append(torch.autograd.graph.register_multi_grad_hook(
                params, lambda grad: activity(), mode="any"))

        self._handles.append(register_before_update(optimizer, before_update, first=activity))
        if scaler is None:
            self._handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: step_end()))
        else:
            original = scaler.update

            def update(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                step_end()
                return result

            scaler.update = update  # instance attribute shadows the method; removed in remove()

    def add(self, handle: Any) -> None:
        """Remove ``handle`` (a hook registered elsewhere) with the others."""
        self._handles.append(handle)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._scaler is not None and "update" in vars(self._scaler):
            del self._scaler.update
        self._scaler = None


def register_before_update(optimizer: torch.optim.Optimizer, before_update: Callable[[], None], *,
                           first: Callable[[], None] | None = None) -> Any:
    """Run ``before_update`` each time ``optimizer.step()`` is about to change the parameters: at the
    step's start, or, when the step is given a closure, right after the closure's first call (forward,
    backward and clipping run inside it). ``first`` runs at the step's start in either case. Hooks
    registered earlier run earlier, with or without a closure. Returns the hook's handle."""

    def pre(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if first is not None:
            first()
        # ``args`` holds the optimizer itself, then step()'s positional arguments
        closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            before_update()
            return None
        return _after_closure(closure, before_update, args, kwargs)

    return optimizer.register_step_pre_hook(pre)


def _after_closure(closure: Callable[[], Any], then: Callable[[], None], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The step's arguments with ``closure`` replaced by one that calls ``then`` after its first call
    (an optimizer such as LBFGS calls its closure several times; the update starts after the first)."""
    first = True

    def wrapped() -> Any:
        nonlocal first
        result = closure()
        if first:
            first = False
            then()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": wrapped}
    return (args[0], wrapped, *args[2:]), kwargs


class ReductionTap:
    """A communication hook whose reductions :attr:`observers` can watch."""

    def __init__(self) -> None:
        self.observers: list[Observer] = []

    def _observed(self, bucket: Any, fut: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """``fut`` (the bucket's reduction), passing its result to every observer that asked."""
        calls = [c for observe in list(self.observers) if (c := observe(bucket)) is not None]
        if not calls:
            return fut

        def notify(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            result = f.value()
            for call in calls:
                call(result)
            return result

        return fut.then(notify)


class AllReduceHook(ReductionTap):
    """DDP's built-in reduction as a hook: every gradient times 1/world, then summed across ranks —
    the same arithmetic, so the same bits, as DDP without a hook."""

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        super().__init__()
        self.group = model.process_group
        self.scale = 1.0 / dist.get_world_size(self.group)
        model.register_comm_hook(None, self._hook)

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        # (DDP checks a hook's annotations against the real types; string annotations fail it)
        buffer = bucket.buffer()
        buffer.mul_(self.scale)
        fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        return self._observed(bucket, fut.then(lambda f: f.value()[0]))


_TAPS: "weakref.WeakKeyDictionary[torch.nn.Module, ReductionTap]" = weakref.WeakKeyDictionary()


def reduction_tap(model: torch.nn.parallel.DistributedDataParallel, compression: Any) -> ReductionTap | None:
    """The tap on ``model``'s reductions: its everystep compression hook, or an :class:`AllReduceHook`
    registered now (once per model); None when a hook of another kind is registered."""
    if isinstance(compression, ReductionTap):
        return compression
    tap = _TAPS.get(model)
    if tap is None:
        try:
            tap = AllReduceHook(model)
        except RuntimeError:  # DDP takes one hook, and the model has one of its own
            return None
        _TAPS[model] = tap
    return tap


def after_backward(callback: Callable[[], None]) -> bool:
    """Run ``callback`` once the current backward pass is complete, after DDP's own end of backward
    (which copies the reduced buckets into the gradients). Call from inside the backward pass (a
    hook); False when there is none to wait for.

    The engine runs end-of-backward callbacks in the order they were queued, those queued by a
    callback after all others: DDP queues its own once every bucket is launched, so a callback
    queued from the first bucket's hook queues ``callback`` again and lands behind it."""
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    try:
        engine.queue_callback(lambda: engine.queue_callback(callback))
    except RuntimeError:
        return False
    return True
