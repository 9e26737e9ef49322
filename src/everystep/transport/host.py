"""Flat host buffers that hold a whole checkpoint as one allocation.

A :class:`TensorLayout` packs tensors back to back, largest element size first, so every tensor
is naturally aligned and the buffer has no holes: the same bytes are the data section of a
safetensors file. A snapshot is one ``copy_`` per tensor into views of the buffer; on CUDA the
copies run on a side stream into pinned memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from .. import tracing
from ..layout import LayoutEntry, TensorLayout, tensor_bytes

__all__ = ["LayoutEntry", "TensorLayout", "HostBuffer", "HostBufferPool", "copy_out", "snapshot_into", "to_host", "tensor_bytes",
           "copy_bandwidth"]


class HostBuffer:
    """One flat, optionally pinned, byte buffer with a typed view per layout entry."""

    def __init__(self, layout: TensorLayout, *, pin: bool = False, data: torch.Tensor | None = None) -> None:
        """``data``: existing memory to lay the tensors over (at least ``layout.nbytes`` bytes)."""
        self.layout = layout
        if data is None:
            data = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        elif data.numel() < layout.nbytes:
            raise ValueError(f"a buffer of {data.numel()} bytes cannot hold a layout of {layout.nbytes}")
        self.data = data
        self.views: dict[str, torch.Tensor] = {
            e.key: self.data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layout.entries
        }

    def memoryview(self) -> memoryview:
        return memoryview(self.data.numpy()) if self.layout.nbytes else memoryview(b"")


def copy_out(targets: list[torch.Tensor], sources: list[torch.Tensor], stream: "torch.cuda.Stream | None" = None, *,
             what: str = "snapshot copy") -> "torch.cuda.Event | None":
    """Copy each of ``sources`` into its target in host memory, in one batched copy. From the CPU
    alone, at once; where one lies on CUDA, asynchronously on ``stream`` (default: the current one),
    after the work queued on the current stream before it, each CUDA source kept from the allocator
    until then: the returned event completes with the copies. ``what``: the copy's name in a trace."""
    with torch.no_grad():
        sources = [t.detach() for t in sources]
        if not any(t.is_cuda for t in sources):
            if sources:  # (one call for all: a copy per tensor would hold the GIL per tensor)
                torch._foreach_copy_(targets, sources)
            return None
        stream = stream or torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), tracing.device_span(what, stream):
            torch._foreach_copy_(targets, sources, non_blocking=True)
            for src in sources:
                if src.is_cuda:
                    src.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
    return event


def snapshot_into(
    buffer: HostBuffer,
    tensors: dict[str, torch.Tensor],
    keys: list[str] | None = None,
    *,
    stream: "torch.cuda.Stream | None" = None,
) -> "torch.cuda.Event | None":
    """Copy ``tensors[k]`` into ``buffer.views[k]`` for each key (all when ``keys`` is None)
    (:func:`copy_out`): CPU sources synchronously, CUDA ones on ``stream``; the returned event
    completes with the copies."""
    keys = list(tensors) if keys is None else keys
    return copy_out([buffer.views[k] for k in keys], [tensors[k] for k in keys], stream)


def to_host(tensors: dict[str, torch.Tensor], stream: "torch.cuda.Stream | None"
            ) -> tuple[dict[str, torch.Tensor], "torch.cuda.Event | None"]:
    """``tensors`` in host memory: those on the CPU as they are; those on CUDA copied into a pinned
    :class:`HostBuffer` (the caching host allocator's, reused from step to step) on ``stream``
    (:func:`snapshot_into`), without waiting for it here. The event (None: nothing to wait for)
    completes with the copies: read the host tensors only after it."""
    keys = [k for k, t in tensors.items() if t.is_cuda]
    if not keys or stream is None:
        return dict(tensors), None
    buffer = HostBuffer(TensorLayout.of({k: tensors[k] for k in keys}), pin=True)
    event = snapshot_into(buffer, tensors, keys, stream=stream)
    return {**tensors, **buffer.views}, event


class HostBufferPool:
    """A bounded set of reusable host buffers. ``acquire`` blocks while all are in use.

    ``make`` allocates a buffer for a layout (default: a :class:`HostBuffer`, pinned if ``pin``);
    ``dropped`` is told of each buffer the pool lets go (a stale layout)."""

    def __init__(self, capacity: int = 2, *, pin: bool | None = None,
                 make: Callable[[TensorLayout], HostBuffer] | None = None,
                 dropped: Callable[[HostBuffer], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a buffer pool needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._make = make or (lambda layout: HostBuffer(layout, pin=self.pin))
        self._dropped = dropped
        self._free: list[HostBuffer] = []
        self._outstanding = 0
        self._cond = threading.Condition()

    def acquire(self, layout: TensorLayout) -> HostBuffer:
        stale = None
        with self._cond:
            while self._outstanding >= self.capacity:
                self._cond.wait()
            self._outstanding += 1
            for i, buf in enumerate(self._free):
                if buf.layout == layout:
                    return self._free.pop(i)
            if self._free:
                stale = self._free.pop(0)  # a stale layout: drop it and allocate anew
        if stale is not None and self._dropped is not None:
            self._dropped(stale)
        return self._make(layout)

    def release(self, buffer: HostBuffer) -> None:
        with self._cond:
            self._outstanding -= 1
            self._free.append(buffer)
            self._cond.notify()


def copy_bandwidth(device: torch.device, nbytes: int = 16 << 20) -> float:
    """Bytes/s of a copy from ``device`` into host memory (pinned for a GPU): the best of three
    copies of ``nbytes`` after a first one, which touches every page of fresh memory."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    target = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device.type == "cuda")
    best = float("inf")
    for attempt in range(4):
        t0 = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt:
            best = min(best, time.perf_counter() - t0)
    return source.numel() * source.element_size() / max(best, 1e-9)

