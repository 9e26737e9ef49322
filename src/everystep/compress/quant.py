"""8-bit quantisation with a per-tensor scale and error feedback."""

from __future__ import annotations

import torch

from .base import Compressed, dequantize

__all__ = ["Quant8"]


class Quant8:
    name = "quant8"

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, grad: torch.Tensor) -> Compressed:
        flat = grad.detach().reshape(-1).float()
        residual = self.residuals.get(name)
        acc = flat + residual if residual is not None else flat
        peak = acc.abs().max()
        scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
        codes = torch.round(acc / scale).clamp_(-127, 127).to(torch.int8)
        self.residuals[name] = acc - codes.float() * scale
        return {"codes": codes, "scale": scale.reshape(())}

    def decompress(self, compressed: Compressed, like: torch.Tensor) -> torch.Tensor:
        return dequantize(compressed["codes"], compressed["scale"], like)

    def nbytes(self, compressed: Compressed) -> int:
        return sum(t.numel() * t.element_size() for t in compressed.values())
