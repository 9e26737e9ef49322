"""A run's summary, folded from its journal: losses per step, recoveries, counters, times."""

from __future__ import annotations

import statistics
from typing import Any

from ...errors import EverystepError
from .run_config import TrainConfig

__all__ = ["summarise", "merge_ranks"]


_CUMULATIVE = ("bytes_written", "stall_seconds", "checkpoints", "snapshot_wait_seconds")
"""Counters each process journals from zero; a run's total sums their last values per lifetime."""


def summarise(cfg: TrainConfig, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold a journal (one or more process lifetimes of one rank) into the run summary.

    ``losses`` holds one value per step this run executed, from ``first_step`` (1 unless the run
    resumed from a checkpoint already there) to the last: ``steps``, or the step it stopped at.
    Each of ``recoveries`` says where the failure was planned (``failed_at``), where the next
    lifetime resumed, from what, how long recovery took, what the lifetime that failed had seen
    recoverable — ``durable_before``, the newest step on storage, and ``memory_before``, the newest
    in memory that outlives the process — and ``recoverable_before``: of these, what this run's
    failure mode leaves (both after a software failure, storage after a hardware one), which no
    restart may lose.
    """
    losses: dict[int, float] = {}
    seconds: dict[int, float] = {}
    recoveries: list[dict[str, Any]] = []
    totals = dict.fromkeys(_CUMULATIVE, 0.0)
    lifetime = dict.fromkeys(_CUMULATIVE, 0.0)
    end: dict[str, Any] | None = None
    stopped: dict[str, Any] | None = None
    failures = iter(cfg.fail_at)
    durable = memory = 0  # the newest steps the lifetime that ended knew recoverable
    for r in records:
        if r["event"] == "start":
            totals = {k: totals[k] + lifetime[k] for k in _CUMULATIVE}
            lifetime = dict.fromkeys(_CUMULATIVE, 0.0)
            if r["pid"] != records[0]["pid"]:
                recoveries.append({
                    "failed_at": next(failures, None), "resumed_from": r["resumed_from"],
                    "recovery_seconds": r["recovery_seconds"], "source": r["source"], "durable_before": durable,
                    "memory_before": memory,
                    "recoverable_before": _recoverable(durable, memory, cfg.fail_mode),
                })
            durable = memory = 0
        elif r["event"] == "settled":
            durable, memory = max(durable, r["durable"]), max(memory, r["memory"])
        elif r["event"] in ("step", "end"):
            lifetime = {k: r[k] for k in _CUMULATIVE}
            if r["event"] == "step":
                durable, memory = max(durable, r.get("durable", 0)), max(memory, r.get("memory", 0))
                losses[r["step"]] = r["loss"]
                seconds[r["step"]] = r["seconds"]
            else:
                end = r
        elif r["event"] == "stop":
            stopped = {"step": r["step"], "reason": r["reason"], "at": r.get("at")}
    first = records[0]["resumed_from"] + 1 if records else 1
    last = stopped["step"] if stopped else cfg.steps
    done = [s for s in range(first, last + 1) if s in losses]
    if end is None or len(done) != last - first + 1:
        raise EverystepError(f"the run ended without finishing: {len(done)} of steps {first}..{last} recorded")
    totals = {k: totals[k] + lifetime[k] for k in _CUMULATIVE}
    return {
        "workload": cfg.workload,
        "strategy": cfg.strategy,
        "seed": cfg.seed,
        "threads": cfg.threads,
        "nproc": cfg.nproc,
        "every": cfg.every,
        "steps": cfg.steps,
        "first_step": first,
        "losses": [losses[s] for s in done],
        "final_state_sha256": end["final_state_sha256"],
        "stopped": stopped,
        "ended_at": end.get("at"),
        "recoveries": recoveries,
        "mean_step_seconds": statistics.fmean(seconds.values()) if seconds else 0.0,
        "bytes_written": int(totals["bytes_written"]),
        "stall_seconds": totals["stall_seconds"],
        "checkpoints": int(totals["checkpoints"]),
        "compress": cfg.compress,
        "fail_mode": cfg.fail_mode,
        "device": cfg.device,
        "snapshot_wait_seconds": totals["snapshot_wait_seconds"],
        "memory_tier": end.get("memory_tier"),
    }


def merge_ranks(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary for a job: rank 0's, with every rank's final hash and bytes written. What each
    failure left recoverable is what every rank had seen recoverable (the ranks recover one step
    together, each its own state; every rank records a commit once its part is in it, and a kill
    armed after a commit finds it recorded on every rank)."""
    out = dict(summaries[0])
    if len(summaries) > 1:
        out["recoveries"] = [_job_recovery([s["recoveries"][i] for s in summaries], out["fail_mode"])
                             for i in range(len(out["recoveries"]))]
        out["rank_state_sha256"] = [s["final_state_sha256"] for s in summaries]
        out["bytes_written_per_rank"] = [s["bytes_written"] for s in summaries]
        out["bytes_written"] = sum(out["bytes_written_per_rank"])
    return out


def _recoverable(durable: int, memory: int, mode: str) -> int:
    """What a failure of ``mode`` leaves: memory that outlives the process survives a software failure only."""
    return max(durable, memory) if mode == "software" else durable


def _job_recovery(ranks: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Rank 0's record of one recovery, with what the job as a whole had recoverable before it."""
    durable, memory = min(r["durable_before"] for r in ranks), min(r["memory_before"] for r in ranks)
    return {**ranks[0], "durable_before": durable, "memory_before": memory,
            "recoverable_before": _recoverable(durable, memory, mode)}
