"""The CUDA paths, on a GPU: side-stream snapshots into pinned host memory, recovery of every
strategy trained on the device, and the LowDiff+ replica of a GPU-trained model.

Skipped where torch sees no GPU; ``--device cuda`` refusing such a machine is tested in any case.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from everystep import Checkpointer
from everystep.errors import ConfigError
from everystep.eval.bench.command import BenchConfig
from everystep.eval.kills.train import TrainConfig, run
from everystep.eval.workloads import build
from everystep.recovery import latest_full
from everystep.tree import flatten, state_hash
from everystep.storage import CheckpointDirectory
from everystep.storage.region.slots import Region
from everystep.strategies import STRATEGIES
from everystep.transport.host import HostBuffer, HostBufferPool, TensorLayout, snapshot_into

from .conftest import loss_gap
from .test_checkpointer import loop

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
pytestmark = pytest.mark.timeout(600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="--device cuda needs a GPU, and torch sees none here"):
        TrainConfig(workload="mlp", strategy="checkfreq", directory=str(tmp_path / "c"), device="cuda")
    with pytest.raises(ConfigError, match="--device cuda needs a GPU, and torch sees none here"):
        BenchConfig(workload="mlp", device="cuda")
    with pytest.raises(ConfigError, match="--device must be cpu or cuda, got 'tpu'"):
        TrainConfig(workload="mlp", strategy="none", device="tpu")


@gpu
def test_a_side_stream_snapshot_into_pinned_memory_waits_for_the_work_queued_before_it():
    pool = HostBufferPool(1)
    x = torch.randn(2048, 2048, device="cuda")
    y = x
    for _ in range(20):  # long enough that a copy not waiting for it would read a stale value
        y = torch.tanh(y @ x)
    tensors = {"y": y, "x": x}
    buffer = pool.acquire(TensorLayout.of(tensors))
    assert buffer.data.is_pinned()
    event = snapshot_into(buffer, tensors, stream=torch.cuda.Stream())
    assert event is not None
    event.synchronize()
    assert torch.equal(buffer.views["y"], y.cpu()) and torch.equal(buffer.views["x"], x.cpu())
    pool.release(buffer)


@gpu
def test_a_pageable_buffer_receives_the_same_bytes():
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32).mul_(0.5)
    buffer = HostBuffer(TensorLayout.of({"x": x}), pin=False)
    event = snapshot_into(buffer, {"x": x})
    assert event is not None
    event.synchronize()
    assert torch.equal(buffer.views["x"], x.cpu())


def _reference(**kw) -> dict:
    return run(TrainConfig(workload="gpt2-tiny", strategy="none", device="cuda", progress=False, **kw))


@gpu
@pytest.mark.parametrize("strategy, compress, mode", [
    ("full_sync", None, "software"),
    ("checkfreq", None, "hardware"),
    ("lowdiff", "topk:0.01", "software"),
    ("naive_diff", None, "software"),
])
def test_a_strategy_trained_on_the_gpu_recovers_bitwise(tmp_path, strategy, compress, mode):
    steps = 10
    ref = _reference(steps=steps, compress=compress)
    got = run(TrainConfig(workload="gpt2-tiny", strategy=strategy, steps=steps, directory=str(tmp_path / "c"),
                          fail_at=(4, 8), fail_mode=mode, compress=compress, device="cuda", progress=False,
                          **({"every": 3} if strategy in ("lowdiff", "naive_diff") else {})))
    assert [r["source"] for r in got["recoveries"]] == ["disk" if STRATEGIES[strategy].exact else "disk (lossy)"] * 2
    if not STRATEGIES[strategy].exact:  # naive_diff: within its documented bound
        resumed = got["recoveries"][0]["resumed_from"]
        assert got["losses"][:resumed] == ref["losses"][:resumed] and loss_gap(got["losses"], ref["losses"]) < 1e-2
        return
    assert got["losses"] == ref["losses"]
    assert got["final_state_sha256"] == ref["final_state_sha256"]


@gpu
@pytest.mark.parametrize("mode", ["software", "hardware"])
def test_lowdiff_plus_trained_on_the_gpu_recovers_to_within_cpu_arithmetic(tmp_path, mode):
    # The agent applies the updates on the CPU: its replica differs from the GPU's state in the last
    # bits (CPU and GPU kernels round differently), so recovery is close, not bitwise, until the next
    # re-base on the live state (every verify_every steps).
    steps = 10
    ref = _reference(steps=steps)
    got = run(TrainConfig(workload="gpt2-tiny", strategy="lowdiff_plus", steps=steps, directory=str(tmp_path / "c"),
                          every=3, fail_at=(4, 8), fail_mode=mode, device="cuda", progress=False))
    assert [r["source"] for r in got["recoveries"]] == (["memory"] * 2 if mode == "software" else ["disk"] * 2)
    gap = loss_gap(got["losses"], ref["losses"])
    print(f"largest relative loss difference against the uninterrupted run ({mode}): {gap:.2e}")
    assert gap < 1e-5


@gpu
@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradient_copies_left_running_at_the_step_end_are_waited_for_by_the_stream_not_the_host(set_to_none):
    # overlap: the step ends with its copies to the slot still on the side stream; the next steps
    # zero the gradients (in place where set_to_none is False) and accumulate into them. The slot
    # must hold each step's gradients exactly as the update consumed them.
    from everystep.background import BackgroundErrors
    from everystep.capture.grads import GradientCapture

    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-3)
    layout = TensorLayout.of({f"g/{i}": p for i, p in enumerate(params)})
    slots = [HostBuffer(layout, pin=True) for _ in range(3)]
    turn = iter(range(10**6))
    current: list[HostBuffer] = []

    def target() -> HostBuffer:
        if not current:
            current.append(slots[next(turn) % len(slots)])
        return current[0]

    errors = BackgroundErrors()
    capture = GradientCapture(model, params, None, layerwise=True, errors=errors, target=target, overlap=True,
                              optimizer=optimizer)
    seen: list[tuple[HostBuffer, list[torch.Tensor]]] = []
    try:
        for _ in range(6):
            for _ in range(2):
                model(torch.randn(64, 2048, device="cuda")).square().sum().backward()
            capture.at_update()
            expected = [p.grad.detach().clone() for p in params]
            optimizer.step()
            capture.settle()
            buffer = current.pop()
            capture.after_copies("checking the slot", lambda b=buffer, e=expected: seen.append((b, [
                b.views[f"g/{i}"].clone() for i in range(len(e))], e)))
            optimizer.zero_grad(set_to_none=set_to_none)
        capture.quiesce()
    finally:
        capture.close()
    errors.raise_pending()
    assert len(seen) == 6
    for _, got, expected in seen:
        assert all(torch.equal(g, e.cpu()) for g, e in zip(got, expected))


@gpu
def test_the_replica_of_a_gpu_trained_model_is_rebased_and_its_final_checkpoint_is_exact(tmp_path):
    w = build("gpt2-tiny", seed=0, optimizer="adamw", device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divergence warning: on a GPU the check is a re-base
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          strategy="lowdiff_plus", every=100, verify_every=2) as ckpt:
            loop(w, ckpt, ckpt.restore(), 7)
    assert ckpt.stats.last_memory_step == 7
    assert ckpt.strategy.rebases == 4  # steps 2, 4 and 6, and the final step 7
    manifest, tree = latest_full(CheckpointDirectory.open(tmp_path / "c"))
    live = {"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict(), "step": 7}
    assert manifest.step == 7
    assert state_hash({k: tree[k] for k in live}) == state_hash(live)


@gpu
@pytest.mark.parametrize("mode, source", [("software", "region"), ("hardware", "disk")])
def test_lightcheck_trained_on_the_gpu_recovers_bitwise_from_its_region(tmp_path, shm, mode, source):
    """The region's mapping registered for DMA, the state copied on a side stream in one batched
    copy with its event (one per layer with updates in backward, below): the copies are of the state itself, so recovery is bitwise on the GPU too. The region lies in
    /dev/shm: a host loss takes it, and recovery reads the persisted checkpoint instead."""
    steps = 10
    ref = _reference(steps=steps)
    got = run(TrainConfig(workload="gpt2-tiny", strategy="lightcheck", steps=steps, directory=str(tmp_path / "c"),
                          fail_at=(4, 8), fail_mode=mode, device="cuda", progress=False,
                          options={"region": f"{shm}/rank-{{rank}}.bin", "persist_every": 2}))
    assert [r["source"] for r in got["recoveries"]] == [source] * 2
    assert got["losses"] == ref["losses"]
    assert got["final_state_sha256"] == ref["final_state_sha256"]


@gpu
def test_lightcheck_with_updates_in_backward_waits_per_layer_on_the_gpu_and_recovers_bitwise(tmp_path):
    """Each layer's update waits for its copy's event on the GPU (no host wait); killed twice, the
    run ends bitwise where the uninterrupted one (updating in backward too) ends."""
    steps = 10
    ref = run(TrainConfig(workload="gpt2-tiny", strategy="none", steps=steps, device="cuda", in_backward=True,
                          progress=False))
    got = run(TrainConfig(workload="gpt2-tiny", strategy="lightcheck", steps=steps, directory=str(tmp_path / "c"),
                          fail_at=(4, 8), device="cuda", in_backward=True, progress=False,
                          options={"persist_every": 2, "flush": False}))
    assert [r["source"] for r in got["recoveries"]] == ["region"] * 2
    assert got["losses"] == ref["losses"]
    assert got["final_state_sha256"] == ref["final_state_sha256"]


@gpu
def test_lightcheck_copies_by_dma_into_the_registered_region_and_waits_on_events(tmp_path):
    """A region on tmpfs is pinned for the GPU's DMA; the copies are timed by events and land bitwise."""
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="everystep-test-"))
    try:
        w = build("gpt2-tiny", seed=0, optimizer="adamw", device="cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                              strategy="lightcheck", region=str(shm / "rank-{rank}.bin"), persist_every=0) as ckpt:
                loop(w, ckpt, ckpt.restore(), 6)
        assert not [c for c in caught if "cannot be pinned" in str(c.message)]
        strategy = ckpt.strategy
        assert strategy.registered is True  # the mapping is pinned for the GPU's DMA
        assert len(strategy.copy_seconds) == 6 and all(s > 0 for s in strategy.copy_seconds)  # steps 1-5, the final 6
        live, _ = flatten({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()})
        region = Region.open(shm / "rank-0.bin", access="read")
        try:
            slot, tensors, _ = region.newest()
            assert slot.step == 6
            assert all(torch.equal(tensors[k], live[k].cpu()) for k in live), "the region holds S_6 bitwise"
        finally:
            region.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@gpu
def test_a_region_on_disk_that_cannot_be_pinned_is_warned_about_once_and_still_holds_the_state(tmp_path):
    """Linux (6.5 on) refuses to pin a writable shared mapping of a disk's file: the copies go through
    pageable memory, and the user is told once, with the region's path and what to do."""
    w = build("gpt2-tiny", seed=0, optimizer="adamw", device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          strategy="lightcheck", persist_every=0, flush=False) as ckpt:
            loop(w, ckpt, ckpt.restore(), 4)
    refusals = [str(c.message) for c in caught if "cannot be pinned" in str(c.message)]
    if ckpt.strategy.registered:
        assert refusals == []
    else:
        assert len(refusals) == 1 and str(tmp_path / "c" / "region" / "rank-0.bin") in refusals[0], refusals
        assert "/dev/shm" in refusals[0]
    live, _ = flatten({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()})
    region = Region.open(tmp_path / "c" / "region" / "rank-0.bin", access="read")
    try:
        slot, tensors, _ = region.newest()
        assert slot.step == 4 and all(torch.equal(tensors[k], live[k].cpu()) for k in live)
    finally:
        region.close()


@gpu
def test_gockpt_refuses_to_bring_the_parts_forward_on_the_host_of_a_gpu_model(tmp_path):
    w = build("gpt2-tiny", seed=0, device="cuda")
    with pytest.raises(ConfigError, match="reconstruct='host' brings the parts forward on the CPU"):
        Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="gockpt", reconstruct="host")


@gpu
@pytest.mark.parametrize("strategy, mode", [("gockpt", "software"), ("gockpt_o", "hardware")])
def test_gockpt_trained_on_the_gpu_brings_its_parts_forward_there_and_recovers_bitwise(tmp_path, strategy, mode):
    steps = 14
    ref = _reference(steps=steps)
    got = run(TrainConfig(workload="gpt2-tiny", strategy=strategy, steps=steps, directory=str(tmp_path / "c"),
                          fail_at=(9, 13), fail_mode=mode, every=4, options={"parts": 3, "chunk_bytes": 1 << 16},
                          device="cuda", progress=False))
    sources = [r["source"] for r in got["recoveries"]]  # (a hardware failure may come before the write is durable)
    assert "disk (parts brought forward on cuda:0)" in sources and set(sources) <= {"none", "disk (parts brought forward on cuda:0)"}
    assert got["losses"] == ref["losses"]
    assert got["final_state_sha256"] == ref["final_state_sha256"]


@gpu
def test_checkfreq_with_a_writer_process_snapshots_into_registered_shared_memory_and_recovers_bitwise(tmp_path):
    steps = 10
    ref = _reference(steps=steps)
    got = run(TrainConfig(workload="gpt2-tiny", strategy="checkfreq", steps=steps, directory=str(tmp_path / "c"),
                          fail_at=(4, 8), fail_mode="software", options={"persist": "process"}, device="cuda",
                          progress=False))
    assert got["losses"] == ref["losses"]
    assert got["final_state_sha256"] == ref["final_state_sha256"]


@gpu
@pytest.mark.parametrize("strategy, mode, source", [("checkfreq", "software", "memory"), ("async", "hardware", "disk"),
                                                   ("checkflow", "software", "memory"), ("full_sync", "software", "memory")])
def test_the_memory_tier_on_the_gpu_takes_each_snapshot_by_dma_and_recovers_bitwise(tmp_path, shm, strategy, mode,
                                                                                     source):
    """``memory=True``: checkfreq's and async's snapshots go straight into the region's slot, registered
    for DMA; the others copy their snapshot into it. A process crash recovers from the region, a host
    loss (the region in /dev/shm gone) from the directory."""
    steps = 10
    ref = _reference(steps=steps)
    got = run(TrainConfig(workload="gpt2-tiny", strategy=strategy, steps=steps, directory=str(tmp_path / "c"),
                          fail_at=(4, 8), fail_mode=mode, device="cuda", progress=False, every=1,
                          options={"memory": True, "region": f"{shm}/rank-{{rank}}.bin", "persist_every": 2}))
    assert [r["source"] for r in got["recoveries"]] == [source] * 2
    assert got["losses"] == ref["losses"]
    assert got["final_state_sha256"] == ref["final_state_sha256"]


@gpu
def test_the_profile_counts_what_an_operator_allocates_and_frees_inside_it():
    """An operator that allocates 64 MiB and frees it before it ends: the profile's bytes alive while
    it runs include them (the allocator's peak between hooks), not only what is alive at its start."""
    from everystep.capture.profile import profile_step

    class Spike(torch.nn.Module):
        def forward(self, x):
            scratch = torch.empty(64 << 20, dtype=torch.uint8, device=x.device)
            scratch.zero_()
            del scratch
            return x * 1.0

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), Spike(), torch.nn.Linear(64, 1)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 64, device="cuda")

    def step():
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    profile = profile_step(model, optimizer, step)
    assert max(profile.resident) >= torch.cuda.memory_allocated() + (64 << 20)


@gpu
def test_gockpt_on_the_gpu_keeps_its_spread_checkpoints_in_the_memory_tier_and_brings_them_forward_there(tmp_path, shm):
    steps = 14
    ref = _reference(steps=steps)
    got = run(TrainConfig(workload="gpt2-tiny", strategy="gockpt", steps=steps, directory=str(tmp_path / "c"),
                          fail_at=(9, 13), fail_mode="software", every=4, device="cuda", progress=False,
                          options={"parts": 3, "chunk_bytes": 1 << 16, "memory": True,
                                   "region": f"{shm}/rank-{{rank}}.bin", "persist_every": 2}))
    assert [r["source"] for r in got["recoveries"]] == ["memory (parts brought forward on cuda:0)"] * 2
    assert got["losses"] == ref["losses"]
    assert got["final_state_sha256"] == ref["final_state_sha256"]


@gpu
def test_a_restore_on_the_gpu_moves_the_optimizers_state_from_the_slot_to_the_device_and_keeps_nothing_there(
        tmp_path, shm):
    """LightCheck's restore of a GPU-trained model reads the optimizer's state out of its slot as
    views, which the optimizer's load copies onto the GPU: the state lands there bitwise, and no
    tensor of the optimizer is left pointing into the slot (the step counters were copied out)."""
    w = build("gpt2-tiny", seed=0, optimizer="adamw", device="cuda")
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="lightcheck",
                      region=str(shm / "rank-{rank}.bin"), persist_every=0) as ckpt:
        loop(w, ckpt, ckpt.restore(), 4)
    fresh = build("gpt2-tiny", seed=0, optimizer="adamw", device="cuda")
    with Checkpointer(tmp_path / "c", fresh.model, fresh.optimizer, scheduler=fresh.scheduler, data=fresh.data,
                      strategy="lightcheck", region=str(shm / "rank-{rank}.bin"), persist_every=0, final=False) as again:
        assert again.restore() == 4 and again.recovered.source == "region"
        trained, restored = w.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
        assert restored.keys() == trained.keys()
        for index, entries in restored.items():
            for name, t in entries.items():
                assert torch.equal(t.cpu(), trained[index][name].cpu()), (index, name)
                assert t.device.type == ("cpu" if name == "step" else "cuda"), (index, name)
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), "a tensor of its own"


@gpu
@pytest.mark.parametrize("strategy, source", [("lightcheck", "region"), ("checkfreq", "disk")])
def test_a_restore_into_an_optimizer_that_holds_its_state_on_the_gpu_fills_its_own_tensors(tmp_path, shm, strategy,
                                                                                           source):
    """Recovery within a process whose optimizer has its state on the GPU already: the stored state
    (a region's slot, read in place; a file, read into host memory) is copied into the tensors the
    optimizer holds, which it keeps at their addresses, now holding the checkpoint's values bitwise;
    torch's load would have put new ones in their place."""
    options = {"region": str(shm / "rank-{rank}.bin"), "persist_every": 0} if strategy == "lightcheck" else {}
    w = build("gpt2-tiny", seed=0, optimizer="adamw", device="cuda")
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=strategy,
                      **options) as ckpt:
        loop(w, ckpt, ckpt.restore(), 4)
    again_w = build("gpt2-tiny", seed=0, optimizer="adamw", device="cuda")
    loop(again_w, None, 0, 1)
    held = {(index, name): (t, t.data_ptr()) for index, entry in enumerate(again_w.optimizer.state.values())
            for name, t in entry.items() if name != "step"}
    assert held and all(t.device.type == "cuda" for t, _ in held.values())
    with Checkpointer(tmp_path / "c", again_w.model, again_w.optimizer, scheduler=again_w.scheduler,
                      data=again_w.data, strategy=strategy, final=False, **options) as again:
        assert again.restore() == 4 and again.recovered.source == source
    for (index, name), (t, address) in held.items():
        now = list(again_w.optimizer.state.values())[index][name]
        assert now is t and now.data_ptr() == address, (index, name)
    assert state_hash({"model": again_w.model.state_dict(), "optimizer": again_w.optimizer.state_dict()}) == \
        state_hash({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()})


@gpu
def test_a_trace_of_a_gpu_run_holds_its_streams_on_the_threads_clock(tmp_path, shm):
    """A bench run on the GPU traced: the training stream's share of each step and LightCheck's
    copies on its side stream are rows of their own, timed by CUDA events, each copy inside the run's
    steps on the host's clock."""
    from everystep import tracing
    from everystep.eval.bench.measure import measure

    stem = tmp_path / "lightcheck"
    measure({"workload": "gpt2-tiny", "strategy": "lightcheck", "steps": 6, "warmup": 2, "every": 1, "threads": 1,
             "seed": 0, "repeat": 0, "options": {}, "compress": None, "device": "cuda", "scratch": str(shm),
             "in_backward": False, "nproc": 1, "parallel": "ddp", "remote": None, "samples": None, "checks": False,
             "trace": str(stem)})
    events = tracing.load(tracing.merge(stem))["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [(tracks.get((e["pid"], e["tid"]), ""), e) for e in events if e["ph"] == "X"]
    on_streams = [(t, e["name"]) for t, e in spans if t.startswith("cuda stream")]
    assert sum(name == "step" for _, name in on_streams) == 6 and sum(name == "lightcheck copy" for _, name in on_streams) >= 5
    steps = [e for t, e in spans if t == "MainThread" and e["name"] == "step"]
    copies = [e for t, e in spans if t.startswith("cuda stream") and e["name"] == "lightcheck copy"]
    assert all(steps[0]["ts"] <= c["ts"] <= steps[-1]["ts"] + steps[-1]["dur"] + 1e6 for c in copies)


@gpu
def test_to_host_copies_into_pinned_memory_on_a_side_stream_after_the_work_before_it():
    """LowDiff's records and end states go to the host this way: the copies wait for the work queued
    before them on the training stream, land in pinned memory, and the host tensors are right once
    the event has passed; what lies on the CPU is handed back as it is."""
    from everystep.transport.host import to_host

    x = torch.randn(2048, 2048, device="cuda")
    y = x
    for _ in range(20):
        y = torch.tanh(y @ x)
    cpu = torch.arange(5)
    got, event = to_host({"y": y, "idx": y.argmax(dim=1), "cpu": cpu}, torch.cuda.Stream())
    assert event is not None and got["cpu"] is cpu and got["y"].is_pinned() and got["idx"].is_pinned()
    event.synchronize()
    assert torch.equal(got["y"], y.cpu()) and torch.equal(got["idx"], y.argmax(dim=1).cpu())
    assert to_host({"cpu": cpu}, None) == ({"cpu": cpu}, None)
