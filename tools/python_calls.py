"""Python calls per training step on each thread of the training process, under one strategy.

``.venv/bin/python tools/python_calls.py --strategy lightcheck --workload gpt2-small`` trains the
workload on the CPU with the strategy checkpointing every step, counts every Python function call
(``sys.setprofile`` on the training thread, ``threading.setprofile`` on the threads started after it:
the strategy's workers) over ``--steps`` steps after ``--warmup``, and prints the calls per step of
each thread by its name. On a step bound by the host launching kernels (a short step on a GPU), the
calls of a thread other than the training thread take the interpreter's lock from it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from everystep import Checkpointer
from everystep.eval.workloads import build


def calls_per_step(strategy: str, workload: str, *, steps: int, warmup: int, options: dict[str, Any]) -> dict[str, float]:
    """The Python calls per step of each thread (see the module docstring)."""
    torch.set_num_threads(1)
    w = build(workload, seed=0)
    counts: collections.Counter[str] = collections.Counter()
    counting = threading.Event()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and counting.is_set():
            counts[threading.current_thread().name] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
            with Checkpointer(Path(tmp) / "ckpt", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                              strategy=strategy, **options) as ckpt:
                ckpt.restore()
                for step in range(warmup + steps):
                    if step == warmup:
                        ckpt.wait()
                        counting.set()
                    loss = w.loss(w.data.next())
                    loss.backward()
                    w.optimizer.step()
                    w.optimizer.zero_grad()
                    w.scheduler.step()
                ckpt.wait()
                counting.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return {name: n / steps for name, n in sorted(counts.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/python_calls.py", description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="lightcheck")
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a strategy option (a JSON value: every=1, layerwise=false)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    found = calls_per_step(args.strategy, args.workload, steps=args.steps, warmup=args.warmup, options=options)
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    print(f"{args.strategy} on {args.workload}, every step, Python calls per step ({args.steps} steps after "
          f"{args.warmup}):")
    for name, n in found.items():
        print(f"  {name}: {n:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
