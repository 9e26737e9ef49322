"""The remote tier (:mod:`everystep.storage.remote.tier`) against a real server (moto's, as in
``test_s3_store.py``): jobs whose machine is lost, pulls, uploads, retention on both sides, the CLI
and the bench over a remote, and what a hostile bucket holds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from everystep.distributed import free_port
from everystep.errors import RemoteStoreError
from everystep.storage.base import Manifest, ObjectInfo, checksum
from everystep.storage.catalog import Catalog
from everystep.storage.remote import RemoteConfig

from .conftest import TamperedClient, ROOT, torch_libraries
from .forked import run_script, start_script, wait_all

from everystep.storage.stores.s3 import S3Store

from .conftest import S3_SECRET as SECRET

# -- the remote tier: checkpoints that outlive the machine -------------------------------------------

_JOB = """
import json, os, signal, sys, warnings
import torch.distributed as dist
from everystep import Checkpointer, RemoteConfig
from everystep.eval.kills.train import training_state_hash
from everystep.eval.workloads import build

local, url, strategy, steps, kill_at, parallel = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                                  int(sys.argv[5]), sys.argv[6])
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    dist.init_process_group("gloo")
w = build("gpt2-tiny", seed=0, optimizer="adamw", rank=rank, world=world, parallel=parallel)
options = {"every": 2} if strategy == "lowdiff_plus" else {}
warned = warnings.catch_warnings(record=True)  # (the upload thread's too: what this rank told its user)
caught = warned.__enter__()
warnings.simplefilter("always")
ckpt = Checkpointer(local, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=strategy,
                    remote=RemoteConfig(url, every=2, lease=1.5) if url else None, **options)
start = ckpt.restore()
read = ckpt.directory.catalog.bytes_read  # (what the restore read from the local directory)
for step in range(start + 1, steps + 1):
    w.loss(w.data.next()).backward()
    w.update()
    if step in (kill_at - 2, kill_at):  # the host is lost after step kill_at: its processes, its disk; the kill
        # is armed after the newest checkpoint went up, so that what a new machine must resume from is known
        # (and an older one went up two steps before, which a pull must not take instead)
        ckpt.wait()
        ckpt.remote.flush()
    if step == kill_at:
        if rank == 0:  # rank 0 kills them all (the others wait for it in their next step's collectives)
            with open(f"{local}.lost.json", "w") as f:
                json.dump({"remote_step": ckpt.stats.last_remote_step}, f)
            os.killpg(0, signal.SIGKILL)
ckpt.close()
with open(f"{local}.r{rank}.json", "w") as f:
    json.dump({"start": start, "source": ckpt.recovered.source if ckpt.recovered else None, "read": read,
               "remote_step": ckpt.stats.last_remote_step, "up": ckpt.remote.bytes_up if url else 0,
               "down": ckpt.remote.bytes_down if url else 0,
               "warned": [str(x.message) for x in caught if issubclass(x.category, RuntimeWarning)],
               "hash": training_state_hash({"step": steps, **ckpt.components.capture(),
                                            **ckpt.components.capture_boundary()})}, f)
if world > 1:
    dist.destroy_process_group()
"""

_HOST = """
import json, os, subprocess, sys
ranks = [subprocess.Popen(json.loads(sys.argv[1]), env={**os.environ, "RANK": str(r)}) for r in range(int(sys.argv[2]))]
codes = {}
while len(codes) < len(ranks):
    pid, status = os.wait()
    codes[pid] = os.waitstatus_to_exitcode(status)
    if codes[pid] != 0:  # the others would wait for it in a collective until the test's timeout
        for p in ranks:
            if p.pid not in codes:
                p.kill()
sys.exit(max(abs(c) for c in codes.values()))
"""
"""A host: the job's ranks, children of one process in a session of its own (killed together); a rank
that fails ends the others."""


def _job(tmp_path, local, url, strategy, steps, kill_at=0, *, nproc=1, parallel="ddp", **env):
    """The job's ranks on one host (``env``: more of their environment); each rank's report."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(nproc),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env}
    args = [str(local), url, strategy, str(steps), str(kill_at), parallel]
    if kill_at:  # the host's ranks in one process group, which rank 0 kills
        done = subprocess.run([sys.executable, "-c", _HOST, json.dumps([sys.executable, "-c", _JOB, *args]), str(nproc)],
                              env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
        return None
    ranks = [start_script(_JOB, *args, env={**env, "RANK": str(rank)}) for rank in range(nproc)]  # (forked: no imports)
    for finished in wait_all(ranks, 240):
        assert finished.returncode == 0, finished.stdout[-3000:]
    return [json.loads(Path(f"{local}.r{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.parametrize("strategy, seed, nproc, parallel", [
    ("checkfreq", 1, 1, "ddp"),
    # each rank's agent writes its part; each rank uploads, and downloads, a share
    pytest.param("lowdiff_plus", 2, 2, "ddp", marks=pytest.mark.long),
    # DCP's files, each rank's shards, through the remote and back
    pytest.param("checkfreq", 3, 2, "fsdp", marks=pytest.mark.long),
])
def test_a_job_whose_machine_is_lost_resumes_on_a_new_one_from_the_remote_bitwise(tmp_path, bucket, strategy, seed,
                                                                                  nproc, parallel):
    import random

    steps = 14
    kill_at = random.Random(seed).randint(5, 11)  # an instant drawn from the seed, an upload maybe in flight
    url = f"s3://{bucket}/job"
    job = dict(nproc=nproc, parallel=parallel)
    reference = _job(tmp_path, tmp_path / "ref", "", strategy, steps, **job)
    _job(tmp_path, tmp_path / "lost", url, strategy, steps, kill_at, **job)
    newest = json.loads((tmp_path / "lost.lost.json").read_text())["remote_step"]
    up = _remote_steps(bucket, "job")
    assert 1 <= newest <= kill_at and up[-1] == newest and len(up) >= 2, up  # an older one is there to be taken wrongly
    # a new machine, its local directory empty; the lost host's lock expires after its lease (1.5 s here)
    resumed = _job(tmp_path, tmp_path / "new", url, strategy, steps, **job)
    for mine, theirs in zip(resumed, reference):
        assert (mine["source"], mine["start"]) == ("remote", newest)  # the newest checkpoint uploaded before the loss
        assert mine["hash"] == theirs["hash"]  # I1: bitwise the uninterrupted run, on every rank
        assert mine["remote_step"] == steps  # its final checkpoint uploaded as it closed
    if (strategy, nproc) == ("checkfreq", 1):  # the state read from what was downloaded, not again from the disk
        assert resumed[0]["read"] == 0
    assert len({r["start"] for r in resumed}) == 1
    for moved in ("down", "up"):  # each rank moved its share, the largest objects first to the least loaded
        shares = [r[moved] for r in resumed]
        assert min(shares) > 0.3 * max(shares), (moved, shares)


def _remote_steps(bucket: str, prefix: str) -> list[int]:
    """The steps of the checkpoints committed under ``prefix`` (their manifests), oldest first."""
    import boto3

    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/manifests/").get("Contents", [])
    return sorted(int(o["Key"].rsplit("-", 1)[1][:12]) for o in listed)


def test_a_share_tampered_with_on_one_rank_sends_every_rank_to_the_remote_checkpoint_before(tmp_path, bucket):
    import boto3

    url = f"s3://{bucket}/job"
    _job(tmp_path, tmp_path / "first", url, "checkfreq", 6, nproc=2)  # the final checkpoint, step 6, uploaded last
    s3 = boto3.client("s3")
    objects = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="job/objects/")["Contents"]}
    newest = sorted(k for k in objects if "full-000000000006" in k)
    assert len(newest) == 2  # each rank's part; the ranks share them out one each
    steps = sorted(int(o["Key"].rsplit("-", 1)[1][:12]) for o in
                   s3.list_objects_v2(Bucket=bucket, Prefix="job/manifests/")["Contents"])
    assert steps[-1] == 6 and len(steps) == 2  # the remote keeps two (which ones: as the uploads fell due)
    s3.put_object(Bucket=bucket, Key=newest[0], Body=b"\0" * objects[newest[0]])  # one rank's share fails its checksum
    resumed = _job(tmp_path, tmp_path / "new", url, "checkfreq", 7, nproc=2)
    assert {(r["source"], r["start"]) for r in resumed} == {("remote", steps[0])}  # on both ranks, the one before
    assert sum(r["down"] for r in resumed) > 0


def test_a_forged_remote_checkpoint_naming_the_local_objects_changes_nothing_local(tmp_path, bucket):
    """Someone who can write the bucket re-signs a manifest of a higher step whose objects verify but
    are named like the local directory's own: a restart on that directory resumes from its own
    newest step, every local object unchanged, nothing forged committed."""
    import boto3

    from everystep.storage.base import ObjectInfo

    from .conftest import files_of

    url, local = f"s3://{bucket}/job", tmp_path / "local"
    _job(tmp_path, local, url, "checkfreq", 6)  # the final checkpoint, step 6, uploaded as it closed
    s3 = boto3.client("s3")
    real = Manifest.from_bytes(s3.get_object(Bucket=bucket, Key="job/manifests/full-000000000006.json")["Body"].read())
    forged = b"\0" * real.objects["tensors"].nbytes
    name = real.objects["tensors"].name  # full-000000000006.safetensors: the local directory's newest
    s3.put_object(Bucket=bucket, Key=f"job/objects/{name}", Body=forged)
    step = 999_999_999_999
    s3.put_object(Bucket=bucket, Key=f"job/manifests/full-{step:012d}.json", Body=Manifest(
        kind="full", step=step, objects={"tensors": ObjectInfo(name=name, nbytes=len(forged), checksum=checksum(forged))},
        meta=real.meta).to_bytes())
    before = files_of(local)
    (resumed,) = _job(tmp_path, local, url, "checkfreq", 7)
    assert (resumed["source"], resumed["start"]) == ("disk", 6)
    after = files_of(local)
    kept = [k for k in before if k.startswith(("objects/", "manifests/")) and k in after]  # (retention keeps two)
    assert f"objects/{name}" in kept and all(after[k] == before[k] for k in kept)
    assert f"manifests/full-{step:012d}.json" not in after


def test_a_pull_never_writes_over_a_local_object(tmp_path, bucket):
    """A local object of the name a remote checkpoint's object has (here one no manifest names, left
    where garbage collection has not run): the pull warns, skips that checkpoint for the one before,
    and the local file is unchanged."""
    import warnings

    from everystep.storage import CheckpointDirectory
    from everystep.storage.remote.tier import RemoteTier

    url = f"s3://{bucket}/job"
    _job(tmp_path, tmp_path / "first", url, "checkfreq", 6)
    steps = _remote_steps(bucket, "job")
    directory = CheckpointDirectory.open(tmp_path / "new", strategy="checkfreq")
    stray = directory.root / "objects" / f"full-{steps[-1]:012d}.safetensors"
    stray.write_bytes(b"mine")
    tier = RemoteTier(RemoteConfig(url, every=2, mtbf=3600.0, lease=1.5), directory, keep=2)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pulled = tier.pull()
        assert (pulled.manifest.step if pulled else None) == (steps[-2] if len(steps) > 1 else None)  # (the one before)
        assert pulled is None or pulled.state[0]["step"] == steps[-2]  # (what it read, handed to the restore)
    finally:
        tier.close(upload=False)
        directory.close()
    assert stray.read_bytes() == b"mine"
    assert any("which a pull never writes over" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_a_share_that_fails_to_upload_on_one_rank_commits_nothing_is_reported_once_and_the_next_upload_goes_up(
        tmp_path, bucket):
    """Under two ranks, rank 1's first object upload fails (a full disk's error, injected): that
    upload is committed by no rank, rank 0 says so once, training goes on, and the next upload goes
    up whole; a new machine resumes from the final one."""
    import re

    import boto3

    url = f"s3://{bucket}/job"
    steps = 8
    done = _job(tmp_path, tmp_path / "first", url, "checkfreq", steps, nproc=2, EVERYSTEP_FAIL="remote.object:1@1")
    failed = [m for m in done[0]["warned"] if "failed" in m]
    assert len(failed) == 1 and "rank 1" in failed[0] and "No space left" in failed[0], done[0]["warned"]
    assert not any("failed" in m for m in done[1]["warned"])  # (rank 0 reports for the job)
    lost = int(re.search(r"checkpoint of step (\d+)", failed[0]).group(1))
    assert any("resumed with step" in m for m in done[0]["warned"])
    s3 = boto3.client("s3")
    committed = [int(o["Key"].rsplit("-", 1)[1][:12]) for o in
                 s3.list_objects_v2(Bucket=bucket, Prefix="job/manifests/")["Contents"]]
    assert lost not in committed and steps in committed
    assert all(r["remote_step"] == steps for r in done)
    resumed = _job(tmp_path, tmp_path / "new", url, "checkfreq", steps + 1, nproc=2)
    assert {(r["source"], r["start"]) for r in resumed} == {("remote", steps)}


def test_a_failed_upload_is_reported_though_retention_discards_its_checkpoint_right_after(bucket, tmp_path,
                                                                                          monkeypatch):
    """An upload that failed (a full disk's error in the upload process) whose checkpoint local
    retention discards as soon as the upload unpins it is still reported: only a checkpoint retired
    while it was pinned (by a retention planned before the pin) makes a failure a benign one."""
    import re
    import threading
    import warnings

    from everystep import Checkpointer, _faults
    from everystep.eval.workloads import build

    monkeypatch.setenv("EVERYSTEP_FAIL", "remote.object:1")  # (read by the upload process it starts)
    reached, proceed = threading.Event(), threading.Event()

    def hold() -> None:  # on the upload thread, once the failed upload has unpinned its checkpoint
        reached.set()
        assert proceed.wait(60)

    _faults.arm("remote.unpinned", action=hold)
    w = build("mlp", seed=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="full_sync", remote=RemoteConfig(f"s3://{bucket}/job", every=1),
                              keep=2) as ckpt:
                ckpt.restore()
                for _ in range(1000):  # (each step commits, then retains the newest two)
                    w.loss(w.data.next()).backward()
                    w.update()
                    if reached.is_set():
                        break
                assert reached.is_set(), "the upload never reached its unpin"
                for _ in range(2):  # two more commits: the checkpoint the failed upload held, unpinned now, is discarded
                    w.loss(w.data.next()).backward()
                    w.update()
                oldest = min(r.manifest.step for r in ckpt.directory.catalog.manifests())
                proceed.set()
                ckpt.remote.wait()
    finally:
        _faults.disarm("remote.unpinned")
        proceed.set()
    said = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    failed = [m for m in said if "No space left" in m]
    assert len(failed) == 1, said
    held = int(re.search(r"uploading the checkpoint of step (\d+)", failed[0]).group(1))  # (1, or later under load)
    assert oldest > held  # the checkpoint the failed upload held was gone locally when it was reported


def _moto(port, **env):
    """A moto server on ``port``, answering (``env``: its settings)."""
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the S3 server (moto) did not start")
            time.sleep(0.1)


def test_a_server_that_goes_away_is_reported_once_training_goes_on_and_uploads_resume(server, tmp_path, monkeypatch):
    import boto3

    from everystep import Checkpointer
    from everystep.eval.workloads import build

    port = free_port()  # a server of this test's own, stopped and started again
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    proc = _moto(port)
    boto3.client("s3").create_bucket(Bucket="gone")
    w = build("mlp", seed=0, optimizer="adamw")

    def train(ckpt, n):
        for _ in range(n):
            w.loss(w.data.next()).backward()
            w.update()
            ckpt.remote.wait()  # (the test's sequence; training itself never waits)

    try:
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="full_sync", remote=RemoteConfig("s3://gone/job", every=1)) as ckpt:
            ckpt.restore()
            train(ckpt, 3)
            # (an upload takes the newest checkpoint committed at its step's end: S_2, committed as step 3 began)
            assert ckpt.stats.last_remote_step == 2
            proc.kill()
            proc.wait()
            with pytest.warns(RuntimeWarning, match="to s3://gone/job failed") as failed:
                train(ckpt, 4)
            assert len([x for x in failed if "failed" in str(x.message)]) == 1  # once, not every step
            assert ckpt.stats.last_durable_step == 6 and ckpt.stats.last_remote_step == 2  # checkpoints stay local
            proc = _moto(port)  # back (empty: moto keeps nothing), its bucket made again
            boto3.client("s3").create_bucket(Bucket="gone")
            with pytest.warns(RuntimeWarning, match="uploads to s3://gone/job resumed"):
                train(ckpt, 2)
            assert ckpt.stats.last_remote_step == 8
    finally:
        proc.kill()
        proc.wait()


def test_an_upload_slower_than_the_steps_keeps_its_checkpoint_from_retention_and_goes_up_whole(
        bucket, tmp_path, monkeypatch):
    """Retention keeps one checkpoint, and each step commits a new one; the upload of one takes longer
    than several steps (its object is held in the upload process, a slow link, until the test has
    seen four more steps committed after the upload began): the checkpoint it uploads is kept until
    it is up, then goes."""
    import warnings

    from everystep import Checkpointer
    from everystep.eval.workloads import build

    gate = tmp_path / "go"
    monkeypatch.setenv("EVERYSTEP_HOLD", f"remote.object={gate}")  # (the upload process's, inherited at its start)
    url = f"s3://{bucket}/slow"
    w = build("mlp", seed=0, optimizer="adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed upload warns
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="full_sync", keep=1,
                          remote=RemoteConfig(url, every=2),
                          ) as ckpt:
            ckpt.restore()
            pinned, steps = tmp_path / "c" / "pinned.json", 0
            try:
                while not pinned.exists() and steps < 50:  # until an upload has begun (it pins its checkpoint)
                    w.loss(w.data.next()).backward()
                    w.update()
                    steps += 1
                for _ in range(4):
                    w.loss(w.data.next()).backward()
                    w.update()
                ckpt.wait()
                assert pinned.exists() and ckpt.stats.last_remote_step == -1  # still going up
                local = sorted(p.name for p in (tmp_path / "c" / "manifests").iterdir())
                assert len(local) == 2 and local[1] == f"full-{ckpt.stats.last_durable_step:012d}.json", local  # and one going up
            finally:
                gate.touch()  # (a failed check above must not leave the upload held, and the test waiting on it)
            ckpt.remote.wait()
            assert ckpt.stats.last_remote_step == int(local[0][len("full-"):-len(".json")])
            assert not (tmp_path / "c" / "pinned.json").exists()
    assert Catalog(S3Store(url)).manifests()[0].manifest.step == ckpt.stats.last_durable_step  # then the final one


def test_a_checkpoint_retired_by_another_processs_retention_before_its_pin_is_passed_over_without_a_warning(
        bucket, tmp_path, monkeypatch):
    """An agent process applies retention too, reading the pins before the upload's pin lands: the
    checkpoint the upload chose is discarded under it. That is no failure of the remote: nothing is
    warned, and the next upload takes the newer checkpoint."""
    import warnings

    from everystep import Checkpointer
    from everystep.eval.workloads import build
    from everystep.storage.directory import CheckpointDirectory

    w = build("mlp", seed=0, optimizer="adamw")
    url = f"s3://{bucket}/retired"
    original = CheckpointDirectory.pin_newest
    retired: list[int] = []

    def retired_first(self, newer_than):
        manifest = original(self, newer_than)
        if manifest is not None and not retired:
            self.catalog.discard(manifest.name)  # (what the other process's retention did)
            retired.append(manifest.step)
        return manifest

    monkeypatch.setattr(CheckpointDirectory, "pin_newest", retired_first)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed upload warns
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="full_sync", keep=1,
                          remote=RemoteConfig(url, every=1)) as ckpt:
            ckpt.restore()
            for _ in range(3):  # (checkpoints at steps 1 and 2: the first step is not one)
                w.loss(w.data.next()).backward()
                w.update()
                ckpt.remote.wait()  # (the test's sequence)
            assert retired == [1] and ckpt.stats.last_remote_step == 2
    assert [r.manifest.step for r in Catalog(S3Store(url)).manifests()] == [ckpt.stats.last_durable_step]  # (the final one)
    assert not (tmp_path / "c" / "pinned.json").exists()


def test_uploads_run_in_a_process_without_pytorch_started_again_when_it_died(bucket, tmp_path):
    import warnings

    from everystep import Checkpointer
    from everystep.eval.workloads import build

    w = build("mlp", seed=0, optimizer="adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed upload warns
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="full_sync", remote=RemoteConfig(f"s3://{bucket}/again", every=1)) as ckpt:
            ckpt.restore()
            for step in range(1, 7):
                w.loss(w.data.next()).backward()
                w.update()
                ckpt.remote.wait()  # (the test's sequence)
                if step == 3:
                    first = ckpt.remote._uploader._process
                    # the process that has uploaded and verified objects holds nothing of PyTorch (it
                    # starts in a fraction of a second of CPU, not PyTorch's 3 s)
                    assert torch_libraries(first.pid) == []
                    first.kill()  # between two uploads
                    first.wait()
            assert ckpt.remote._uploader._process.pid != first.pid
            assert ckpt.stats.last_remote_step == 5  # every upload went up, the next one by a new process


_BIG = """
import os, sys, torch
from everystep import Checkpointer, RemoteConfig

local, url, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Linear(1500, 1500)  # 27 MB with AdamW's state: each upload is a multipart one of 4 parts
opt = torch.optim.AdamW(model.parameters())
with Checkpointer(local, model, opt, strategy="full_sync", remote=RemoteConfig(url, every=1, lease=1.0)) as ckpt:
    start = ckpt.restore()
    for step in range(start + 1, steps + 1):
        model(torch.ones(4, 1500)).square().mean().backward()
        opt.step(); opt.zero_grad()
    print(start, ckpt.recovered.source if ckpt.recovered else None)
"""


@pytest.mark.parametrize("point", [pytest.param("store.remote.part:4", marks=pytest.mark.long),  # (its objects)
                                   "remote.before_manifest:2"])  # (its commit)
def test_an_upload_killed_at_any_point_leaves_the_previous_remote_checkpoint_and_is_collected(bucket, tmp_path, point):
    # The job is killed in its second upload: as its first part goes up (a multipart upload in
    # progress), or with every object up and the manifest not. Nothing of it is visible; a new machine
    # resumes from the first upload, and collects what the killed one left.
    url = f"s3://{bucket}/big"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    killed = run_script(_BIG, str(tmp_path / "lost"), url, "6", timeout=240, env={**env, "EVERYSTEP_CRASH": point})
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    store = S3Store(url)
    (committed,) = [int(k[len("manifests/full-"):-len(".json")]) for k in store.list("manifests/")]
    assert bool(store.leftovers()) == point.startswith("store.remote.part")  # an upload in progress, invisible
    again = subprocess.run([sys.executable, "-c", _BIG, str(tmp_path / "new"), url, "6"], capture_output=True,
                           text=True, timeout=240, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.split() == [str(committed), "remote"]
    assert store.leftovers() == []
    named = {f"objects/{o.name}" for r in Catalog(store).manifests() for o in r.manifest.objects.values()}
    assert set(store.list("objects/")) == named  # what the killed upload wrote without a manifest: collected


def test_the_cli_trains_with_a_remote_and_inspects_verifies_and_recovers_it_by_url(bucket, tmp_path, capsys):
    import boto3

    from .conftest import call_cli

    url = f"s3://{bucket}/cli"
    code, out, err = call_cli(capsys, "train", "--workload", "mlp", "--strategy", "checkfreq", "--steps", "6",
                              "--dir", str(tmp_path / "a"), "--remote", url, "--remote-every", "2")
    assert code == 0, err
    trained = out.strip().splitlines()[-1].split()[-1]
    code, out, _ = call_cli(capsys, "inspect", url)
    assert code == 0 and out.startswith(f"{url}: strategy checkfreq") and "full step        6" in out
    assert call_cli(capsys, "verify", url)[:2] == (0, f"{url}: 2 checkpoint(s), all verify\n")
    code, out, _ = call_cli(capsys, "recover", "--dir", url)
    assert code == 0 and out.split()[:2] == ["step", "6,"] and trained in out  # the final state, bitwise
    # The newest remote object replaced by someone with other bytes: verify names it; a new machine
    # falls back to the checkpoint before it
    s3 = boto3.client("s3")
    key = next(k["Key"] for k in s3.list_objects_v2(Bucket=bucket, Prefix="cli/objects/")["Contents"] if "000006" in k["Key"])
    s3.put_object(Bucket=bucket, Key=key, Body=b"not the checkpoint")
    code, out, _ = call_cli(capsys, "verify", url)
    assert code == 1 and "full-000000000006" in out and "1 problem(s)" in out
    with pytest.warns(RuntimeWarning, match="the remote checkpoint of step 6 at .* does not verify"):
        code, out, err = call_cli(capsys, "train", "--workload", "mlp", "--strategy", "checkfreq", "--steps", "6",
                                  "--dir", str(tmp_path / "b"), "--remote", url, "--remote-every", "2", "--json",
                                  str(tmp_path / "b.json"))
    assert code == 0, err
    import json

    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["final_state_sha256"] == trained and 1 < summary["first_step"] <= 6  # resumed before step 6


def test_credentials_the_server_does_not_know_are_one_error_naming_the_url_and_never_the_secret(server, tmp_path,
                                                                                                 monkeypatch):
    from everystep import Checkpointer
    from everystep.eval.workloads import build

    port = free_port()
    proc = _moto(port, INITIAL_NO_AUTH_ACTION_COUNT="0")  # a server that checks every request's signature
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEVERYSTEPWRONG01")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    w = build("mlp", seed=0)
    try:
        with pytest.raises(RemoteStoreError) as refused:
            Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="checkfreq", remote="s3://creds/job")
    finally:
        proc.kill()
        proc.wait()
    message = str(refused.value)
    assert message.startswith("reading s3://creds/job/everystep.json failed: InvalidAccessKeyId")
    assert "check AWS_ACCESS_KEY_ID" in message and SECRET not in message and "AKIAEVERYSTEPWRONG01" not in message


def test_the_bench_runs_each_strategy_with_and_without_the_remote_tier_and_compares_upload_throughput(bucket, tmp_path,
                                                                                                      capsys):
    import json

    from .conftest import call_cli

    out = tmp_path / "b.json"
    code, stdout, err = call_cli(capsys, "bench", "--workload", "mlp", "--strategies", "checkfreq", "--steps", "5",
                                 "--warmup", "1", "--repeats", "1", "--every", "1", "--remote", f"s3://{bucket}/bench",
                                 "--json", str(out))
    assert code == 0, err
    assert "| checkfreq+remote |" in stdout and "boto3's upload_fileobj" in stdout
    report = json.loads(out.read_text())
    tiered = [r for r in report["runs"] if r["strategy"] == "checkfreq+remote"]
    assert tiered and tiered[0]["remote_step"] >= 1 and report["summary"]["checkfreq+remote"]["resumes_bitwise"]
    assert report["upload_throughput"]["everystep_bytes_per_second"] > 0 and report["upload_throughput"]["ratio"] > 0


def test_uploads_in_progress_that_are_not_everysteps_are_left_and_its_own_aborted(bucket, tmp_path):
    """A multipart upload in progress under a key with a space, and one in a folder everystep never
    writes: a writer's start leaves both (no traceback) and aborts the one a killed writer of its own left."""
    import boto3

    from everystep.storage import CheckpointDirectory
    from everystep.storage.remote.tier import RemoteTier

    s3 = boto3.client("s3")
    for key in ("job/objects/a b/full-000000000004.safetensors", "job/notes/full-000000000005.safetensors",
                "job/objects/full-000000000003.safetensors"):  # (each named like an object of everystep's)
        s3.create_multipart_upload(Bucket=bucket, Key=key)
    directory = CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    RemoteTier(RemoteConfig(f"s3://{bucket}/job", every=2, mtbf=3600.0), directory, keep=2).close(upload=False)
    directory.close()
    left = sorted(u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []))
    assert left == ["job/notes/full-000000000005.safetensors", "job/objects/a b/full-000000000004.safetensors"]


def test_a_server_that_cannot_list_uploads_is_used_without_it_with_one_warning(bucket, tmp_path):
    """An S3-compatible server without ListMultipartUploads (``NotImplemented``): the tier starts, and
    says once that what a killed writer left is not collected there."""
    import warnings

    import boto3
    from botocore.exceptions import ClientError

    from everystep.storage import CheckpointDirectory
    from everystep.storage.remote.tier import RemoteTier

    class NoListing(TamperedClient):
        def get_paginator(self, name):
            if name == "list_multipart_uploads":
                raise ClientError({"Error": {"Code": "NotImplemented", "Message": "not here"}}, "ListMultipartUploads")
            return self._client.get_paginator(name)

    url = f"s3://{bucket}/job"
    directory = CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier = RemoteTier(RemoteConfig(url, every=2, mtbf=3600.0), directory, keep=2,
                          store=S3Store(url, s3=NoListing(boto3.client("s3"), lambda head: None)))
        tier.close(upload=False)
    directory.close()
    said = [str(w.message) for w in caught if "cannot list multipart uploads" in str(w.message)]
    assert len(said) == 1 and "NotImplemented" in said[0], [str(w.message) for w in caught]


def test_reading_a_dcp_remote_leaves_no_folder_behind(bucket, tmp_path, capsys, monkeypatch):
    """``inspect``, ``verify`` and ``recover`` of a remote in DCP's format fetch its files into a
    temporary folder: each removes it before it ends."""
    import tempfile

    from .conftest import call_cli

    url = f"s3://{bucket}/dcp"
    code, _, err = call_cli(capsys, "train", "--workload", "mlp", "--strategy", "checkfreq", "--steps", "4",
                            "--dir", str(tmp_path / "a"), "--full-format", "dcp", "--remote", url)
    assert code == 0, err
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for args in (("inspect", url), ("verify", url), ("recover", "--dir", url)):
        code, out, err = call_cli(capsys, *args)
        assert code == 0, (args, err)
        assert list(scratch.iterdir()) == [], args


@pytest.mark.parametrize("forged", [pytest.param("a bad skeleton", marks=pytest.mark.long), "a rank's part"])
def test_a_newest_remote_checkpoint_that_verifies_but_is_malformed_is_passed_over_for_the_one_before(
        tmp_path, bucket, forged):
    """A remote manifest re-signed so that its objects still verify but it is no state: the newest's
    skeleton replaced (a new machine resumes from the remote checkpoint before it, nothing of the
    bad one committed in its directory), or a rank's part of a step after it (not a checkpoint:
    the newest is taken)."""
    import boto3

    url = f"s3://{bucket}/job"
    _job(tmp_path, tmp_path / "first", url, "checkfreq", 6)
    steps = _remote_steps(bucket, "job")
    s3 = boto3.client("s3")
    real = Manifest.from_bytes(s3.get_object(Bucket=bucket, Key=f"job/manifests/full-{steps[-1]:012d}.json")["Body"].read())
    bad = Manifest(kind="full", step=real.step, objects=real.objects, meta={**real.meta, "skeleton": 7}) \
        if forged == "a bad skeleton" else Manifest(kind="full", step=real.step + 1, rank=1, meta=real.meta, objects={})
    s3.put_object(Bucket=bucket, Key=f"job/manifests/{bad.name}.json", Body=bad.to_bytes())
    (resumed,) = _job(tmp_path, tmp_path / "new", url, "checkfreq", 4)
    before = ("remote", steps[-2]) if len(steps) > 1 else (None, 0)  # (the uploads may have put up only the final one)
    assert (resumed["source"], resumed["start"]) == (before if forged == "a bad skeleton" else ("remote", steps[-1]))
    assert forged == "a rank's part" or any("does not read as a state" in m for m in resumed["warned"]), resumed["warned"]


@pytest.mark.parametrize("step", [100, 999_999_999_999])
def test_a_newest_remote_checkpoint_that_does_not_verify_stops_no_upload_after_it(tmp_path, bucket, step):
    """A manifest newer than anything the job made, whose object is not there: the restarted job
    warns once, resumes from its own directory, and still uploads every checkpoint it makes after
    (the remote's newest that verifies is what it holds, not the newest that parses)."""
    import boto3

    url = f"s3://{bucket}/job"
    _job(tmp_path, tmp_path / "first", url, "checkfreq", 6)
    s3 = boto3.client("s3")
    real = Manifest.from_bytes(s3.get_object(Bucket=bucket, Key="job/manifests/full-000000000006.json")["Body"].read())
    objects = {k: ObjectInfo(name=o.name.replace("000000000006", f"{step:012d}"), nbytes=o.nbytes, checksum=o.checksum)
               for k, o in real.objects.items()}
    forged = Manifest(kind="full", step=step, objects=objects, meta=real.meta)
    s3.put_object(Bucket=bucket, Key=f"job/manifests/{forged.name}.json", Body=forged.to_bytes())
    (resumed,) = _job(tmp_path, tmp_path / "first", url, "checkfreq", 12)
    assert (resumed["source"], resumed["start"]) == ("disk", 6)
    assert [m for m in resumed["warned"] if "does not verify" in m] != []
    assert max(s for s in _remote_steps(bucket, "job") if s != step) == 12 and resumed["remote_step"] == 12


# -- what the bucket holds, fuzzed ---------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_bucket(server, tmp_path_factory):
    """A prefix holding a small run's remote checkpoints (the final one, step 4, and one before it), and
    every value there."""
    import boto3

    tmp = tmp_path_factory.mktemp("fuzz-s3")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="fuzz-bucket")
    _job(tmp, tmp / "first", "s3://fuzz-bucket/job", "checkfreq", 4)
    listed = s3.list_objects_v2(Bucket="fuzz-bucket", Prefix="job/")["Contents"]
    return {o["Key"]: s3.get_object(Bucket="fuzz-bucket", Key=o["Key"])["Body"].read() for o in listed}


def _as_made(s3, made: dict[str, bytes]) -> None:
    """The prefix back as the run left it."""
    for o in s3.list_objects_v2(Bucket="fuzz-bucket", Prefix="job/").get("Contents", []):
        if o["Key"] not in made:
            s3.delete_object(Bucket="fuzz-bucket", Key=o["Key"])
    for key, body in made.items():
        s3.put_object(Bucket="fuzz-bucket", Key=key, Body=body)


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .test_hostile import _JSON, _paths, _replace  # noqa: E402


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_in_any_field_of_what_the_bucket_holds_ends_in_a_fallback_or_one_clear_error(fuzz_bucket, data):
    """A field of a remote manifest, of the prefix's marker or of its lock replaced by a random JSON
    value (a manifest and the marker re-signed): recovering from the URL, or taking its lock, ends in
    one of the run's steps or nothing, or in one EverystepError — never another exception, never a
    wait past the lease, never a line of the lock's printed as it is."""
    import warnings

    import boto3

    from everystep.errors import EverystepError
    from everystep.eval.kills.train import recover_run
    from everystep.storage.directory import marker_bytes
    from everystep.storage.remote.lock import RemoteLock

    s3 = boto3.client("s3")
    _as_made(s3, fuzz_bucket)
    key = data.draw(st.sampled_from(sorted(k for k in fuzz_bucket if "/manifests/" in k)
                                    + ["job/everystep.json", "job/writer.lock"]), label="value")
    body = json.loads(fuzz_bucket[key]) if key != "job/writer.lock" else {"holder": "h", "host": "a", "pid": 1, "renewals": 0}
    body.pop("checksum", None)
    path = data.draw(st.sampled_from([p for p in _paths(body) if p]), label="field")
    edited = _replace(body, path, data.draw(_JSON, label="new value"))
    if "/manifests/" in key:
        raw = json.dumps(edited, sort_keys=True, separators=(",", ":")).encode()
        edited["checksum"] = checksum(raw)
        s3.put_object(Bucket="fuzz-bucket", Key=key, Body=json.dumps(edited).encode())
    elif key.endswith("everystep.json"):
        s3.put_object(Bucket="fuzz-bucket", Key=key, Body=marker_bytes(edited) if isinstance(edited, dict) else b"[]")
    else:
        s3.put_object(Bucket="fuzz-bucket", Key=key, Body=json.dumps(edited).encode())
    if key.endswith("writer.lock"):
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            RemoteLock(S3Store("s3://fuzz-bucket/job"), "s3://fuzz-bucket/job", lease=0.3).release()
        assert time.monotonic() - t0 < 0.3 + 0.5 + 5
        assert all("\n" not in str(w.message) and "\x1b" not in str(w.message) for w in caught)
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = recover_run("s3://fuzz-bucket/job")
    except EverystepError:
        return
    made = {int(k.rsplit("-", 1)[1][:12]) for k in fuzz_bucket if "/manifests/" in k}  # (as the uploads fell due)
    assert found["step"] in {0, *made}, (found, made)


def test_the_remote_tiers_settings_are_one_config_and_the_arguments_they_replace_say_so(tmp_path):
    import torch

    from everystep import Checkpointer
    from everystep.errors import ConfigError

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"remote_every is RemoteConfig's every: give remote=RemoteConfig\(url, every"):
        Checkpointer(tmp_path / "c", model, opt, remote="s3://bucket/job", remote_every=2)
    with pytest.raises(ConfigError, match="remote must be an s3://bucket/prefix URL or a RemoteConfig, got int"):
        Checkpointer(tmp_path / "c", model, opt, remote=3)
    assert not (tmp_path / "c").exists()  # (refused before anything was made)
    for bad, match in ((dict(every=0), "RemoteConfig.every must be a positive number of steps or None, got 0"),
                       (dict(lease=-1.0), "RemoteConfig.lease must be a positive number of seconds, got -1.0"),
                       (dict(mtbf=True), "RemoteConfig.mtbf must be a positive number of seconds, got True")):
        with pytest.raises(ConfigError, match=match):
            RemoteConfig("s3://bucket/job", **bad)
    with pytest.raises(ConfigError, match="remote must be an s3://bucket/prefix URL, got '/tmp/job'"):
        RemoteConfig("/tmp/job")
