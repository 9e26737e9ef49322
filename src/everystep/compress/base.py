"""The Compressor protocol, and the one function that turns any stored gradient record back into
the gradient the optimizer consumed."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Compressor", "Compressed", "decompress", "sparse", "dequantize", "dequantize_mean", "low_rank"]

Compressed = dict[str, torch.Tensor]
"""A compressed gradient: named tensors. The names say the form (see :func:`decompress`)."""


class Compressor(Protocol):
    """Compresses one parameter's gradient with error feedback.

    ``compress`` folds the residual kept for ``name`` into ``grad``, returns the compressed form
    and keeps the new residual. ``decompress`` is a pure function of the compressed form: the
    training step and the replay of a differential call it alike, so both see the same bits.
    """

    name: str

    def compress(self, name: str, grad: torch.Tensor) -> Compressed: ...

    def decompress(self, compressed: Compressed, like: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self, compressed: Compressed) -> int: ...


def sparse(values: torch.Tensor, indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out[indices.long()] = values.to(like.dtype)
    return out.view_as(like)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (codes.float() * scale).to(like.dtype).view_as(like)


def dequantize_mean(codes: torch.Tensor, scales: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of 8-bit codes ``[world, n]`` with one scale per rank, in rank order."""
    acc = codes[0].float() * scales[0]
    for r in range(1, codes.shape[0]):
        acc += codes[r].float() * scales[r]
    return acc.div_(codes.shape[0]).to(like.dtype).view_as(like)


def low_rank(p: torch.Tensor, q: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """P·Qᵀ computed as PyTorch's PowerSGD hook computes it (a batched product of one matrix)."""
    out = torch.empty((1, p.shape[0], q.shape[0]), dtype=like.dtype, device=like.device)
    torch.bmm(p.to(like.dtype).unsqueeze(0), q.to(like.dtype).unsqueeze(0).transpose(1, 2), out=out)
    return out.view_as(like)


def decompress(record: Compressed, like: torch.Tensor) -> torch.Tensor:
    """The gradient a stored record stands for, shaped and typed like ``like``.

    ============================  ==========================================================
    ``dense``                     the gradient itself
    ``values``, ``indices``       top-k: the values at their flat indices, zero elsewhere
    ``codes``, ``scale``          8-bit codes times one scale
    ``codes``, ``scales``         the mean over ranks of each rank's codes times its scale
    ``p``, ``q``                  PowerSGD's factors: P·Qᵀ
    ``mul`` (with any of these)   one scalar the result was multiplied by (gradient clipping)
    ============================  ==========================================================

    A record read from storage lives on the CPU; it is moved to ``like``'s device first, so that
    the arithmetic is the device's, as in training.
    """
    if any(t.device != like.device for t in record.values()):
        record = {k: t.to(like.device) for k, t in record.items()}
    if "dense" in record:
        out = record["dense"].to(like.dtype).view_as(like)
    elif "indices" in record:
        out = sparse(record["values"], record["indices"], like)
    elif "scales" in record:
        out = dequantize_mean(record["codes"], record["scales"], like)
    elif "codes" in record:
        out = dequantize(record["codes"], record["scale"], like)
    elif "p" in record:
        out = low_rank(record["p"], record["q"], like)
    else:
        raise KeyError(f"not a gradient record: it holds {sorted(record)}")
    if "mul" in record:
        out = out * record["mul"]
    return out
