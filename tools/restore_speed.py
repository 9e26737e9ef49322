"""How long ``Checkpointer.restore()`` takes, end to end in one process, against ``torch.load`` and
``load_state_dict`` of the same state.

``.venv/bin/python tools/restore_speed.py --workload gpt2-small`` trains the workload a few steps
under each strategy (every step, in a directory on ``/dev/shm`` unless ``--dir``), then restores
it into a freshly built workload ``--repeats`` times, interleaved with ``torch.save``'s file of the
same model and optimizer state loaded the way a training script loads it, and prints the median of
each; ``--profile`` prints where one restore of each strategy spent its time. What is timed is the
restore alone: building the fresh workload is not. ``--stepped``: the fresh workload trains one step
before it is restored, so that its optimizer holds its state (a recovery within the process that
trains, or a job that makes its optimizer's state before loading, as
``torch.distributed.checkpoint.state_dict`` does). ``--first-step``: the first training step after
each restore is timed too (a restore's work left to a thread beside training, as the pages a region
lends are made the process's own, shows there). A strategy named ``NAME:copied`` is ``NAME`` with
nothing lent out of a region (each slot's state copied out as it is verified, as where the kernel
cannot lend).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from everystep import Checkpointer
from everystep.eval.workloads import build
from everystep.storage.region import slots as region


@contextlib.contextmanager
def _lending(name: str):
    """``name``'s strategy, with nothing lent out of a region where it ends in ``:copied``."""
    supported = region.lending_supported
    if name.endswith(":copied"):
        region.lending_supported = lambda: False
    try:
        yield name.removesuffix(":copied")
    finally:
        region.lending_supported = supported


def _train_step(w) -> float:
    t0 = time.perf_counter()
    w.loss(w.data.next()).backward()
    w.update()
    return time.perf_counter() - t0


def restore_seconds(workload: str, strategies: list[str], *, repeats: int, root: Path, profile: bool = False,
                    stepped: bool = False, first_step: bool = False) -> dict[str, float]:
    """The median seconds of a restore under each strategy, and of ``torch.load`` (see the module
    docstring); with ``first_step``, also of the first step after it (``NAME first step``)."""
    torch.set_num_threads(1)
    w = build(workload, seed=0)
    for strategy in dict.fromkeys(s.removesuffix(":copied") for s in strategies):
        with Checkpointer(root / strategy, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=strategy,
                          every=1) as ckpt:
            ckpt.restore()
            for _ in range(3):
                _train_step(w)
    torch.save({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()}, root / "torch_save.pt")
    names = [*strategies, "torch.load"]
    times: dict[str, list[float]] = {n: [] for name in names for n in (name, f"{name} first step")[:1 + first_step]}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            fresh = build(workload, seed=0)
            if stepped:
                _train_step(fresh)
            t0 = time.perf_counter()
            if name == "torch.load":
                state = torch.load(root / "torch_save.pt", weights_only=True)
                fresh.model.load_state_dict(state["model"])
                fresh.optimizer.load_state_dict(state["optimizer"])
                times[name].append(time.perf_counter() - t0)
                if first_step:
                    times[f"{name} first step"].append(_train_step(fresh))
                continue
            with _lending(name) as strategy, Checkpointer(root / strategy, fresh.model, fresh.optimizer,
                                                          scheduler=fresh.scheduler, data=fresh.data,
                                                          strategy=strategy, final=False) as ckpt:
                profiler = cProfile.Profile() if profile and repeat == repeats - 1 else None
                t0 = time.perf_counter()
                if profiler is not None:
                    profiler.enable()
                ckpt.restore()
                times[name].append(time.perf_counter() - t0)
                if profiler is not None:
                    profiler.disable()
                    print(f"-- {name}, restored from {ckpt.recovered.source if ckpt.recovered else None}")
                    pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)
                if first_step:
                    times[f"{name} first step"].append(_train_step(fresh))  # (its checkpoint is the next restore's)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/restore_speed.py", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--strategies", default="checkfreq,lightcheck")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where the checkpoints are made (default: a folder on /dev/shm)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--stepped", action="store_true", help="restore into a workload that trained one step")
    parser.add_argument("--first-step", action="store_true", help="time the first training step after each restore too")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="everystep-restore-", dir=args.dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)))
    try:
        found = restore_seconds(args.workload, args.strategies.split(","), repeats=args.repeats, root=root,
                                profile=args.profile, stepped=args.stepped, first_step=args.first_step)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    into = "a workload that trained one step" if args.stepped else "a fresh workload"
    print(f"restore of {args.workload} into {into}, median of {args.repeats} (interleaved), "
          f"in {args.dir or 'memory (/dev/shm)'}:")
    for name, seconds in found.items():
        print(f"  {name}: {seconds * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
