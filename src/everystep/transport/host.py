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

__all__ = ["LayoutEntry", "TensorLayout", "HostBuffer", "HostBufferPool", "snapshot_into", "to_host", "tensor_bytes",
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


def snapshot_into(
    buffer: HostBuffer,
    tensors: dict[str, torch.Tensor],
    keys: list[str] | None = None,
    *,
    stream: "torch.cuda.Stream | None" = None,
) -> "torch.cuda.Event | None":
    """Copy ``tensors[k]`` into ``buffer.views[k]`` for each key (all when ``keys`` is None).

    CPU sources are copied synchronously. CUDA sources are copied asynchronously on ``stream``
    (which first waits for the current stream); the returned event completes with the copies.
    """
    keys = list(tensors) if keys is None else keys
    on_cuda = any(tensors[k].is_cuda for k in keys)
    if not on_cuda:
        if keys:
            with torch.no_grad():  # one call for all: a copy per tensor would hold the GIL per tensor
                torch._foreach_copy_([buffer.views[k] for k in keys], [tensors[k] for k in keys])
        return None
    stream = stream or torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), tracing.device_span("snapshot copy", stream):
        for k in keys:
            src = tensors[k].detach()
            buffer.views[k].copy_(src, non_blocking=True)
            if src.is_cuda:
                src.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def to_host(tensors: dict[str, torch.Tensor], stream: "torch.cuda.Stream | None"
            ) -> tuple[dict[str, torch.Tensor], "torch.cuda.Event | None"]:
    """``tensors`` in host memory: those on the CPU as they are; those on CUDA copied into pinned
    memory (the caching host allocator's, reused from step to step) in one batched copy on
    ``stream``, after the work queued on the current stream before it, without waiting for it here.
    The event (None: nothing to wait for) completes with the copies: read the host tensors only after it."""
    keys = [k for k, t in tensors.items() if t.is_cuda]
    if not keys or stream is None:
        return dict(tensors), None
    found = dict(tensors)
    with torch.no_grad():
        for k in keys:
            found[k] = torch.empty(tensors[k].shape, dtype=tensors[k].dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), tracing.device_span("to host", stream):
            sources = [tensors[k].detach() for k in keys]
            torch._foreach_copy_([found[k] for k in keys], sources, non_blocking=True)
            for t in sources:
                t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
    return found, event


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

