"""``everystep plan --checkflow``: profile a workload's step and plan its snapshots and offloads."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..capture.profile import profile_step
from ..policy.schedule import StepProfile, coarsen, plan
from .workloads import build
from .plotting import pyplot

__all__ = ["plan_workload"]


def plan_workload(workload: str, *, bandwidth: float, per_size: int, memory_limit: int | None = None,
                  steps: int = 48, device: str = "cpu", in_backward: bool = False,
                  batch: int | None = None) -> dict[str, Any]:
    """Profile one step of ``workload`` (after two warm-up steps), merge it into at most ``steps``
    time steps, plan it, and compare the plan's peak with CheckFreq's and with no checkpointing."""
    w = build(workload, seed=0, device=device, in_backward=in_backward, batch=batch)

    def one() -> None:
        w.loss(w.data.next()).backward()
        w.update()

    for _ in range(2):
        one()
    fine = profile_step(w.model, w.optimizer, one)
    coarse, spans = coarsen(fine, steps, group_bytes=per_size)
    found = plan(coarse, bandwidth=bandwidth, per_size=per_size, memory_limit=memory_limit)
    return {
        "workload": workload, "batch": w.data.batch_size, "device": device, "bandwidth": bandwidth,
        "per_size": per_size,
        "operators": fine.steps, "time_steps": coarse.steps, "tensors": len(fine.tensors),
        "groups": len(coarse.tensors), "pieces": len(found.profile.tensors), "splits": found.splits,
        "feasible": found.feasible, "reason": found.reason, "solver_seconds": found.seconds,
        "step_seconds": sum(fine.times), "checkpoint_bytes": sum(t.nbytes for t in fine.tensors),
        "peak": found.peak, "peak_none": max(fine.resident), "peak_checkfreq": checkfreq_peak(fine, bandwidth),
        "memory_limit": found.memory_limit,
        "schedule": asdict(found.schedule) if found.schedule else None, "spans": spans,
        "profile": {"times": list(coarse.times), "resident": list(coarse.resident)},
        "pieces_bytes": [t.nbytes for t in found.profile.tensors],
    }


def plot_schedule(result: dict[str, Any], path: str) -> None:
    """The schedule over the time steps: bytes alive without checkpointing, snapshots held on top,
    and the bytes offloaded in each time step."""
    plt = pyplot()

    resident = [r / 2**20 for r in result["profile"]["resident"]]
    steps = range(len(resident))
    held, moved = [0.0] * len(resident), [0.0] * len(resident)
    schedule = result["schedule"]
    for size, c, s in zip(result["pieces_bytes"], schedule["created"], schedule["offloaded"]):
        for t in range(c, s + 1):
            held[t] += size / 2**20
        moved[s] += size / 2**20
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True, height_ratios=(3, 1))
    top.stackplot(steps, resident, held, labels=["alive without checkpointing", "snapshots held"])
    top.set_ylabel("device MiB")
    top.legend(loc="upper left")
    top.set_title(f"{result['workload']}, batch {result['batch']}: Checkflow schedule at "
                  f"{result['bandwidth'] / 1e9:g} GB/s")
    bottom.bar(steps, moved)
    bottom.set_ylabel("offloaded MiB")
    bottom.set_xlabel("time step (merged operators)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def checkfreq_peak(profile: StepProfile, bandwidth: float) -> int:
    """CheckFreq's device peak, counted as the ILP counts: every tensor snapshotted at once at the
    first operator and offloaded over the link from the next one on, each byte held up to and
    including the operator that offloads it."""
    total = sum(t.nbytes for t in profile.tensors)
    peak, moved = 0, 0.0
    for t, (seconds, resident) in enumerate(zip(profile.times, profile.resident)):
        peak = max(peak, resident + max(0, int(total - moved)))
        if t:
            moved += bandwidth * seconds
    return peak
