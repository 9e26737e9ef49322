"""What background work costs a short training step, by kind: the coefficient behind a fixed cost.

A copy of the workload trains with nothing beside it, and with background work started at each
step's start, finished before the next: ``--ms`` milliseconds of CPU time (of the worker's own
thread) of one kind, in a thread of the training process or in another process —

- ``python``: a loop of Python bytecode, which holds the GIL (serialisation, JSON, bookkeeping);
- ``copy``: ``Tensor.copy_`` of 16 MiB, which releases the GIL (a snapshot, a hash, ``fsync``).

Blocks of steps go round the arms in a rotated order, as ``everystep bench`` interleaves its
repeats. For each arm it prints the overhead over the bare step and the training time lost per
millisecond of background work: above 1, the work delays training by more than it takes (GIL
hand-overs); below 1, training only shares the cores, caches and memory bandwidth with it.

    python tools/interference.py [--workload gpt2-tiny] [--compress topk:0.01] [--ms 2] [--blocks 10] [--steps 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

_SOURCE = torch.empty(4 << 20, dtype=torch.float32)
_TARGET = torch.empty_like(_SOURCE)


def python_work(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    total = 0
    while time.thread_time() < end:
        for i in range(200):
            total += i


def copy_work(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        _TARGET.copy_(_SOURCE)


WORK: dict[str, Callable[[float], None]] = {"python": python_work, "copy": copy_work}


def _serve(kind: str, ms: float, conn: Connection) -> None:
    """The other process's side: one unit of work per request, answered when done."""
    torch.set_num_threads(1)
    while conn.recv():
        WORK[kind](ms)
        conn.send(True)
    conn.close()


class Background:
    """``start()`` has one unit of work begin (in a thread or another process); ``finish()``
    waits for it."""

    def __init__(self, where: str, kind: str, ms: float) -> None:
        self._thread: threading.Thread | None = None
        self._process = None
        if where == "thread":
            go, done = threading.Semaphore(0), threading.Semaphore(0)

            def loop() -> None:
                while go.acquire() and not self._closing:
                    WORK[kind](ms)
                    done.release()

            self._closing = False
            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()
            self._go, self._done = go, done
        else:
            ours, theirs = multiprocessing.get_context("spawn").Pipe()
            self._process = multiprocessing.get_context("spawn").Process(target=_serve, args=(kind, ms, theirs),
                                                                          daemon=True)
            self._process.start()
            theirs.close()
            self._conn = ours

    def start(self) -> None:
        if self._thread is not None:
            self._go.release()
        else:
            self._conn.send(True)

    def finish(self) -> None:
        if self._thread is not None:
            self._done.acquire()
        else:
            self._conn.recv()

    def close(self) -> None:
        if self._thread is not None:
            self._closing = True
            self._go.release()
            self._thread.join()
        else:
            self._conn.send(False)
            self._process.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-tiny")
    parser.add_argument("--compress", default="topk:0.01", help="the workload's gradient compression ('none': without)")
    parser.add_argument("--ms", type=float, default=2.0, help="CPU milliseconds of background work per step")
    parser.add_argument("--blocks", type=int, default=10, help="rounds of blocks")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    args = parser.parse_args()

    from everystep.eval.bench.command import interleaved_order
    from everystep.eval.bench.measure import _step
    from everystep.eval.workloads import build

    torch.set_num_threads(1)
    w = build(args.workload, seed=0, compress=None if args.compress == "none" else args.compress)
    for _ in range(5):
        _step(w)
    arms: list[tuple[str, Background | None]] = [("none", None)]
    arms += [(f"{kind} in a {where}", Background(where, kind, args.ms))
             for where in ("thread", "process") for kind in WORK]
    by_name = dict(arms)
    medians: dict[str, list[float]] = {name: [] for name in by_name}  # each round's median step, per arm
    try:
        for _, name in interleaved_order(list(by_name), args.blocks):
            background = by_name[name]
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if background is not None:
                    background.start()
                _step(w)
                times.append(time.perf_counter() - t0)
                if background is not None:
                    background.finish()  # (outside the timing: work longer than a step is not counted)
            medians[name].append(statistics.median(times))
    finally:
        for _, background in arms:
            if background is not None:
                background.close()
    base = statistics.median(medians["none"])
    print(f"{args.workload}: a bare step takes {base * 1e3:.2f} ms (median); background work of {args.ms:g} ms "
          f"CPU a step:")
    for name, _ in arms[1:]:
        ratios = [x / y - 1 for x, y in zip(medians[name], medians["none"])]
        overhead, q = statistics.median(ratios), statistics.quantiles(ratios, n=4)
        print(f"  {name}: overhead {overhead:+.1%} (quartiles {q[0]:+.1%} to {q[2]:+.1%}); "
              f"{overhead * base * 1e3 / args.ms:.2f} ms of training lost per ms of work")


if __name__ == "__main__":
    main()
