"""Sharded training (FSDP2, HSDP, tensor parallel, FSDP+TP, ZeRO-1): real ranks on loopback (gloo), each
layout told apart from the objects themselves, and every strategy that does not checkpoint a layout
refusing it before anything is written, its message naming the strategy and the layout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from everystep.parallelism import LAYOUTS
from everystep.strategies import STRATEGIES

from .conftest import ROOT
from .test_distributed import _free_port

_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from everystep import Checkpointer
from everystep.parallelism import sharded_layout

dist.init_process_group("gloo")
world, root, strategies = dist.get_world_size(), sys.argv[1], json.loads(sys.argv[2])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def tp(net, mesh):
    return parallelize_module(net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def jobs():
    flat = init_device_mesh("cpu", (world,))
    two = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "inner"))
    net = Net(); fully_shard(net.up, mesh=flat); fully_shard(net, mesh=flat)
    yield "FSDP2", net, torch.optim.AdamW(net.parameters())
    net = Net(); fully_shard(net, mesh=two)
    yield "HSDP", net, torch.optim.AdamW(net.parameters())
    net = tp(Net(), flat)
    yield "TP", net, torch.optim.AdamW(net.parameters())
    net = tp(Net(), two["inner"]); fully_shard(net, mesh=two["outer"])
    yield "FSDP+TP", net, torch.optim.AdamW(net.parameters())
    net = torch.nn.parallel.DistributedDataParallel(Net())
    yield "ZeRO-1", net, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW)
    net = torch.nn.parallel.DistributedDataParallel(Net())
    yield None, net, torch.optim.AdamW(net.parameters())


seen = {}
for expected, model, optimizer in jobs():
    model(torch.randn(4, 8)).sum().backward()  # a step first: FSDP2 swaps its parameters in and out
    optimizer.step()
    found = sharded_layout(model, optimizer)
    refused = {}
    for name in strategies if expected else ():
        where = os.path.join(root, f"{found}-{name}")
        try:
            Checkpointer(where, model, optimizer, strategy=name).close()
            refused[name] = None
        except Exception as e:
            refused[name] = f"{type(e).__name__}: {e}"
        refused[name + ":written"] = os.path.exists(where)
    seen[str(expected)] = {"found": found, "refused": refused}
print(json.dumps(seen))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Each rank's report of each layout: the layout found, and each strategy's refusal."""
    root = tmp_path_factory.mktemp("sharded")
    strategies = sorted(n for n in STRATEGIES if n != "none")
    port = _free_port()
    env = {**os.environ, "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    import json

    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, str(root), json.dumps(strategies)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "RANK": str(r)})
             for r in range(4)]
    done = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, done):
        assert p.returncode == 0, err[-4000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in done]


def test_every_layout_is_told_apart_on_every_rank(four_ranks):
    for report in four_ranks:
        assert {k: v["found"] for k, v in report.items()} == {**{layout: layout for layout in LAYOUTS if layout != "FSDP1"},
                                                              "None": None}


def test_every_strategy_refuses_a_layout_it_does_not_checkpoint_naming_both_and_writes_nothing(four_ranks):
    for report in four_ranks:
        for layout, seen in report.items():
            for name, refusal in seen["refused"].items():
                if name.endswith(":written"):
                    continue
                written = seen["refused"][name + ":written"]
                if layout in STRATEGIES[name].sharded_layouts:
                    assert refusal is None, (layout, name, refusal)
                    continue
                assert refusal is not None and refusal.startswith(
                    f"ConfigError: strategy {name!r} cannot checkpoint a job sharded with {layout}"), (layout, name, refusal)
                assert "nothing was written" in refusal and "torch.distributed.checkpoint" in refusal
                assert not written, (layout, name)
