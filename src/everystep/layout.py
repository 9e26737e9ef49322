"""Where tensors lie in one flat buffer: the layout that host buffers, shared-memory regions and
tensor files share. A :class:`TensorLayout` packs tensors back to back, largest element size
first, so every tensor is naturally aligned and the buffer has no holes."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["LayoutEntry", "TensorLayout", "tensor_bytes", "shape_overflows"]


@dataclass(frozen=True, slots=True)
class LayoutEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where each tensor lives in a flat buffer. Built by :meth:`of`; compared by value."""

    entries: tuple[LayoutEntry, ...]
    nbytes: int
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.entries, self.nbytes)))

    def __hash__(self) -> int:  # hashed by every cache keyed on a layout, once per checkpoint: computed once
        return self._hash

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "TensorLayout":
        """The layout of ``tensors``; a state checkpointed every step gets the same object back each
        time (cached by keys, dtypes and shapes: cheaper than building it, and compared by identity
        first)."""
        return _layout_of(tuple((k, t.dtype, t.shape) for k, t in tensors.items()))

    @classmethod
    def planned(cls, entries: "Iterable[tuple[str, torch.dtype, tuple[int, ...]]]") -> "TensorLayout":
        """The layout of tensors not made yet, each given as its key, dtype and shape."""
        return _layout_of(tuple((k, dtype, torch.Size(shape)) for k, dtype, shape in entries))


@functools.lru_cache(maxsize=64)
def _layout_of(signature: tuple[tuple[str, torch.dtype, torch.Size], ...]) -> TensorLayout:
    order = sorted(enumerate(signature), key=lambda it: (-it[1][1].itemsize, it[0]))
    entries, offset = [], 0
    for _, (key, dtype, shape) in order:
        n = math.prod(shape) * dtype.itemsize
        entries.append(LayoutEntry(key, dtype, tuple(shape), offset, n))
        offset += n
    return TensorLayout(tuple(entries), offset)


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})
"""Dtypes NumPy has: their bytes come by way of ``numpy()`` alone, with no view (a differential
batch holds hundreds of small tensors; the views cost more than the bytes)."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype in _NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def shape_overflows(shape: tuple[int, ...] | list[int], itemsize: int) -> bool:
    """Whether a tensor of ``shape`` cannot be made: its strides (each dimension counted as at least
    one, as a zero-size tensor's are) overflow 64 bits — a shape no state holds, which a forged
    header can name (``[0, 2**62, 4]``: no bytes, and torch refuses it with a RuntimeError)."""
    return math.prod(max(d, 1) for d in shape) * itemsize >= 1 << 63

