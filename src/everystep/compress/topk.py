"""Top-k sparsification with error feedback (Stich et al.; the ratio ρ keeps ⌈ρ·n⌉ entries)."""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from .base import Compressed, sparse

__all__ = ["TopK"]


class TopK:
    name = "topk"

    def __init__(self, ratio: float = 0.01, *, error_feedback: bool = True) -> None:
        if not 0 < ratio <= 1:
            raise ConfigError(f"top-k ratio must lie in (0, 1], got {ratio}")
        self.ratio = ratio
        self.error_feedback = error_feedback
        """Keep what was not sent and add it to the next gradient; off: drop it (no residual state)."""
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, grad: torch.Tensor) -> Compressed:
        flat = grad.detach().reshape(-1)
        residual = self.residuals.get(name)
        acc = flat + residual if residual is not None else flat.clone() if self.error_feedback else flat
        k = max(1, math.ceil(self.ratio * acc.numel()))
        indices = acc.abs().topk(k, sorted=False).indices.sort().values
        values = acc[indices]
        if self.error_feedback:
            acc[indices] = 0
            self.residuals[name] = acc
        index_dtype = torch.int32 if acc.numel() < 2**31 else torch.int64
        return {"values": values, "indices": indices.to(index_dtype)}

    def decompress(self, compressed: Compressed, like: torch.Tensor) -> torch.Tensor:
        return sparse(compressed["values"], compressed["indices"], like)

    def nbytes(self, compressed: Compressed) -> int:
        return sum(t.numel() * t.element_size() for t in compressed.values())
