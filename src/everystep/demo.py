"""``everystep demo``: the whole job in miniature.

Trains ``gpt2-tiny`` with CheckFreq checkpointing every step, kills the training twice with
SIGKILL, recovers each time, and checks the result against an uninterrupted run without
checkpointing: every loss and the final state hash must be bitwise equal. Ends with a short
interleaved bench of every strategy, every step, on the same model at :data:`BENCH_SAMPLES` samples
a step: a step long beside the checkpoint's fixed cost, as a GPU-bound step of real training is.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .eval.kills.train import TrainConfig, run

__all__ = ["demo", "BENCH_SAMPLES"]

BENCH_SAMPLES = 64
"""Samples a step in the demo's bench (gpt2-tiny's own batch is 4: a step of a few milliseconds on
the CPU, mostly the fixed cost of whatever runs beside it)."""


def demo(directory: Path, *, steps: int = 30) -> int:
    if directory.exists():
        shutil.rmtree(directory)
    fail_at = (max(2, steps // 3), max(3, (2 * steps) // 3))
    print(f"1. reference: gpt2-tiny, {steps} steps, no checkpointing")
    ref = run(TrainConfig(workload="gpt2-tiny", strategy="none", steps=steps, seed=1))
    print(f"2. checkfreq every step into {directory / 'checkfreq'}, killed with SIGKILL during steps {fail_at}")
    cf = run(TrainConfig(workload="gpt2-tiny", strategy="checkfreq", steps=steps, seed=1,
                         directory=str(directory / "checkfreq"), fail_at=fail_at))
    for r in cf["recoveries"]:
        print(f"   killed during step {r['failed_at']}: recovered step {r['resumed_from']} from {r['source']} "
              f"in {r['recovery_seconds'] * 1e3:.1f} ms")
    same_losses = ref["losses"] == cf["losses"]
    same_state = ref["final_state_sha256"] == cf["final_state_sha256"]
    print(f"3. losses bitwise equal to the uninterrupted run: {same_losses}")
    print(f"   final state sha256 equal: {same_state} ({cf['final_state_sha256'][:16]}…)")
    print(f"   mean step time {cf['mean_step_seconds'] * 1e3:.1f} ms with checkpointing vs "
          f"{ref['mean_step_seconds'] * 1e3:.1f} ms without (two separate runs; see `everystep bench` for "
          f"an interleaved measurement)")
    print(f"   {cf['checkpoints']} checkpoints, {cf['bytes_written'] / cf['steps'] / 2**20:.2f} MiB written per step, "
          f"stall {cf['stall_seconds'] / max(1, cf['checkpoints']) * 1e3:.2f} ms per checkpoint")
    if not (same_losses and same_state):
        print("FAILED: recovery was not exact")
        return 1
    print("OK: recovery was exact")
    from .eval.bench.command import BenchConfig, markdown_table, reference_spread, run_bench, summarise
    from .strategies import STRATEGIES

    spread = {"every": 5, "parts": 2}  # (by default a GoCkpt checkpoint starts every 50 steps)
    memory = "/dev/shm" if Path("/dev/shm").is_dir() else None
    cfg = BenchConfig(workload="gpt2-tiny", strategies=tuple(STRATEGIES), steps=15, warmup=3, repeats=3,
                      compress="topk:0.01", options={"gockpt": spread, "gockpt_o": spread}, samples=BENCH_SAMPLES,
                      scratch=memory)
    print(f"4. a short bench: every strategy on gpt2-tiny at {BENCH_SAMPLES} samples a step, {cfg.steps} steps, "
          f"{cfg.repeats} interleaved repeats, all training with top-k compression (which lowdiff reuses); gockpt and "
          "gockpt_o start a checkpoint every 5 steps spread over 2; checkflow plans in the background during the "
          "first steps" + (f"; each run's directory in {memory}, so that what is measured is the cost on the "
                           "training step and not this machine's disk (on a disk, full_sync waits for it every step "
                           "and so does lightcheck's region, flushed before each commit)" if memory else ""))
    runs = run_bench(cfg)
    summary, spread_of_none = summarise(runs), reference_spread(runs)
    print(markdown_table(summary, spread_of_none))
    if spread_of_none is not None:
        print(f"   none's mean step varied by {spread_of_none:.1%} between its rounds: an overhead within that (*) "
              "is not resolved by a run this short")
    print(stalls(summary))
    return 0


def stalls(summary: dict[str, dict[str, Any]]) -> str:
    """What a bench's summary says of the thesis: how long the training thread waits per checkpoint,
    against a step, strategy by strategy (the blocking ones wait for the write, the others for a
    snapshot), and what the overheads are made of on a step this short."""
    step = summary["none"]["mean_step_seconds"]
    waits = sorted((s["stall_per_checkpoint_seconds"], name) for name, s in summary.items()
                   if name != "none" and s["stall_per_checkpoint_seconds"] is not None)
    listed = ", ".join(f"{name} {stall * 1e3:.1f} ms" for stall, name in waits)
    return (f"   a step takes {step * 1e3:.1f} ms; the training thread waits per checkpoint: {listed}.\n"
            "   A checkpoint's cost is mostly fixed: the capture on the training thread, and background work\n"
            "   competing with it for the cores. The longer the step over the same state, the smaller its share,\n"
            "   as on a GPU-bound step of real training; at gpt2-tiny's own batch (`everystep bench`) it is most\n"
            "   of a step (docs/measurements.md).")
