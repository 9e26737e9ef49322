"""A real training step as Checkflow's operator sequence (:class:`~everystep.policy.checkflow.StepProfile`).

One step of the user's model, optimizer and batch is run with hooks on every leaf module: each
module's forward and each module's backward is an operator (PyTorch's forward hooks and full
backward hooks), and the optimizer's step, when it updates everything at once, is the last one.
For each operator: its time (on CUDA from events on the current stream, on the CPU from the clock),
and the bytes alive on the device while it runs — parameters, optimizer state and gradients, plus
the activations autograd has saved for backward and not yet freed (counted through
``torch.autograd.graph.saved_tensors_hooks``, each storage once). For each parameter and optimizer
state tensor: the operator that updates it — the optimizer's step, or, with an
:class:`~everystep.OptimizerInBackward`, the backward of the module that owns the parameter.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..optim import OptimizerInBackward
from ..policy.checkflow import StepProfile, Tensor

__all__ = ["profile_step"]


def profile_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> StepProfile:
    """Run ``step()`` (one whole training step: forward, backward, the update) once, profiled. The
    optimizer must hold its state already (run a step before) for the state's bytes to count."""
    recorder = _Recorder(model, optimizer)
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), warnings.catch_warnings():
            # the first module's backward hook has no input gradient to wait for: expected here
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            step()
        recorder.close_step()
    finally:
        recorder.remove()
    return recorder.profile()


class _Recorder:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.cuda = any(p.is_cuda for p in model.parameters())
        self.marks: list[tuple[str, Any, int]] = []
        """(operator that starts here, a clock mark, bytes alive when it starts)."""
        self.saved: dict[int, int] = {}
        self.owner: dict[torch.Tensor, str] = {}
        self.updated: dict[torch.Tensor, int] = {}
        self.handles: list[Any] = []
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        leaves = [(name, m) for name, m in model.named_modules() if not list(m.children())]
        for name, module in leaves:
            for p in module.parameters(recurse=False):
                self.owner[p] = name
            self.handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.mark(f"forward {n}")))
            self.handles.append(module.register_full_backward_pre_hook(lambda m, g, n=name: self.mark(f"backward {n}")))
        if isinstance(optimizer, OptimizerInBackward):
            self.handles.append(optimizer.register_layer_pre_hook(self._on_layer_update))
        else:
            self.handles.append(optimizer.register_step_pre_hook(lambda *a: self.mark("optimizer step")))
            self.handles.append(optimizer.register_step_post_hook(lambda *a: self._on_update_all()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.saved and key not in self.weights:  # weights count as parameters
            self.saved[key] = storage.nbytes()
            weakref.finalize(t, self.saved.pop, key, None)
        return t

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            clock: Any = event
        else:
            clock = time.perf_counter()
        self.marks.append((name, clock, self.alive()))

    def alive(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        state = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return sum(t.numel() * t.element_size() for t in (*params, *grads, *state)) + sum(self.saved.values())

    def _on_layer_update(self, optimizer: Any, params: list[torch.Tensor]) -> None:
        for p in params:
            self.updated[p] = len(self.marks) - 1  # inside the operator running now

    def _on_update_all(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.updated[p] = len(self.marks) - 1

    def close_step(self) -> None:
        self.mark("(end)")

    def profile(self) -> StepProfile:
        if self.cuda:
            torch.cuda.synchronize()
            times = [a[1].elapsed_time(b[1]) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            times = [b[1] - a[1] for a, b in zip(self.marks, self.marks[1:])]
        resident = [m[2] for m in self.marks[:-1]]
        tensors = []
        index = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                at = self.updated.get(p)
                if at is None:  # no gradient this step: nothing updates it
                    index += 1
                    continue
                owner = self.owner.get(p, f"param{index}")
                tensors.append(Tensor(f"{owner}#{index}", p.numel() * p.element_size(), at))
                for name, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        tensors.append(Tensor(f"{owner}#{index}.{name}", value.numel() * value.element_size(), at))
                index += 1
        return StepProfile(tuple(max(t, 1e-7) for t in times), tuple(resident), tuple(tensors))
