"""Where tensors lie in one flat buffer: the layout that host buffers, shared-memory regions and
tensor files share. A :class:`TensorLayout` packs tensors back to back, largest element size
first, so every tensor is naturally aligned and the buffer has no holes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayoutEntry", "TensorLayout", "tensor_bytes"]


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

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "TensorLayout":
        order = sorted(enumerate(tensors.items()), key=lambda it: (-it[1][1].element_size(), it[0]))
        entries, offset = [], 0
        for _, (key, t) in order:
            n = t.numel() * t.element_size()
            entries.append(LayoutEntry(key, t.dtype, tuple(t.shape), offset, n))
            offset += n
        return cls(tuple(entries), offset)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())
