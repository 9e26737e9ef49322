"""Storage that is slow, hangs or fails never takes training with it without a word: with the memory
tier training never waits for it, without it the wait is said while it lasts, and ``close()`` waits
for storage at most ``close_timeout``, then names what is durable and what is only in memory."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from everystep import Checkpointer
from everystep._faults import arm, disarm, disk_full
from everystep.errors import BackgroundWriteError, StorageTimeoutError
from everystep.slow_storage import SAID_WAIT, WaitReport

from .test_checkpointer import attach, loop, make

pytestmark = pytest.mark.timeout(120)
POINT = "store.object.mid_write"
STEPS = 6


@pytest.fixture
def said(monkeypatch):
    """What the Checkpointer said of training's waits, and an event set at the first."""
    found: list[str] = []
    first = threading.Event()

    def say(self, what, stats, latest=False):
        found.append(what)
        first.set()

    monkeypatch.setattr(WaitReport, "_say", say)
    return found, first


@pytest.fixture
def held():
    """Every write of an object held at its middle until the gate opens (storage that hangs)."""
    gate = threading.Event()
    arm(POINT, action=gate.wait, repeat=True)
    yield gate
    gate.set()
    disarm(POINT)
    for thread in threading.enumerate():  # (a close given up on ends once storage answers)
        if thread.name == "everystep-close":
            thread.join()


def _options(memory: bool, shm) -> dict:
    return {"memory": True, "region": f"{shm}/rank-{{rank}}.bin"} if memory else {}  # (persisted as storage allows)


def test_training_that_waits_on_hung_storage_is_told_while_it_waits(tmp_path, said, held):
    """Without the memory tier, every step to a disk that hangs: training blocks in a step, and the
    wait is said while it lasts (then storage answers and training goes on)."""
    found, first = said
    w = make("mlp", 0)
    ckpt = attach(w, tmp_path / "c", "checkfreq", every=1)
    ckpt.restore()
    training = threading.Thread(target=loop, args=(w, ckpt, 0, STEPS))
    training.start()
    assert first.wait(30) and training.is_alive()
    assert found[0].startswith("training has been waiting") and " at step " in found[0]
    held.set()
    training.join()
    ckpt.close()
    assert ckpt.stats.last_durable_step == STEPS


def test_with_the_memory_tier_training_never_waits_and_close_gives_up_naming_what_is_where(tmp_path, shm, said, held):
    """Storage that hangs for good under the memory tier: every step trains without a wait, and
    close() gives up after close_timeout, naming the step on storage (none) and the one only in
    memory with its region; once storage answers, a restart reads it from there, nothing lost."""
    found, _ = said
    w = make("mlp", 0)
    region = f"{shm}/rank-{{rank}}.bin"
    ckpt = attach(w, tmp_path / "c", "checkfreq", every=1, close_timeout=1.0, **_options(True, shm))
    ckpt.restore()
    loop(w, ckpt, 0, STEPS)
    assert found == [] and ckpt.stats.last_durable_step == 0 and ckpt.stats.steps_not_durable == STEPS
    assert ckpt.stats.last_memory_step >= STEPS - 2  # (checkfreq's snapshot of a step is taken in the next)
    with pytest.raises(StorageTimeoutError, match=rf"newest checkpoint on storage is of step 0; step {STEPS} is only "
                                                  rf"in memory, in {region.format(rank=0)}"):
        ckpt.close()
    held.set()
    for thread in threading.enumerate():
        if thread.name == "everystep-close":
            thread.join()
    again = make("mlp", 0)
    with attach(again, tmp_path / "c", "checkfreq", every=1, **_options(True, shm)) as restarted:
        assert restarted.restore() == STEPS and restarted.recovered.source == "memory"


@pytest.mark.parametrize("memory", [False, True], ids=["directory", "memory tier"])
def test_a_slow_write_is_said_only_where_training_waits_for_it(tmp_path, shm, said, memory):
    """Each object written in 1.5 s (a slow disk): without the tier training waits and is told so;
    with it, it trains on without a wait and the disk gets what it can. (Three steps: each write
    without the tier is waited for whole.)"""
    found, _ = said
    steps = 3
    arm(POINT, action=lambda: time.sleep(SAID_WAIT + 0.5), repeat=True)
    try:
        w = make("mlp", 0)
        with attach(w, tmp_path / "c", "checkfreq", every=1, **_options(memory, shm)) as ckpt:
            ckpt.restore()
            loop(w, ckpt, 0, steps)
    finally:
        disarm(POINT)
    assert (found == []) == memory, found
    assert ckpt.stats.last_durable_step == steps  # (the close waited: storage answered)


@pytest.mark.parametrize("memory", [False, True], ids=["directory", "memory tier"])
def test_a_write_that_fails_is_raised_and_the_memory_tier_keeps_the_step(tmp_path, shm, memory):
    """Every object write fails (a full disk): the failure reaches the training thread as an error
    naming it, never swallowed; with the tier, the newest step is still in memory for a restart."""
    arm(POINT, action=disk_full, repeat=True)
    w = make("mlp", 0)
    try:
        with pytest.raises(BackgroundWriteError, match="No space left on device"):
            with attach(w, tmp_path / "c", "checkfreq", every=1, **_options(memory, shm)) as ckpt:
                ckpt.restore()
                loop(w, ckpt, 0, STEPS)
    finally:
        disarm(POINT)
    if memory:
        again = make("mlp", 0)
        with attach(again, tmp_path / "c", "checkfreq", every=1, **_options(True, shm)) as restarted:
            assert restarted.restore() >= 1 and restarted.recovered.source == "memory"


def test_close_timeout_is_checked_by_name():
    w = make("mlp", 0)
    with pytest.raises(TypeError, match="close_timeout must be a finite number or None, got 'soon'"):
        Checkpointer(None, w.model, w.optimizer, strategy="none", close_timeout="soon")
    with pytest.raises(ValueError, match="close_timeout must be a positive number of seconds or None, got 0"):
        Checkpointer(None, w.model, w.optimizer, strategy="none", close_timeout=0)


def test_train_on_storage_held_for_good_finishes_its_steps_and_exits_non_zero_within_its_close_timeout(tmp_path):
    from .conftest import run_cli

    t0 = time.monotonic()
    proc = run_cli("train", "--workload", "mlp", "--strategy", "checkfreq", "--option", "memory=true", "--steps", "12",
                   "--every", "1", "--dir", str(tmp_path / "c"), "--close-timeout", "3",
                   env={"EVERYSTEP_HOLD": f"{POINT}={tmp_path / 'never'}"})
    assert proc.returncode == 2 and time.monotonic() - t0 < 60, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("everystep: error: close() waited 3 s (close_timeout) for storage") and \
        "the newest checkpoint on storage is of step 0; step 12 is only in memory, in /dev/shm/" in line, proc.stderr
    region = Path(re.search(r"in (/dev/shm/\S+\.bin):", line).group(1))
    assert region.is_file()  # (the run's newest step, kept for a restart; removed here)
    shutil.rmtree(region.parent)


def test_a_hashing_process_stopped_by_sigstop_is_an_error_naming_it_not_a_hang(tmp_path):
    """The region's hashing process stopped (SIGSTOP) while a commit asks it: the commit fails with
    an error naming it within seconds, and the next question starts a new one."""
    import os
    import signal

    import torch

    from everystep.errors import EverystepError
    from everystep.storage.region.slots import Region
    from everystep.storage.region.mapping import RegionLayout

    tensors = {"t": torch.arange(4096, dtype=torch.float32)}
    region = Region.open(tmp_path / "r.bin")
    try:
        writer = region.begin(RegionLayout.of(tensors), 100)
        writer.views["t"].copy_(tensors["t"])
        first = region.checksums(writer)
        stopped = region._hasher._process.pid
        os.kill(stopped, signal.SIGSTOP)
        with pytest.raises(EverystepError, match="the hashing process was stopped \\(SIGSTOP\\?\\) while asked"):
            region.checksums(writer)
        assert region.checksums(writer) == first and region._hasher._process.pid != stopped
    finally:
        region.close()
