"""Python calls per training step on each thread of the training process, under one strategy, and
what the training thread waits on the device for.

``.venv/bin/python tools/python_calls.py --strategy lightcheck --workload gpt2-small`` trains the
workload on the CPU with the strategy checkpointing every step, counts every Python function call
(``sys.setprofile`` on the training thread, ``threading.setprofile`` on the threads started after it:
the strategy's workers) over ``--steps`` steps after ``--warmup``, and prints the calls per step of
each thread by its name. On a step bound by the host launching kernels (a short step on a GPU), the
calls of a thread other than the training thread take the interpreter's lock from it.

It also counts, on the training thread alone, the calls that on a GPU make the host wait for the
device (:data:`SYNCS`: a tensor read into Python, ``.cpu()``, ``.to("cpu")``, a stream's or event's
``synchronize()``), through a :class:`~torch.overrides.TorchFunctionMode` (which sees the thread it is
entered on only). On the CPU none of them waits; each one counted is one a GPU step would pay.
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
from torch.overrides import TorchFunctionMode

from everystep import Checkpointer
from everystep.eval.workloads import build
from everystep.strategies import STRATEGIES

SYNCS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"})
"""Tensor methods that read a tensor into the host (on a GPU: a wait for the device); ``to`` is
counted when it moves to the CPU."""


class _Syncs(TorchFunctionMode):
    """Counts :data:`SYNCS` on the thread it is entered on, while ``counting`` is set."""

    def __init__(self, counting: threading.Event) -> None:
        super().__init__()
        self.counting, self.found = counting, collections.Counter[str]()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if self.counting.is_set() and (name in SYNCS or name == "to" and _to_cpu(args, kwargs or {})):
            self.found[name] += 1
        return func(*args, **(kwargs or {}))


def _to_cpu(args: Any, kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    return target is not None and torch.device(target).type == "cpu"


def _count_synchronize(found: collections.Counter[str], counting: threading.Event, training: threading.Thread):
    """Patch each CUDA ``synchronize`` to count its calls on ``training`` (none runs on the CPU: it
    counts what a strategy would call there all the same)."""
    patched = []
    for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")):
        original = getattr(owner, name)

        def counted(*a: Any, _original: Any = original, _what: str = f"{owner.__name__}.{name}", **k: Any) -> Any:
            if counting.is_set() and threading.current_thread() is training:
                found[_what] += 1
            return _original(*a, **k)

        setattr(owner, name, counted)
        patched.append((owner, name, original))
    return patched


def measure_threads(strategy: str, workload: str, *, steps: int, warmup: int, options: dict[str, Any],
                    compress: str | None = None) -> dict[str, Any]:
    """Per step, each thread's Python calls (``calls``, by thread name) and the training thread's
    waits for the device (``syncs``, by call), with the strategy checkpointing (``none``: without)."""
    torch.set_num_threads(1)
    w = build(workload, seed=0, compress=compress)
    counts: collections.Counter[str] = collections.Counter()
    counting = threading.Event()
    syncs = _Syncs(counting)
    patched = _count_synchronize(syncs.found, counting, threading.current_thread())

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and counting.is_set():
            counts[threading.current_thread().name] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp, syncs:
            directory = Path(tmp) / "ckpt" if STRATEGIES[strategy].needs_store else None
            with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                              compression=w.compression, strategy=strategy, **options) as ckpt:
                ckpt.restore()
                for step in range(warmup + steps):
                    if step == warmup:
                        ckpt.wait()
                        counting.set()
                    loss = w.loss(w.data.next())
                    loss.backward()
                    w.update()
                ckpt.wait()
                counting.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        for owner, name, original in patched:
            setattr(owner, name, original)
    return {"calls": {name: n / steps for name, n in sorted(counts.items())},
            "syncs": {name: n / steps for name, n in sorted(syncs.found.items())}}


def calls_per_step(strategy: str, workload: str, *, steps: int, warmup: int, options: dict[str, Any]) -> dict[str, float]:
    """The Python calls per step of each thread (see the module docstring)."""
    return measure_threads(strategy, workload, steps=steps, warmup=warmup, options=options)["calls"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/python_calls.py", description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="lightcheck")
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a strategy option (a JSON value: every=1, layerwise=false)")
    parser.add_argument("--compress", default=None, help="the gradient compression training runs with (topk:0.01)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    found = measure_threads(args.strategy, args.workload, steps=args.steps, warmup=args.warmup, options=options,
                            compress=args.compress)
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    print(f"{args.strategy} on {args.workload}, Python calls per step ({args.steps} steps after {args.warmup}):")
    for name, n in found["calls"].items():
        print(f"  {name}: {n:,.0f}")
    syncs = ", ".join(f"{name} {n:g}" for name, n in found["syncs"].items()) or "none"
    print(f"the training thread's waits for the device per step: {syncs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
