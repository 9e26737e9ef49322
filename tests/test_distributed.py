"""Jobs of two real processes (gloo on loopback): sharded checkpoints, a killed rank, DCP, stopping."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from everystep.cli import main
from everystep.distributed import Ranks
from everystep.errors import ConfigError, EverystepError, StateMismatchError
from everystep.eval.data import SyntheticData
from everystep.distributed import free_port as _free_port
from everystep.eval.kills.train import TrainConfig, run
from everystep.inventory import verify_store
from everystep.recovery import read_full
from everystep.tree import state_hash, unflatten
from everystep.storage.directory import CheckpointDirectory
from everystep.policy import deadline_margin
from everystep.stopping import StopWatch, deadline_from_environment
from everystep.storage.formats.sharded import RankShare
from everystep.recovery import common_step

from .conftest import assert_recovered, running
from .forked import start_script, wait_all

STEPS = 14
JOB = dict(workload="gpt2-tiny", steps=STEPS, nproc=2, progress=False)


def _job(tmp: Path, strategy: str, **kw) -> dict:
    return run(TrainConfig(strategy=strategy, directory=None if strategy == "none" else str(tmp / strategy), **{**JOB, **kw}))


class _References(dict):
    """Uninterrupted two-rank runs without checkpointing, by compression, each run when first needed."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp = tmp

    def __missing__(self, key: str | None) -> dict:
        """``key``: the compression, or ``"in_backward"`` for updates in backward."""
        kw = {"in_backward": True} if key == "in_backward" else {"compress": key}
        self[key] = _job(self.tmp, "none", **kw)
        return self[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str | None, dict]:
    return _References(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def delayed(tmp_path_factory) -> tuple[Path, dict]:
    """checkfreq on two ranks, rank 1's part of the first checkpoint held back 1.5 s before its rename:
    rank 0's commit waits for it in a gather while both training threads go on through DDP's
    all-reduces. Sharing a group, the two would pair wrong collectives and hang; the collective
    timeout turns a hang into a failure."""
    tmp = tmp_path_factory.mktemp("delayed")
    with pytest.MonkeyPatch.context() as env:  # the ranks inherit it
        env.setenv("EVERYSTEP_DELAY", "store.object.before_rename=1.5@1")
        env.setenv("EVERYSTEP_COLLECTIVE_TIMEOUT", "60")
        summary = _job(tmp, "checkfreq", keep=3)
    return tmp / "checkfreq", summary


def test_background_commits_never_wait_on_the_training_group(delayed, reference):
    directory, summary = delayed
    assert summary["rank_state_sha256"] == reference[None]["rank_state_sha256"]
    assert summary["losses"] == reference[None]["losses"]
    b0, b1 = summary["bytes_written_per_rank"]
    assert abs(b0 - b1) < 0.1 * (b0 + b1)  # replicated state split in halves; each rank's own state is small
    names = {p.name for p in (directory / "objects").iterdir()}
    assert {f"full-{STEPS:012d}-r0.safetensors", f"full-{STEPS:012d}-r1.safetensors"} <= names


SPREAD = "disk (parts brought forward on cpu)"


@pytest.mark.parametrize("strategy, compress, mode, extra, sources", [
    ("full_sync", None, "hardware", {"every": 3, "stagger": 1, "fail_at": (5, 9)}, {"disk"}),
    ("checkfreq", None, "software", {}, {"disk"}),
    ("lowdiff", "topk:0.01", "software", {"every": 5, "options": {"batch": 2}}, {"disk"}),
    ("lowdiff_plus", None, "software", {"every": 3}, {"memory"}),
    ("lightcheck", None, "software", {"options": {"persist_every": 3}}, {"region"}),
    ("lightcheck", None, "software", {"options": {"persist_every": 3}, "in_backward": True}, {"region"}),
    ("gockpt_o", None, "hardware", {"every": 2, "fail_at": (6, 10), "options": {"parts": 2, "chunk_bytes": 4096}},
     {"disk"}),  # (reconstructed on the host: a full checkpoint)
    ("gockpt", None, "software", {"every": 2, "fail_at": (6, 10),
                                  "options": {"parts": 2, "chunk_bytes": 4096, "reconstruct": "device"}}, {SPREAD}),
    ("checkflow", None, "hardware", {}, {"disk"}),
])
def test_a_killed_rank_and_the_restarted_job_recover_bitwise(tmp_path, reference, strategy, compress, mode, extra,
                                                             sources):
    # Step 4 kills rank 1 and step 7 rank 0 (unless ``fail_at``: later, where the first checkpoint
    # is committed later), each in the middle of a checkpoint write (seed 0). With in_backward, each bucket's parameters are updated once its all-reduce
    # completes. Each restart resumes from the newest step recoverable before its kill, from
    # ``sources``; a strategy that keeps every step in memory loses at most one finished step.
    fail_at = extra.get("fail_at", (4, 7))
    summary = _job(tmp_path, strategy, compress=compress, fail_mode=mode, **{"fail_at": fail_at, **extra})
    ref = reference["in_backward" if extra.get("in_backward") else compress]
    assert [r["failed_at"] for r in summary["recoveries"]] == list(fail_at)
    assert_recovered(summary, sources=sources, lose=1 if sources & {"region", "memory"} else None)
    assert summary["rank_state_sha256"] == ref["rank_state_sha256"]
    assert summary["losses"] == ref["losses"]
    if strategy == "lowdiff_plus":  # the agents outlive their training processes; each rank has its own
        _assert_agents_gone(tmp_path / strategy)
        store = CheckpointDirectory.open(tmp_path / strategy)
        assert verify_store(store) == []  # the agents' parts committed, or collected at the restart
        final = max((r.manifest for r in store.catalog.manifests() if r.manifest), key=lambda m: m.step)
        assert final.step == STEPS
        split = {k for part in final.meta["parts"] for k in part["pieces"]}  # written once, across the ranks
        assert any(k.startswith("/optimizer/state/") for k in split) and any(k.startswith("/model/") for k in split)


def test_naive_diff_on_two_ranks_restarts_every_rank_from_the_same_lossy_state(tmp_path, reference):
    # Lossy by design, so not bitwise: each restart passes the check that the ranks restored the same
    # replicated state (else StateMismatchError), and the run stays close to the uninterrupted one.
    summary = _job(tmp_path, "naive_diff", every=5, fail_at=(4, 7))
    ref = reference[None]["losses"]
    assert [r["failed_at"] for r in summary["recoveries"]] == [4, 7]
    assert_recovered(summary, sources={"disk (lossy)"})
    resumed = summary["recoveries"][0]["resumed_from"]
    assert summary["losses"][:resumed] == ref[:resumed]
    assert max(abs(a - b) / b for a, b in zip(summary["losses"], ref)) < 0.03


def _assert_agents_gone(directory: Path) -> None:
    """Each agent that announced itself here (an agent killed cannot withdraw its file) has exited."""
    pids = [json.loads(p.read_text())["pid"] for p in directory.glob("agent*.json")]
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, "a checkpoint agent outlived the job"


def test_an_agent_lost_on_one_rank_turns_every_rank_to_its_own_full_checkpoints(tmp_path, reference, capfd, monkeypatch):
    monkeypatch.setenv("EVERYSTEP_CRASH", "agent.step:5@1")  # rank 1's agent dies at its fifth step
    summary = _job(tmp_path, "lowdiff_plus", every=4)
    assert summary["rank_state_sha256"] == reference[None]["rank_state_sha256"]
    assert summary["losses"] == reference[None]["losses"]
    err = capfd.readouterr().err
    # Both ranks fall back together, at the first agreement after the loss (step 8), naming rank 1.
    assert err.count("recovery from memory is off and the training process writes full checkpoints every 4 steps") == 2
    assert "is lost: rank 1:" in err
    _assert_agents_gone(tmp_path / "lowdiff_plus")
    store = CheckpointDirectory.open(tmp_path / "lowdiff_plus")
    steps = sorted(r.manifest.step for r in store.catalog.manifests() if r.manifest)
    assert steps == [12, STEPS]  # the training processes' own checkpoints, every 4 steps from 8, and the final one


@pytest.mark.parametrize("reachable, on_disk, expected", [
    ([[7, 8], [6, 7]], 3, 7),  # one agent a step ahead: the step both can reach
    ([[7], [7, 8]], 3, 7),
    ([[8, 9], [8, 9]], 3, 9),
    ([[7], [8]], 3, None),  # nothing in common
    ([[7, 8], None], 3, None),  # a rank without its agent
    ([[7, 8], [7, 8]], 9, None),  # storage holds a newer checkpoint
    ([[5]], 5, 5),
])
def test_ranks_recover_from_memory_only_at_a_step_every_agent_holds(reachable, on_disk, expected):
    assert common_step(reachable, on_disk) == expected


def test_a_part_that_fails_on_one_rank_is_raised_on_every_rank_and_its_step_is_not_committed(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("EVERYSTEP_FAIL", "store.object.mid_write:2@1")  # rank 1's part of step 2: disk full
    with pytest.raises(EverystepError, match="reported the error above|failed unexpectedly"):
        _job(tmp_path, "checkfreq")
    err = capfd.readouterr().err
    # Rank 1 reports its own failure in one line — unless rank 0, which learns of it at the commit,
    # ended the job first: torchrun then stops rank 1 (whose traceback is torchrun's doing).
    own = re.findall(r"error on rank 1: .*", err)
    assert all(re.search(r"background write .* No space left on device", line) for line in own), own
    assert "the full checkpoint of step 2 was not committed: rank 1: StoreWriteError" in err  # rank 0 learns why
    # Rank 0 raises it at its next checkpoint call or, when its collectives with the failed rank
    # fail first, reports it while closing.
    assert re.search(r"error on rank 0: .*the full checkpoint of step 2 was not committed: rank 1: StoreWriteError|"
                     r"step 2 was not committed: rank 1: StoreWriteError.*\(PeerFailedError\)", err)
    # The writes already queued behind it (steps 3 and 4, on a slow machine, before a rank's next
    # checkpoint call raises) still commit whole; step 2 never does.
    store = CheckpointDirectory.open(tmp_path / "checkfreq", create=False)
    steps = sorted(r.manifest.step for r in store.catalog.manifests())
    assert steps and 2 not in steps
    # What rank 0 wrote of step 2 (and of a later step whose commit the failure cut off) is left
    # for the next start to collect; everything committed verifies.
    left = verify_store(store)
    assert any("full-000000000002-r0" in p for p in left)
    assert all(p.endswith("no checkpoint names this file") for p in left)
    store.collect_garbage()
    assert verify_store(store) == []


def test_verify_names_a_flipped_byte_and_a_missing_rank_part(delayed, tmp_path, capsys):
    copy = tmp_path / "c"
    shutil.copytree(delayed[0], copy)
    store = CheckpointDirectory.open(copy, create=False)
    assert verify_store(store) == []
    first, second = sorted((r.manifest for r in store.catalog.manifests()), key=lambda m: m.step)[-2:]
    flipped = copy / "objects" / first.objects["tensors-r0"].name
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0x40
    flipped.write_bytes(bytes(data))
    missing = copy / "objects" / second.objects["tensors-r1"].name
    missing.unlink()
    assert main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"{flipped} fails its checksum" in out
    assert f"{missing} is missing" in out


def test_a_single_process_resumes_from_a_two_rank_checkpoint(delayed, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(delayed[0], copy)
    one = run(TrainConfig(workload="gpt2-tiny", strategy="checkfreq", steps=STEPS + 2, directory=str(copy), progress=False))
    assert one["first_step"] == STEPS + 1 and len(one["losses"]) == 2
    assert CheckpointDirectory.open(copy, create=False).marker["world_size"] == 1
    # Strategies with per-rank differential state refuse instead: see test_storage.


def test_dcp_checkpoints_load_with_plain_torch_distributed_checkpoint(tmp_path, reference):
    summary = _job(tmp_path, "checkfreq", full_format="dcp")
    assert summary["rank_state_sha256"] == reference[None]["rank_state_sha256"]
    store = CheckpointDirectory.open(tmp_path / "checkfreq", create=False)
    newest = max((r.manifest for r in store.catalog.manifests()), key=lambda m: m.step)
    tree = read_full(store, newest)  # everystep's own reading, as rank 0
    outside = tmp_path / "plain.pt"
    script = (
        "import sys, torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    )
    folder = store.root / "objects" / next(iter(newest.objects.values())).name.split("/")[0]
    subprocess.run([sys.executable, "-c", script, str(folder), str(outside)], check=True, capture_output=True)
    plain = torch.load(outside, weights_only=True)
    rank0 = {k[len("rank0"):] if k.startswith("rank0/") else k: v for k, v in plain.items() if not k.startswith("rank1/")}
    # DCP holds the tensors; the scalars (step, hyperparameters) live in the manifest's JSON skeleton.
    skeleton = newest.meta["parts"][0]["meta"]["skeleton"]
    assert state_hash(unflatten(skeleton, rank0)) == state_hash(tree)


def test_a_deadline_ends_the_run_with_a_final_checkpoint_and_the_rerun_matches(tmp_path):
    cfg = dict(workload="gpt2-tiny", strategy="checkfreq", steps=30, directory=str(tmp_path / "c"), progress=False)
    # A deadline already past stops the run after its first step, whatever the machine's speed.
    stopped = run(TrainConfig(**cfg, deadline=time.time() - 1))
    assert stopped["stopped"]["step"] == 1 and "before the deadline" in stopped["stopped"]["reason"]
    assert len(stopped["losses"]) == 1
    steps = [r.manifest.step for r in CheckpointDirectory.open(tmp_path / "c", create=False).catalog.manifests()]
    assert max(steps) == 1
    rest = run(TrainConfig(**cfg))
    whole = run(TrainConfig(**{**cfg, "directory": str(tmp_path / "whole")}))
    assert rest["first_step"] == 2
    assert rest["final_state_sha256"] == whole["final_state_sha256"]
    assert stopped["losses"] + rest["losses"] == whole["losses"]


def test_the_deadline_margin_is_one_step_one_checkpoint_and_the_buffer(monkeypatch):
    assert deadline_margin(2.0, 10.0) == 2 + 10 + 10 * 2 + 2 * 10
    assert deadline_margin(2.0, 10.0, k1=0, k2=0) == 12
    watch = StopWatch(time.time() + 100)
    watch.max_step, watch.max_checkpoint = 5.0, 10.0  # needs 85 s
    assert watch.reason() is None
    watch.max_step = 8.0  # needs 118 s
    assert "less than the 118.0 s needed" in watch.reason()
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1800000000")
    assert deadline_from_environment() == 1_800_000_000.0
    monkeypatch.setenv("SLURM_JOB_END_TIME", "tomorrow")
    with pytest.raises(ConfigError, match="SLURM_JOB_END_TIME must be a Unix time"):
        deadline_from_environment()


def test_sigterm_stops_every_rank_with_a_final_checkpoint_and_the_rerun_matches(tmp_path, reference):
    directory = tmp_path / "c"
    cmd = [sys.executable, "-m", "everystep", "train", "--workload", "gpt2-tiny", "--strategy", "checkfreq",
           "--steps", str(STEPS), "--nproc", "2", "--dir", str(directory)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list((directory / "manifests").glob("full-*.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped early after step" in out and "received SIGTERM" in out
    rest = run(TrainConfig(strategy="checkfreq", directory=str(directory), **JOB))
    assert rest["first_step"] > 1
    assert rest["rank_state_sha256"] == reference[None]["rank_state_sha256"]


def test_a_stop_signal_to_the_supervisor_is_only_recorded_by_its_handler(tmp_path):
    """The handler runs between any two bytecodes of the supervisor, inside the zygote channel's lock as
    well (while it polls the ranks): polling again from there waited for that lock for ever."""
    import socket
    import threading

    from everystep._forking import Channel, Forked
    from everystep.eval.kills.train import _Job

    journal = tmp_path / "journal-r0.jsonl"
    journal.write_text('{"event": "start"}\n')  # the rank has started: the signal is due to it
    mine, theirs = socket.socketpair()
    channel = Channel(mine)
    job = _Job.__new__(_Job)
    job.journals, job.started_before, job.held = [str(journal)], [0], None
    job.procs = [Forked(channel, pid=2**22 + 1)]
    done, let_go = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with channel._lock:
            done.wait(5)
            let_go.set()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    while not channel._lock.locked():
        time.sleep(0.001)
    job.forward(signal.SIGTERM, None)
    returned_while_locked = not let_go.is_set()
    done.set()
    holder.join()
    mine.close(), theirs.close()
    assert returned_while_locked
    assert job.held == signal.SIGTERM  # passed on by wait()'s next round


def test_replicated_state_that_differs_between_ranks_is_refused(tmp_path):
    script = f"""
import os, torch, torch.distributed as dist
from everystep import Checkpointer
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())  # no DDP: each rank starts from other weights
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    with Checkpointer({str(tmp_path / "c")!r}, model, opt, strategy="full_sync") as ckpt:
        ckpt.restore()
except Exception as e:
    print(type(e).__name__, e)
"""
    out = _spawn_two(script)
    assert out.count("StateMismatchError parameters or optimizer state of rank 1 differ from rank 0's at step 0 "
                     "(2 of 2 tensors, first '/model/bias')") == 2, out


def _spawn_two(script: str, world: int = 2) -> str:
    """The ranks' output, stdout and stderr (each rank forked from the tests' zygote)."""
    port = _free_port()
    ranks = [start_script(script, env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port)}) for r in range(world)]
    return "".join(done.stdout for done in wait_all(ranks, 120))


def test_four_ranks_restart_bitwise_when_ddp_keeps_its_first_buckets(tmp_path):
    # Above two ranks an all-reduce's sum order follows the bucket layout; the harness's DDP keeps its
    # first buckets (find_unused_parameters=True), so the first step after a restart sums as the run did.
    four = dict(JOB, nproc=4, max_nproc=4)
    ref = run(TrainConfig(strategy="none", **four))
    summary = run(TrainConfig(strategy="checkfreq", directory=str(tmp_path / "c"), fail_at=(5, 9), **four))
    assert [r["failed_at"] for r in summary["recoveries"]] == [5, 9]
    assert_recovered(summary, sources={"disk"})
    assert summary["losses"] == ref["losses"]
    assert summary["rank_state_sha256"] == ref["rank_state_sha256"]


def test_a_ddp_that_regroups_its_buckets_above_two_ranks_is_warned_of(tmp_path):
    script = f"""
import warnings, torch, torch.distributed as dist
from everystep import Checkpointer
dist.init_process_group("gloo")
for keep in (False, True):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), find_unused_parameters=keep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer({str(tmp_path)!r} + f"/c{{keep}}", model, torch.optim.SGD(model.parameters(), lr=0.1),
                          strategy="full_sync") as ckpt:
            ckpt.restore()
    print(f"rank {{dist.get_rank()}} keep {{keep}}:", [str(w.message) for w in caught if "buckets" in str(w.message)])
dist.destroy_process_group()
"""
    out = _spawn_two(script, world=3)
    assert 'rank 0 keep False: ["DistributedDataParallel over 3 ranks regroups its gradient buckets' in out, out
    assert "rank 0 keep True: []" in out and "rank 1 keep False: []" in out, out


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([torch.float32, torch.float64, torch.int8])),
                      min_size=1, max_size=6), world=st.integers(1, 4))
def test_shard_plans_split_replicated_bytes_evenly_and_cover_every_element(sizes, world):
    tensors = {f"/t{i}": torch.zeros(n, dtype=dtype) for i, (n, dtype) in enumerate(sizes)}
    tensors["/own"] = torch.ones(3)
    replicated = {k for k in tensors if k != "/own"}
    plans = [RankShare.of(tensors, replicated, Ranks(rank=r, world=world)) for r in range(world)]
    biggest = max(t.element_size() for t in tensors.values())
    total = sum(tensors[k].numel() * tensors[k].element_size() for k in replicated)
    for key in replicated:
        covered = sorted(tuple(p.pieces[key][:2]) for p in plans if key in p.pieces) if world > 1 else [(0, tensors[key].numel())]
        assert covered[0][0] == 0 and covered[-1][1] == tensors[key].numel()
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for p in plans:
        assert "/own" in p.local
        share = sum(t.numel() * t.element_size() for k, t in p.local.items() if k != "/own")
        assert abs(share - total / world) <= biggest * len(sizes) or world == 1


def test_the_sampler_position_resumes_mid_epoch_without_repeating_or_skipping_a_sample():
    def sampler(rank: int, world: int = 2) -> SyntheticData:
        return SyntheticData(lambda g: torch.zeros(1), size=40, batch_size=4, seed=3, rank=rank, world=world)

    drawn: list[int] = []
    for rank in range(2):
        first = sampler(rank)
        for _ in range(2):
            drawn += first.sample_indices()
            first.next()
        resumed = sampler(rank)
        resumed.load_state_dict(first.state_dict())
        while resumed.epoch == 0:
            drawn += resumed.sample_indices()
            resumed.next()
    assert sorted(drawn) == list(range(40))  # 5 global batches of 2 × 4: each sample exactly once
    single = sampler(0, world=1)
    single.load_state_dict({**first.state_dict(), "epoch": 0, "index": 3})
    assert single.index == 6
    with pytest.raises(StateMismatchError, match="not a whole number of global batches of 2 × 4"):
        sampler(0).load_state_dict({"epoch": 0, "index": 3, "seed": 3, "rank": 0, "world": 1})


def test_a_rendezvous_port_is_drawn_below_the_ports_the_kernel_hands_out_whatever_seeded_random():
    """A port the kernel hands out (gloo's connections bind to port 0) may be taken again before the
    rendezvous binds it, and the job then hangs with one rank short; below that range only a bind by
    number takes one."""
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = []
    for _ in range(3):
        random.seed(0)  # (a workload seeds Python's generator: two jobs must not draw the same port)
        ports.append(_free_port())
    assert all(10000 <= p < low for p in ports) and len(set(ports)) > 1, (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free
