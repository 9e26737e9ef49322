"""Where a checkpoint every K steps stalls training, in its steady state: the training thread's time in
each of a strategy's hooks, per strategy, in interleaved rounds.

Each run trains ``--workload`` for ``2 * every + parts + 1`` warm-up steps (through two checkpoints:
a strategy's second host buffer is made when a checkpoint begins while the one before is still being
written) and then ``3 * every`` timed steps. It prints one JSON line per run: the mean and median
step, the stall the Checkpointer counted (``stats.stall_seconds``) and the checkpoints made in the
timed steps, the time spent in each of GoCkpt's hooks (``_begin``, ``_before_update``,
``_copy_gradients``, ``_copy_part``, ``_finish``; not the final checkpoint written at close), and
every timed step.

    PYTHONPATH=src python tools/spread_stall.py --device cuda --scratch /dev/shm \\
        --strategies none,gockpt,gockpt_o,async,checkfreq --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from typing import Any

HOOKS = ("_begin", "_finish", "_before_update", "_copy_gradients", "_copy_part")


def timed_hooks(strategy: Any, spent: collections.Counter[str]) -> None:
    """Wrap the strategy's hooks that exist so that their time adds up in ``spent``."""
    for name in HOOKS:
        method = getattr(strategy, name, None)
        if method is None:
            continue

        def wrapper(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(strategy, name, wrapper)


def run(name: str, args: argparse.Namespace, round_: int) -> dict[str, Any]:
    from everystep import Checkpointer
    from everystep.eval.bench.measure import _step
    from everystep.eval.workloads import build

    warmup = 2 * args.every + args.parts + 1
    steps = warmup + 3 * args.every
    w = build(args.workload, seed=0, device=args.device)
    options = {} if name == "none" else {"every": args.every, **({"parts": args.parts} if name.startswith("gockpt") else {})}
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        ckpt = Checkpointer(f"{tmp}/c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=name, **options)
        spent: collections.Counter[str] = collections.Counter()
        timed_hooks(ckpt.strategy, spent)
        ckpt.restore()
        times, stall0, made0 = [], 0.0, 0
        for step in range(1, steps + 1):
            if step == warmup + 1:
                ckpt.wait()
                stall0, made0 = ckpt.stats.stall_seconds, ckpt.stats.checkpoints
                spent.clear()
            t0 = time.perf_counter()
            _step(w)
            if step > warmup:
                times.append(time.perf_counter() - t0)
        stall = ckpt.stats.stall_seconds - stall0
        ckpt.wait()
        made = ckpt.stats.checkpoints - made0
        hooks = {k: round(1e3 * v, 2) for k, v in spent.items()}
        ckpt.close()
    return {"round": round_, "strategy": name, "mean_step_ms": round(1e3 * statistics.mean(times), 2),
            "median_step_ms": round(1e3 * statistics.median(times), 2), "stall_ms": round(1e3 * stall, 2),
            "checkpoints": made, "hooks_ms": hooks, "steps_ms": [round(1e3 * t, 1) for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="none,gockpt,gockpt_o,async,checkfreq")
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--parts", type=int, default=7, help="GoCkpt's K")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="where the checkpoint directories go (default: the temp dir)")
    args = parser.parse_args()
    names = args.strategies.split(",")
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each round starts one further along
            print(json.dumps(run(name, args, r)), flush=True)


if __name__ == "__main__":
    main()
