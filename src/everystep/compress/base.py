"""The Compressor protocol: what a compressed gradient is and how it turns back into one."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Compressor", "Compressed"]

Compressed = dict[str, torch.Tensor]
"""A compressed gradient: named tensors (values and indices, or codes and a scale)."""


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
