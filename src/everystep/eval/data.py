"""Deterministic synthetic data with a resumable position (epoch, index, sampler seed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import StateMismatchError

__all__ = ["SyntheticData"]


class SyntheticData:
    """A dataset of ``size`` samples made from their index, shuffled per epoch by a seeded sampler.

    ``next()`` returns the next batch; the position is ``state_dict()`` = {epoch, index, seed,
    rank, world}, where ``index`` counts batches drawn in the current epoch. Drawing never touches
    the global random generators, so data and training randomness stay independent.

    With ``world`` > 1 it is a distributed sampler: the epoch's permutation is cut into global
    batches of ``world × batch_size`` samples and rank r draws the r-th part of each, so ranks never
    share a sample. A position saved at another world size is carried over when the samples
    consumed so far fill whole global batches of the new size.
    """

    def __init__(self, make_sample: Callable[[torch.Generator], Any], *, size: int, batch_size: int, seed: int,
                 rank: int = 0, world: int = 1) -> None:
        if batch_size < 1 or size < batch_size * world:
            raise ValueError(f"need 1 <= batch_size and batch_size * world <= size, got batch_size={batch_size}, "
                             f"world={world}, size={size}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must lie in 0..{world - 1}, got {rank}")
        self.make_sample = make_sample
        self.size = size
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world = rank, world
        self.epoch = 0
        self.index = 0
        self._order: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.size // (self.batch_size * self.world)

    def _permutation(self) -> torch.Tensor:
        if self._order is None:
            g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
            self._order = torch.randperm(self.size, generator=g)
        return self._order

    def sample_indices(self) -> list[int]:
        """Dataset indices of the batch that ``next()`` will return."""
        start = (self.index * self.world + self.rank) * self.batch_size
        return self._permutation()[start : start + self.batch_size].tolist()

    def next(self) -> Any:
        samples = []
        for i in self.sample_indices():
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            samples.append(self.make_sample(g))
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        first = samples[0]
        if isinstance(first, tuple):
            return tuple(torch.stack(parts) for parts in zip(*samples))
        return torch.stack(samples)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "rank": self.rank, "world": self.world}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data position was saved with sampler seed {state['seed']}; this run uses {self.seed}")
        index, world = int(state["index"]), int(state.get("world", 1))
        if world != self.world:
            consumed = index * world * self.batch_size
            if consumed % (self.world * self.batch_size):
                raise StateMismatchError(
                    f"the data position ({consumed} samples into epoch {state['epoch']}, drawn by {world} ranks) is "
                    f"not a whole number of global batches of {self.world} × {self.batch_size}; resume with {world} "
                    "ranks or from the start of an epoch"
                )
            index = consumed // (self.world * self.batch_size)
        self.epoch, self.index, self._order = int(state["epoch"]), index, None
