"""OptimizerInBackward: per-parameter updates during backward, as one optimizer a Checkpointer and
an LR scheduler can work with; under DDP, updates from each bucket's all-reduce."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from everystep import Checkpointer, ConfigError, EverystepError, OptimizerInBackward
from everystep.eval.bench.command import BenchConfig
from everystep.eval.kills.train import TrainConfig, run

from .test_distributed import _spawn_two


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


@pytest.mark.parametrize("cls, kw", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
                                     (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True})])
def test_updates_in_backward_equal_the_optimizer_stepped_after_it_bitwise(cls, kw):
    model, plain_model = _model(), _model()
    ours = OptimizerInBackward(model.parameters(), cls, **kw)
    plain = cls(plain_model.parameters(), foreach=False, **kw)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1 / (k + 1)) for o in (ours, plain)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for x in _batches(4):
            model(x).square().sum().backward()
            assert all(p.grad is None for p in model.parameters())  # each freed once applied
            schedules[0].step()
            plain_model(x).square().sum().backward()
            plain.step()
            plain.zero_grad()
            schedules[1].step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    mine, theirs = ours.state_dict()["state"], plain.state_dict()["state"]
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(v, theirs[i][k]) for i, st in mine.items() for k, v in st.items())


def test_hooks_come_in_the_order_a_step_has():
    model = _model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    seen: list = []
    optimizer.register_step_pre_hook(lambda *a: seen.append("pre"))
    optimizer.register_step_post_hook(lambda *a: seen.append("post"))
    handle = optimizer.register_layer_pre_hook(lambda opt, params: seen.append(tuple(params[0].shape)))
    for x in _batches(2):
        model(x).sum().backward()
    assert seen == ["pre", (2,), (2, 8), (8,), (8, 4), "post"] * 2  # backward order, every update inside the step
    handle.remove()
    model(_batches(1)[0]).sum().backward()
    assert seen[-2:] == ["pre", "post"]


def test_loaded_state_is_the_state_each_parameter_steps_with():
    model = _model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.Adam, lr=1e-2)
    for x in _batches(2):
        model(x).sum().backward()
    saved, twin = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(model)  # (a live step tensor is not cloned by loading)
    loaded = OptimizerInBackward(twin.parameters(), torch.optim.Adam, lr=1.0)
    loaded.load_state_dict(saved)
    assert loaded.param_groups[0]["lr"] == 1e-2
    x = _batches(3)[2]
    model(x).sum().backward()
    twin(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_mistakes_are_refused_with_what_to_do():
    model = _model()
    params = list(model.parameters())
    with pytest.raises(ConfigError, match="params is empty"):
        OptimizerInBackward([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ConfigError, match="a parameter twice"):
        OptimizerInBackward(params + params[:1], torch.optim.SGD, lr=0.1)
    optimizer = OptimizerInBackward([{"params": params[:2], "lr": 0.5}, {"params": params[2:]}], torch.optim.SGD, lr=0.1)
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.5, 0.1, 0.1]
    with pytest.raises(EverystepError, match="remove the call to optimizer.step"):
        optimizer.step()
    with pytest.raises(EverystepError, match="make a new one"):
        optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


def test_a_checkpointer_refuses_what_cannot_follow_updates_in_backward(tmp_path):
    model = _model()
    optimizer = OptimizerInBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ConfigError, match="strategy .lowdiff_plus. reads the gradients .* use one of async, checkfreq, "
                                          "full_sync, lightcheck, none"):
        Checkpointer(tmp_path / "a", model, optimizer, strategy="lowdiff_plus")
    with pytest.raises(ConfigError, match="takes no GradScaler"):
        Checkpointer(tmp_path / "b", model, optimizer, scaler=torch.amp.GradScaler("cpu"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ConfigError, match="--in-backward takes no --compress, and one of the strategies async, checkfreq"):
        TrainConfig(strategy="lowdiff_plus", directory=str(tmp_path / "c"), in_backward=True)
    with pytest.raises(ConfigError, match="--in-backward cannot run dcp, lowdiff_plus: they read the gradients"):
        BenchConfig(strategies=("dcp", "lowdiff_plus", "lightcheck"), in_backward=True)


_IN_BACKWARD = dict(workload="gpt2-tiny", steps=10, seed=2, in_backward=True, progress=False)


@pytest.fixture(scope="module")
def in_backward_reference() -> dict:
    """The run without checkpointing, updating in backward."""
    return run(TrainConfig(strategy="none", **_IN_BACKWARD))


@pytest.mark.parametrize("strategy", ["full_sync", "checkfreq"])
def test_strategies_that_copy_the_whole_state_recover_bitwise_with_updates_in_backward(tmp_path, strategy,
                                                                                       in_backward_reference):
    common, reference = _IN_BACKWARD, in_backward_reference
    s = run(TrainConfig(strategy=strategy, directory=str(tmp_path / "c"), fail_at=(4, 7), **common))
    assert [r["failed_at"] for r in s["recoveries"]] == [4, 7]
    assert s["losses"] == reference["losses"] and s["final_state_sha256"] == reference["final_state_sha256"]


_DDP = """
import os, torch, torch.distributed as dist
from everystep import OptimizerInBackward
dist.init_process_group("gloo")
rank = dist.get_rank()
def make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Linear(300, 300), torch.nn.Tanh(),
                            torch.nn.Linear(300, 3))
    return torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.2)
ours, plain = make(), make()
inb = OptimizerInBackward(ours.parameters(), torch.optim.Adam, lr=1e-2, ddp=ours)
opt = torch.optim.Adam(plain.parameters(), lr=1e-2, foreach=False)
calls = []
inb.register_layer_pre_hook(lambda o, params: calls.append(len(params)))
g = torch.Generator().manual_seed(rank)
for _ in range(3):
    x = torch.randn(8, 6, generator=g)
    ours(x).square().mean().backward()
    plain(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    inb.zero_grad()
same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters()))
print(f"rank {rank} same {same} updates {len(calls)} of {sum(calls)}")
dist.destroy_process_group()
"""


def test_under_ddp_each_bucket_is_applied_once_reduced_and_equals_ddp_then_step():
    out = _spawn_two(_DDP)
    assert out.count("same True") == 2, out
    updates, params = (int(n) for n in re.search(r"updates (\d+) of (\d+)", out).groups())
    assert params == 3 * 6 and 3 < updates < params  # one update per bucket, more than one bucket a step
