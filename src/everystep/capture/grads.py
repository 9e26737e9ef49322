"""Layer-wise gradient capture: each gradient the optimizer consumes, copied into a host slot.

Each parameter's gradient is handed, the moment it is final for this backward pass, to a copy
worker that moves it into the slot (on CUDA, on a low-priority side stream, so that compute and
gradient synchronisation go first). In one process a post-accumulate-grad hook hands it over.
Under DDP the local gradient is not final — its bucket's reduction replaces it — so the reduced
bucket is taken from the communication hook's future as it completes
(:func:`~everystep.capture.hooks.reduction_tap`: everystep's compression hooks, or, when the model
has no hook, DDP's own all-reduce registered as one); with a hook of another kind, every gradient
is copied before the step instead.

Right before ``optimizer.step()`` (:meth:`GradientCapture.at_update`) every gradient is checked
against what was copied — same tensor, same version counter as when it became final — and copied
again where clipping, unscaling or another backward changed it in place, so the slot holds exactly
what the optimizer consumes; those copies overlap the optimizer's update. Clipping multiplies
every gradient in place, every step, even by 1: then every copy made during backward is wasted
memory bandwidth. With ``layerwise=None`` capture during backward stops after two steps in a row in
which most of its copies had to be made again, and the gradients are copied once, at the step
(``True``: always during backward; ``False``: never).

When the copies end. Without ``overlap``, :meth:`settle` (after the update) waits for them. With
``overlap`` the training thread never waits for them at the step: what needs the slot whole (the
message that hands it to the agent) runs after them on the copier (:meth:`after_copies`, which on
CUDA waits for the copies' events there), and the copies are guarded only where the gradients can
next change in place (:meth:`guard`): at the first gradient of the next backward (accumulation,
DDP's buckets) and at ``zero_grad(set_to_none=False)`` of the optimizer or the model. On CUDA the
guard is the training stream waiting for the copies' event, not the host; on the CPU the thread
waits there for the copier. Gradients changed in place by other means between two steps (a
``p.grad.zero_()`` by hand) are not guarded: the agent's replica then diverges, which its periodic
comparison with the live state finds and repairs with the full state.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import tracing
from .._faults import crash_point
from ..background import BackgroundErrors, Worker
from ..transport.host import HostBuffer
from ..tree import local_shard
from .hooks import ReductionTap, after_backward, reduction_tap

__all__ = ["GradientCapture", "BATCH_BYTES"]

BATCH_BYTES = 32 * 2**20
"""Gradients queued during backward before the copier takes them (one job per batch)."""


class GradientCapture:
    """Copies the gradients of ``params`` into the buffer ``target()`` gives (``None``: copy nothing
    now — no slot, or nobody to send it to). A slot's gradient of parameter ``i`` is ``g/{i}``."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], compression: Any, *,
                 layerwise: bool | None, errors: BackgroundErrors,
                 target: Callable[[], HostBuffer | None], overlap: bool = False,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.params = params
        self.mode = layerwise
        self.layerwise = layerwise is not False
        self.early_copies = 0
        """Gradients copied while backward produced them."""
        self.recopies = 0
        """Of those, the ones copied again at the step because they changed in place (clipping)."""
        self._target = target
        self._errors = errors
        self._copied: dict[int, tuple[torch.Tensor, int]] = {}
        self._reduced: list[int] = []
        self._awaiting_end = False
        self._stale_streak = 0
        self._hooks: list[Any] = []
        self._tap: ReductionTap | None = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # A post-accumulate-grad hook would see the local gradient, which the bucket's reduction
            # replaces: the reduced bucket is taken from the communication hook instead.
            self._index_of = {p.data_ptr(): i for i, p in enumerate(params)}
            self._tap = reduction_tap(model, compression) if self.layerwise else None
            if self._tap is not None:
                self._tap.observers.append(self._on_bucket)
        elif self.layerwise:
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                           for i, p in enumerate(params) if p.requires_grad]
        self._stream = torch.cuda.Stream(priority=0) if torch.cuda.is_available() else None
        self._copier = Worker("everystep-grad-copy", errors)
        self._lock = threading.Lock()
        self._queued: list[tuple[HostBuffer, int, torch.Tensor, torch.cuda.Event | None]] = []
        self._queued_bytes = 0
        self._posted = False
        self._buffer: HostBuffer | None = None
        """The slot this step's gradients go to, once its first one took it."""
        self.overlap = overlap
        self._unguarded = False
        """``overlap``: the last step's copies may still run, and nothing guarded them yet."""
        self._last_copy: torch.cuda.Event | None = None
        """The newest copy's event (copier thread)."""
        self._step_copy: torch.cuda.Event | None = None
        """The event of the settled step's last copy."""
        self._marked = threading.Event()
        """Set on the copier once it has issued every copy of the settled step."""
        self._zeroing: list[Any] = []
        if overlap:
            grads = [p for p in params if p.requires_grad]
            if grads:  # before the gradient is accumulated into ``.grad`` or DDP's bucket
                self._hooks.append(torch.autograd.graph.register_multi_grad_hook(
                    grads, lambda grad: self.guard(), mode="any"))
            self._zeroing = [o for o in (optimizer, model) if o is not None]
            for owner in self._zeroing:
                owner.zero_grad = functools.partial(self._zero_grad, owner.zero_grad)  # (removed by close)

    # -- during backward -----------------------------------------------------------------------

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if self.layerwise:
            self._copy(index, param.grad)

    def _on_bucket(self, bucket: Any) -> Any:
        """A DDP bucket's reduction starts (training thread): where its gradients lie in it, and what
        copies them out of the reduced bucket when its future completes."""
        buffer = self._target() if self.layerwise else None
        if buffer is None:
            return None
        base = bucket.buffer()
        size, start = base.element_size(), base.data_ptr()
        where = [(i, (g.data_ptr() - start) // size, g.numel())
                 for p, g in zip(bucket.parameters(), bucket.gradients())
                 if (i := self._index_of.get(p.data_ptr())) is not None]
        if not self._awaiting_end:
            self._awaiting_end = after_backward(self._on_backward_end)

        def reduced(result: torch.Tensor) -> None:  # the thread that completed the reduction
            try:
                flat = result.detach().reshape(-1)
                event = _event(flat)
                self._hand_over(buffer, [(i, flat[offset:offset + n].view(self.params[i].shape), event)
                                         for i, offset, n in where])
                self._reduced.extend(i for i, _, _ in where)
            except BaseException as e:
                self._errors.record("taking the reduced gradients for the agent", e)

        return reduced

    def _on_backward_end(self) -> None:
        """After DDP copied the reduced buckets into the gradients: what the copies hold is what the
        gradients hold now, until something changes them in place."""
        self._awaiting_end = False
        for i in self._reduced:
            g = self.params[i].grad
            if g is not None:
                self._copied[i] = (g, g._version)
        self._reduced = []

    def _copy(self, index: int, grad: torch.Tensor | None) -> None:
        """A parameter's gradient, as backward produced it (training thread): queued for the copier.
        A few Python calls each: on a GPU this runs between the kernel launches of backward."""
        if grad is None:
            return
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = self._target()  # (the step's slot: taken by its first gradient)
            if buffer is None:
                return
        self._copied[index] = (grad, grad._version)
        self._hand_over(buffer, [(index, grad, _event(grad) if grad.is_cuda else None)])

    def _hand_over(self, buffer: HostBuffer, grads: list[tuple[int, torch.Tensor, torch.cuda.Event | None]]) -> None:
        """Queue gradients for the copier, which takes them in batches of :data:`BATCH_BYTES` (the
        rest at the step, :meth:`at_update`): a few jobs a step, not one per parameter."""
        with self._lock:
            for i, g, e in grads:  # (a loop, not generators: no Python call per gradient)
                self._queued.append((buffer, i, g, e))
                self._queued_bytes += g.nbytes
        self._flush(at_least=BATCH_BYTES)

    def _flush(self, *, at_least: int = 0) -> None:
        """Hand the copier what is queued, once it is ``at_least`` bytes (0: however little), unless
        a job that will take it is posted already."""
        with self._lock:
            if self._posted or not self._queued or self._queued_bytes < at_least:
                return
            self._posted = True
        self._copier.post("copying gradients for the agent during backward", self._copy_queued)

    def _copy_queued(self) -> None:
        with self._lock:
            queued, self._queued, self._posted, self._queued_bytes = self._queued, [], False, 0
        for buffer in {id(b): b for b, _, _, _ in queued}.values():
            mine = [(i, g, e) for b, i, g, e in queued if b is buffer]
            self._copy_all_into(buffer, [(i, g) for i, g, _ in mine], [e for _, _, e in mine])

    def _copy_all_into(self, buffer: HostBuffer, due: list[tuple[int, torch.Tensor]],
                       events: list[torch.cuda.Event | None]) -> None:
        """Copy ``due`` into the slot: on the CPU in one call; on CUDA each copy issued on the side
        stream after the event that made its gradient, then all waited for once."""
        targets, grads = [buffer.views[f"g/{i}"] for i, _ in due], [g for _, g in due]
        if events.count(None) == len(events):  # (the CPU's; counted in C, as the copier's calls are few)
            with torch.no_grad():
                torch._foreach_copy_(targets, grads)
            return
        assert self._stream is not None
        with torch.cuda.stream(self._stream), tracing.device_span("gradient copy", self._stream):
            for event in {id(e): e for e in events if e is not None}.values():
                self._stream.wait_event(event)
            for target, g in zip(targets, grads):
                target.copy_(g, non_blocking=True)  # (DMA where the slot is registered)
                g.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        if self.overlap:
            self._last_copy = done  # (waited for where the slot is handed on, or by the next guard)
        else:
            done.synchronize()

    def _copy_at_update(self, buffer: HostBuffer, due: list[tuple[int, torch.Tensor]],
                        event: torch.cuda.Event | None) -> None:
        crash_point("lowdiff_plus.gradients.copy")  # on the copier thread, while the update runs
        self._copy_all_into(buffer, due, [event] * len(due))

    # -- at the step ---------------------------------------------------------------------------

    def at_update(self) -> list[int]:
        """Right before ``optimizer.step()``: copy what was not copied yet or changed since (clipped,
        unscaled, compressed); return the indices of the parameters that have a gradient."""
        self._awaiting_end = False
        self._flush()
        early, stale, due = len(self._copied), 0, []
        for i, p in enumerate(self.params):
            g = p.grad
            seen = self._copied.get(i)
            if g is not None and (seen is None or seen[0] is not g or seen[1] != g._version):
                stale += seen is not None
                due.append((i, g))
        buffer = self._target() if due else None
        if buffer is not None:  # one job for all: each job is a GIL hand-over the training thread waits for
            for i, g in due:
                self._copied[i] = (g, g._version)
            local = [(i, local_shard(g)) for i, g in due]  # (a DTensor's: this rank's shard, what the slot holds)
            self._copier.post("copying the gradients for the agent", self._copy_at_update, buffer, local,
                              _event(local[0][1]))
        self._judge(early, stale)
        return [i for i, p in enumerate(self.params) if p.grad is not None]

    def _judge(self, early: int, stale: int) -> None:
        """Count this step's copies during backward and those made again; with ``layerwise=None``,
        stop copying during backward after two steps in a row that made most of them again."""
        self.early_copies += early
        self.recopies += stale
        if not early:
            return
        self._stale_streak = self._stale_streak + 1 if 2 * stale > early else 0
        if self.mode is None and self._stale_streak >= 2:
            self.layerwise = False

    def settle(self) -> None:
        """After the update: the next step's first gradient takes the next slot. Without ``overlap``,
        wait until the slot holds every copy (its gradients may change next); with it, only mark
        where this step's copies end, for :meth:`guard` and :meth:`after_copies`."""
        self._copied.clear()
        self._buffer = None
        if not self.overlap:
            self._copier.drain()
            return
        self._flush()
        self._marked.clear()
        self._copier.post("marking the step's gradient copies", self._mark)
        self._unguarded = True

    def _mark(self) -> None:
        """(Copier thread, after the step's copies were issued.)"""
        self._step_copy = self._last_copy
        self._marked.set()

    def after_copies(self, what: str, then: Callable[[], None]) -> None:
        """Run ``then`` on the copier once the settled step's copies are in the slot."""
        self._copier.post(what, self._when_copied, then)

    def _when_copied(self, then: Callable[[], None]) -> None:
        done = self._step_copy
        if done is not None:
            done.synchronize()  # (the copier waits for the device, not the training thread)
        then()

    def guard(self) -> None:
        """Before the gradients can change in place after :meth:`settle` (training thread): on CUDA
        the current stream waits for the step's copies; on the CPU this thread waits for them."""
        if not self._unguarded:
            return
        self._unguarded = False
        if self._stream is None:
            self._copier.drain()
            return
        self._marked.wait()  # (the copies issued: normally long before the next backward)
        if self._step_copy is not None:
            torch.cuda.current_stream().wait_event(self._step_copy)

    def quiesce(self) -> None:
        """Wait until every copy and everything posted after them has run (training thread)."""
        self._unguarded = False
        self._copier.drain()
        if self._last_copy is not None:
            self._last_copy.synchronize()

    def _zero_grad(self, zero_grad: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``zero_grad`` of the optimizer or the model: guarded where it zeroes in place."""
        if not kwargs.get("set_to_none", args[0] if args else True):
            self.guard()
        return zero_grad(*args, **kwargs)

    def close(self) -> None:
        self._copier.close()
        for owner in self._zeroing:
            if "zero_grad" in vars(owner):
                del owner.zero_grad
        self._zeroing = []
        for h in self._hooks:
            h.remove()
        if self._tap is not None:
            self._tap.observers.remove(self._on_bucket)
            self._tap = None


def _event(t: torch.Tensor) -> torch.cuda.Event | None:
    """An event recorded on the current stream after what produced ``t`` (CUDA tensors only)."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event
