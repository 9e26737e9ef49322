"""I9, ownership: one writer per directory, readers change nothing, garbage collection removes only
what everystep wrote; and the careless user's mistakes, each refused in one line with nothing lost."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from everystep import Checkpointer
from everystep.errors import ConfigError, DirectoryInUseError, ReadOnlyStoreError
from everystep.eval.kills.train import TrainConfig, recover_run, run
from everystep.eval.workloads import build
from everystep.inventory import verify_store
from everystep.storage import CheckpointDirectory

from .conftest import ROOT, call_cli, files_of, run_cli

_HOLDER = textwrap.dedent("""
    import sys
    from everystep.storage import CheckpointDirectory
    store = CheckpointDirectory.open(sys.argv[1], strategy="checkfreq")
    print("holding", flush=True)
    sys.stdin.read()
""")


def _train(directory: Path, steps: int, strategy: str = "checkfreq", **options) -> dict:
    return run(TrainConfig(workload="mlp", strategy=strategy, steps=steps, directory=str(directory), progress=False,
                           **options))


def _hold(directory: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc


def test_a_second_writer_is_refused_naming_the_owner_and_a_dead_owner_leaves_no_lock(tmp_path, capsys):
    directory = tmp_path / "d"
    _train(directory, 3)
    holder = _hold(directory)
    try:
        with pytest.raises(DirectoryInUseError, match=f"process {holder.pid} is writing checkpoints there") as caught:
            CheckpointDirectory.open(directory, strategy="checkfreq")
        assert caught.value.pid == holder.pid
        code, out, err = call_cli(capsys, "train", "--workload", "mlp", "--steps", "5", "--dir", str(directory))
        assert code == 2 and err.count("\n") == 1 and f"process {holder.pid}" in err
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own, the kernel releases the lock
        holder.wait()
    CheckpointDirectory.open(directory, strategy="checkfreq").close()


def test_readers_work_beside_a_live_writer_and_change_nothing(tmp_path, capsys):
    directory = tmp_path / "d"
    _train(directory, 3)
    leftover = directory / "objects" / ".tmp-full-000000000004.safetensors-0123abcd"
    leftover.write_bytes(b"half a write")
    holder = _hold(directory)
    try:
        before = files_of(directory)
        assert call_cli(capsys, "recover", "--dir", str(directory))[0] == 0
        assert call_cli(capsys, "inspect", str(directory))[0] == 0
        assert call_cli(capsys, "verify", str(directory))[0] == 0  # the writer's temporary: a write in progress
        assert recover_run(str(directory))["step"] == 3
        assert files_of(directory) == before
    finally:
        holder.kill()
        holder.wait()
    code, out, _ = call_cli(capsys, "verify", str(directory))  # no writer: a crash's leftover, named, not removed
    assert code == 1 and f"{leftover}: no checkpoint names this file" in out and leftover.exists()
    reader = CheckpointDirectory.open(directory, create=False, access="read")
    with pytest.raises(ReadOnlyStoreError):
        reader.catalog.write_object("full-000000000009.safetensors", [b"x"])
    with pytest.raises(ReadOnlyStoreError):
        reader.collect_garbage()


def test_recover_beside_a_training_run_does_not_break_it(tmp_path):
    """The report: ``recover`` while ``train`` writes used to collect the run's temporaries. (Each
    commit is slowed, so that on any machine the run outlasts several recoveries.)"""
    directory = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-m", "everystep", "train", "--workload", "gpt2-tiny", "--steps", "60",
                             "--dir", str(directory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "EVERYSTEP_DELAY": "store.manifest.before_rename=0.05"})
    deadline = time.monotonic() + 120
    while not any((directory / "manifests").glob("full-*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the run committed nothing"
        time.sleep(0.05)
    steps = []
    while proc.poll() is None:
        steps.append(recover_run(str(directory))["step"])
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert len(steps) >= 2 and steps == sorted(steps)
    assert verify_store(CheckpointDirectory.open(directory, create=False, access="read")) == []


def test_garbage_collection_removes_only_its_own_leftovers_and_says_so(tmp_path, caplog):
    directory = tmp_path / "d"
    _train(directory, 3)
    objects = directory / "objects"
    mine = [objects / ".tmp-full-000000000004.safetensors-0123abcd", objects / "full-000000000004.safetensors"]
    for path in mine:
        path.write_bytes(b"left by a crash")
    theirs = [objects / "notes.txt", objects / "backup-of-step11.safetensors", objects / "my_eval_results" / "a.json"]
    for path in theirs:
        path.parent.mkdir(exist_ok=True)
        path.write_text("precious")
    with caplog.at_level(logging.WARNING, logger="everystep"):
        store = CheckpointDirectory.open(directory, strategy="checkfreq")
        removed = store.collect_garbage()
        store.close()
    assert sorted(removed) == sorted(str(p.relative_to(directory)) for p in mine)
    assert "removed 2 file(s) an interrupted run left" in caplog.text
    assert not any(p.exists() for p in mine) and all(p.read_text() == "precious" for p in theirs)


def test_a_corrupt_manifest_keeps_its_objects_and_verify_names_it(tmp_path, capsys):
    directory = tmp_path / "d"
    _train(directory, 4)
    manifest = directory / "manifests" / "full-000000000004.json"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x01
    manifest.write_bytes(bytes(data))
    before = files_of(directory)
    code, out, _ = call_cli(capsys, "recover", "--dir", str(directory))
    assert code == 0 and out.startswith("step 3,")
    assert files_of(directory) == before
    store = CheckpointDirectory.open(directory, strategy="checkfreq")
    store.collect_garbage()
    store.close()
    assert (directory / "objects" / "full-000000000004.safetensors").exists()
    code, out, _ = call_cli(capsys, "verify", str(directory))
    assert code == 1 and "full-000000000004" in out and "unreadable" in out


def test_a_flipped_byte_in_the_marker_is_found(tmp_path, capsys):
    directory = tmp_path / "d"
    _train(directory, 2)
    marker = directory / "everystep.json"
    text = marker.read_text()
    marker.write_text(text.replace('"world_size": 1', '"world_size": 3'))
    code, _, err = call_cli(capsys, "verify", str(directory))
    assert code == 2 and "everystep.json fails its checksum" in err and err.count("\n") == 1


def test_recover_of_a_lowdiff_directory_at_step_0_reports_it_and_rewrites_nothing(tmp_path, capsys):
    directory = tmp_path / "d"
    _train(directory, 1, strategy="lowdiff", compress="topk:0.05", every=50)
    for path in (directory / "manifests").glob("diff-*"):
        path.unlink()  # only the step-0 full checkpoint is left
    for path in (directory / "objects").glob("diff-*"):
        path.unlink()
    for path in (directory / "manifests").glob("full-000000000001*"):
        path.unlink()
    before = files_of(directory)
    code, out, _ = call_cli(capsys, "recover", "--dir", str(directory))
    assert code == 0 and out.startswith("step 0, state sha256 ") and "from disk" in out
    assert files_of(directory) == before


def test_the_api_names_its_argument_and_a_failed_constructor_leaves_the_directory_as_it_was(tmp_path):
    w = build("mlp", seed=0)
    directory = tmp_path / "new"
    with pytest.raises(ConfigError, match="pass compression= to the Checkpointer") as caught:
        Checkpointer(directory, w.model, w.optimizer, strategy="lowdiff")
    assert "--compress" not in str(caught.value)
    assert not directory.exists() or list(directory.iterdir()) == []
    with Checkpointer(directory, w.model, w.optimizer, strategy="checkfreq") as ckpt:
        assert ckpt.restore() == 0


@pytest.mark.parametrize("args, message", [
    (["--nproc", "100000"], "--nproc 100000 is more ranks than this machine runs at once"),
    (["--deadline", "-10"], "argument --deadline: must be a finite number above 0"),
    (["--strategy", "lowdiff"], "--strategy lowdiff reuses compressed gradients: add --compress"),
])
def test_bad_arguments_get_one_line_and_start_nothing(tmp_path, capsys, args, message):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code, _, err = call_cli(capsys, "train", "--workload", "mlp", "--dir", str(tmp_path / "d"), *args)
    assert code == 2 and message in err and err.count("\n") == 1
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
    assert not (tmp_path / "d").exists()


def test_a_directory_past_the_asked_steps_or_of_another_world_size_is_refused_before_anything_starts(tmp_path, capsys):
    directory = tmp_path / "d"
    _train(directory, 6)
    before = files_of(directory)
    code, _, err = call_cli(capsys, "train", "--workload", "mlp", "--steps", "5", "--dir", str(directory))
    assert code == 2 and err.count("\n") == 1 and "up to step 6, past --steps 5" in err
    assert files_of(directory) == before
    lowdiff = tmp_path / "lowdiff"
    _train(lowdiff, 2, strategy="lowdiff", compress="topk:0.05")
    before = files_of(lowdiff)
    code, _, err = call_cli(capsys, "train", "--workload", "mlp", "--strategy", "lowdiff", "--compress", "topk:0.05",
                            "--steps", "9", "--nproc", "3", "--max-nproc", "3", "--dir", str(lowdiff))
    assert code == 2 and err.count("\n") == 1 and "written by 1 rank(s); this run has 3" in err
    assert files_of(lowdiff) == before


def test_a_new_directory_that_cannot_be_created_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, _, err = call_cli(capsys, "train", "--workload", "mlp", "--steps", "2", "--dir", str(tmp_path / "file" / "d"))
    assert code == 2 and err.count("\n") == 1 and "cannot create the checkpoint directory" in err


def test_an_agent_lost_at_the_last_step_does_not_lose_the_final_checkpoint(tmp_path):
    """The report: the agent killed at step 30's message, the run exited 0 and recovery gave step 21."""
    directory = tmp_path / "d"
    proc = run_cli("train", "--workload", "mlp", "--strategy", "lowdiff_plus", "--steps", "30", "--every", "7",
                   "--dir", str(directory), env={"EVERYSTEP_CRASH": "agent.step:30"})
    assert proc.returncode == 0, proc.stderr
    assert "the checkpoint agent" in proc.stderr and "is lost" in proc.stderr
    assert recover_run(str(directory))["step"] == 30


def test_killing_the_supervisor_takes_its_workers_with_it(tmp_path):
    directory = tmp_path / "d"
    sup = subprocess.Popen([sys.executable, "-m", "everystep", "train", "--workload", "gpt2-tiny", "--steps", "400",
                            "--fail-at", "399", "--dir", str(directory)], cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any((directory / "manifests").glob("full-*.json")):
        assert sup.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    workers = psutil.Process(sup.pid).children(recursive=True)
    assert workers
    sup.send_signal(signal.SIGKILL)
    sup.wait()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    CheckpointDirectory.open(directory, strategy="checkfreq").close()  # and the directory is free again
