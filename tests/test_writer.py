"""checkfreq and async with persist="process": the checkpoints a writer process writes from shared
memory are the thread's, recover bitwise, and its faults are the training process's."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest
import torch

from everystep import BackgroundWriteError, Checkpointer, ConfigError
from everystep.eval.kills.train import TrainConfig
from everystep.eval.workloads import build
from everystep.storage import CheckpointDirectory

from .conftest import ROOT
from .test_checkpointer import live_hash, loop

STEPS = 8


def _run(directory, strategy, stop, **options):
    w = build("gpt2-tiny", seed=1)
    with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=strategy,
                      **options) as ckpt:
        start = ckpt.restore()
        loop(w, ckpt, start, stop)
        writer = getattr(ckpt.strategy, "_writer", None)
    return w, ckpt, start, writer


@pytest.mark.parametrize("strategy", ["checkfreq", "async"])
def test_the_writer_process_writes_what_the_thread_writes_and_recovery_is_bitwise(tmp_path, strategy):
    torch.set_num_threads(1)
    w, ckpt, _, writer = _run(tmp_path / "p", strategy, STEPS, persist="process", keep=3)
    thread, by_thread, _, _ = _run(tmp_path / "t", strategy, STEPS, keep=3)
    assert live_hash(w, STEPS) == live_hash(thread, STEPS)
    assert writer is not None and writer.process.returncode == 0  # closed with the Checkpointer
    manifests = CheckpointDirectory.open(tmp_path / "p", access="read").catalog.manifests()
    assert [r.name for r in manifests] == [f"full-{s:012d}" for s in (STEPS - 2, STEPS - 1, STEPS)]  # retention ran
    assert abs(ckpt.bytes_written - by_thread.bytes_written) < 0.02 * by_thread.bytes_written  # counted here too
    assert ckpt.stats.checkpoints == by_thread.stats.checkpoints == STEPS
    again = build("gpt2-tiny", seed=1)
    with Checkpointer(tmp_path / "p", again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                      strategy=strategy) as reader:
        assert reader.restore() == STEPS
    assert live_hash(again, STEPS) == live_hash(w, STEPS)


_KILLED = """
import sys, torch
from everystep import Checkpointer
from everystep.eval.kills.train import TrainConfig
from everystep.eval.workloads import build
from tests.test_checkpointer import loop
torch.set_num_threads(1)
w = build("gpt2-tiny", seed=1)
with Checkpointer(sys.argv[1], w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="checkfreq",
                  persist="process") as ckpt:
    print(ckpt.strategy._writer.process.pid, flush=True)
    loop(w, ckpt, ckpt.restore(), int(sys.argv[2]))
    if len(sys.argv) > 3:
        sys.stdin.read()  # until the test kills this process
"""


def _script(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-c", _KILLED, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **(env or {})}, **kw)


def test_a_crash_mid_write_in_the_writer_kills_the_training_process_and_the_previous_checkpoint_recovers(tmp_path):
    """I1, I3: the fault injected in the writer process's fourth object write kills the training
    process (as a crash of its persist thread would); the restarted run resumes from the last
    committed checkpoint and ends in the uninterrupted state."""
    torch.set_num_threads(1)
    killed = _script(tmp_path / "c", STEPS, env={"EVERYSTEP_CRASH": "store.object.mid_write:4"})
    killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL
    committed = [r.manifest.step for r in CheckpointDirectory.open(tmp_path / "c", access="read").catalog.manifests()]
    assert max(committed) == 3  # S_4's object was being written
    w, _, start, _ = _run(tmp_path / "c", "checkfreq", STEPS, persist="process")
    reference = build("gpt2-tiny", seed=1)
    loop(reference, None, 0, STEPS)
    assert start == 3 and live_hash(w, STEPS) == live_hash(reference, STEPS)


def test_the_writer_process_dies_with_the_training_process(tmp_path):
    training = _script(tmp_path / "c", 2, "wait", stdin=subprocess.PIPE)
    writer = int(training.stdout.readline())
    handle = os.pidfd_open(writer)
    try:
        training.kill()
        training.wait(timeout=60)
        ready, _, _ = select.select([handle], [], [], 30)  # readable once the writer has exited
        assert ready, "the writer process outlived the training process"
    finally:
        os.close(handle)
        training.stdin.close()


def test_a_full_disk_in_the_writer_process_is_the_training_process_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EVERYSTEP_FAIL", "store.object.mid_write:3+")  # the writer inherits it: S_1, S_2 written
    w = build("gpt2-tiny", seed=1)
    ckpt = Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="checkfreq", persist="process")
    ckpt.restore()
    monkeypatch.delenv("EVERYSTEP_FAIL")
    with pytest.raises(BackgroundWriteError, match="checkpoint at step 3 failed: StoreWriteError: .*No space left on "
                                                   r"device.*\(in the checkpoint writer process, pid \d+\)"):
        loop(w, ckpt, 0, 200)
    try:
        ckpt.close()  # a final checkpoint of a later step fails too
    except BackgroundWriteError as e:
        assert "No space left on device" in str(e)
    ckpt.close()
    assert [r.manifest.step for r in CheckpointDirectory.open(tmp_path / "c", access="read").catalog.manifests()] == [1, 2]


def test_persist_mistakes_are_refused_naming_the_option(tmp_path):
    with pytest.raises(ConfigError, match="persist must be 'thread' or 'process', got 'disk'"):
        Checkpointer(tmp_path / "a", *_model(), strategy="checkfreq", persist="disk")
    with pytest.raises(ConfigError, match="persist='process' .* use persist='thread' .* full_format='dcp'"):
        Checkpointer(tmp_path / "b", *_model(), strategy="checkfreq", persist="process", full_format="dcp")
    with pytest.raises(ConfigError, match=r"--option: persist='process' .* serves one training process .* \(--nproc 2, "
                                          r"--full-format safetensors\)"):
        TrainConfig(workload="mlp", strategy="checkfreq", steps=3, directory=str(tmp_path / "c"), nproc=2,
                    options={"persist": "process"}, max_nproc=2)
    assert not (tmp_path / "c").exists()


def _model():
    w = build("mlp", seed=0)
    return w.model, w.optimizer



def test_a_dropped_buffer_is_forgotten_and_a_new_one_shared_with_the_next_write(tmp_path):
    """A host buffer pool drops a buffer whose layout went stale: the writer process forgets it and
    maps the new one, in order, with the next write."""
    from everystep.agent.writer import WriterProcess
    from everystep.layout import TensorLayout
    from everystep.recovery import read_full
    from everystep.tree import flatten

    directory = CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    writer = WriterProcess(directory.root, keep=5)
    buffer = None
    try:
        for step, n in ((1, 8), (2, 8), (3, 16)):  # step 3's layout is another: a new buffer
            x = torch.arange(n, dtype=torch.float32) * step
            tensors, skeleton = flatten({"step": step, "x": x})
            layout = TensorLayout.of(tensors)
            if buffer is None or buffer.layout != layout:
                if buffer is not None:
                    writer.drop(buffer)
                buffer = writer.buffer(layout)
            buffer.views["/x"].copy_(x)
            assert writer.write(step, buffer, skeleton).step == step
    finally:
        writer.close()
    assert writer.process.returncode == 0
    store = CheckpointDirectory.open(tmp_path / "c", access="read")
    found = {r.manifest.step: read_full(store, r.manifest)["x"] for r in store.catalog.manifests()}
    assert sorted(found) == [1, 2, 3]
    assert all(torch.equal(x, torch.arange(len(x), dtype=torch.float32) * s) for s, x in found.items())
