"""Checkpointing strategies, one module each, subclasses of :class:`Strategy`."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..errors import ConfigError
from ..parallelism import DTENSOR_LAYOUTS
from .base import Strategy, StrategyConfig
from .context import CheckpointStats, StrategyContext
from .checkflow import Checkflow
from .checkfreq import AsyncSnapshot, CheckFreq
from .full_sync import FullSync
from .gockpt import GoCkpt, GoCkptO
from .lowdiff import LowDiff
from .lowdiff_plus import LowDiffPlus
from .lightcheck import LightCheck
from .naive_diff import NaiveDiff
from .none import NoCheckpoint

__all__ = ["Strategy", "StrategyConfig", "StrategyContext", "CheckpointStats", "STRATEGIES", "create", "NoCheckpoint", "FullSync", "CheckFreq", "LowDiff", "LowDiffPlus", "NaiveDiff", "LightCheck", "AsyncSnapshot", "GoCkpt", "GoCkptO", "Checkflow", "sharded_refusal", "default_full_format", "full_format_refusal"]

STRATEGIES: dict[str, Any] = {cls.name: cls for cls in (NoCheckpoint, FullSync, CheckFreq, AsyncSnapshot, LowDiff, LowDiffPlus,
                                                      NaiveDiff, LightCheck, GoCkpt, GoCkptO, Checkflow)}


def sharded_refusal(strategy: Strategy | type[Strategy], layout: str) -> tuple[str, list[str]]:
    """Why ``strategy`` does not checkpoint a job sharded with ``layout``, and the strategies that do
    (``none``, which takes any job, checkpoints nothing)."""
    why = strategy.sharded_refusal or (
        f"it captures the state of data parallelism, where every rank holds the whole model and optimizer state, "
        f"and each {layout} rank holds only its shards")
    return why, sorted(n for n, cls in STRATEGIES.items() if layout in cls.sharded_layouts and cls.needs_store)


def default_full_format(strategy: Strategy | type[Strategy], layout: str | None) -> str:
    """The format of a new directory's full checkpoints: DCP's for a job of DTensors (plain
    ``torch.distributed.checkpoint`` loads it) where the strategy writes it, else everystep's own.
    Both load at another world size or layout."""
    if layout in DTENSOR_LAYOUTS and "dcp" in strategy.full_formats:
        return "dcp"
    return strategy.full_formats[0]


def full_format_refusal(names: list[str], full_format: str, remedy: str) -> str | None:
    """Why ``--full-format FULL_FORMAT`` cannot be given to the strategies ``names`` (each naming
    the reason, then ``remedy``), or None: the refusal ``everystep train`` and ``everystep bench`` raise."""
    if full_format not in Strategy.full_formats:  # (the base class's: every format)
        return f"--full-format must be {' or '.join(Strategy.full_formats)}, got {full_format!r}"
    unable = [n for n in names if full_format not in STRATEGIES[n].full_formats]
    if not unable:
        return None
    reasons = {n: STRATEGIES[n].full_formats_reason or f"it writes {' and '.join(STRATEGIES[n].full_formats)}"
               for n in unable}
    why = reasons[unable[0]] if len(unable) == 1 else "; ".join(f"{n}: {r}" for n, r in reasons.items())
    return f"{', '.join(unable)} {'write' if len(unable) > 1 else 'writes'} no --full-format {full_format} ({why}): {remedy}"


def create(name: str, **options: Any) -> Strategy:
    """Build a strategy by name; options are the fields of its ``Config``."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}")
    allowed = {f.name for f in fields(cls.Config)}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"strategy {name!r} has no option {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}")
    return cls(cls.Config(**options))
