"""How long LowDiff+'s checkpoint agent takes to apply one step to its replica, on this machine's CPU.

``.venv/bin/python tools/agent_speed.py --workload gpt2-small --threads 2`` builds the workload, lays its
state out in shared memory as the agent's replica (:class:`~everystep.agent.replica.Replica`), and
times the application of one step's gradients, the median of ``--repeats``, with the optimizer's own
path (the one that reproduces CPU training bitwise) and with torch's fused CPU kernel (``fused``, the
default where training runs on a GPU). It runs in this process: the agent's work without the agent's
messages and slots' copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from everystep.agent.replica import Replica, optimizer_class_path, slot_layout
from everystep.eval.workloads import build
from everystep.layout import TensorLayout
from everystep.replay import group_scalars
from everystep.state import TrainingComponents
from everystep.transport.host import HostBuffer
from everystep.transport.shared import SharedRegion
from everystep.tree import flatten, storage_key

__all__ = ["agent_step_seconds"]


def agent_step_seconds(workload: str, *, fused: bool, threads: int, repeats: int = 7) -> dict[str, Any]:
    """The median seconds of one step applied to a replica of ``workload``'s state (see the module
    docstring), with ``threads`` CPU threads."""
    torch.set_num_threads(threads)
    w = build(workload, seed=0)
    w.loss(w.data.next()).backward()
    w.update()  # (the optimizer's state exists, as at any step but the first)
    tensors, skeleton = flatten(TrainingComponents(model=w.model, optimizer=w.optimizer).capture())
    where = {storage_key(t): k for k, t in tensors.items() if t.numel()}
    params = [p for g in w.optimizer.param_groups for p in g["params"]]
    region, buffer = SharedRegion.holding(TensorLayout.of(tensors))
    for key, t in tensors.items():
        buffer.views[key].copy_(t)
    replica = Replica(step=0, region=region, layout=buffer.layout, skeleton=skeleton,
                      index_keys=[where[storage_key(p.detach())] for p in params],
                      optimizer_class=optimizer_class_path(w.optimizer), fused=fused)
    _, slot = SharedRegion.holding(slot_layout({i: p.detach() for i, p in enumerate(params)}, {}))
    slot = HostBuffer(slot.layout, data=slot.data)
    generator = torch.Generator().manual_seed(0)
    for i, p in enumerate(params):
        slot.views[f"g/{i}"].copy_(torch.randn(p.shape, generator=generator) * 1e-3)
    groups, seconds = group_scalars(w.optimizer), []
    for step in range(1, repeats + 2):
        t0 = time.perf_counter()
        replica.apply(step, slot, groups=groups, skipped=False, has_grad=list(range(len(params))), skeleton=skeleton)
        seconds.append(time.perf_counter() - t0)
    return {"workload": workload, "parameters": sum(p.numel() for p in params), "threads": threads,
            "fused": replica.fused, "seconds": statistics.median(seconds[1:]), "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/agent_speed.py", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    found = [agent_step_seconds(args.workload, fused=fused, threads=args.threads, repeats=args.repeats)
             for fused in (False, True)]
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    for r in found:
        print(f"{r['workload']} ({r['parameters'] / 1e6:.1f} M parameters), {r['threads']} thread(s), "
              f"{'fused CPU kernel' if r['fused'] else 'the optimizer’s own path'}: {r['seconds'] * 1e3:.1f} ms per step "
              f"(median of {r['repeats']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
