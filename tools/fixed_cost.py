"""The fixed cost of a checkpoint on a short step, measured in one process against ``none``.

One copy of the workload trains with no checkpointing and one under each strategy (a checkpoint
every step, or the strategy's own interval for the differential ones), all in one process; blocks
of steps go round the copies, in a rotated order, and each round gives every strategy one
overhead ratio against the ``none`` block of that round. One process, one machine state: the slow
drifts of a noisy machine cancel within a round, where separate processes (``everystep bench``)
see them as spread, and strategies measured together are compared under the same drifts. Work
still in flight at the end of a block is waited for outside the timing.

With each overhead it prints where the time goes, per step of the strategy's blocks: the training
thread's time inside everystep (its hooks, waits included), the CPU time (user and system, from
``/proc``) of the threads the strategy started in this process (not of another process:
``lowdiff_plus``'s agent, the writer of ``persist=process``), and the machine's inter-processor
interrupts of two kinds (``/proc/interrupts``: function calls, which a thread woken on another core
costs, and TLB shootdowns) — the rest of what a strategy costs is interference: background work
competing with training for the GIL and the cores (``tools/interference.py`` measures it by kind).

    python tools/fixed_cost.py --strategies checkfreq,lowdiff,lowdiff_plus [--src DIR]

A strategy may carry options after ``+``: ``checkfreq+persist=process``.

``--src`` measures another checkout's ``src`` (an earlier commit) with the same method.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any


def _thread_cpu(tids: set[int]) -> float:
    """CPU seconds (user and system) the threads ``tids`` of this process have used so far."""
    ticks = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _ipis() -> int:
    """Inter-processor interrupts so far, machine-wide, of the kinds background work causes: function
    calls (a thread woken on another core: a GIL or queue hand-over) and TLB shootdowns (pages
    unmapped or write-protected while another thread of the process runs)."""
    total = 0
    with contextlib.suppress(OSError), open("/proc/interrupts") as f:
        for line in f:
            name, _, counts = line.partition(":")
            if name.strip() in ("CAL", "TLB"):
                total += sum(int(c) for c in counts.split() if c.isdigit())
    return total


def _tids() -> set[int]:
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def measure(specs: list[str], workload: str, compress: str, blocks: int, steps: int,
            profile: dict[str, dict[str, float]] | None = None) -> dict[str, list[float]]:
    """Each strategy's overhead ratio over ``none``, one per round of blocks; ``profile`` gets, per
    strategy, the training thread's seconds inside everystep, its threads' CPU seconds and the
    inter-processor interrupts (its own and ``none``'s), per step."""
    import torch

    from everystep import Checkpointer
    from everystep.eval.bench.command import interleaved_order
    from everystep.eval.bench.measure import _step
    from everystep.eval.workloads import build

    torch.set_num_threads(1)
    arms: list[tuple[str, Any, Any]] = []  # (name, workload, checkpointer or None)
    medians: list[dict[str, float]] = [{} for _ in range(blocks)]  # per round, each arm's median step
    threads: dict[str, set[int]] = {}
    inside = {spec: 0.0 for spec in specs}
    cpu = {spec: 0.0 for spec in specs}
    ipis = {spec: 0 for spec in ["none", *specs]}
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        arms.append(("none", build(workload, seed=0, compress=compress), None))
        for i, spec in enumerate(specs):
            strategy, *given = spec.split("+")
            options = {k: int(v) if v.isdigit() else v for k, _, v in (o.partition("=") for o in given)}
            every = {} if strategy in ("lowdiff", "naive_diff", "lowdiff_plus") or "every" in options else {"every": 1}
            w = build(workload, seed=0, compress=compress)
            before = _tids()
            ckpt = stack.enter_context(Checkpointer(f"{d}/c{i}", w.model, w.optimizer, scheduler=w.scheduler,
                                                    data=w.data, compression=w.compression, strategy=strategy,
                                                    **every, **options))
            ckpt.restore()
            _step(w)  # (threads a strategy starts at its first step)
            threads[spec] = _tids() - before
            arms.append((spec, w, ckpt))
        for _, w, ckpt in arms:
            for _ in range(3):
                _step(w)
            if ckpt is not None:
                ckpt.wait()
        by_name = {name: (w, ckpt) for name, w, ckpt in arms}
        for b, name in interleaved_order(list(by_name), blocks):
            w, ckpt = by_name[name]
            times = []
            if ckpt is not None:
                stall, used = ckpt.stats.stall_seconds, _thread_cpu(threads[name])
            interrupts = _ipis()
            for _ in range(steps):
                t0 = time.perf_counter()
                _step(w)
                times.append(time.perf_counter() - t0)
            if ckpt is not None:
                ckpt.wait()
                inside[name] += ckpt.stats.stall_seconds - stall
                cpu[name] += _thread_cpu(threads[name]) - used
            ipis[name] += _ipis() - interrupts
            medians[b][name] = statistics.median(times)
    if profile is not None:
        for spec in specs:
            profile[spec] = {"inside": inside[spec] / (blocks * steps), "threads_cpu": cpu[spec] / (blocks * steps),
                             "ipis": ipis[spec] / (blocks * steps), "ipis_none": ipis["none"] / (blocks * steps)}
    return {spec: [m[spec] / m["none"] - 1 for m in medians] for spec in specs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="checkfreq,lowdiff,lowdiff_plus")
    parser.add_argument("--workload", default="gpt2-tiny")
    parser.add_argument("--compress", default="topk:0.01")
    parser.add_argument("--blocks", type=int, default=16, help="rounds of blocks")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--src", help="import everystep from this source directory")
    args = parser.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    profile: dict[str, dict[str, float]] = {}
    for spec, ratios in measure(args.strategies.split(","), args.workload, args.compress, args.blocks,
                                args.steps, profile).items():
        q = statistics.quantiles(ratios, n=4)
        print(f"{spec}: overhead {statistics.median(ratios):+.1%} (median of {len(ratios)} rounds; "
              f"quartiles {q[0]:+.1%} to {q[2]:+.1%}); per step: {profile[spec]['inside'] * 1e3:.2f} ms of the "
              f"training thread inside everystep, {profile[spec]['threads_cpu'] * 1e3:.2f} ms CPU of its threads, "
              f"{profile[spec]['ipis']:.1f} inter-processor interrupts (none: {profile[spec]['ipis_none']:.1f})",
              flush=True)


if __name__ == "__main__":
    main()
