"""Node-local checkpoint directories: two hosts on loopback, each a ``torchrun`` of its own with its own
directory standing for its own disk (:mod:`everystep.eval.kills.lost_hosts`), no directory that both see. Hosts
are lost (SIGKILLed with every process they started) at steps drawn from the seed and restarted in
place (their disks kept) or replaced (an empty disk); every rank resumes from the same step, bitwise,
or the job refuses to start with one message."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from everystep.eval.kills.lost_hosts import TwoHosts, descendants, final_hashes, lose_hosts, rank0_losses
from everystep.eval.kills.train import TrainConfig, run
from everystep.storage.base import Manifest
from everystep.storage.hosts import hosts_of, readers_hosts
from everystep.errors import CheckpointDirectoryError

from .conftest import running

LONG = pytest.mark.long


def _reference(steps: int, local: int, parallel: str = "ddp") -> dict:
    return run(TrainConfig(workload="gpt2-tiny", strategy="none", steps=steps, nproc=2 * local, max_nproc=4,
                           parallel=parallel, progress=False))


def _assert_bitwise(job: TwoHosts, reference: dict) -> None:
    assert rank0_losses(job) == reference["losses"]
    assert final_hashes(job) == reference["rank_state_sha256"]


def _manifests(disk: Path) -> dict[str, Manifest]:
    return {p.stem: Manifest.from_bytes(p.read_bytes(), name=p.stem) for p in (disk / "manifests").glob("*.json")}


def _assert_each_disk_holds_its_own_parts(job: TwoHosts) -> None:
    """Every host's directory commits the same checkpoints, and holds of each the parts of the ranks
    that were on that host when it was written: one host's ranks each, the two hosts between them all."""
    first, second = (_manifests(disk) for disk in job.disks)
    assert first.keys() == second.keys() and first
    for name, manifest in first.items():
        groups = [set(g) for g in manifest.meta["hosts"]]
        held = [{int(key[len("tensors-r"):]) for key, info in manifest.objects.items()
                 if (disk / "objects" / info.name).exists()} for disk in job.disks]
        assert held[0] in groups and held[1] in groups and held[0] | held[1] == set(range(2 * job.local)), (name, held)
        assert not held[0] & held[1], (name, held)


def _assert_verify_reads_each_disks_own_parts(job: TwoHosts, capsys) -> None:
    """``verify`` on each host's directory verifies the parts it holds and says where the others are;
    a byte flipped in one of its parts, and a part removed, are named."""
    from .conftest import call_cli

    for disk in job.disks:
        code, out, _ = call_cli(capsys, "inspect", str(disk))
        assert code == 0 and "INVALID" not in out and "node-local (2 hosts): the parts of ranks" in out, out
        assert call_cli(capsys, "verify", str(disk))[0] == 0
        code, _, err = call_cli(capsys, "recover", "--dir", str(disk))  # a whole state: every host's parts
        assert code == 2 and "copy every host's objects/ into one directory" in err, err
    merged = job.tmp / "merged"
    shutil.copytree(job.disks[0], merged)
    for part in (job.disks[1] / "objects").glob("full-*"):
        shutil.copy(part, merged / "objects")
    code, out, _ = call_cli(capsys, "recover", "--dir", str(merged))
    assert code == 0 and out.startswith(f"step {job.steps}, state sha256"), out
    parts = sorted((job.disks[1] / "objects").glob("full-*.safetensors"))
    data = bytearray(parts[-1].read_bytes())
    data[-1] ^= 1
    parts[-1].write_bytes(data)
    parts[0].unlink()
    code, out, _ = call_cli(capsys, "verify", str(job.disks[1]))
    assert code == 1 and f"{parts[-1].name} fails its checksum" in out and f"{parts[0].name} is missing" in out, out
    assert call_cli(capsys, "verify", str(job.disks[0]))[0] == 0  # (the other host's own parts are whole)


def _starts_agree(loss) -> None:
    """Every rank of the job restarted from one step (each restart logs its rank's start)."""
    assert len(loss.starts) == 2 * loss_local(loss), loss.starts
    assert len({s["start"] for s in loss.starts}) == 1, loss.starts


def loss_local(loss) -> int:
    return len(loss.starts) // 2


def _plan(steps: int, losses: int, seed: int, hosts: tuple[int, ...] | None = None) -> list[tuple[int, tuple[int, ...]]]:
    rng = random.Random(seed)
    return [(4 + (i + 1) * (steps - 8) // (losses + 1) + rng.randint(-2, 2), hosts or (rng.randrange(2),))
            for i in range(losses)]


@pytest.mark.parametrize("strategy, parallel, local", [
    ("checkfreq", "ddp", 1),
    pytest.param("checkfreq", "fsdp", 1, marks=LONG), pytest.param("checkfreq", "ddp", 2, marks=LONG),
    pytest.param("lightcheck", "ddp", 1, marks=LONG), pytest.param("lightcheck", "fsdp", 1, marks=LONG),
    pytest.param("lowdiff_plus", "ddp", 1, marks=LONG), pytest.param("lowdiff_plus", "fsdp", 1, marks=LONG),
    pytest.param("lightcheck", "ddp", 2, marks=LONG),
])
def test_hosts_restarted_in_place_resume_from_their_own_disks_bitwise(tmp_path, capsys, strategy, parallel, local):
    """Both hosts lost at once, twice (once in the suite's run), and restarted with their disks (their
    memory lost): every rank resumes from the newest full checkpoint, read from its own host's disk and
    the parts the other host sends, bitwise; each directory holds only its own ranks' parts."""
    steps = 16
    reference = _reference(steps, local, parallel)
    job = TwoHosts(tmp_path, local=local, strategy=strategy, steps=steps, parallel=parallel, persist_every=1,
                   peers=False, node_local=True)
    losses = lose_hosts(job, _plan(steps, 1 if (strategy, parallel, local) == ("checkfreq", "ddp", 1) else 2, seed=3,
                                   hosts=(0, 1)))  # (the suite's: one loss)
    for loss in losses:
        _starts_agree(loss)
        assert {s["source"] for s in loss.starts} == {"disk"}, loss.starts
        assert loss.resumed == loss.on_disk > 0, loss  # (lowdiff_plus: its agents' newest persisted)
    _assert_bitwise(job, reference)
    _assert_each_disk_holds_its_own_parts(job)
    _assert_verify_reads_each_disks_own_parts(job, capsys)


@pytest.mark.parametrize("seen, expected", [
    ([[0, 1], [0, 1]], None),
    ([[0], [1]], ((0,), (1,))),
    ([[0, 1], [0, 1], [2, 3], [2, 3]], ((0, 1), (2, 3))),
    ([[0, 2], [1], [0, 2]], ((0, 2), (1,))),
])
def test_the_ranks_that_see_each_others_probes_share_a_directory(seen, expected):
    assert hosts_of(seen, "/ckpt") == expected


@pytest.mark.parametrize("listings, expected", [
    (["a", "a"], None), (["a", "b"], ((0,), (1,))), (["b", "a", "b", "a"], ((0, 2), (1, 3))),
])
def test_readers_whose_directories_list_the_same_read_as_one_host(listings, expected):
    assert readers_hosts(listings) == expected


@pytest.mark.parametrize("seen", [[[0, 1], [1]], [[1], [0, 1]], [[0, 1], [1, 2], [1, 2]]])
def test_ranks_that_see_each_other_inconsistently_are_refused(seen):
    with pytest.raises(CheckpointDirectoryError, match="inconsistently"):
        hosts_of(seen, "/ckpt")


def _is_rank(pid: int) -> bool:
    """``pid`` is a rank a host's torchrun started (not a helper of torchrun's own)."""
    try:
        return b"everystep.eval.kills.lost_hosts\0rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait_for(condition, what: str, timeout: float = 180.0) -> None:
    """Poll ``condition`` until it holds (what a test waits for: a host's log, a step reached)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("strategy, parallel", [
    pytest.param("lightcheck", "ddp", marks=LONG), pytest.param("lightcheck", "fsdp", marks=LONG),
    pytest.param("lowdiff_plus", "ddp", marks=LONG),
    pytest.param("lowdiff_plus", "fsdp", marks=LONG),
])
def test_a_replaced_host_takes_its_state_from_its_peers_memory(tmp_path, strategy, parallel):
    """With peers: a host replaced (its memory and its disk empty) after the survivor's disk holds full
    checkpoints; the job resumes from the peers' memory, newer than the disk, bitwise; the survivor's
    checkpoints that the new disk lacks are discarded, and both disks then hold every new one."""
    steps = 16
    reference = _reference(steps, 1, parallel)
    job = TwoHosts(tmp_path, local=1, strategy=strategy, steps=steps, parallel=parallel, persist_every=3, node_local=True)
    (loss,) = lose_hosts(job, [(8, (1,))], replace=True)
    _starts_agree(loss)
    assert any(s["source"].startswith("peer memory") for s in loss.starts), loss.starts
    assert loss.resumed >= loss.reached - 2, loss
    _assert_bitwise(job, reference)
    _assert_each_disk_holds_its_own_parts(job)


@LONG
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_replaced_host_takes_its_parts_from_the_remote(tmp_path, bucket, monkeypatch, parallel):
    """checkfreq without peers, uploading as often as it can: a host replaced with an empty disk once the
    remote holds a checkpoint; every rank resumes from the newest checkpoint the remote holds (each rank
    downloads its own part), bitwise. Each commit is slowed down (0.2 s), so that training is still
    running when the first upload (a process started, then the objects) is up."""
    import boto3

    monkeypatch.setenv("EVERYSTEP_DELAY", "store.commit.before_manifest:1+=0.2")
    steps = 40
    reference = _reference(steps, 1, parallel)
    job = TwoHosts(tmp_path, local=1, strategy="checkfreq", steps=steps, parallel=parallel, persist_every=1, peers=False,
                   node_local=True, remote=f"s3://{bucket}/job")
    try:
        def uploaded() -> list[str]:
            return [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="job/manifests/")
                    .get("Contents", [])]

        _wait_for(lambda: job.newest_step() >= 6 and uploaded(), "an upload, and step 6")
        job.lose(0)
        assert job.hosts[1][0].poll() is None, "the job ended before the host was lost"
        newest = max(int(key.split("-")[1][:12]) for key in uploaded())
        replaced = time.time()
        job.start(0, replace=True)
        job.wait(300)
    finally:
        job.close()
    starts = [e for e in job.events() if "start" in e and e["at"] >= replaced]
    assert [(e["start"], e["source"]) for e in starts] == [(newest, "remote")] * 2, (newest, starts)
    _assert_bitwise(job, reference)
    _assert_each_disk_holds_its_own_parts(job)


def test_a_replaced_host_with_neither_peers_nor_remote_is_refused_in_one_message(tmp_path):
    """checkfreq, node-local disks, no peers, no remote: a host replaced with an empty disk holds none of
    the survivor's checkpoints; no rank starts from step 0, every rank says what is missing, and the
    survivor's disk is left as it was."""
    job = TwoHosts(tmp_path, local=1, strategy="checkfreq", steps=40, persist_every=1, peers=False, node_local=True,
                   max_restarts=1)
    try:
        _wait_for(lambda: job.newest_step() >= 5, "step 5")
        survivor = [pid for pid in descendants(job.hosts[0][0].pid) if _is_rank(pid)]
        assert survivor
        job.lose(1)
        # Host 0's rank may commit a step more, and retire one, before its collectives with the lost
        # host fail; its torchrun then starts it again. What the refused start does is judged from there.
        try:
            _wait_for(lambda: not any(running(pid) for pid in survivor), "host 0's rank to end")
        except AssertionError:  # (where it waits, from its own stacks: each rank writes them on SIGUSR1)
            size = Path(f"{job.hosts[0][1]}.log").stat().st_size
            for pid in survivor:
                os.kill(pid, signal.SIGUSR1)
            try:
                _wait_for(lambda: Path(f"{job.hosts[0][1]}.log").stat().st_size > size, "the stacks", timeout=10)
            except AssertionError:
                pass
            raise AssertionError("host 0's rank did not end after host 1 was lost:\n" + TwoHosts.log(job.hosts[0][1]))
        before = sorted(p.name for p in (job.disks[0] / "manifests").iterdir())
        replaced = time.time()
        job.start(1, replace=True)
        said = "no step to restore that every host can load"
        _wait_for(lambda: all(said in TwoHosts.log(s) for _, s, _ in job.hosts), "both hosts to refuse")
    finally:
        job.close()
    assert not [e for e in job.events() if "start" in e and e["at"] >= replaced]  # no rank started training
    assert sorted(p.name for p in (job.disks[0] / "manifests").iterdir()) == before  # nothing written or deleted
    for _, scratch, _ in job.hosts:
        assert "(peers=True) or a remote tier (remote=)" in TwoHosts.log(scratch)


@LONG
def test_a_crash_between_one_hosts_part_and_its_manifest_resumes_every_rank_from_the_step_before(tmp_path,
                                                                                              monkeypatch):
    """Rank 1 is killed in the commit of the 6th checkpoint it takes part in, after every part was written
    and rank 0's host committed it, before its own host's manifest: the job ends. Restarted in place,
    the hosts agree on the newest step both committed, resume from it bitwise, and rank 0's host
    discards the checkpoint the other lacks."""
    steps = 14
    reference = _reference(steps, 1)
    monkeypatch.setenv("EVERYSTEP_CRASH", "store.commit.before_manifest:6@1")
    job = TwoHosts(tmp_path, local=1, strategy="checkfreq", steps=steps, persist_every=1, peers=False,
                   node_local=True, max_restarts=0)
    try:
        _wait_for(lambda: all(p.poll() is not None for p, _, _ in job.hosts), "the job to end")
        ahead = {p.name for p in (job.disks[0] / "manifests").iterdir()} - \
            {p.name for p in (job.disks[1] / "manifests").iterdir()}
        assert len(ahead) == 1, ahead  # (one host committed the step, the other did not)
        monkeypatch.delenv("EVERYSTEP_CRASH")
        job.max_restarts, job.rdzv_id = 20, "job-again"
        restart = len(job.scratches)
        for index in range(2):
            job.start(index)
        job.wait(300)
    finally:
        job.close()
    step = int(ahead.pop().split("-")[1].split(".")[0])
    starts = [e for s in job.scratches[restart:] for e in _events(s) if "start" in e]
    assert sorted(e["start"] for e in starts) == [step - 1, step - 1], (step, starts)
    assert all(e["source"] == "disk" for e in starts), starts
    _assert_bitwise(job, reference)
    _assert_each_disk_holds_its_own_parts(job)


def _events(scratch: Path) -> list[dict]:
    return [json.loads(line) for p in scratch.glob("events-*.jsonl") for line in p.read_text().splitlines()
            if line.endswith("}")]


_TWO_DISKS = """
import sys, warnings, torch, torch.distributed as dist
from everystep import Checkpointer, state_hash
from everystep.distributed import Ranks
from everystep.errors import DirectoryInUseError
from everystep.storage.directory import CheckpointDirectory
dist.init_process_group("gloo")
rank = dist.get_rank()
disk = sys.argv[1] + f"/host{rank}"  # (each rank a host of its own, its directory its own disk)
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
state = lambda: state_hash({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
if sys.argv[2] == "read":  # every rank reads through a store opened for reading: nothing written
    store = CheckpointDirectory.open(disk, ranks=Ranks.detect(), access="read")
    print(f"rank {rank} restored {Checkpointer(store, model, optimizer, strategy='full_sync').restore()}, {state()}")
    sys.exit()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with Checkpointer(disk, model, optimizer, strategy="full_sync", every=1, keep=2) as ckpt:
        start = ckpt.restore()
        print(f"rank {rank} restored {start}")
        if sys.argv[2] == "tamper":
            for w in caught:
                print(f"rank {rank} warned: {w.message}")
        else:
            for step in range(start + 1, 4):
                model(torch.ones(2, 16)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            try:  # a second writer of this host's directory, while the job holds it
                CheckpointDirectory.open(disk, ranks=Ranks(), other_world=True)
            except DirectoryInUseError as e:
                print(f"rank {rank} second writer: {e}")
            reader = CheckpointDirectory.open(disk, ranks=Ranks(), other_world=True, access="read")
            print(f"rank {rank} reader sees {sorted(r.manifest.step for r in reader.catalog.manifests())}")
print(f"rank {rank} ended at {state()}")
"""

_TAMPER = """
from everystep.distributed import Ranks
send = Ranks.send_bytes
def flipping(self, channel, data, to, _sent=[]):
    if data is not None and not _sent:  # this rank's first part sent, one byte flipped on its way
        _sent.append(True)
        data = bytearray(data)
        data[len(data) // 2] ^= 1
    send(self, channel, data, to)
Ranks.send_bytes = flipping
"""


def test_a_part_changed_on_its_way_between_hosts_is_refused_and_the_step_before_restored(tmp_path):
    """I8 and I9 under node-local disks, two hosts of one rank each (forked, gloo): a second writer
    of a host's directory is refused while the job holds it, and a reader beside it sees every
    checkpoint; a job whose ranks open their disks for reading restores the newest state, bitwise,
    writing nothing; on restore each rank reads the other host's part through the other rank, and where
    the first part each sends has a byte changed on the way, the receivers refuse them, every rank
    passes over that step and both restore the one before."""
    first = _two_hosts(_TWO_DISKS, tmp_path, "train")
    for rank in (0, 1):
        assert f"rank {rank} restored 0" in first
        in_use = rf"rank {rank} second writer: .*host{rank} is in use: process \d+ is writing checkpoints there"
        assert re.search(in_use, first), first
        assert f"rank {rank} reader sees [1, 2]" in first, first  # (step 3's: written as the job closes)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    read = _two_hosts(_TWO_DISKS, tmp_path, "read")
    for rank in (0, 1):  # each rank reads its host's part and is sent the other's; nothing is written
        ended = re.search(rf"rank {rank} ended at (\w+)", first).group(1)
        assert f"rank {rank} restored 3, {ended}" in read, read
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == files
    again = _two_hosts(_TAMPER + _TWO_DISKS, tmp_path, "tamper")
    assert "rank 0 restored 2" in again and "rank 1 restored 2" in again, again
    for rank in (0, 1):  # (each rank's first part sent was changed: each receiver refuses one, and learns of the other)
        assert re.search(rf"rank {rank} warned: skipping the checkpoint at step 3: .*on arrival, fails its checksum",
                         again), again


def _two_hosts(script: str, tmp_path: Path, *args: str) -> str:
    """The output of a job of two ranks running ``script`` with ``tmp_path`` and ``args``, each rank
    forked from the tests' zygote."""
    from everystep.distributed import free_port

    from .forked import start_script, wait_all

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [start_script(script, str(tmp_path), *args, env={**env, "RANK": str(r)}) for r in range(2)]
    done = wait_all(ranks, 120)
    assert all(d.returncode == 0 for d in done), "".join(d.stdout for d in done)
    return "".join(d.stdout for d in done)
