"""The Checkpointer's behaviour, shared by every strategy, and each invariant it must keep."""

from __future__ import annotations

import gc
import pickle
import re

import pytest
import torch

from everystep import (
    BackgroundWriteError,
    Checkpointer,
    CheckpointDirectoryError,
    NoValidCheckpointError,
    StateMismatchError,
    UnclosedCheckpointerWarning,
)
from everystep.errors import ConfigError
from everystep.eval.kills.train import training_state_hash
from everystep.compress import GradientCompression, make_compressor
from everystep.eval.workloads import build
from everystep.storage import CheckpointDirectory
from everystep.storage.base import Manifest, ObjectInfo, checksum
from everystep.strategies import STRATEGIES, create

from .conftest import FullDisk, files_of

DISK = sorted(name for name, cls in STRATEGIES.items() if cls.needs_store)
LOSSY = {name for name, cls in STRATEGIES.items() if not cls.exact}
SPREAD = {"gockpt", "gockpt_o"}
"""A checkpoint started after step N is complete only at N+K (K = parts; 1 in these tests)."""
DIFFERENTIAL = {"lowdiff", "naive_diff"}
EXACT = [name for name in DISK if name not in LOSSY]
COMPRESS = {"lowdiff": "topk:0.05"}
"""Strategies that reuse compressed gradients train with compression; their reference does too."""


def make(workload, seed, strategy=None):
    w = build(workload, seed=seed)
    spec = COMPRESS.get(strategy)
    w.compression = GradientCompression(make_compressor(spec), w.model, w.optimizer) if spec else None
    return w


def loop(w, ckpt, start, stop, losses=None):
    """The user's training loop, unchanged by checkpointing."""
    for _ in range(start + 1, stop + 1):
        loss = w.loss(w.data.next())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
        w.optimizer.step()
        w.optimizer.zero_grad()
        w.scheduler.step()
        if losses is not None:
            losses.append(loss.item())


def live_hash(w, step):
    from everystep.state import TrainingComponents

    c = TrainingComponents(model=w.model, optimizer=w.optimizer, scheduler=w.scheduler, data=w.data,
                           compression=getattr(w, "compression", None))
    return training_state_hash({"step": step, **c.capture(), **c.capture_boundary()})


def attach(w, directory, strategy, **kw):
    return Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                        compression=getattr(w, "compression", None), strategy=strategy, **kw)


@pytest.fixture(scope="module")
def uninterrupted():
    """The loop without everystep, by (workload, seed, compression, steps): its losses and final state's
    hash, each run when first asked (the strategies that train with the same compression share it)."""
    runs: dict[tuple, tuple[list[float], str]] = {}

    def get(workload, seed, strategy, steps):
        key = (workload, seed, COMPRESS.get(strategy), steps)
        if key not in runs:
            ref, losses = make(workload, seed, strategy), []
            loop(ref, None, 0, steps, losses)
            runs[key] = losses, live_hash(ref, steps)
        return runs[key]

    return get


@pytest.mark.parametrize("strategy", EXACT)
@pytest.mark.parametrize("workload", ["gpt2-tiny", "resnet"])
def test_restore_is_bit_exact_and_training_continues_identically(tmp_path, strategy, workload, uninterrupted):
    """I1 (in one process): resume from step 3 reproduces the uninterrupted run's state and losses."""
    ref_losses, ref_hash = uninterrupted(workload, 3, strategy, 5)

    w = make(workload, 3, strategy)
    with attach(w, tmp_path / "c", strategy, every=2) as ckpt:
        assert ckpt.restore() == 0
        loop(w, ckpt, 0, 3)
    w2 = make(workload, 99, strategy)  # other initial values: everything must come from the checkpoint
    w2.data.seed = 3
    losses = []
    with attach(w2, tmp_path / "c", strategy) as ckpt:
        assert ckpt.restore() == 3
        loop(w2, ckpt, 3, 5, losses)
    assert losses == ref_losses[3:]
    assert live_hash(w2, 5) == ref_hash


def closure_loop(w, start, stop, losses):
    """A loop whose forward, backward and clipping run inside ``optimizer.step(closure)``, as PyTorch
    Lightning's automatic optimization calls it."""
    for _ in range(start + 1, stop + 1):
        batch = w.data.next()

        def closure():
            w.optimizer.zero_grad()
            loss = w.loss(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
            losses.append(loss.item())
            return loss

        w.optimizer.step(closure)
        w.scheduler.step()


@pytest.mark.parametrize("strategy", ["checkfreq", "lowdiff"])
def test_a_step_given_a_closure_is_recorded_after_the_closure(tmp_path, strategy):
    """The gradients a differential strategy records are the ones the closure computed (before the
    update, after backward and clipping), so resuming from its records is bit-exact."""
    ref, ref_losses = make("gpt2-tiny", 4, strategy), []
    closure_loop(ref, 0, 5, ref_losses)
    w, losses = make("gpt2-tiny", 4, strategy), []
    with attach(w, tmp_path / "c", strategy, every=2) as ckpt:
        assert ckpt.restore() == 0
        closure_loop(w, 0, 3, losses)
    assert losses == ref_losses[:3]
    w2 = make("gpt2-tiny", 99, strategy)
    w2.data.seed = 4
    with attach(w2, tmp_path / "c", strategy) as ckpt:
        assert ckpt.restore() == 3
        closure_loop(w2, 3, 5, losses)
    assert losses == ref_losses
    assert live_hash(w2, 5) == live_hash(ref, 5)


def test_step_events_come_before_gradients_when_forward_bypasses_the_model():
    """Activity (the end of S_t's capture window) comes before the first gradient of the next step's
    first micro-batch, where the forward skips the model's hooks and micro-batches accumulate before
    optimizer.step(): a strategy that copies gradients as backward makes them must not see them sooner."""
    from everystep.capture.hooks import StepHooks

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []
    hooks = StepHooks(model=model, optimizer=opt, scaler=None, step_end=lambda: events.append("end"),
                      activity=lambda: events.append("activity"), before_update=lambda: events.append("update"))
    model[1].weight.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
    try:
        for _ in range(2):
            for _ in range(2):  # micro-batches
                model.forward(torch.randn(3, 4)).sum().backward()  # .forward: no module hooks
            opt.step()
            opt.zero_grad()
    finally:
        hooks.remove()
    # (the Checkpointer acts on the first activity after a step's end only)
    assert events == ["activity", "grad", "activity", "grad", "activity", "update", "end"] * 2


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_checkpointing_does_not_change_training(tmp_path, strategy, uninterrupted):
    """I6: losses and final state are bitwise those of the same loop without everystep."""
    ref_losses, ref_hash = uninterrupted("gpt2-tiny", 5, strategy, 6)
    w, losses = make("gpt2-tiny", 5, strategy), []
    with attach(w, tmp_path / "c", strategy, every=2) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 6, losses)
    assert losses == ref_losses
    assert live_hash(w, 6) == ref_hash


@pytest.mark.parametrize("strategy", DISK)
def test_every_and_keep_and_final_checkpoint(tmp_path, strategy):
    w = make("mlp", 0, strategy)
    persist = {"persist_every": 3} if strategy == "lightcheck" else {}  # its region's slots are persisted so
    persist |= {"parts": 1} if strategy in SPREAD else {}
    with attach(w, tmp_path / "c", strategy, every=3, keep=2, **persist) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 10)
    manifests = [r.manifest for r in CheckpointDirectory.open(tmp_path / "c").catalog.manifests()]
    fulls = sorted(m.step for m in manifests if m.kind == "full")
    differentials = sorted((m.meta["base"], m.step) for m in manifests if m.kind != "full")
    if strategy in DIFFERENTIAL:
        # full checkpoints at 0, 3, 6, 9 (F = every), a differential every step; the last step's is
        # the final one. Kept: the newest two fulls and the differentials newer than the newest.
        assert fulls == [6, 9]
        assert differentials == [(9, 10)]
        assert ckpt.stats.checkpoints == 4 + 10
    elif strategy in SPREAD:  # started at 3, 6, 9, complete one step later: 4, 7, 10 (10 also the last step)
        assert fulls == [7, 10] and differentials == [] and ckpt.stats.checkpoints == 3
    else:
        assert fulls == [9, 10] and differentials == []  # 3, 6, 9 by interval, 10 at close; the newest two kept
        # lowdiff_plus also checkpoints every step in the agent's memory
        assert ckpt.stats.checkpoints == (10 if strategy == "lowdiff_plus" else 4)
    w2 = make("mlp", 0, strategy)
    with attach(w2, tmp_path / "c", strategy, final=False) as again:
        assert again.restore() == 10
    if strategy not in LOSSY:
        assert live_hash(w2, 10) == live_hash(w, 10)


def test_empty_directory_restores_step_zero_and_none_needs_no_directory(tmp_path):
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync") as ckpt:
        assert ckpt.restore() == 0
    with attach(w, None, "none") as ckpt:
        assert ckpt.restore() == 0


def test_flipped_byte_skips_to_previous_checkpoint_with_a_warning(tmp_path):
    """I4: corruption is detected and the previous valid checkpoint is used."""
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync", keep=3) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 3)
    newest = tmp_path / "c" / "objects" / "full-000000000003.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    newest.write_bytes(raw)
    w2 = build("mlp", seed=0)
    with pytest.warns(UserWarning, match="skipping the checkpoint at step 3: .*fails its checksum"):
        with attach(w2, tmp_path / "c", "full_sync", final=False) as ckpt:
            assert ckpt.restore() == 2


def test_truncated_objects_everywhere_give_a_clear_error(tmp_path):
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 2)
    for obj in (tmp_path / "c" / "objects").iterdir():
        obj.write_bytes(obj.read_bytes()[:100])
    w2 = build("mlp", seed=0)
    with pytest.warns(UserWarning), pytest.raises(NoValidCheckpointError, match=r"step 2: .*truncated.*step 1: .*truncated"):
        with attach(w2, tmp_path / "c", "full_sync", final=False) as ckpt:
            ckpt.restore()


class _Exploit:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickle_in_place_of_a_tensor_file_is_refused_without_running_it(tmp_path):
    """I5: even with checksums forged to match, a pickle is never unpickled."""
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 1)
    store = CheckpointDirectory.open(tmp_path / "c")
    [record] = store.catalog.manifests()
    exploit = _Exploit()
    exploit.marker = str(tmp_path / "pwned")
    payload = pickle.dumps(exploit)
    info = record.manifest.objects["tensors"]
    (store.root / "objects" / info.name).write_bytes(payload)
    forged = Manifest(kind="full", step=1, objects={"tensors": ObjectInfo(info.name, len(payload), checksum(payload))},
                      meta=record.manifest.meta)
    store.catalog.commit(forged)
    store.close()
    w2 = build("mlp", seed=0)
    with pytest.warns(UserWarning, match="not a valid safetensors file"), pytest.raises(NoValidCheckpointError):
        with attach(w2, tmp_path / "c", "full_sync", final=False) as ckpt:
            ckpt.restore()
    assert not (tmp_path / "pwned").exists()


def test_other_model_shapes_are_refused_by_name_and_nothing_is_deleted(tmp_path):
    """I7: a mismatch names the parameter, changes no live tensor, and deletes no stored file."""
    w = build("gpt2-tiny", seed=0)
    with attach(w, tmp_path / "c", "checkfreq") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 2)
    before = files_of(tmp_path / "c")
    other = build("mlp", seed=0)
    with pytest.raises(StateMismatchError, match="the model has '0.bias', '0.weight', '3.bias' and 3 more which the checkpoint lacks"):
        with attach(other, tmp_path / "c", "checkfreq") as ckpt:
            ckpt.restore()
    from everystep.eval.workloads import GPT, GPTConfig

    wider = GPT(GPTConfig(vocab=256, seq=32, layers=2, width=64, heads=4))
    wider.wpe = torch.nn.Embedding(64, 64)
    snapshot = {k: v.clone() for k, v in wider.state_dict().items()}
    opt = torch.optim.AdamW(wider.parameters())
    with pytest.raises(StateMismatchError, match=r"model parameter 'wpe.weight' has shape \(64, 64\); the checkpoint has \(32, 64\)"):
        with Checkpointer(tmp_path / "c", wider, opt, strategy="checkfreq") as ckpt:
            ckpt.restore()
    assert all(torch.equal(v, snapshot[k]) for k, v in wider.state_dict().items())
    assert files_of(tmp_path / "c") == before


def test_missing_component_is_named(tmp_path):
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 1)
    with pytest.raises(StateMismatchError, match="has scheduler state but the Checkpointer was not given one"):
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, data=w.data, strategy="full_sync") as ckpt:
            ckpt.restore()


def test_directory_of_another_strategy_is_refused_untouched(tmp_path):
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 1)
    before = files_of(tmp_path / "c")
    with pytest.raises(CheckpointDirectoryError, match="written by strategy 'full_sync'; this run uses 'checkfreq'"):
        attach(w, tmp_path / "c", "checkfreq")
    assert files_of(tmp_path / "c") == before


def test_training_without_restore_into_a_used_directory_is_refused(tmp_path):
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 2)
    before = files_of(tmp_path / "c")
    with pytest.raises(CheckpointDirectoryError, match="holds checkpoints up to step 2, but training started without restore"):
        w2 = build("mlp", seed=0)
        with attach(w2, tmp_path / "c", "full_sync") as ckpt:
            loop(w2, ckpt, 0, 1)
    assert files_of(tmp_path / "c") == before


@pytest.mark.parametrize("strategy", DISK)
def test_full_disk_surfaces_in_the_training_process_and_keeps_the_previous_checkpoint(tmp_path, strategy, monkeypatch):
    """Every failed write is reported once, in the training thread, naming the cause."""
    w = make("mlp", 0, strategy)
    store = CheckpointDirectory.open(tmp_path / "c", strategy=strategy)
    disk = FullDisk(store)
    agent = STRATEGIES[strategy].shares_store  # its checkpoint agent writes, in a process of its own
    if agent:  # the agent inherits the environment: its writes fail from its third on (S_0, S_1 written)
        monkeypatch.setenv("EVERYSTEP_FAIL", "store.object.mid_write:3+")
    persist = {"persist_every": 1} if strategy == "lightcheck" else {}  # its region's slots all go to the directory
    persist |= {"every": 1, "parts": 1} if strategy in SPREAD else {}
    durable = 2 if strategy in SPREAD else 1  # (a spread one started after step 1 is complete at 2)
    ckpt = attach(w, store, strategy, **({"every": 1} if agent else {}), **persist)
    ckpt.restore()
    loop(w, ckpt, 0, durable + 1)
    ckpt.wait()  # step `durable` is durable; the next checkpoint starts with the next step
    disk.full = True
    expected = OSError if strategy == "full_sync" else BackgroundWriteError  # full_sync writes in the foreground
    messages = []
    with pytest.raises(expected, match="No space left on device") as raised:
        loop(w, ckpt, durable + 1, 500)  # the failure surfaces at a checkpoint call long before step 500
    messages.append(str(raised.value))
    try:
        ckpt.close()  # the final checkpoint fails too, unless it already failed and was reported
    except expected as e:
        messages.append(str(e))
    ckpt.close()  # closed: quiet
    # each failure is named once across messages (a message may name its step twice: step and file)
    found = [{int(a or b) for a, b in re.findall(r"at step (\d+)|full-(\d+)\.safetensors", m)} for m in messages]
    reported = sorted(s for steps in found for s in steps)
    if agent:  # the agent's attempts are seen only through its reports: steps 2, 3, … each once
        assert reported == list(range(2, 2 + len(reported))) and reported
    else:
        failed = sorted(int(n.split("-")[1].split(".")[0]) for n in disk.failed)
        assert failed and reported == failed
    assert max(r.manifest.step for r in CheckpointDirectory.open(tmp_path / "c").catalog.manifests()) == durable
    monkeypatch.delenv("EVERYSTEP_FAIL", raising=False)
    w2 = make("mlp", 0, strategy)
    with attach(w2, tmp_path / "c", strategy, final=False, **persist) as again:
        if strategy == "lightcheck":  # the region is not on the full disk: it goes on
            assert again.restore() > 1 and again.recovered.source == "region"
        else:
            assert again.restore() == durable


def test_unclosed_checkpointer_warns(tmp_path):
    w = build("mlp", seed=0)
    ckpt = attach(w, tmp_path / "c", "full_sync")
    with pytest.warns(UnclosedCheckpointerWarning, match="never closed"):
        del ckpt
        gc.collect()


def test_restore_after_training_started_is_an_error(tmp_path):
    w = build("mlp", seed=0)
    with attach(w, tmp_path / "c", "full_sync") as ckpt:
        ckpt.restore()
        with pytest.raises(Exception, match="restore\\(\\) must be called once"):
            ckpt.restore()


def test_config_errors_name_the_rule():
    with pytest.raises(ConfigError, match="every must be a positive number of steps, got 0"):
        create("full_sync", every=0)
    with pytest.raises(ConfigError, match="keep must be at least 1"):
        create("checkfreq", keep=0)
    with pytest.raises(ConfigError, match="buffers must be at least 1"):
        create("checkfreq", buffers=0)
    with pytest.raises(ConfigError, match="unknown strategy 'fast'"):
        create("fast")
    with pytest.raises(ConfigError, match="strategy 'full_sync' has no option buffers"):
        create("full_sync", buffers=2)


def test_grad_scaler_state_and_skipped_steps_are_counted(tmp_path):
    """A step the GradScaler skips is still a step: restore() returns the loop's own count."""
    def make():
        w = build("mlp", seed=0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        return w, scaler

    def run(w, scaler, ckpt, start, stop):
        for step in range(start + 1, stop + 1):
            loss = w.loss(w.data.next())
            scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
            scaler.step(w.optimizer)
            scaler.update()
            w.optimizer.zero_grad()
            w.scheduler.step()

    w, scaler = make()
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, scaler=scaler, data=w.data,
                      strategy="checkfreq") as ckpt:
        ckpt.restore()
        run(w, scaler, ckpt, 0, 3)
    assert scaler.get_scale() == 2.0**9  # halved by the skip at step 2
    w2, scaler2 = make()
    with Checkpointer(tmp_path / "c", w2.model, w2.optimizer, scheduler=w2.scheduler, scaler=scaler2, data=w2.data,
                      strategy="checkfreq") as ckpt:
        assert ckpt.restore() == 3
    assert scaler2.get_scale() == 2.0**9
    assert "update" not in vars(scaler2)  # the hook is removed at close


def test_checkfreq_reports_its_snapshot_wait(tmp_path):
    w = build("gpt2-tiny", seed=0)
    with attach(w, tmp_path / "c", "checkfreq") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 4)
    stats = ckpt.stats.as_dict()
    assert stats["checkpoints"] == 4
    assert 0 < stats["snapshot_wait_seconds"] <= stats["stall_seconds"]
