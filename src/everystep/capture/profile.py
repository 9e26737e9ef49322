"""A real training step as Checkflow's operator sequence (:class:`~everystep.policy.schedule.StepProfile`).

One step of the user's model, optimizer and batch is run with hooks on every leaf module: each
module's forward and each module's backward is an operator (a forward pre-hook; a hook on the
module's output tensor, which fires as backward reaches the module), and the optimizer's step,
when it updates everything at once, is the last one.
For each operator: its time (on CUDA from events on the current stream, on the CPU from the clock),
and the bytes alive on the device while it runs — on CUDA the most the caching allocator held from
its start to its end (``torch.cuda.max_memory_allocated``, its peak statistics reset at each
operator, so that what an operator allocates and frees inside counts; after a profile the device's
peak statistics start again from the profiled step's end); on the CPU the parameters, optimizer state
and gradients, plus the activations autograd has saved for backward and not yet freed (counted
through ``torch.autograd.graph.saved_tensors_hooks``, each storage once), as the operator starts. For each parameter and optimizer
state tensor (named ``param/I`` and ``state/I/NAME``, I its index in the optimizer's groups): the
operator that updates it — the optimizer's step, or, with an :class:`~everystep.OptimizerInBackward`,
the backward of the module that owns the parameter. Scalar state (Adam's ``step``) is left out.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..policy.schedule import StepProfile, Tensor
from ..tree import local_shard

__all__ = ["profile_step", "StepRecorder", "OperatorHooks"]


def profile_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> StepProfile:
    """Run ``step()`` (one whole training step: forward, backward, the update) once, profiled. The
    optimizer must hold its state already (run a step before) for the state's bytes to count."""
    recorder = StepRecorder(model, optimizer)
    try:
        step()
    finally:
        profile = recorder.finish()
    return profile


class StepRecorder:
    """Profiles the training step that runs from now until :meth:`finish` (the training loop's own):
    the activations are counted while the model's forward runs."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._recorder = _Recorder(model, optimizer)
        self._saving: Any = torch.autograd.graph.saved_tensors_hooks(self._recorder.pack, lambda t: t)
        self._saving.__enter__()  # until the model's forward ends (made before it, or as it starts)
        self._handles = [model.register_forward_hook(lambda m, a, out: self._exit())]

    def _exit(self) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None

    def finish(self) -> StepProfile:
        """The step's profile; the hooks are removed."""
        self._exit()
        for handle in self._handles:
            handle.remove()
        self._recorder.close_step()
        self._recorder.remove()
        return self._recorder.profile()


class OperatorHooks:
    """Calls ``on_operator(name)`` as each operator of a step starts: each leaf module's forward and
    backward, and (with an optimizer that steps after backward) the optimizer's step. A module's
    backward starts when the gradient of its output is computed (a hook on the output tensor)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 on_operator: Callable[[str], None]) -> None:
        self.handles: list[Any] = []
        for name, module in model.named_modules():
            if list(module.children()):
                continue
            self.handles.append(module.register_forward_pre_hook(lambda m, a, n=name: on_operator(f"forward {n}")))
            self.handles.append(module.register_forward_hook(
                lambda m, a, out, n=name: _on_gradient(out, lambda: on_operator(f"backward {n}"))))
        if not updates_in_backward(optimizer):
            self.handles.append(optimizer.register_step_pre_hook(lambda *a: on_operator("optimizer step")))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def updates_in_backward(optimizer: Any) -> bool:
    """Whether ``optimizer`` updates layer by layer during backward: it offers layer hooks, as
    :class:`~everystep.OptimizerInBackward` does, in place of one ``step()``."""
    return callable(getattr(optimizer, "register_layer_pre_hook", None))


def _on_gradient(output: Any, call: Callable[[], None]) -> None:
    """Call ``call`` when the gradient of ``output`` (its first tensor that needs one) is computed."""
    for t in output if isinstance(output, (tuple, list)) else (output,):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad: call())
            return


class _Recorder:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.cuda = any(p.is_cuda for p in model.parameters())
        self.marks: list[tuple[str, Any, int]] = []
        """(operator that starts here, a clock mark, bytes alive when it starts)."""
        self.peaks: list[int] = []
        """CUDA: at each mark, the most bytes allocated since the mark before (inside the operator that ends)."""
        self.saved: dict[int, int] = {}
        self.updated: dict[torch.Tensor, int] = {}
        self.weights = {local_shard(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.operators = OperatorHooks(model, optimizer, self.mark)
        self.handles: list[Any] = []
        if updates_in_backward(optimizer):
            self.handles.append(optimizer.register_layer_pre_hook(self._on_layer_update))
        else:
            self.handles.append(optimizer.register_step_post_hook(lambda *a: self._on_update_all()))

    def remove(self) -> None:
        self.operators.remove()
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
            self.peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            clock: Any = event
        else:
            clock = time.perf_counter()
        self.marks.append((name, clock, self.alive()))

    def alive(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        state = [local_shard(v) for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        params = [local_shard(p) for p in self.model.parameters()]
        grads = [local_shard(p.grad) for p in self.model.parameters() if p.grad is not None]
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
        if self.cuda:  # the peak inside each operator (the first mark's peak is before the step)
            resident = [max(alive, peak) for alive, peak in zip(resident, self.peaks[1:])]
        tensors = []
        index = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                at = self.updated.get(p)
                if at is not None:  # (None: no gradient this step, nothing updates it)
                    mine = local_shard(p)  # (of a DTensor, this rank's shard: what it copies)
                    tensors.append(Tensor(f"param/{index}", mine.numel() * mine.element_size(), at))
                    for name, value in self.optimizer.state.get(p, {}).items():
                        value = local_shard(value) if isinstance(value, torch.Tensor) else value
                        if isinstance(value, torch.Tensor) and value.numel() > 1:
                            tensors.append(Tensor(f"state/{index}/{name}", value.numel() * value.element_size(), at))
                index += 1
        return StepProfile(tuple(max(t, 1e-7) for t in times), tuple(resident), tuple(tensors))
