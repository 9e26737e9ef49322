"""The GPU check's runs of the bench: which strategies each part runs (its variants, :class:`Variant`), their
interleaved rounds inside a part's time box, and what their overheads are compared with."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import EverystepError
from ..bench.libraries import LIBRARIES, missing
from .sizes import BOUND, BOUND_MEMORY_TIER, COMPRESSED, DEVICE_SNAPSHOT, EVERY_STEP, MEMORY_TIER, ONCE, REGIME, SPREAD, Box, Sizes, failure

__all__ = ["Variant", "variants", "bound_variants", "regime_variants", "over_references", "targets", "spec", "rounds", "exact"]


@dataclass(frozen=True)
class Variant:
    label: str
    strategy: str
    every: int | None
    options: dict[str, Any] = field(default_factory=dict)
    scratch: str | None = None
    compress: str | None = None
    """The gradient compression training runs with (:data:`~everystep.eval.gpu.sizes.COMPRESSED`)."""
    workload: str | None = None
    """None: the sizes' workload."""
    steps: int | None = None
    """Steps of its runs, and the first ``warmup`` left out of the timing (None: the sizes')."""
    warmup: int | None = None
    samples: int | None = None
    """Samples a step (None: the workload's batch)."""
    once: bool = False
    """Measured in the first round only (:data:`~everystep.eval.gpu.sizes.ONCE`: bound by the disk)."""


def variants(sizes: Sizes) -> list[Variant]:
    """``none``, :data:`EVERY_STEP` every step, :data:`MEMORY_TIER` every step with their memory tier
    (``NAME+memory``), the checkpointing libraries every step where they import
    (:mod:`~everystep.eval.bench.libraries`), CheckFreq snapshotting on the device (:data:`DEVICE_SNAPSHOT`), :data:`SPREAD`
    every ``spread_every`` steps (labelled ``NAME/K``) to the directory and with their memory tier
    (``NAME+memory/K``), and a ``none`` with each compression a strategy reuses (``none+C``);
    lightcheck's checkpoint directory, and so its region, in ``/dev/shm``. What writes the whole state
    to the directory every step or every K, :data:`ONCE`, runs in the first round only."""
    found = [Variant("none", "none", None)] + _compressed_references()
    found += [_every_step(name, sizes, sizes.warmup) for name in EVERY_STEP] + [_memory_tier(name) for name in MEMORY_TIER]
    found += [Variant(name, name, 1) for name in LIBRARIES if missing(name) is None]  # (where the device machine has them)
    found.append(Variant(DEVICE_SNAPSHOT, "checkfreq", 1, {"snapshot": "device"}, once=True))
    for name in SPREAD:
        options = {"parts": sizes.spread_parts} if name.startswith("gockpt") else {}
        for memory in (False, True):
            found.append(Variant(f"{name}{'+memory' if memory else ''}/{sizes.spread_every}", name, sizes.spread_every,
                                 {**options, **({"memory": True} if memory else {})}, steps=sizes.spread_steps,
                                 warmup=sizes.spread_warmup, once=not memory))
    return found


def bound_variants(sizes: Sizes) -> list[Variant]:
    """The ``bound`` part's: ``none`` (and its compressed twins) and :data:`BOUND` every step, on the
    GPU-bound workload."""
    chosen = [Variant("none", "none", None)] + _compressed_references()
    chosen += [_every_step(name, sizes, sizes.bound_warmup) for name in BOUND]
    chosen += [_memory_tier(name) for name in BOUND_MEMORY_TIER]
    # lowdiff last: its step there took seconds (a write of 6 GB each batch, on an H200), and a round
    # cut by the time box cut the runs after it, the memory tier's among them
    chosen.sort(key=lambda v: v.label == "lowdiff")
    return [dataclasses.replace(v, workload=sizes.bound_workload, steps=v.steps or sizes.bound_steps,
                                warmup=sizes.bound_warmup) for v in chosen]


def _every_step(name: str, sizes: Sizes, warmup: int) -> Variant:
    """``name`` every step: ``lowdiff_plus`` its replica (persisted at its own interval); ``lowdiff`` a
    differential, b in a write, a full checkpoint every F (:attr:`Sizes.lowdiff_every`), timed over
    F steps after ``warmup``."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if name == "lowdiff":
        return Variant(name, name, sizes.lowdiff_every, {"batch": sizes.lowdiff_batch}, compress=COMPRESSED.get(name),
                       steps=warmup + sizes.lowdiff_every)
    every = None if name == "lowdiff_plus" else 1
    return Variant(name, name, every, scratch=shm if name == "lightcheck" else None, compress=COMPRESSED.get(name),
                   once=name in ONCE)


def regime_variants(sizes: Sizes) -> list[Variant]:
    """The ``regime`` part's: ``none`` and :data:`REGIME` every ``regime_every`` steps (labelled
    ``NAME/K``) on the workload whose copy spans several steps, each with its memory tier (GoCkpt's
    spread checkpoints go there)."""
    every = sizes.regime_every
    chosen = [Variant("none", "none", None)] + [Variant(f"{name}/{every}", name, every, {"memory": True})
                                                 for name in REGIME]
    return [dataclasses.replace(v, workload=sizes.regime_workload, steps=sizes.regime_steps, warmup=sizes.regime_warmup,
                                samples=sizes.regime_samples) for v in chosen]


def _memory_tier(name: str) -> Variant:
    return Variant(f"{name}+memory", name, 1, {"memory": True})


def _compressed_references() -> list[Variant]:
    return [Variant(f"none+{c}", "none", None, compress=c) for c in dict.fromkeys(COMPRESSED.values())]


def over_references(summary: dict[str, dict[str, Any]], runs: list[dict[str, Any]], chosen: list[Variant]) -> None:
    """A run with a gradient compression is compared with the ``none`` run of the same round that
    trains with the same one: its summary's overhead (and each round's) is over that run, and
    ``reference`` names it."""
    for v in chosen:
        if v.compress is None or v.strategy == "none" or v.label not in summary:
            continue
        reference = f"none+{v.compress}"
        base = {r["repeat"]: r["mean_step_seconds"] for r in runs if r["strategy"] == reference}
        overheads = [r["mean_step_seconds"] / base[r["repeat"]] - 1 for r in runs
                     if r["strategy"] == v.label and r["repeat"] in base]
        if overheads:
            summary[v.label].update(overhead=statistics.median(overheads), overheads=overheads, reference=reference)


def targets(summary: dict[str, dict[str, Any]], most: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each strategy's overhead against the most it may cost (``met`` None where it was not measured)."""
    found = {}
    for name, limit in most.items():
        overhead = summary.get(name, {}).get("overhead")
        found[name] = {"overhead": overhead, "target_at_most": limit,
                       "met": None if overhead is None else overhead <= limit}
    return found


def spec(sizes: Sizes, v: Variant, repeat: int, steps: int | None = None, *, checks: bool = True,
         trace: str | None = None) -> dict[str, Any]:
    """The run of ``v`` in round ``repeat``: its recovery and resume checks only where ``checks``,
    its trace to the path stem ``trace`` (None: none)."""
    from ..bench.command import BenchConfig, run_spec

    cfg = BenchConfig(workload=v.workload or sizes.workload, strategies=(v.strategy,),
                      steps=steps or v.steps or sizes.steps, warmup=v.warmup or sizes.warmup, repeats=1,
                      device=sizes.device, options={v.strategy: v.options}, scratch=v.scratch, compress=v.compress,
                      samples=v.samples)
    return {**run_spec(cfg, repeat, v.strategy, v.every), "checks": checks, "trace": trace}


def rounds(sizes: Sizes, chosen: list[Variant], repeats: int, box: Box, failures: list[dict[str, str]], part: str,
           steps: int | None = None, say: Callable[[str], None] = print, traces: Path | None = None,
           checks: bool = True) -> tuple[list[dict[str, Any]], int]:
    """Interleaved rounds of ``chosen`` (repeat r starts r places along), each run labelled by its
    variant, its ``wall_seconds`` beside it: the recovery and resume checks in the first round only,
    and the variants measured :attr:`~Variant.once` in it alone. A round starts only while the box
    holds one as long as its runs took last time (the first round's without its checks). A variant
    that fails is reported and left out of the rounds after. ``traces``: a folder for each run's
    trace (:func:`~everystep.tracing.run_stem`); ``checks`` False: no run checks its recovery. Returns the runs of
    complete rounds and their number."""
    from ... import tracing
    from ..bench.command import measure_run

    runs: list[dict[str, Any]] = []
    done = 0
    failed: set[str] = set()
    took: dict[str, float] = {}  # a variant's last run, without its checks: what the next will take
    for r in range(repeats):
        live = [v for v in chosen if v.label not in failed and (r == 0 or not v.once)]
        if r and box.left() < 1.1 * sum(took.get(v.label, 0.0) for v in live):
            say(f"  {part}: {done} round(s); the box has no time for another")
            break
        order = [live[(r + i) % len(live)] for i in range(len(live))]
        mine: list[dict[str, Any]] = []
        for i, v in enumerate(order):
            if box.left() <= 0:
                break
            say(f"  {part}: round {r + 1}/{repeats}, run {i + 1}/{len(order)}: {v.label}")
            stem = tracing.run_stem(traces, f"{part}_{v.label}", r) if traces is not None else None
            started = time.monotonic()
            try:
                got = measure_run(spec(sizes, v, r, steps, checks=checks and r == 0, trace=None if stem is None else str(stem)),
                                  timeout=max(box.left(), 1))
            except EverystepError as e:
                failures.append(failure(part, f"{v.label}, round {r + 1}", str(e)))
                failed.add(v.label)
                if v.label == "none" or box.left() <= 0:
                    break
                continue
            wall = time.monotonic() - started
            took[v.label] = wall - got.get("seconds", {}).get("checks", 0.0)
            mine.append({**got, "strategy": v.label, "run_strategy": v.strategy, "workload": v.workload or sizes.workload,
                         "compress": v.compress, "wall_seconds": wall})
        complete = "none" not in failed and {m["strategy"] for m in mine} == {v.label for v in order} - failed
        if not complete:
            say(f"  {part}: round {r + 1} incomplete, left out")
            break
        runs.extend(mine)
        done += 1
    return runs, done


def exact(strategy: str, device: str) -> bool:
    """Whether a run of ``strategy`` must resume bitwise: not the peers (they keep no RNG or data
    position), not a lossy strategy, not ``lowdiff_plus`` on a GPU (its replica is updated by the
    CPU's arithmetic until the next re-base)."""
    from ...strategies import STRATEGIES

    return strategy in STRATEGIES and STRATEGIES[strategy].exact and not (strategy == "lowdiff_plus" and device == "cuda")
