"""Compression in DDP's communication hook, in a one-process group: records equal what the optimizer
consumed, through clipping and a GradScaler, and LowDiff replays them bitwise."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from everystep import Checkpointer
from everystep.compress import ddp_compression, decompress
from everystep.distributed import init_process_group
from everystep.eval.workloads import build
from everystep.state import TrainingComponents
from everystep.tree import state_hash

SPECS = ["topk:0.05", "quant8", "powersgd:rank=2"]


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    owns = init_process_group(one_process=True)
    yield
    if owns:
        dist.destroy_process_group()


def _make(spec: str, seed: int = 0):
    w = build("gpt2-tiny", seed=seed)
    w.model = DDP(w.model)
    w.compression = ddp_compression(spec, w.model, w.optimizer)
    return w


def _loop(w, n, scaler, clip=0.05):
    for i in range(n):
        loss = w.loss(w.data.next())
        scaler.scale(loss * (float("inf") if i == 2 else 1.0)).backward()  # step 3 is skipped
        scaler.unscale_(w.optimizer)
        torch.nn.utils.clip_grad_norm_(w.model.parameters(), clip)  # a small norm: clipping bites
        scaler.step(w.optimizer)
        scaler.update()
        w.optimizer.zero_grad()
        w.scheduler.step()


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**8)


@pytest.mark.parametrize("spec", SPECS)
def test_records_are_what_the_optimizer_consumed(spec):
    w = _make(spec)
    consumed = {}
    w.optimizer.register_step_pre_hook(  # runs after the compression's own pre-hook
        lambda opt, a, k: consumed.update({n: p.grad.clone() for n, p in w.model.module.named_parameters()}))
    forms = set()
    for _ in range(4):
        loss = w.loss(w.data.next())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(w.model.parameters(), 0.05)
        w.optimizer.step()
        w.optimizer.zero_grad()
        records = w.compression.take()
        assert set(records) == set(consumed)
        for name, record in records.items():
            assert torch.equal(decompress(record, consumed[name]), consumed[name]), name
            forms |= set(record)
    assert w.compression.dense_records == 0
    expected = {"topk:0.05": {"values", "indices"}, "quant8": {"codes", "scales", "mul"},
                "powersgd:rank=2": {"p", "q", "mul", "dense"}}[spec]
    assert expected <= forms


def _hash(w, scaler):
    c = TrainingComponents(model=w.model, optimizer=w.optimizer, scheduler=w.scheduler, data=w.data,
                           compression=w.compression, scaler=scaler)
    return state_hash({**c.capture(), **c.capture_boundary()})


@pytest.mark.parametrize("spec", SPECS)
def test_lowdiff_replays_hook_records_bitwise(tmp_path, spec):
    ref, s_ref = _make(spec), _scaler()
    _loop(ref, 7, s_ref)
    w, s = _make(spec), _scaler()
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, scaler=s,
                      compression=w.compression, strategy="lowdiff", every=50, batch=2) as ckpt:
        ckpt.restore()
        _loop(w, 7, s)
    assert _hash(w, s) == _hash(ref, s_ref)  # checkpointing changes nothing (I6)
    w2, s2 = _make(spec, seed=3), _scaler()
    w2.data.seed = 0
    with Checkpointer(tmp_path / "c", w2.model, w2.optimizer, scheduler=w2.scheduler, data=w2.data, scaler=s2,
                      compression=w2.compression, strategy="lowdiff", every=50, batch=2, final=False) as ckpt:
        assert ckpt.restore() == 7
    assert _hash(w2, s2) == _hash(ref, s_ref)


def _train_unclipped(w, n):
    for _ in range(n):
        w.loss(w.data.next()).backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
        w.scheduler.step()


@pytest.mark.parametrize("hook,overlap", [(None, False), (None, True), ("topk:0.05", False), ("topk:0.05", True),
                                          ("powersgd:rank=2", False), ("foreign", True)])
def test_lowdiff_plus_copies_reduced_buckets_from_the_communication_hook(tmp_path, hook, overlap):
    # Each gradient is copied from its bucket's reduced result during backward and never again at the
    # step; with a hook everystep does not own, at the step. Training is unchanged (I6) and the
    # replica equals the live state every step (a divergence warns), with the slots handed over at
    # the step or after their copies (``overlap``: the next backward's buckets wait for them).
    def make():
        w = build("gpt2-tiny", seed=0)
        w.model = DDP(w.model, bucket_cap_mb=0.05)
        if hook == "foreign":
            w.model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif hook is not None:
            w.compression = ddp_compression(hook, w.model, w.optimizer)
        return w

    ref = make()
    _train_unclipped(ref, 4)
    w = make()  # built after the reference trained: build() seeds the random state both draw from
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          compression=w.compression, strategy="lowdiff_plus", every=50, verify_every=1,
                          verify_sample=0, overlap=overlap) as ckpt:
            ckpt.restore()
            _train_unclipped(w, 4)
    s, n = ckpt.strategy, len(list(w.model.parameters()))
    assert (s.early_copies, s.recopies) == ((0, 0) if hook == "foreign" else (4 * n, 0))
    assert _hash(w, None) == _hash(ref, None)


def _two_rank_worker(rank: int, port: int, directory: str, out: str) -> None:
    """Rank ``rank`` of two: PowerSGD over many small DDP buckets, LowDiff, then a fresh restore."""
    import datetime
    import json

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)

    def make(seed):
        return build("gpt2-tiny", seed=seed, rank=rank, world=2, compress="powersgd:rank=2", bucket_cap_mb=0.05)

    def attach(w, **kw):
        return Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                            compression=w.compression, strategy="lowdiff", every=50, batch=2, **kw)

    w, s = make(0), _scaler()
    with attach(w, scaler=s) as ckpt:
        ckpt.restore()
        _loop(w, 6, s)
        trained = _hash(w, s)
    w2, s2 = make(5), _scaler()
    w2.data.seed = 0
    with attach(w2, scaler=s2, final=False) as ckpt:
        step = ckpt.restore()
        restored = _hash(w2, s2)
        _loop(w2, 2, s2)  # the restored process trains on through DDP's re-bucketing
    w3, s3 = make(0), _scaler()
    _loop(w3, 8, s3)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"step": step, "same": trained == restored, "on": _hash(w2, s2) == _hash(w3, s3),
                   "buckets": len(w.compression._layouts)}, f)
    dist.destroy_process_group()


def test_two_ranks_many_buckets_powersgd_replays_and_trains_on(tmp_path):
    import json

    import torch.multiprocessing as mp

    from everystep.distributed import free_port as _free_port

    job = mp.start_processes(_two_rank_worker, args=(_free_port(), str(tmp_path / "c"), str(tmp_path / "out")),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not job.join(timeout=2):
        if time.monotonic() > deadline:  # ranks that issue collectives in different orders hang
            for p in job.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 120 s")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        assert result["buckets"] > 1
        assert result == {"step": 6, "same": True, "on": True, "buckets": result["buckets"]}
