"""8-bit quantisation with a per-tensor scale and (by default) error feedback."""

from __future__ import annotations

import torch

from .base import Compressed, dequantize

__all__ = ["Quant8"]


class Quant8:
    name = "quant8"

    def __init__(self, *, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        """Keep the rounding error and add it to the next gradient; off: drop it (no residual state)."""
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, grad: torch.Tensor) -> Compressed:
        flat = grad.detach().reshape(-1).float()
        residual = self.residuals.get(name)
        acc = flat + residual if residual is not None else flat
        peak = acc.abs().max()
        scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
        codes = torch.round(acc / scale).clamp_(-127, 127).to(torch.int8)
        if self.error_feedback:
            self.residuals[name] = acc - codes.float() * scale
        return {"codes": codes, "scale": scale.reshape(())}

    def decompress(self, compressed: Compressed, like: torch.Tensor) -> torch.Tensor:
        return dequantize(compressed["codes"], compressed["scale"], like)

    def nbytes(self, compressed: Compressed) -> int:
        return sum(t.numel() * t.element_size() for t in compressed.values())
