"""The fixed cost of a checkpoint on a short step, measured in one process against ``none``.

Two copies of a workload train side by side, one under the strategy (a checkpoint every step,
or the strategy's own interval for the differential ones), one with no checkpointing; blocks of
steps alternate between them, and each block pair gives one overhead ratio. One process, one
machine state: the slow drifts of a noisy machine cancel in each pair, where separate processes
(``everystep bench``) see them as spread. Work still in flight at the end of a block is waited
for outside the timing.

    python tools/fixed_cost.py --strategies checkfreq,lowdiff,lowdiff_plus [--src DIR]

A strategy may carry options after ``+``: ``checkfreq+persist=process``.

``--src`` measures another checkout's ``src`` (an earlier commit) with the same method.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def measure(spec: str, workload: str, compress: str, blocks: int, steps: int) -> list[float]:
    import torch

    from everystep import Checkpointer
    from everystep.eval.measure import _step
    from everystep.eval.workloads import build

    torch.set_num_threads(1)
    strategy, *given = spec.split("+")
    options = {k: v for k, _, v in (o.partition("=") for o in given)}
    plain, checked = (build(workload, seed=0, compress=compress) for _ in range(2))
    every = {} if strategy in ("lowdiff", "naive_diff", "lowdiff_plus") else {"every": 1}
    ratios = []
    with tempfile.TemporaryDirectory() as d:
        with Checkpointer(f"{d}/c", checked.model, checked.optimizer, scheduler=checked.scheduler, data=checked.data,
                          compression=checked.compression, strategy=strategy, **every, **options) as ckpt:
            ckpt.restore()
            for _ in range(3):
                _step(plain), _step(checked)
            for _ in range(blocks):
                times: dict[int, list[float]] = {0: [], 1: []}
                for arm, w in enumerate((plain, checked)):
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        _step(w)
                        times[arm].append(time.perf_counter() - t0)
                ckpt.wait()
                ratios.append(statistics.median(times[1]) / statistics.median(times[0]) - 1)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="checkfreq,lowdiff,lowdiff_plus")
    parser.add_argument("--workload", default="gpt2-tiny")
    parser.add_argument("--compress", default="topk:0.01")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--src", help="import everystep from this source directory")
    args = parser.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    for strategy in args.strategies.split(","):
        ratios = measure(strategy, args.workload, args.compress, args.blocks, args.steps)
        q = statistics.quantiles(ratios, n=4)
        print(f"{strategy}: overhead {statistics.median(ratios):+.1%} (median of {len(ratios)} block pairs; "
              f"quartiles {q[0]:+.1%} to {q[2]:+.1%})", flush=True)


if __name__ == "__main__":
    main()
