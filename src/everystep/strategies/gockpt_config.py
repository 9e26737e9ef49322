"""GoCkpt's configuration, and one checkpoint in the making: its parameters, the chunks of each part,
their copies, and the gradients that bring them forward (see :mod:`everystep.strategies.gockpt`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import ConfigError
from ..policy.parts import ALIGN, PartSplit
from ..tree import local_shard
from .full_state import FullStateConfig

__all__ = ["ELEMENTWISE", "GoCkptConfig", "Param", "Chunk", "Spread"]

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
               torch.optim.Rprop)
"""Optimizers whose update of an element reads only that element's gradient and state (and scalars):
a part of a parameter can be brought forward on its own."""


@dataclass(kw_only=True, slots=True)
class GoCkptConfig(FullStateConfig):
    quantities: ClassVar[dict[str, str]] = {"chunk_bytes": "size"}
    every: int = 50
    """A checkpoint starts every this many steps; it is complete ``parts`` steps later."""
    parts: int | None = None
    """K, the steps one checkpoint's copy is spread over; ``None``: the smallest K whose copy fits
    under a step, at most 7 (and at most ``every``)."""
    chunk_bytes: int = 4 << 20
    """A parameter and its state are copied in chunks of about this many bytes."""
    threads: int = 4
    """Threads that apply the gradients to the parts copied (``reconstruct="host"``)."""
    reconstruct: str | None = None
    """Where the parts are brought forward: ``"host"`` (as they arrive, by ``threads`` threads; the
    checkpoint written is a full one) or ``"device"`` (at recovery, on the training device; the
    parts are written with their gradients). ``None``: ``"device"`` for a model on a GPU, else
    ``"host"``."""

    def __post_init__(self) -> None:
        FullStateConfig.__post_init__(self)
        if self.parts is not None and not 1 <= self.parts <= self.every:
            raise ConfigError(f"parts must lie in 1..every ({self.every}): a checkpoint spans parts steps and the next "
                              f"starts every steps later; got {self.parts}")
        if self.chunk_bytes < ALIGN * 4:
            raise ConfigError(f"chunk_bytes must be at least {ALIGN * 4}, got {self.chunk_bytes}")
        if self.threads < 1:
            raise ConfigError(f"threads must be at least 1, got {self.threads}")
        if self.reconstruct not in (None, "host", "device"):
            raise ConfigError(f"reconstruct must be 'host' or 'device' (or None: by where the model is), got "
                              f"{self.reconstruct!r}")


@dataclass(eq=False)
class Param:
    """A parameter the optimizer updates, and where its tensors lie in the flat state."""

    tensor: torch.Tensor
    """The parameter (of a DTensor, its shards are what the checkpoint holds: :attr:`local`)."""
    group: int
    key: str
    elementwise: dict[str, str]
    """State name → key, for each state tensor of the parameter's shape (chunked with it)."""
    whole: dict[str, str]
    """State name → key, for the others (scalars such as Adam's step: each chunk has its own)."""

    @property
    def local(self) -> torch.Tensor:
        """What this rank holds of the parameter: all of it, or its shard of a DTensor."""
        return local_shard(self.tensor)


@dataclass(eq=False)
class Chunk:
    """A chunk's copy, brought forward by its shard's optimizer (whose state it is)."""

    index: int
    """The chunk's place in the plan, parts in order."""
    param: int
    start: int
    stop: int
    view: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    """Host: the state the chunk's optimizer brings forward. Device: the state as copied."""


@dataclass(eq=False)
class Spread:
    """One checkpoint in the making: S_start's parts copied over the next K steps."""

    start: int
    params: list[Param]
    """The parameters and their state's keys as S_start has them."""
    plan: PartSplit
    host: dict[str, torch.Tensor]
    """Host tensors, full shape, for each parameter and each of its element-wise state tensors."""
    copies: list[Future[Any]] = field(default_factory=list)
    copied: list[list[Chunk]] = field(default_factory=list)
    """Per part copied, its chunks."""
    shards: list[list[tuple[torch.optim.Optimizer, list[int], list[Chunk]]]] = field(default_factory=list)
    """Host: per part copied, per shard, its optimizer, the groups it has, its chunks."""
    applied: list[Future[Any]] = field(default_factory=list)
    gradient_copies: list[Future[Any]] = field(default_factory=list)
    """gockpt_o: the copies of gradients made for this checkpoint, one per update (the next update
    waits for the last)."""
    records: list[tuple[dict[str, Any], dict[int, torch.Tensor]]] = field(default_factory=list)
    """Device: per update, its step and group settings, and the gradients kept, by chunk index."""
    events: list[Any] = field(default_factory=list)
    """CUDA: events that complete with the copies on the copy stream (parts, gradients, the rest)."""
    apply_seconds: list[float] = field(default_factory=list)
    held: list[tuple[Any, Any]] = field(default_factory=list)
    """The pooled host buffers (pool, buffer) the checkpoint holds until it is written or dropped."""
    gradients: Any = None
    """Device: the host buffer that the gradients kept lie in (see ``GoCkpt._gradient_layout``)."""

    @property
    def parts(self) -> int:
        return len(self.plan.parts)
