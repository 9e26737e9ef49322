"""End to end: `everystep train` with failures equals an uninterrupted run; the CLI's other verbs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from everystep.eval.kills.faults import FailurePlan
from everystep.eval.kills.train import TrainConfig, run
from everystep.strategies.checkfreq import CheckFreqConfig

from .conftest import call_cli, run_cli

STEPS = 12
MIDDLE = 6


def _seed_with_mid_write_kill() -> int:
    """A seed whose failure at step MIDDLE lands in the middle of a checkpoint write."""
    return next(s for s in range(1000) if FailurePlan(steps=(MIDDLE,), seed=s).point(MIDDLE) == "write")


SEED = _seed_with_mid_write_kill()


@pytest.fixture(scope="module")
def reference():
    return run(TrainConfig(workload="gpt2-tiny", strategy="none", steps=STEPS, seed=SEED, progress=False))


@pytest.mark.parametrize("strategy, mode", [("full_sync", "software"), ("checkfreq", "hardware")])
def test_killed_runs_recover_bit_exactly(tmp_path, reference, strategy, mode):
    # The other two pairs run with two ranks in test_distributed.py.
    """I1 and I2: killed during the first step, mid-write, and the last step; same losses and state."""
    fail_at = (1, MIDDLE, STEPS)
    s = run(TrainConfig(workload="gpt2-tiny", strategy=strategy, steps=STEPS, seed=SEED, directory=str(tmp_path / "c"),
                        fail_at=fail_at, fail_mode=mode, progress=False))
    assert s["losses"] == reference["losses"]
    assert s["final_state_sha256"] == reference["final_state_sha256"]
    assert [r["failed_at"] for r in s["recoveries"]] == list(fail_at)
    # I2: lost are the step in progress and the checkpoints not yet durable: one for full_sync; for
    # checkfreq, one per host buffer (two by default) still being written, and the finished step whose
    # snapshot waits for a free buffer. Nothing the failed process had seen durable is lost.
    in_flight = CheckFreqConfig().buffers + 1 if strategy == "checkfreq" else 1
    for r in s["recoveries"]:
        assert r["source"] in ("disk", "none") and r["recovery_seconds"] >= 0
        assert r["failed_at"] - 1 - in_flight <= r["resumed_from"] <= r["failed_at"] - 1
        assert r["resumed_from"] >= r["durable_before"]
    assert s["recoveries"][0]["resumed_from"] == 0 and s["recoveries"][0]["source"] == "none"
    assert len(s["losses"]) == STEPS and s["steps"] == STEPS
    assert s["bytes_written"] > 0 and s["mean_step_seconds"] > 0
    # Every process lifetime's checkpoints count: at least one per step that was finished and kept.
    # A lifetime's count is the one it journaled at its last step's end; one killed (hardware) may
    # have committed up to `in_flight` more after that, which its successor resumes from and does not
    # write again: those are durable but not counted.
    assert s["checkpoints"] >= STEPS - 1 - (in_flight * len(fail_at) if mode == "hardware" else 0)


def test_cli_train_recover_inspect(tmp_path, reference, capsys):
    out, d = tmp_path / "run.json", tmp_path / "c"
    run_cli("train", "--workload", "gpt2-tiny", "--strategy", "checkfreq", "--steps", str(STEPS), "--seed", str(SEED),
            "--dir", str(d), "--fail-at", "4", "--json", str(out), check=True)
    summary = json.loads(out.read_text())
    for key in ("steps", "losses", "final_state_sha256", "recoveries", "mean_step_seconds", "bytes_written"):
        assert key in summary
    assert summary["final_state_sha256"] == reference["final_state_sha256"]
    assert set(summary["recoveries"][0]) == {"failed_at", "resumed_from", "recovery_seconds", "source", "durable_before",
                                             "memory_before", "recoverable_before"}

    rec = tmp_path / "rec.json"
    assert call_cli(capsys, "recover", "--dir", str(d), "--json", str(rec))[0] == 0
    recovered = json.loads(rec.read_text())
    assert recovered["step"] == STEPS and recovered["state_sha256"] == reference["final_state_sha256"]

    obj = d / "objects" / f"full-{STEPS:012d}.safetensors"
    raw = bytearray(obj.read_bytes())
    raw[-10] ^= 0xFF
    obj.write_bytes(raw)
    code, listing, _ = call_cli(capsys, "inspect", str(d))
    assert code == 0 and f"step {STEPS - 1:>8}" in listing and "valid" in listing
    assert "INVALID: object" in listing and "fails its checksum" in listing
    assert call_cli(capsys, "recover", "--dir", str(d), "--json", str(rec))[0] == 0
    assert json.loads(rec.read_text())["step"] == STEPS - 1


def test_crash_inside_a_write_leaves_the_previous_checkpoint(tmp_path, capsys):
    """I3 through the CLI: SIGKILL in the middle of the third checkpoint's write."""
    d = tmp_path / "c"
    killed = run_cli("train", "--strategy", "full_sync", "--steps", "5", "--dir", str(d),
                     env={"EVERYSTEP_CRASH": "store.object.mid_write:3"})
    assert killed.returncode == -9
    assert any(p.name.startswith(".tmp-") for p in (d / "objects").iterdir())  # the torn write is there
    assert sorted(p.name for p in (d / "manifests").iterdir()) == [f"full-{s:012d}.json" for s in (1, 2)]  # not its manifest
    ref = run(TrainConfig(strategy="none", steps=2, progress=False))
    rec = tmp_path / "rec.json"
    assert call_cli(capsys, "recover", "--dir", str(d), "--json", str(rec))[0] == 0
    assert json.loads(rec.read_text())["step"] == 2
    assert json.loads(rec.read_text())["state_sha256"] == ref["final_state_sha256"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--steps", "10", "--fail-at", "11", "--dir", "{tmp}/c"], "--fail-at steps must lie in 1..10; got 11"),
        (["train", "--strategy", "full_sync"], "strategy 'full_sync' needs --dir"),
        (["train", "--strategy", "full_sync", "--dir", "{tmp}/foreign"], "is not empty and is not an everystep checkpoint"),
        (["recover", "--dir", "{tmp}/missing"], "no everystep checkpoint directory at"),
        (["inspect", "{tmp}/missing"], "no everystep checkpoint directory at"),
        (["train", "--strategy", "full_sync", "--every", "0", "--dir", "{tmp}/c"], "argument --every: must be at least 1"),
    ],
)
def test_user_mistakes_get_one_clear_line_and_status_2(tmp_path, capsys, args, message):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.csv").write_text("1,2\n")
    code, _, err = call_cli(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert (tmp_path / "foreign" / "data.csv").read_text() == "1,2\n"


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_path_with_no_checkpoints_is_said_before_torch_is_imported(tmp_path, command):
    """``inspect`` and ``verify`` of a path that is no checkpoint directory say so at once: they open
    the directory before anything imports torch (seconds of a start)."""
    import subprocess
    import sys

    said = subprocess.run([sys.executable, "-c", "import sys; from everystep.cli import main\n"
                           f"code = main([{command!r}, {str(tmp_path / 'missing')!r}])\n"
                           "print(code, 'torch' in sys.modules)"], capture_output=True, text=True)
    assert "no everystep checkpoint directory at" in said.stderr and said.stdout.split() == ["2", "False"], said


def test_verify_names_each_file_that_is_wrong(tmp_path, capsys):
    run(TrainConfig(workload="mlp", strategy="full_sync", steps=3, every=1, keep=3, directory=str(tmp_path / "c"),
                    progress=False))
    code, out, _ = call_cli(capsys, "verify", str(tmp_path / "c"))
    assert code == 0 and "3 checkpoint(s), all verify" in out
    objects = tmp_path / "c" / "objects"
    flipped = objects / "full-000000000002.safetensors"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 1
    flipped.write_bytes(raw)
    (objects / "full-000000000003.safetensors").unlink()
    (objects / "stray.bin").write_bytes(b"x")
    code, out, _ = call_cli(capsys, "verify", str(tmp_path / "c"), "--json", str(tmp_path / "v.json"))
    assert code == 1
    problems = json.loads((tmp_path / "v.json").read_text())["problems"]
    assert any("full-000000000002" in p and "fails its checksum" in p for p in problems)
    assert any("full-000000000003" in p and "is missing" in p for p in problems)
    assert any(p.endswith("stray.bin: no checkpoint names this file") for p in problems)
    assert len(problems) == 3 and "3 problem(s)" in out


def test_ranks_forked_from_the_zygote_get_their_environment_and_die_with_it(tmp_path):
    """Each rank of a supervised run is forked from a zygote that imported torch once: it runs in the
    environment it was given, not the zygote's (a crash point armed there fires), in a process group
    of its own; and a zygote that dies takes its ranks with it."""
    import os
    import select
    import signal

    from everystep.eval.kills.train import WORKER, Journal, worker_argv
    from everystep.eval.zygote import Zygote

    def argv(**kw) -> list[str]:
        return worker_argv(TrainConfig(workload="mlp", progress=False, **kw), str(journal))

    journal = tmp_path / "journal.jsonl"
    with Zygote(WORKER) as zygote:
        crashing = zygote.fork({**os.environ, "EVERYSTEP_CRASH": "store.object.mid_write:3"},
                               argv(strategy="full_sync", steps=50, directory=str(tmp_path / "c")))
        assert crashing.wait() == -signal.SIGKILL
        assert max(r["step"] for r in Journal.read(str(journal)) if r["event"] == "step") < 5
        child = zygote.fork(dict(os.environ), argv(strategy="none", steps=10**6))
        pidfd = os.pidfd_open(child.pid)
        while not any(r["event"] == "step" and r["step"] > 5 for r in Journal.read(str(journal))):
            assert child.poll() is None, f"the rank ended with status {child.returncode}"
            select.select([pidfd], [], [], 0.05)
        assert os.getpgid(child.pid) == child.pid and os.getsid(child.pid) == zygote.process.pid
        zygote.process.send_signal(signal.SIGKILL)
        assert select.select([pidfd], [], [], 60)[0], "the rank outlived its zygote"
        assert child.wait() == -signal.SIGKILL
        os.close(pidfd)


def test_a_ranks_agent_is_forked_from_its_zygote_into_its_process_group(tmp_path):
    """A rank's checkpoint agent is forked from the rank's zygote (no fresh interpreter), in the rank's
    process group: it outlives the rank killed alone (a crash: the next lifetime takes its replica) and
    dies with the group (a lost machine)."""
    import os
    import select
    import signal

    import psutil

    from everystep.agent.channel import AgentAddress
    from everystep.eval.kills.train import WORKER, Journal, worker_argv
    from everystep.eval.zygote import Zygote

    journal, directory = tmp_path / "journal.jsonl", tmp_path / "c"
    cfg = TrainConfig(workload="mlp", strategy="lowdiff_plus", steps=10**6, directory=str(directory), progress=False)
    with Zygote(WORKER) as zygote:
        rank = zygote.fork(dict(os.environ), worker_argv(cfg, str(journal)))
        while not (journal.exists() and any(r["event"] == "step" for r in Journal.read(str(journal)))):
            assert rank.poll() is None, f"the rank ended with status {rank.returncode}"
            select.select([], [], [], 0.05)
        agent = AgentAddress.find(directory).pid
        assert (psutil.Process(agent).ppid(), os.getpgid(agent)) == (zygote.process.pid, rank.pid)
        with open(f"/proc/{agent}/environ", "rb") as f:
            assert b"EVERYSTEP_ZYGOTE=" not in f.read()  # (an agent asks for no child)
        rank.kill()
        assert rank.wait(60) == -signal.SIGKILL
        pidfd = os.pidfd_open(agent)
        assert not select.select([pidfd], [], [], 0.5)[0], "the agent died with its rank alone"
        os.killpg(rank.pid, signal.SIGKILL)
        assert select.select([pidfd], [], [], 60)[0], "the agent outlived its rank's group"
        os.close(pidfd)


def test_a_zygotes_child_writes_where_its_asker_writes_when_it_asks(tmp_path):
    """Standard output goes with each request: one zygote serves an asker whose output moved (a test
    capturing it, a log rotated), and is not started again for it."""
    import os

    from everystep.eval import zygote

    first = zygote.shared("subprocess:call")
    for name in ("a", "b"):
        with open(tmp_path / name, "w") as out:
            saved = os.dup(1)
            os.dup2(out.fileno(), 1)
            try:
                child = zygote.shared("subprocess:call").fork(dict(os.environ), ["echo", f"to {name}"])
            finally:
                os.dup2(saved, 1)
                os.close(saved)
        assert child.wait(60) == 0 and (tmp_path / name).read_text() == f"to {name}\n"
    assert zygote.shared("subprocess:call") is first


def test_a_request_to_a_zygote_names_no_code_but_its_entry_and_an_agents(tmp_path):
    """What a zygote reads from its socket chooses no code to run: a request naming another entry point
    is not answered, nothing is forked, and the asker is no longer listened to."""
    import os

    import pytest

    from everystep.errors import EverystepError
    from everystep.eval.zygote import Zygote

    planted = tmp_path / "ran"
    with Zygote("os:getpid") as zygote:
        with pytest.raises(EverystepError, match="ended"):
            zygote.fork(dict(os.environ), ["touch", str(planted)], entry="subprocess:call")
        assert zygote.process.wait(60) == 0
    assert not planted.exists()


def test_a_shared_zygote_is_replaced_only_where_what_its_imports_read_changed(monkeypatch):
    """A run forks from a zygote as if it had started it: a new one where an environment variable that
    torch reads at import changed; the same one where only what a child reads itself changed (a crash
    point, which each child arms; the collective timeout, read as a group is made; the compiler's
    cache that torch names in this process)."""
    from everystep.eval import zygote

    entry = "os:getpid"  # (a zygote that imports nothing more: only its reuse is tested here)
    first = zygote.shared(entry)
    monkeypatch.setenv("EVERYSTEP_CRASH", "store.object.mid_write:3")
    monkeypatch.setenv("EVERYSTEP_COLLECTIVE_TIMEOUT", "20")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    assert zygote.shared(entry) is first
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    second = zygote.shared(entry)
    assert second is not first and first.process.wait(60) == 0  # (the one replaced is ended)
    monkeypatch.setenv("EVERYSTEP_COLLECTIVE_TIMEOUT", "30")
    assert zygote.shared(entry) is second


def test_the_collective_timeout_is_read_when_a_group_is_made(monkeypatch):
    from everystep.distributed import collective_timeout

    monkeypatch.delenv("EVERYSTEP_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout() == 600
    monkeypatch.setenv("EVERYSTEP_COLLECTIVE_TIMEOUT", "20")
    assert collective_timeout() == 20


def _bad_arguments(tmp: "Path") -> list[tuple[str, ...]]:
    """Bad arguments for every subcommand; each must end in one line on stderr and exit status 2."""
    a_file = tmp / "a-file"
    a_file.write_text("not a folder")
    (tmp / "bad.json").write_text('{"config": 1}')
    d = str(tmp / "d")
    train = ("train", "--workload", "mlp", "--steps", "2", "--dir", d)
    return [
        (*train, "--threads", "100000"), (*train, "--seed", "-1"), (*train, "--steps", "0"), (*train, "--every", "0"),
        (*train, "--keep", "0"), (*train, "--nproc", "0"), (*train, "--deadline", "nan"), (*train, "--stagger", "x"),
        (*train, "--option", "every=abc"), (*train, "--option", "every=2.5"), (*train, "--option", "keep=null"),
        (*train, "--strategy", "lightcheck", "--option", "flush=maybe"),
        (*train, "--strategy", "lightcheck", "--option", f"region={a_file}/r.bin"),
        (*train, "--strategy", "checkflow", "--option", "memory_limit=0"),
        (*train, "--json", f"{a_file}/out.json"), (*train, "--json", str(tmp)), (*train, "--option", "nope=1"),
        ("recover", "--dir", str(a_file)), ("inspect", str(tmp / "missing")), ("verify", str(a_file)),
        ("bench", "--steps", "0"), ("bench", "--repeats", "0"), ("bench", "--threads", "0"), ("bench", "--budget", "-1"),
        ("bench", "--samples", "0"),
        ("bench", "--strategies", "none,nope", "--steps", "1"),
        ("simulate", "--mtbf", "0", "--strategy", "a:1:1:1:0:1"), ("simulate", "--mtbf", "nan"),
        ("simulate", "--gpus", "0"), ("simulate", "--trials", "0"), ("simulate", "--from-bench", str(tmp / "bad.json")),
        ("simulate", "--from-bench", str(tmp / "missing.json")), ("simulate", "--strategy", "a:1:1"),
        ("simulate", "--mtbf", "1e-9", "--strategy", "a:1:1:1:0:1", "--trials", "1"),
        ("plan", "--step-seconds", "1", "--mtbf", "inf"), ("plan", "--step-seconds", "1", "--mtbf", "10", "--bandwidth", "0"),
        ("plan", "--checkflow", "--workload", "mlp", "--bandwidth", "1e9", "--memory-limit", "0"),
        ("plan", "--checkflow", "--workload", "mlp", "--bandwidth", "1", "--per-size", "1e-6"),
        ("plan", "--checkflow", "--workload", "mlp", "--bandwidth", "nan"), ("plan", "--time-steps", "1"),
        ("demo", "--steps", "0"), ("gpu-check", "--parts", "tests,nope"), ("gpu-check", "--parts", ","),
        ("gpu-check", "--dry-run", "--out", f"{a_file}/reports"), ("nope",),
    ]


def test_every_bad_argument_gets_one_line_and_exit_status_2(tmp_path, capsys):
    """Item 16 of the hostile users' second round: each subcommand over a table of bad arguments."""
    failures = []
    for args in _bad_arguments(tmp_path):
        code, out, err = call_cli(capsys, *args)
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("everystep: warning")]
        if code != 2 or len(lines) != 1 or "Traceback" in err:
            failures.append(f"everystep {' '.join(args)} -> exit {code}, stderr {err!r}")
    assert not failures, "\n".join(failures)


def test_the_parser_offers_each_registrys_names_and_imports_no_pytorch():
    """The flags that name a strategy, a workload, an optimizer or a layout offer exactly their
    registry's names, written out in cli_args so that `everystep --help` answers at once."""
    import subprocess
    import sys

    from everystep import cli_args
    from everystep.eval.workloads import OPTIMIZERS, PARALLEL, WORKLOADS
    from everystep.strategies import STRATEGIES

    assert cli_args.STRATEGY_NAMES == tuple(sorted(STRATEGIES))
    assert cli_args.WORKLOAD_NAMES == tuple(WORKLOADS)
    assert cli_args.OPTIMIZER_NAMES == tuple(OPTIMIZERS)
    assert cli_args.PARALLEL_NAMES == PARALLEL
    helped = subprocess.run([sys.executable, "-c", "import sys; from everystep.cli import main\n"
                             "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
                             "print('torch' in sys.modules, file=sys.stderr)"], capture_output=True, text=True)
    assert "--strategy {async,checkflow," in helped.stdout and helped.stderr.strip() == "False", helped.stderr


def test_an_error_that_quotes_a_traceback_is_printed_on_one_line(capsys, monkeypatch):
    """Item 12: an error carrying another tool's traceback (DCP's, on a full disk) is one line."""
    from everystep import cli
    from everystep.errors import BackgroundWriteError

    def failing(args):
        raise BackgroundWriteError("writing the checkpoint failed:\nTraceback (most recent call last):\n  File x\n"
                                   "OSError: [Errno 28] No space left on device")

    monkeypatch.setattr(cli, "cmd_recover", failing)
    code, _, err = call_cli(capsys, "recover", "--dir", "x")
    assert code == 2 and err.count("\n") == 1
    assert "writing the checkpoint failed: … OSError: [Errno 28] No space left on device" in err


@pytest.mark.parametrize("command", [("verify", "{d}"), ("inspect", "{d}"), ("recover", "--dir", "{d}"),
                                     ("train", "--workload", "mlp", "--steps", "1", "--dir", "{d}")])
def test_a_directory_that_cannot_be_read_is_one_line(tmp_path, capsys, monkeypatch, command):
    """Item 17: another user's directory (PermissionError wherever it is first touched) is one line
    naming the path, exit 2. (The suite runs as root, whom permissions do not stop: the error is
    raised where the directory is opened.)"""
    import errno
    import os

    from everystep.storage import directory

    d = str(tmp_path / "theirs")

    def denied(root, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root))

    monkeypatch.setattr(directory.CheckpointDirectory, "open", staticmethod(denied))
    code, _, err = call_cli(capsys, *(a.format(d=d) for a in command))
    assert code == 2 and err == f"everystep: error: Permission denied: {d}\n"


def test_warnings_of_the_ranks_are_the_commands_own_one_line_ones_naming_the_rank(tmp_path):
    """Under ``--nproc 2`` each rank that skips a corrupt checkpoint says so as the command line's own
    warning, naming its rank: not Python's format with a file, a line number and a source line."""
    d = tmp_path / "c"
    run_cli("train", "--workload", "mlp", "--strategy", "checkfreq", "--steps", "4", "--nproc", "2", "--dir", str(d),
            check=True)
    newest = d / "objects" / "full-000000000004-r0.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 1
    newest.write_bytes(data)
    done = run_cli("train", "--workload", "mlp", "--strategy", "checkfreq", "--steps", "6", "--nproc", "2",
                   "--dir", str(d), check=True)
    said = [line for line in done.stderr.splitlines() if "skipping the checkpoint at step 4" in line]
    assert sorted(line.split(":")[1] for line in said) == [" warning (rank 0)", " warning (rank 1)"], done.stderr
    assert "UserWarning" not in done.stderr and ".py:" not in done.stderr, done.stderr
