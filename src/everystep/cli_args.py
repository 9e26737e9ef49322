"""The types of the command line's values: each parses one flag's text, or says what is wrong with it;
what can be refused before any work (:func:`preflight`); an error's message on one line."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["STRATEGY_NAMES", "WORKLOAD_NAMES", "OPTIMIZER_NAMES", "PARALLEL_NAMES", "step_list", "whole", "THREADS", "number", "POSITIVE", "NOT_NEGATIVE", "byte_amount", "RATE", "SIZE", "MIB", "comma_list", "whole_list", "option", "strategy_option", "gpu_check_parts", "preflight", "one_line"]

# The choices of the flags that name a registry's entry, written out: the registries import PyTorch,
# and the parser does not, so that `everystep --help` and a mistyped flag answer at once.
# tests/test_cli.py checks each against its registry.
STRATEGY_NAMES = ("async", "checkflow", "checkfreq", "full_sync", "gockpt", "gockpt_o", "lightcheck", "lowdiff",
                  "lowdiff_plus", "naive_diff", "none")
"""``--strategy``: the names of :data:`everystep.strategies.STRATEGIES`, sorted."""
WORKLOAD_NAMES = ("mlp", "gpt2-tiny", "gpt2-small", "gpt2-medium", "resnet")
"""``--workload``: the names of :data:`everystep.eval.workloads.WORKLOADS`, smallest first."""
OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw")
"""``--optimizer``: the names of :data:`everystep.eval.workloads.OPTIMIZERS`."""
PARALLEL_NAMES = ("ddp", "fsdp", "hsdp", "zero1")
"""``--parallel``: :data:`everystep.eval.workloads.PARALLEL`."""


def step_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated step numbers like 7,19; got {text!r}") from None


def whole(least: int, most: int | None = None, what: str = "") -> Any:
    """An argparse type: a whole number from ``least`` (to ``most``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number; got {text!r}") from None
        top = most() if callable(most) else most
        if value < least or (top is not None and value > top):
            span = f"from {least} to {top}{what}" if top is not None else f"at least {least}"
            raise argparse.ArgumentTypeError(f"must be {span}; got {value}")
        return value

    return parse


def _cores() -> int:
    from .eval.kills.run_config import usable_cores

    return usable_cores()


THREADS = whole(1, _cores, " (the cores this process may run on)")


def number(least: float, *, above: bool, what: str = "") -> Any:
    """An argparse type: a finite number above (or from) ``least``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
        if not math.isfinite(value) or value < least or (above and value == least):
            raise argparse.ArgumentTypeError(f"must be a finite number {'above' if above else 'of at least'} "
                                             f"{least:g}{what}; got {text}")
        return value

    return parse


POSITIVE = number(0, above=True)
NOT_NEGATIVE = number(0, above=False)


def byte_amount(*, rate: bool, unit: float = 1.0, plausible: float = 0.0, least: float = 0.0) -> Any:
    """An argparse type: a size or rate with an optional unit (:mod:`everystep.units`), in bytes
    (or bytes/s); a bare number is in ``unit`` bytes."""
    from .units import UnitError, parse_bytes

    def parse(text: str) -> float:
        try:
            value = parse_bytes(text, rate=rate, unit=unit, plausible=plausible)
        except UnitError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least:g} bytes; got {text}")
        return value

    return parse


RATE = byte_amount(rate=True, plausible=1e5)  # below 100 kB/s: a unit was forgotten (16 meaning 16GB/s)
SIZE = byte_amount(rate=False, plausible=1024)
MIB = 2**20


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def whole_list(text: str) -> tuple[int, ...]:
    """Comma-separated whole numbers, each at least 1."""
    try:
        values = tuple(int(s) for s in comma_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers of at least 1; got {text!r}")
    return values


def option(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE; got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def strategy_option(text: str) -> tuple[tuple[str, str], Any]:
    target, dot, rest = text.partition(".")
    if not dot or not target.isidentifier():
        raise argparse.ArgumentTypeError(f"expected STRATEGY.NAME=VALUE; got {text!r}")
    name, value = option(rest)
    return (target, name), value


def gpu_check_parts(text: str) -> tuple[str, ...]:
    from .eval.gpu.sizes import ALL_PARTS

    chosen = comma_list(text)
    unknown = [p for p in chosen if p not in ALL_PARTS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ALL_PARTS)}; got {text!r}")
    return chosen


def preflight(args: argparse.Namespace) -> None:
    """What can be refused before any work: a file that could not be written at the end (a run's
    summary would be lost), a figure that could not be drawn."""
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if path:
            problem = _unwritable(Path(path))
            if problem:
                raise ConfigError(f"--{flag} {path}: {problem}")
    out = getattr(args, "out", None)
    if out:
        problem = _unwritable(Path(out) / "report")
        if problem:
            raise ConfigError(f"--out {out}: {problem}")
    if getattr(args, "plot", None):
        from .eval.plotting import check_plotting

        check_plotting()


def _unwritable(path: Path) -> str | None:
    """Why ``path`` could not be written (its folders made as needed), or None."""
    if path.is_dir():
        return "is a folder"
    if path.exists():
        return None if os.access(path, os.W_OK) else "cannot be written (permission denied)"
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    return None if os.access(folder, os.W_OK | os.X_OK) else f"{folder} cannot be written (permission denied)"


def one_line(e: BaseException) -> str:
    """An error's message on one line (a message that quotes another tool's traceback keeps its last line)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(e).__name__
    return f"{lines[0]} … {lines[-1]}"
