"""Checkflow's snapshot memory as executed, against its plan and against CheckFreq's whole copy.

Trains a workload with the ``checkflow`` strategy (a checkpoint every step), waits for the plan of
its profiled step, runs more steps under the schedule, and prints the most bytes of snapshots held
at once (accounted as they are made and freed), the plan's, and the bytes CheckFreq's snapshot of
the whole parameters and optimizer state holds at once.

    python tools/checkflow_memory.py --workload gpt2-small --bandwidth 3e8 --per-size-mib 4 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile


def measure(workload: str, bandwidth: float | None, per_size: int, steps: int) -> dict:
    import torch

    from everystep import Checkpointer
    from everystep.eval.workloads import build

    w = build(workload, seed=0)
    options = {"per_size": per_size, **({"bandwidth": bandwidth} if bandwidth else {})}
    with tempfile.TemporaryDirectory() as tmp:
        with Checkpointer(tmp, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="checkflow",
                          **options) as ckpt:
            ckpt.restore()
            for t in range(1, steps + 1):
                w.loss(w.data.next()).backward()
                w.update()
                if t == 3:
                    ckpt.wait()  # the plan is made: the steps after run it
    s = ckpt.strategy
    whole = sum(t.numel() * t.element_size() for g in w.optimizer.param_groups for p in g["params"]
                for t in (p, *[v for v in w.optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.numel() > 1]))
    found = s.plans[-1]
    return {"workload": workload, "bandwidth": bandwidth, "per_size": per_size, "feasible": found.feasible,
            "pieces": len(found.profile.tensors), "solver_seconds": found.seconds, "late": s.late,
            "peak_snapshot_bytes": s.peak_snapshot_bytes, "planned_snapshot_bytes": s.planned_snapshot_bytes,
            "checkfreq_snapshot_bytes": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--bandwidth", type=float, help="bytes/s (default: measured)")
    parser.add_argument("--per-size-mib", type=float, default=16.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    r = measure(args.workload, args.bandwidth, int(args.per_size_mib * 2**20), args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    mib = 2**20
    if not r["feasible"]:
        print(f"{r['workload']}: no feasible schedule ({r['pieces']} pieces): every checkpoint copies the whole state at once")
        return
    print(f"{r['workload']}: snapshots held at once {r['peak_snapshot_bytes'] / mib:.1f} MiB as executed, "
          f"{r['planned_snapshot_bytes'] / mib:.1f} MiB planned ({r['pieces']} pieces, {r['late']} late), "
          f"{r['checkfreq_snapshot_bytes'] / mib:.1f} MiB for CheckFreq's whole copy")


if __name__ == "__main__":
    main()
