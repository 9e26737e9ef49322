"""Sharded training (FSDP2, HSDP, tensor parallel, FSDP+TP, ZeRO-1): real ranks on loopback (gloo), each
layout told apart from the objects themselves; every strategy that does not checkpoint a layout
refusing it before anything is written, its message naming the strategy and the layout; the ones
that do, killed and restarted, recovering bitwise; and checkpoints loaded at another world size or
layout, every tensor gathered on both sides bitwise equal."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from everystep.parallelism import LAYOUTS
from everystep.strategies import STRATEGIES

from .conftest import ROOT, assert_recovered
from .forked import start_script, wait_all
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
    ranks = [start_script(_SCRIPT, str(root), json.dumps(strategies), env={**env, "RANK": str(r)}) for r in range(4)]
    done = wait_all(ranks, 240)
    for d in done:
        assert d.returncode == 0, d.stdout[-4000:]
    return [_last_json(d.stdout) for d in done]


@pytest.mark.xdist_group("four-ranks")  # one worker: both tests read the one launch
def test_every_layout_is_told_apart_on_every_rank(four_ranks):
    for report in four_ranks:
        assert {k: v["found"] for k, v in report.items()} == {**{layout: layout for layout in LAYOUTS if layout != "FSDP1"},
                                                              "None": None}


@pytest.mark.xdist_group("four-ranks")
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


# -- FSDP2 and HSDP checkpointed: killed and restarted, resharded at load ------------------------------

from everystep.eval.kills.train import TrainConfig, recover_run, run  # noqa: E402
from everystep.storage.directory import CheckpointDirectory  # noqa: E402

FSDP_JOB = dict(workload="gpt2-tiny", steps=12, nproc=2, progress=False, parallel="fsdp")


@pytest.fixture(scope="module")
def fsdp_reference() -> dict:
    """The uninterrupted two-rank FSDP2 run, without checkpointing."""
    return run(TrainConfig(strategy="none", **FSDP_JOB))


@pytest.mark.parametrize("strategy, mode, fail_at, extra", [
    # one failure where recovery reads the disk each time; two where the second restarts from memory
    # a job that was itself restarted, or spreads a checkpoint over steps. `make test` runs one
    # strategy of each way to recover (a full checkpoint on disk, a region, a spread checkpoint after
    # a hardware failure, an agent's memory); the others recover as one of those does: make test-long
    pytest.param("full_sync", "hardware", (5,), {}, marks=pytest.mark.long),
    ("checkfreq", "software", (4, 7), {}),
    pytest.param("async", "hardware", (6,), {}, marks=pytest.mark.long),
    ("lightcheck", "software", (4, 7), {"options": {"persist_every": 3}}),
    pytest.param("checkflow", "hardware", (5,), {}, marks=pytest.mark.long),
    pytest.param("gockpt", "software", (6, 10), {"every": 2, "options": {"parts": 2, "chunk_bytes": 4096}},
                 marks=pytest.mark.long),
    ("gockpt_o", "hardware", (7, 11), {"every": 3, "options": {"parts": 2, "chunk_bytes": 4096}}),
    ("lowdiff_plus", "software", (4, 7), {"every": 3}),
])
def test_fsdp2_ranks_killed_and_restarted_recover_bitwise(tmp_path, fsdp_reference, strategy, mode, fail_at, extra):
    # The rank killed and the instant in its step (start, forward, backward, update, mid-write) are
    # drawn from the seed for each step. gockpt_o: each rank's shards in two parts, brought forward on
    # the host with the gradient shards the updates consume.
    summary = run(TrainConfig(strategy=strategy, directory=str(tmp_path / strategy), fail_at=fail_at, fail_mode=mode,
                              **extra, **FSDP_JOB))
    assert [r["failed_at"] for r in summary["recoveries"]] == list(fail_at)
    if strategy == "lowdiff_plus":  # each rank's agent holds its shards, brought forward by the gradient shards
        assert [(r["source"], r["resumed_from"]) for r in summary["recoveries"]] == [("memory", 4), ("memory", 7)]
        assert_recovered(summary, sources={"memory"}, lose=1)
    elif strategy == "lightcheck":  # each rank's region holds its shards; at most one done step lost
        assert_recovered(summary, sources={"region"}, lose=1)
        # One process without FSDP skips the regions (shards of another layout) for the final checkpoint
        with pytest.warns(UserWarning, match="skipping the region's slot of step 12: its tensors are not this rank's"):
            found = recover_run(str(tmp_path / strategy))
        assert (found["step"], found["source"]) == (12, "disk")
    else:  # the newest checkpoint committed before each kill, or a newer one (GoCkpt's: its parts reconstructed
        assert_recovered(summary, sources={"disk"})  # on the host, a full checkpoint)
    assert summary["losses"] == fsdp_reference["losses"]
    assert summary["rank_state_sha256"] == fsdp_reference["rank_state_sha256"]  # each rank's shards, bitwise
    if strategy == "checkfreq":
        _each_of_two_ranks_wrote_half(tmp_path / strategy)


def _each_of_two_ranks_wrote_half(root):
    """Under FSDP2 each of two ranks writes its shards, half the state; rank 0 also DCP's small index.
    (What each rank reports it wrote, DCP's index included, is the bench's two-rank test's.)"""
    store = CheckpointDirectory.open(root, create=False, access="read")
    for record in store.catalog.manifests():
        files = record.manifest.objects
        state = [sum(i.nbytes for n, i in files.items() if n.startswith(f"dcp/__{r}_")) for r in range(2)]
        assert all(abs(b / sum(state) - 0.5) <= 0.01 for b in state), state  # each rank's data file: half
        assert files["dcp/.metadata"].nbytes < 0.03 * sum(state)  # DCP's index, written by rank 0
    store.close()


ZERO_JOB = {**FSDP_JOB, "parallel": "zero1", "steps": 9}


@pytest.fixture(scope="module")
def zero_reference() -> dict:
    return run(TrainConfig(strategy="none", **ZERO_JOB))


@pytest.mark.parametrize("strategy, fail_at, extra", [
    ("checkfreq", (3, 6), {}),
    ("lightcheck", (3, 6), {"options": {"persist_every": 2}}),
    # GoCkpt's own setting: each rank brings its partition's parameters and state forward
    ("gockpt", (7, 8), {"every": 3, "options": {"parts": 2, "chunk_bytes": 4096}}),
])
def test_zero1_ranks_killed_and_restarted_recover_bitwise(tmp_path, zero_reference, strategy, fail_at, extra):
    # ZeRO-1: DDP replicas whose optimizer state is partitioned; each rank stores its partition's state.
    summary = run(TrainConfig(strategy=strategy, directory=str(tmp_path / "c"), fail_at=fail_at, **extra, **ZERO_JOB))
    assert [r["failed_at"] for r in summary["recoveries"]] == list(fail_at)
    assert_recovered(summary, sources={"region" if strategy == "lightcheck" else "disk"})
    assert summary["losses"] == zero_reference["losses"]
    assert summary["rank_state_sha256"] == zero_reference["rank_state_sha256"]
    store = CheckpointDirectory.open(tmp_path / "c", create=False, access="read")
    newest = max((r.manifest for r in store.catalog.manifests()), key=lambda m: m.step)
    owned = [{i for i, _ in part["meta"]["skeleton"]["optimizer"]["state"]["__intkeys__"]} for part in newest.meta["parts"]]
    store.close()
    assert owned[0] and owned[1] and not owned[0] & owned[1]  # each parameter's state stored by one rank


HSDP_JOB = {**FSDP_JOB, "nproc": 4, "max_nproc": 4, "parallel": "hsdp", "steps": 9}


@pytest.fixture(scope="module")
def hsdp_reference() -> dict:
    """The uninterrupted four-rank HSDP run (two replicas of two shards), without checkpointing."""
    return run(TrainConfig(strategy="none", **HSDP_JOB))


@pytest.mark.parametrize("strategy, options", [("lightcheck", {"persist_every": 2}),
                                               pytest.param("lowdiff_plus", {}, marks=pytest.mark.long)])
def test_hsdp_on_four_ranks_killed_and_restarted_recovers_bitwise(tmp_path, hsdp_reference, strategy, options):
    # A hardware failure: lowdiff_plus's agents die with their ranks, and recovery reads the full
    # checkpoints they wrote, in everystep's format (each shard's rows split between its replicas).
    # (Two failures in a row, and restarts from memory, are FSDP2's kill tests'.)
    reference = hsdp_reference
    summary = run(TrainConfig(strategy=strategy, directory=str(tmp_path / "c"), fail_at=(5,), fail_mode="hardware",
                              every=2 if strategy == "lowdiff_plus" else None, options=options, **HSDP_JOB))
    assert [r["failed_at"] for r in summary["recoveries"]] == [5]
    assert_recovered(summary, sources={"region" if strategy == "lightcheck" else "disk"})  # (regions in the directory)
    assert summary["losses"] == reference["losses"]
    assert summary["rank_state_sha256"] == reference["rank_state_sha256"]
    # Each shard is held by two ranks (the replicas) and written once: a quarter of the state per rank.
    from everystep.eval.workloads import build

    state = 3 * sum(p.numel() * p.element_size() for p in build("gpt2-tiny").model.parameters())  # AdamW: 3 copies
    store = CheckpointDirectory.open(tmp_path / "c", create=False, access="read")
    newest = max((r.manifest for r in store.catalog.manifests()), key=lambda m: m.step)
    data = [sum(i.nbytes for n, i in newest.objects.items() if n.startswith((f"dcp/__{r}_", f"tensors-r{r}")))
            for r in range(4)]
    store.close()
    assert state <= sum(data) < 1.5 * state, (data, state)  # once (headers: about 1.5 kB per tensor), not twice
    assert all(abs(b / sum(data) - 0.25) <= 0.02 for b in data), data


_RESHARD = """
import json, os, sys, torch, torch.distributed as dist
from everystep import Checkpointer
from everystep.tree import state_hash
from torch.distributed.tensor import DTensor

jobs = json.loads(sys.argv[1])
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")


def build(layout):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 42), torch.nn.ReLU(), torch.nn.Linear(42, 6))
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(net[0], mesh=mesh); fully_shard(net, mesh=mesh)
    elif layout in ("tp", "fsdp+tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world // 2, 2) if layout == "fsdp+tp" else (1, world), mesh_dim_names=("dp", "tp"))
        net = parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if layout == "fsdp+tp":
            fully_shard(net, mesh=mesh["dp"])
    elif layout in ("ddp", "zero"):
        net = torch.nn.parallel.DistributedDataParallel(net)
    if layout == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return net, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def whole(tree):
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {k: whole(v) for k, v in tree.items()}
    return tree


def gathered(layout, net, opt):
    if layout == "zero":
        opt.consolidate_state_dict(to=0)  # every rank's partition, gathered to rank 0
        state = opt.state_dict()["state"] if dist.get_rank() == 0 else None
    else:
        state = opt.state_dict()["state"]
    module = net.module if layout in ("ddp", "zero") else net
    return state_hash({"model": whole(module.state_dict()), "optimizer": whole(state)})


def step(net, opt, i):
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(i * 100 + (dist.get_rank() if world > 1 else 0)))
    net(x).square().mean().backward()
    opt.step(); opt.zero_grad()


# Either format moves between layouts: DCP's (a sharded job's default), through DCP; everystep's own,
# through the boxes of the whole tensor its parts hold. A reader takes the directory's. Each job of
# this launch is a fresh model at its layout: a writer's (3 steps, then the final checkpoint) or a
# reader's (what it restored, gathered, then a step at this layout).
reports = {}
for job in jobs:
    layout = job["layout"]
    net, opt = build(layout)
    fmt = job.get("format")
    with Checkpointer(job["root"], net, opt, strategy="full_sync", every=100, full_format=fmt) as ckpt:
        start = ckpt.restore()
        if fmt is not None:
            for i in range(1, 4):
                step(net, opt, i)
            report = {"start": start, "hash": None}
        else:
            report = {"start": start, "hash": gathered(layout, net, opt)}
            step(net, opt, start + 1)  # training goes on at this world size
            report["loss_finite"] = bool(torch.isfinite(net(torch.ones(2, 12)).sum()))
    report["written"] = gathered(layout, net, opt) if fmt is not None else None  # after the final checkpoint: what it holds
    reports[job["root"]] = report
if world == 1 or dist.get_rank() == 0:
    print(json.dumps(reports))
if world > 1:
    dist.barrier()  # every rank done with every group before any is torn down (gloo aborts otherwise, now and then)
    dist.destroy_process_group()
"""


def _reshard_run(world: int, jobs: list[dict]) -> dict:
    """One launch of ``world`` ranks running ``jobs`` (each at its layout) in turn: each rank-0 report by root."""

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    if world > 1:
        env.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    ranks = [start_script(_RESHARD, json.dumps(jobs), env={**env, "RANK": str(r)}) for r in range(world)]
    done = wait_all(ranks, 180)
    for d in done:
        assert d.returncode == 0, d.stdout[-3000:]
    return _last_json(done[0].stdout)


def _last_json(output: str) -> Any:
    """The report a rank printed last (its output holds its warnings too)."""
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


_PAIRS = [
    (("fsdp", 2), ("single", 1)),
    (("fsdp", 2), ("fsdp", 4)),  # 42 rows over 4 ranks: shards of 11, 11, 10 and 10
    (("fsdp", 2), ("ddp", 2)),
    (("single", 1), ("fsdp", 2)),
    (("ddp", 2), ("fsdp", 2)),
    (("fsdp+tp", 4), ("fsdp", 2)),  # TP's shards by column and by row, into FSDP2's by row
    (("zero", 2, "safetensors"), ("zero", 3)),  # ZeRO-1's optimizer state: each rank's partition, by that rank
    # everystep's own format: each rank's shards as boxes of the whole, cut to another rank's at load
    (("fsdp", 2, "safetensors"), ("fsdp", 4)),
    (("fsdp+tp", 4, "safetensors"), ("single", 1)),
    (("ddp", 2, "safetensors"), ("fsdp", 2)),
]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Each pair's writer report and reader report. Launches are shared: one per world size that
    writes (each writer a job, at its layout and format), then one per world size that reads (each
    checkpoint read a job, from a copy: a reader's first step may write)."""
    import shutil

    tmp = tmp_path_factory.mktemp("resharding")
    written: dict[tuple, tuple] = {}
    for world in sorted({w[1] for w, _ in _PAIRS}):
        writers = [w for w in dict.fromkeys(w for w, _ in _PAIRS) if w[1] == world]
        roots = {w: str(tmp / ("w-" + "-".join(map(str, w)))) for w in writers}
        reports = _reshard_run(world, [{"root": roots[w], "layout": w[0], "format": (w[2:] or ("dcp",))[0]}
                                       for w in writers])
        written.update((w, (roots[w], reports[roots[w]])) for w in writers)
    found = {}
    for world in sorted({r[1] for _, r in _PAIRS}):
        pairs = [(w, r) for w, r in _PAIRS if r[1] == world]
        roots = {}
        for w, r in pairs:
            roots[w, r] = str(tmp / ("r-" + "-".join(map(str, (*w, "to", *r)))))
            shutil.copytree(written[w][0], roots[w, r])
        reports = _reshard_run(world, [{"root": roots[p], "layout": p[1][0]} for p in pairs])
        found.update((p, (written[p[0]][1], reports[roots[p]])) for p in pairs)
    return found


@pytest.mark.xdist_group("resharding")  # one worker: the launches are shared by every pair
@pytest.mark.parametrize("writer, reader", _PAIRS, ids=lambda v: "-".join(map(str, v)))
def test_a_checkpoint_loads_bitwise_at_another_world_size_and_layout(resharded, writer, reader):
    saved, loaded = resharded[writer, reader]
    assert loaded["start"] == 3
    assert loaded["hash"] == saved["written"]  # every tensor, gathered on both sides, bitwise
    assert loaded["loss_finite"]


@pytest.mark.parametrize("boxes, why", [
    ([[[0, 0], [2, 3], [4, 3]], [[1, 0], [3, 3], [4, 3]]], "overlap"),
    ([[[0, 0], [2, 3], [4, 3]], [[3, 0], [1, 3], [4, 3]]], "do not cover"),
    ([[[0, 0], [2, 3], [4, 3]], [[2, 0], [3, 3], [4, 3]]], "inside the shape"),
    ([[[0, 0], [2, 3], [4, 3]], [[2, 0], [2, 3], [5, 3]]], "two shapes"),
    ([[[0], [2, 3], [4, 3]], [[2, 0], [2, 3], [4, 3]]], "inside the shape"),
])
def test_boxes_that_do_not_tile_their_tensor_once_are_refused_before_anything_is_read(boxes, why):
    from everystep.storage.formats.sharded import _check_parts

    good = [{"pieces": {}, "boxes": {"/model/w": [[0, 0], [2, 3], [4, 3]]}, "meta": {}},
            {"pieces": {}, "boxes": {"/model/w": [[2, 0], [2, 3], [4, 3]]}, "meta": {}}]
    assert _check_parts(good) == good
    with pytest.raises(ValueError, match=why):
        _check_parts([{"pieces": {}, "boxes": {"/model/w": box}, "meta": {}} for box in boxes])


def test_a_box_that_is_all_this_rank_reads_of_its_tensor_is_taken_as_read_and_a_view_is_copied():
    import torch

    from everystep.storage.formats.sharded import _Boxes

    whole = torch.arange(12.0).view(4, 3)
    boxes = _Boxes({})  # (no live DTensor: every tensor is read whole)
    boxes.add("/model/w", [0, 0], whole, [4, 3])
    buffer = torch.arange(20.0)
    boxes.add("/model/v", [0], buffer[2:8], [6])  # (a view of a larger buffer: copied out of it)
    halves = torch.arange(12.0).view(4, 3)
    boxes.add("/model/u", [0, 0], halves[:2].clone(), [4, 3])
    boxes.add("/model/u", [2, 0], halves[2:].clone(), [4, 3])
    found = boxes.finish()
    assert found["/model/w"].data_ptr() == whole.data_ptr()  # (no second copy of the bytes read)
    assert found["/model/v"].data_ptr() != buffer.data_ptr() + 2 * 4
    assert torch.equal(found["/model/v"], buffer[2:8])
    buffer.zero_()
    assert torch.equal(found["/model/v"], torch.arange(2.0, 8.0))  # (its own memory)
    assert torch.equal(found["/model/u"], halves)
    again = _Boxes({})
    again.add("/model/w", [0, 0], whole, [4, 3])
    again.add("/model/w", [2, 0], whole[2:].clone(), [4, 3])  # (a box that covers rows read already)
    with pytest.raises(ValueError, match="fill"):
        again.finish()
