"""LowDiff and naive differential checkpointing: exact replay, batching, chains, bytes, refusals."""

from __future__ import annotations

import threading

import pytest
import torch

from everystep import Checkpointer
from everystep.compress import GradientCompression, make_compressor
from everystep.errors import ConfigError
from everystep.eval.kills.faults import FailurePlan
from everystep.eval.kills.train import TrainConfig, run
from everystep.eval.workloads import build
from everystep.state import TrainingComponents
from everystep.tree import flatten, state_hash
from everystep.storage import CheckpointDirectory
from everystep.storage.formats.tensorfile import load_tensors
from everystep.strategies import context as strategy_context
from everystep.strategies.lowdiff import LowDiff
from everystep.tree import state_error

from .test_policy import exhaustive_optimum

STEPS = 12


def _seed_with_mid_write_kill(step: int) -> int:
    return next(s for s in range(1000) if FailurePlan(steps=(step,), seed=s).point(step) == "write")


@pytest.mark.parametrize(
    "optimizer, compress, mode",
    [("adamw", "topk:0.01", "software"), ("adam", "quant8", "hardware"), ("momentum", "quant8", "software")],
)
def test_killed_lowdiff_runs_equal_the_uninterrupted_compressed_run(tmp_path, optimizer, compress, mode):
    """I1 and I2, with a scheduler and gradient clipping in the loop; killed mid-batch and mid-write."""
    seed = _seed_with_mid_write_kill(7)
    common = dict(workload="gpt2-tiny", steps=STEPS, seed=seed, optimizer=optimizer, compress=compress, progress=False)
    ref = run(TrainConfig(strategy="none", **common))
    fail_at = (1, 7, STEPS)
    s = run(TrainConfig(strategy="lowdiff", directory=str(tmp_path / "c"), every=5, options={"batch": 3},
                        fail_at=fail_at, fail_mode=mode, **common))
    assert s["losses"] == ref["losses"]
    assert s["final_state_sha256"] == ref["final_state_sha256"]
    for r in s["recoveries"]:
        # lost: the steps of the batch not yet written (at most b), the batches the writer still had
        # queued (none on a quiet machine; a loaded one lags) and the step in progress — never a
        # step the failed process had seen durable
        assert r["durable_before"] <= r["resumed_from"] <= r["failed_at"]


def _make(seed=0, optimizer="adamw", compress="topk:0.05", workload="gpt2-tiny"):
    w = build(workload, seed=seed, optimizer=optimizer)
    w.compression = GradientCompression(make_compressor(compress), w.model, w.optimizer)
    return w


def _attach(w, directory, **kw):
    return Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                        compression=w.compression, strategy=kw.pop("strategy", "lowdiff"), **kw)


def _loop(w, n, scaler=None, inf_at=()):
    for i in range(n):
        loss = w.loss(w.data.next())
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
            w.optimizer.step()
        else:
            scaler.scale(loss * (float("inf") if i + 1 in inf_at else 1.0)).backward()
            scaler.unscale_(w.optimizer)
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
            scaler.step(w.optimizer)
            scaler.update()
        w.optimizer.zero_grad()
        w.scheduler.step()


def _hash(w, scaler=None):
    c = TrainingComponents(model=w.model, optimizer=w.optimizer, scheduler=w.scheduler, data=w.data,
                           compression=w.compression, scaler=scaler)
    return state_hash({**c.capture(), **c.capture_boundary()})


def test_replay_across_a_step_the_grad_scaler_skipped(tmp_path):
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**8)

    ref, s_ref = _make(), scaler()
    _loop(ref, 6, s_ref, inf_at=(3,))
    w, s = _make(), scaler()
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, scaler=s,
                      compression=w.compression, strategy="lowdiff", every=50, batch=2) as ckpt:
        ckpt.restore()
        _loop(w, 6, s, inf_at=(3,))
    w2, s2 = _make(seed=7), scaler()
    w2.data.seed = 0
    with Checkpointer(tmp_path / "c", w2.model, w2.optimizer, scheduler=w2.scheduler, data=w2.data, scaler=s2,
                      compression=w2.compression, strategy="lowdiff", every=50, batch=2, final=False) as ckpt:
        assert ckpt.restore() == 6
    assert _hash(w2, s2) == _hash(ref, s_ref)


def test_parallel_replay_equals_serial_replay_bitwise(tmp_path):
    w = _make()
    with _attach(w, tmp_path / "c", every=50, batch=4) as ckpt:
        ckpt.restore()
        _loop(w, 8)
    hashes = []
    for threads in (1, 3):
        w2 = _make(seed=1)
        w2.data.seed = 0
        with _attach(w2, tmp_path / "c", every=50, batch=4, replay_threads=threads, final=False) as ckpt:
            assert ckpt.restore() == 8
        hashes.append(_hash(w2))
    assert hashes[0] == hashes[1] == _hash(w)


def test_batches_are_concatenations_and_bytes_stay_near_the_compressed_size(tmp_path):
    w = _make(workload="gpt2-small", compress="topk:0.01")
    with _attach(w, tmp_path / "c", every=50, batch=1, final=False) as ckpt:
        ckpt.restore()
        full_bytes = ckpt.bytes_written
        _loop(w, 3)
        ckpt._activity()  # the boundary of step 3, as the next forward would trigger it
        ckpt.wait()
        written = ckpt.bytes_written - full_bytes
    sent = w.compression.compressed_bytes  # the compressor's own output (values and indices), 3 steps
    store = CheckpointDirectory.open(tmp_path / "c")
    manifests = [r.manifest for r in store.catalog.manifests() if r.manifest.kind == "diff"]
    assert sorted(m.step for m in manifests) == [1, 2, 3]
    # Error-feedback residuals depend on the uncompressed gradients, so replay cannot rebuild them:
    # each batch stores them densely for recovery to be exact. Everything else is the records.
    residual = sum(sum(t.numel() * t.element_size() for k, t in load_tensors(store.catalog.read_object(m.objects["tensors"]),
                   what="d").items() if k.startswith("end/compression/")) for m in manifests)
    assert residual == 3 * sum(p.numel() * 4 for p in w.model.parameters())
    assert written - residual <= 1.2 * sent, (written - residual, sent)
    assert ckpt.strategy.record_bytes == sent  # in one process the records are the compressed gradients
    assert residual <= ckpt.strategy.end_bytes <= written - sent
    assert sent / 3 < full_bytes / 20  # a compressed gradient is a small fraction of the full state


def test_summing_a_batch_is_refused_unless_the_update_is_linear(tmp_path):
    w = _make(optimizer="adamw")
    with pytest.raises(ConfigError, match="sum_linear needs an update that is linear in the gradient.*AdamW"):
        _attach(w, tmp_path / "a", sum_linear=True)
    w = _make(optimizer="momentum")
    with pytest.raises(ConfigError, match="SGD with these settings is not"):
        _attach(w, tmp_path / "m", sum_linear=True)


def test_summing_equals_concatenation_for_plain_sgd(tmp_path):
    """For p ← p − lr·g the batch sum Σ lr_s·g_s gives the same state, up to float rounding only."""
    states = {}
    for mode in (False, True):
        w = _make(optimizer="sgd")
        with _attach(w, tmp_path / str(mode), every=50, batch=4, sum_linear=mode) as ckpt:
            ckpt.restore()
            _loop(w, 8)
        w2 = _make(optimizer="sgd", seed=3)
        w2.data.seed = 0
        with _attach(w2, tmp_path / str(mode), every=50, batch=4, sum_linear=mode, final=False) as ckpt:
            assert ckpt.restore() == 8
        states[mode] = ({k: v.clone() for k, v in w2.model.state_dict().items()}, w.model.state_dict())
    concatenated, live = states[False]
    summed, _ = states[True]
    assert all(torch.equal(concatenated[k], live[k]) for k in live)  # concatenation: bitwise
    for k in live:
        assert torch.allclose(summed[k], live[k], rtol=1e-5, atol=1e-7), k


def test_a_corrupt_batch_ends_the_chain_with_a_warning(tmp_path):
    w = _make()
    with _attach(w, tmp_path / "c", every=50, batch=2) as ckpt:
        ckpt.restore()
        _loop(w, 6)
    path = tmp_path / "c" / "objects" / "diff-000000000004.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(raw)
    w2 = _make(seed=2)
    w2.data.seed = 0
    with pytest.warns(UserWarning, match="chain from step 0 ends at step 2: .*fails its checksum"):
        with _attach(w2, tmp_path / "c", every=50, batch=2, final=False) as ckpt:
            assert ckpt.restore() == 2


def test_differentials_older_than_a_durable_full_checkpoint_are_deleted(tmp_path, monkeypatch):
    # The batch that ends at step 4 is written only once the full checkpoint of step 4 is durable
    # (the order that leaves a batch older than a full checkpoint to delete): only newer batches stay.
    write_batch, persist = LowDiff._write_batch, strategy_context.persist_full
    full_at_4 = threading.Event()

    def persisting(directory, step, *args, **kwargs):
        found = persist(directory, step, *args, **kwargs)
        if step == 4:
            full_at_4.set()
        return found

    def late(self, base, records, *args):
        if records[-1].step == 4:
            assert full_at_4.wait(60), "the full checkpoint of step 4 was never written"
        write_batch(self, base, records, *args)

    monkeypatch.setattr(strategy_context, "persist_full", persisting)
    monkeypatch.setattr(LowDiff, "_write_batch", late)
    w = _make()
    with _attach(w, tmp_path / "c", every=4, batch=1, keep=1) as ckpt:
        ckpt.restore()
        _loop(w, 6)
    kinds = sorted((r.manifest.kind, r.manifest.step) for r in CheckpointDirectory.open(tmp_path / "c").catalog.manifests())
    assert ("full", 4) in kinds and all(step > 4 for kind, step in kinds if kind == "diff")


def test_lowdiff_needs_compression_and_restore(tmp_path):
    w = build("mlp", seed=0)
    with pytest.raises(ConfigError, match="lowdiff reuses compressed gradients"):
        Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="lowdiff")
    w = _make(workload="mlp")
    ckpt = _attach(w, tmp_path / "d")
    with pytest.raises(Exception, match="needs restore\\(\\) to be called before the first step"):
        _loop(w, 1)
    ckpt.close()


def test_adaptation_applies_the_integer_optimum_of_measured_costs(tmp_path):
    w = _make(workload="mlp")
    with _attach(w, tmp_path / "c", every=3, batch=1, adapt=True, mtbf=600.0) as ckpt:
        ckpt.restore()
        _loop(w, 7)
        strategy = ckpt.strategy
        costs = strategy.last_costs
    assert costs is not None and costs.mtbf_seconds == 600.0 and costs.full_bytes > 0
    # the best whole pair for the costs it measured, every pair tried under the model written out anew
    # (up to well past the pair found: on a fast machine the measured costs put F beyond 10,000)
    bounds = max(10_000, 3 * strategy.interval), max(200, 3 * strategy.batch)
    assert (strategy.interval, strategy.batch) == exhaustive_optimum(costs, *bounds) != (3, 1)
    with pytest.raises(ConfigError, match="adapt=True needs mtbf"):
        _attach(_make(workload="mlp"), tmp_path / "x", adapt=True)


def test_naive_diff_is_lossy_and_its_error_is_measurable(tmp_path):
    w = build("gpt2-tiny", seed=0)
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                      strategy="naive_diff", every=50, ratio=0.01) as ckpt:
        ckpt.restore()
        _loop(w, 5)
    truth, _ = flatten({"model": w.model.state_dict()})
    w2 = build("gpt2-tiny", seed=1)
    w2.data.seed = 0
    with Checkpointer(tmp_path / "c", w2.model, w2.optimizer, scheduler=w2.scheduler, data=w2.data,
                      strategy="naive_diff", every=50, final=False) as again:
        assert again.restore() == 5
        assert again.recovered.source == "disk (lossy)"
    got, _ = flatten({"model": w2.model.state_dict()})
    error = state_error(got, truth)
    assert 0 < error < 0.05  # not exact, by design, but not far off either
    assert w2.data.state_dict() == w.data.state_dict()  # what a difference cannot carry is exact


def test_the_two_trades_of_lowdiffs_bytes_exact_without_error_feedback_lossy_when_residuals_drop(tmp_path):
    """By default each batch also stores the dense error-feedback residuals (exact recovery). Without
    error feedback (``topk:RATIO,ef=off``) the step records alone recover bitwise, and writes shrink
    to them; with ``residual="drop"`` the records alone are stored, and recovery takes the base full
    checkpoint's residuals: the model and optimizer are exact, training then drifts, and the
    recovery says it is lossy."""
    end_bytes, record_bytes = {}, {}
    for label, compress, residual in (("keep", "topk:0.05", "keep"), ("ef_off", "topk:0.05,ef=off", "keep"),
                                      ("drop", "topk:0.05", "drop")):
        w = _make(compress=compress)
        with _attach(w, tmp_path / label, every=50, batch=1, residual=residual) as ckpt:
            ckpt.restore()
            _loop(w, 6)
            ckpt.wait()
            end_bytes[label], record_bytes[label] = ckpt.strategy.end_bytes, ckpt.strategy.record_bytes
        params = _model_and_optimizer(w)
        _loop(w, 3)
        after = _hash(w)
        again = _make(compress=compress)  # at S_0: recovery must bring S_6
        with _attach(again, tmp_path / label, every=50, batch=1, residual=residual, final=False) as ckpt:
            assert ckpt.restore() == 6
            source = ckpt.recovered.source
        assert state_error(_model_and_optimizer(again), params) == 0  # replayed from the records: exact
        _loop(again, 3)
        if label == "drop":
            assert source == "disk (lossy: residuals of step 0)" and _hash(again) != after
        else:
            assert source == "disk" and _hash(again) == after
    assert end_bytes["ef_off"] < end_bytes["keep"] / 4 and end_bytes["drop"] < end_bytes["keep"] / 4
    assert record_bytes["ef_off"] == pytest.approx(record_bytes["keep"], rel=0.01)


def _model_and_optimizer(w):
    tensors, _ = flatten({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()["state"]})
    return {k: t.detach().clone() for k, t in tensors.items()}


@pytest.mark.parametrize("spec, message", [("topk:0.01,ef=maybe", "ef=on or ef=off"),
                                           ("powersgd:rank=2,ef=off", "PowerSGD keeps its own error feedback")])
def test_compression_options_are_checked(spec, message):
    with pytest.raises(ConfigError, match=message):
        make_compressor(spec)


def test_a_residual_option_other_than_keep_or_drop_is_refused():
    with pytest.raises(ConfigError, match="residual must be 'keep' or 'drop'"):
        LowDiff(LowDiff.Config(residual="zero"))
