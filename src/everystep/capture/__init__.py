"""Where everystep learns that a step happened: optimizer, model and GradScaler hooks."""

from .hooks import StepHooks

__all__ = ["StepHooks"]
