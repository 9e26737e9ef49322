"""GoCkpt's part plan: the state cut into K parts, each copied during its own training step.

A *unit* is a parameter with its optimizer state. Units are cut into chunks of about
``chunk_bytes`` (counting the parameter's bytes and those of every state tensor of its shape), so a
chunk of a parameter and the same elements of its state always travel together; chunk boundaries
fall on multiples of :data:`ALIGN` elements. The chunks, in unit order, are then cut into K
consecutive parts of nearly equal size: each part's bytes lie within one chunk of the mean.

How many parts (:func:`choose_parts`): GoCkpt's stall analysis (its §4.2.3) hides the copy of one
part under one step's compute, and keeps K ≤ 7 — beyond it, the gradients shipped each step for the
parts already copied cost more than the state copy they hide. So K is the smallest number of parts
whose copy fits under a step, at most 7.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

__all__ = ["ALIGN", "MAX_PARTS", "Unit", "Chunk", "PartSplit", "choose_parts"]

ALIGN = 64
"""Chunk boundaries are multiples of this many elements (whole vectors for every SIMD width)."""

MAX_PARTS = 7
"""GoCkpt's optimum (§4.2.3): past 7 steps the gradients shipped outweigh the copy hidden."""


@dataclass(frozen=True)
class Unit:
    """A parameter and its optimizer state, by their keys in the flat state."""

    param: str
    numel: int
    bytes_per_element: int
    """The parameter's element size plus that of each state tensor of its shape."""


@dataclass(frozen=True)
class Chunk:
    unit: int
    start: int
    stop: int
    nbytes: int


@dataclass(frozen=True)
class PartSplit:
    units: tuple[Unit, ...]
    parts: tuple[tuple[Chunk, ...], ...]

    @classmethod
    def of(cls, units: list[Unit], parts: int, chunk_bytes: int) -> "PartSplit":
        """Cut ``units`` into chunks of about ``chunk_bytes`` and the chunks into ``parts`` parts
        (fewer when there are fewer chunks than that)."""
        if parts < 1 or chunk_bytes < 1:
            raise ValueError(f"parts and chunk_bytes must be positive, got {parts} and {chunk_bytes}")
        chunks = [c for i, u in enumerate(units) for c in _chunks(i, u, chunk_bytes)]
        cum = list(itertools.accumulate((c.nbytes for c in chunks), initial=0))
        k = max(1, min(parts, len(chunks)))
        cuts = [0]
        for part in range(1, k):  # each cut at the chunk boundary nearest its share, no part empty
            target = cum[-1] * part / k
            cuts.append(min(range(cuts[-1] + 1, len(chunks) - (k - part) + 1), key=lambda i: abs(cum[i] - target)))
        cuts.append(len(chunks))
        return cls(tuple(units), tuple(tuple(chunks[a:b]) for a, b in zip(cuts, cuts[1:])))

    def part_bytes(self) -> list[int]:
        return [sum(c.nbytes for c in part) for part in self.parts]


def _chunks(index: int, unit: Unit, chunk_bytes: int) -> list[Chunk]:
    per = max(ALIGN, chunk_bytes // max(1, unit.bytes_per_element) // ALIGN * ALIGN)
    return [Chunk(index, a, min(a + per, unit.numel), (min(a + per, unit.numel) - a) * unit.bytes_per_element)
            for a in range(0, unit.numel, per)]


def choose_parts(state_bytes: int, bandwidth: float, step_seconds: float, limit: int = MAX_PARTS) -> int:
    """The smallest K for which copying ``state_bytes``/K at ``bandwidth`` (bytes/s) takes no longer
    than a step of ``step_seconds``, at most ``limit``."""
    if bandwidth <= 0 or step_seconds <= 0:
        return limit
    return max(1, min(limit, math.ceil(state_bytes / bandwidth / step_seconds)))
