"""Where everystep learns that a step happened, and where gradients become final: optimizer, model,
GradScaler and DDP communication hooks."""

from .hooks import AllReduceHook, ReductionTap, StepHooks, after_backward, reduction_tap

__all__ = ["StepHooks", "ReductionTap", "AllReduceHook", "reduction_tap", "after_backward"]
