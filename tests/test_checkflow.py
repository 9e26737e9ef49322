"""The ``checkflow`` strategy: the plan executed inside each step (snapshots before the update,
offloads at the planned operators), every step a consistent checkpoint, kills, peak snapshot memory
against the plan, re-planning when the step changes."""

from __future__ import annotations

import os
import re
import random
import statistics
import time

import pytest
import torch

import everystep
from everystep import Checkpointer
from everystep.eval.workloads import build
from everystep.strategies import create

from .conftest import ROOT
from .forked import run_script
from .test_checkpointer import live_hash

STEPS = 12
OPTIONS = {"bandwidth": 1e9, "per_size": 1 << 14}
"""A link slow enough, and pieces small enough, that the snapshots and offloads spread over the step."""


def _train(w, ckpt, start, stop, losses=None, *, hashes=None, plan_at=3, slow_from=None):
    took: list[float] = []
    for t in range(start + 1, stop + 1):
        began = time.perf_counter()
        loss = w.loss(w.data.next())
        if slow_from is not None and t >= slow_from:
            # the workload changes (not a synchronisation): each step from here takes four times
            # what a step took before (their median), whatever this machine's speed
            time.sleep(3 * statistics.median(took))
        loss.backward()
        w.update()
        if losses is not None:
            losses.append(loss.item())
        if hashes is not None:
            hashes[t] = live_hash(w, t)
        if ckpt is not None and t == plan_at:
            ckpt.wait()  # the plan of the profiled step is made: the next steps run it
        if slow_from is None or t < slow_from:
            took.append(time.perf_counter() - began)


@pytest.mark.parametrize("workload", ["gpt2-tiny", "resnet"])
def test_every_step_checkpoints_the_state_before_its_update_as_planned(tmp_path, workload):
    w, hashes = build(workload, seed=1), {}
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="checkflow",
                      final=False, keep=20, **OPTIONS) as ckpt:
        ckpt.restore()
        _train(w, ckpt, 0, 9, hashes=hashes)
    s = ckpt.strategy
    assert len(s.plans) == 1 and s.plans[0].feasible and s.late == 0
    assert 0 < s.peak_snapshot_bytes <= s.planned_snapshot_bytes + OPTIONS["per_size"]
    total = sum(t.numel() * t.element_size() for g in w.optimizer.param_groups for p in g["params"]
                for t in (p, *[v for v in w.optimizer.state[p].values() if v.numel() > 1]))
    assert s.peak_snapshot_bytes < total  # CheckFreq holds a copy of all of it at once
    for step in (8, 6, 4):  # S_8 is written during step 9; each from its own step, by the schedule
        again = build(workload, seed=1)
        _keep_only(tmp_path / "c", step)
        with Checkpointer(tmp_path / "c", again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                          strategy="checkflow", final=False, **OPTIONS) as reader:
            assert reader.restore() == step
        assert live_hash(again, step) == hashes[step]


def _keep_only(directory, step):
    """Hide the checkpoints newer than ``step`` (as a crash right after it would have left them)."""
    for manifest in (directory / "manifests").iterdir():
        if int(manifest.name.split("-")[1].split(".")[0]) > step:
            manifest.unlink()


_KILLED = """
import sys, torch
from everystep import Checkpointer
from everystep._faults import arm
from everystep.eval.workloads import build
from tests.test_checkflow import OPTIONS, _train
torch.set_num_threads(1)
directory, point, nth, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
w = build("gpt2-tiny", seed=1)
with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="checkflow",
                  **OPTIONS) as ckpt:
    ckpt.restore()
    _train(w, ckpt, 0, 3)
    arm(point, after=nth)
    _train(w, ckpt, 3, steps)
"""


@pytest.fixture(scope="module")
def uninterrupted():
    torch.set_num_threads(1)
    w, losses = build("gpt2-tiny", seed=1), []
    _train(w, None, 0, STEPS, losses)
    return losses, live_hash(w, STEPS)


@pytest.mark.parametrize("point, nth", [(p, random.Random(f"{p}/{i}").randint(1, hi))
                                        for p, hi in [("checkflow.offload", 150), ("store.object.mid_write", 6)]
                                        for i in range(2)])
def test_a_kill_while_offloading_or_writing_recovers_bitwise(tmp_path, point, nth, uninterrupted):
    directory = str(tmp_path / "c")
    killed = run_script(_KILLED, directory, point, str(nth), str(STEPS),
                        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}, cwd=ROOT)
    assert killed.returncode == -9, killed.stdout
    w, losses = build("gpt2-tiny", seed=1), []
    with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="checkflow",
                      **OPTIONS) as ckpt:
        start = ckpt.restore()
        _train(w, None, start, STEPS, losses)
    ref_losses, ref_final = uninterrupted
    assert 2 <= start < STEPS and losses == ref_losses[start:] and live_hash(w, STEPS) == ref_final


def test_steps_that_change_their_time_are_profiled_and_planned_again(tmp_path):
    w = build("gpt2-tiny", seed=1)
    with pytest.warns(UserWarning, match="profiling the next step to plan again"):
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          strategy="checkflow", **OPTIONS) as ckpt:
            ckpt.restore()
            _train(w, ckpt, 0, 20, slow_from=12)
            ckpt.wait()
    assert len(ckpt.strategy.plans) == 2


def test_options_are_checked():
    with pytest.raises(Exception, match="bandwidth must be a positive"):
        create("checkflow", bandwidth=0)


_TWO_RANKS = """
import torch, torch.distributed as dist
import everystep
from everystep import Checkpointer
from everystep.eval.workloads import build
from everystep.state import bare_module
from tests.test_checkflow import OPTIONS, _train
dist.init_process_group("gloo")
rank = dist.get_rank()
w = build("gpt2-tiny", seed=1, rank=rank, world=2)
with Checkpointer({directory!r}, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="checkflow",
                  final=False, keep=20, **OPTIONS) as ckpt:
    ckpt.restore()
    _train(w, ckpt, 0, 6)
    hash6 = everystep.state_hash({{"model": bare_module(w.model).state_dict(), "optimizer": w.optimizer.state_dict()}})
    _train(w, ckpt, 6, 7)  # S_6 is taken, by the schedule, during step 7
s = ckpt.strategy
print(f"rank {{rank}} plans {{len(s.plans)}} feasible {{s.plans[0].feasible}} late {{s.late}} "
      f"peak {{s.peak_snapshot_bytes}} planned {{s.planned_snapshot_bytes}} hash6 {{hash6}} "
      f"wrote {{ckpt.bytes_written}}")
dist.destroy_process_group()
"""


def test_under_two_ranks_each_runs_its_schedule_on_its_share_and_the_checkpoint_loads_in_one_process(tmp_path):
    from .test_distributed import _spawn_two

    out = _spawn_two(_TWO_RANKS.format(directory=str(tmp_path / "c")))
    found = re.findall(r"rank (\d) plans 1 feasible True late 0 peak (\d+) planned (\d+) hash6 (\w+) wrote (\d+)", out)
    assert len(found) == 2, out
    for _, peak, planned, _, _ in found:  # each rank holds at most what its plan holds, of its share
        assert 0 < int(peak) <= int(planned) + OPTIONS["per_size"]
    assert found[0][3] == found[1][3]  # replicated
    b0, b1 = int(found[0][4]), int(found[1][4])
    assert abs(b0 - b1) < 0.1 * (b0 + b1)  # the replicated state written in halves
    _keep_only(tmp_path / "c", 6)
    again = build("gpt2-tiny", seed=1)  # (the data's seed must match; the model's values come from the checkpoint)
    with Checkpointer(tmp_path / "c", again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                      strategy="checkflow", final=False, **OPTIONS) as reader:
        assert reader.restore() == 6
    assert everystep.state_hash({"model": again.model.state_dict(), "optimizer": again.optimizer.state_dict()}) \
        == found[0][3]
