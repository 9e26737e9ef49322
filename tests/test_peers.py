"""Replicas on peers: two hosts on loopback, each a ``torchrun`` of its own (elastic rendezvous,
restarts allowed) with its own scratch memory; a host lost — its torchrun and its training
processes SIGKILLed together at an instant drawn from the seed — and a replacement host started
with an empty scratch directory. The job recovers from the survivors' memory, bitwise."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from everystep.distributed import free_port
from everystep.eval.train import TrainConfig, run
from everystep.peers import Holdings, Transfer, buddies, pack, plan_recovery, unpack
from everystep.errors import CorruptCheckpointError

from .conftest import ROOT

_RANK = """
import json, os, sys, time
import torch.distributed as dist
from everystep import Checkpointer
from everystep.eval.train import training_state_hash
from everystep.eval.workloads import build

shared, scratch, strategy, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
w = build("gpt2-tiny", seed=0, optimizer="adamw", rank=rank, world=world)
ckpt = Checkpointer(shared, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=strategy,
                    region=os.path.join(scratch, "region-{rank}.bin"), peers=True, persist_every=1000)
start = ckpt.restore()
source = ckpt.recovered.source if ckpt.recovered else None
with open(os.path.join(scratch, f"events-{os.getpid()}.jsonl"), "a") as log:
    log.write(json.dumps({"rank": rank, "start": start, "source": source, "at": time.time(),
                          "read": ckpt.catalog_bytes_read if hasattr(ckpt, "catalog_bytes_read") else None}) + "\\n")
    log.flush()
    for step in range(start + 1, steps + 1):
        loss = w.loss(w.data.next())
        loss.backward()
        w.update()
        log.write(json.dumps({"rank": rank, "step": step, "loss": loss.item(), "at": time.time()}) + "\\n")
        log.flush()
ckpt.close()
final = {"step": steps, **ckpt.components.capture(), **ckpt.components.capture_boundary()}
with open(os.path.join(shared, f"final-r{rank}.json"), "w") as f:
    json.dump({"hash": training_state_hash(final)}, f)
dist.destroy_process_group()
"""


class _Hosts:
    """Two hosts of ``local`` ranks each, one job: a torchrun per host, the rendezvous store held
    by this process (so that losing either host leaves it)."""

    def __init__(self, tmp: Path, local: int, strategy: str, steps: int) -> None:
        self.tmp, self.local, self.strategy, self.steps = tmp, local, strategy, steps
        self.shared = tmp / "shared"
        self.script = tmp / "rank.py"
        self.script.write_text(_RANK)
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False)
        self.hosts: list[tuple[subprocess.Popen, Path, float]] = []
        self.scratches: list[Path] = []
        self.started = [self.start(i) for i in range(2)]

    def start(self, index: int) -> int:
        scratch = self.tmp / f"host{index}-{len(self.scratches)}"
        scratch.mkdir()
        self.scratches.append(scratch)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # each rendezvous round makes its own store
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(self.local),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "job",
               "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120",
               "--max-restarts", "20", "--monitor-interval", "0.1",
               str(self.script), str(self.shared), str(scratch), self.strategy, str(self.steps)]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=open(f"{scratch}.log", "w"),
                                stderr=subprocess.STDOUT)
        entry = (proc, scratch, time.time())
        if index < len(self.hosts):
            self.hosts[index] = entry
        else:
            self.hosts.append(entry)
        return index

    def events(self) -> list[dict]:
        found = []
        for scratch in self.scratches:
            for path in scratch.glob("events-*.jsonl"):
                found += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return found

    def newest_step(self) -> int:
        return max((e["step"] for e in self.events() if "step" in e), default=0)

    def lose(self, index: int) -> None:
        """SIGKILL host ``index``: its torchrun and every process under it."""
        proc = self.hosts[index][0]
        doomed = _descendants(proc.pid)
        for pid in [proc.pid, *doomed]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def wait(self, timeout: float) -> None:
        for proc, scratch, _ in self.hosts:
            assert proc.wait(timeout) == 0, Path(f"{scratch}.log").read_text()[-4000:]

    def close(self) -> None:
        for proc, _, _ in self.hosts:
            if proc.poll() is None:
                self.lose(self.hosts.index(next(h for h in self.hosts if h[0] is proc)))


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.parametrize("local", [1, 2])
def test_a_host_lost_again_and_again_recovers_from_its_peers_memory_bitwise(tmp_path, local):
    """Two hosts of ``local`` ranks each (DDP), lightcheck with peers; five losses of a host drawn
    from the seed. The checkpoint directory holds no full checkpoint until the end (``persist_every``
    past the run), so every restart's state came from memory."""
    steps, losses = 40, 5
    reference = run(TrainConfig(workload="gpt2-tiny", strategy="none", steps=steps, nproc=2 * local, max_nproc=4,
                                progress=False))
    rng = random.Random(1)
    job = _Hosts(tmp_path, local, "lightcheck", steps)
    try:
        lost = []
        for i in range(losses):
            # a step drawn from the seed, and at least two steps after the restart from the last loss
            target = max(4 + (i + 1) * (steps - 8) // (losses + 1) + rng.randint(-2, 2), (lost or [0])[-1] + 2)
            while job.newest_step() < target:
                assert all(p.poll() is None for p, _, _ in job.hosts), "a host ended before it was lost"
                time.sleep(0.02)
            victim = rng.randrange(2)
            job.lose(victim)
            lost.append(job.newest_step())
            job.start(victim)
        job.wait(240)
    finally:
        job.close()
    events = job.events()
    starts = sorted((e for e in events if "start" in e), key=lambda e: e["at"])
    restarts = [e for e in starts if e["start"] > 0]
    assert len(restarts) >= losses * 2 * local
    # Each loss: the survivor from its own region, the replacement from its buddy's mirror.
    assert all(e["source"] == "region" or e["source"].startswith("peer memory (host ") for e in restarts)
    assert sum(e["source"].startswith("peer memory") for e in restarts) >= losses
    for done in lost:  # steps lost at each loss: at most the one in flight and the one being committed
        resumed = min(e["start"] for e in restarts if e["start"] >= done - 2)
        assert resumed >= done - 2
    timeline: dict[int, float] = {}
    for e in sorted((e for e in events if "step" in e and e["rank"] == 0), key=lambda e: e["at"]):
        timeline[e["step"]] = e["loss"]  # the last lifetime to take a step is the one that led on
    assert [timeline[s] for s in range(1, steps + 1)] == reference["losses"]
    finals = [json.loads((job.shared / f"final-r{r}.json").read_text())["hash"] for r in range(2 * local)]
    assert finals == reference["rank_state_sha256"]
    manifests = sorted(p.name for p in (job.shared / "manifests").glob("full-*"))
    assert len(manifests) == 1 and f"{steps:012d}" in manifests[0]  # the final checkpoint alone: storage was never read


@pytest.mark.parametrize("hosts, expected", [
    (["a", "a", "b", "b"], [2, 3, 0, 1]),
    (["a", "b", "c"], [1, 2, 0]),
    (["a", "b", "b"], [1, 0, 0]),  # one rank on a: it mirrors both of b's
    (["a", "a"], [None, None]),
])
def test_each_rank_mirrors_to_a_rank_on_the_next_host(hosts, expected):
    assert buddies(hosts) == expected


def _held(host, region, mirror):
    return Holdings(host, region, mirror)


def test_the_ranks_take_the_newest_step_every_ranks_state_can_be_put_together_at():
    survivor = _held("a", {0: [9, 10]}, {1: [9, 10]})
    replacement = _held("b", {1: []}, {0: []})  # a new host: an empty scratch
    assert plan_recovery([survivor, replacement], -1) == (10, [Transfer(0, 1, "own", "mirror", 1),
                                                               Transfer(0, 1, "replicated", "region", 0)])
    assert plan_recovery([survivor, replacement], 10) is None  # storage holds a step as new
    # A mirror one step behind: the step both have.
    assert plan_recovery([_held("a", {0: [9, 10]}, {1: [8, 9]}), replacement], -1)[0] == 9
    # Both hosts lost: nothing in memory.
    assert plan_recovery([_held("c", {}, {}), _held("d", {}, {})], -1) is None
    # Ranks renumbered at the restart: the new rank 1 holds rank 0's region (rank 0 takes it whole),
    # and its own part in a mirror (the rest it reads from that region, here).
    assert plan_recovery([_held("b", {}, {}), _held("a", {0: [7]}, {1: [7]})], -1) == (
        7, [Transfer(1, 0, "whole", "region", 0)])


def test_a_state_from_a_peer_is_checked_before_it_is_used():
    import torch

    tensors = {"/rng/cpu": torch.arange(10, dtype=torch.uint8), "/data/index": torch.tensor([3], dtype=torch.int64)}
    buffer = pack(4, 1, tensors, {"step": 4, "rng": {"__tensor__": "/rng/cpu"}})
    step, rank, got, skeleton = unpack(buffer.clone(), sender=1)
    assert (step, rank) == (4, 1) and all(torch.equal(got[k], tensors[k]) for k in tensors)
    flipped = buffer.clone()
    flipped[-1] ^= 1
    with pytest.raises(CorruptCheckpointError, match="rank 1 sent: tensor '/data/index' fails its checksum"):
        unpack(flipped, sender=1)
    with pytest.raises(CorruptCheckpointError, match="the state rank 1 sent is unreadable"):
        unpack(buffer[:-3].clone(), sender=1)
    with pytest.raises(CorruptCheckpointError, match="rank 1 sent the state of rank 1 at step 4 for that of rank 1 at step 5"):
        unpack(buffer.clone(), sender=1, expect=(5, 1))


def test_a_mirror_another_directory_made_is_not_written_over(tmp_path, monkeypatch):
    from everystep.storage.region import RegionStore

    from .test_distributed import _spawn_two

    mirror = tmp_path / "scratch" / "region-0.bin.mirror"  # where rank 1, rank 0's buddy, keeps rank 0's part
    mirror.parent.mkdir(mode=0o700)
    RegionStore.open(mirror, owner="another-run").close()
    before = mirror.read_bytes()
    monkeypatch.setenv("EVERYSTEP_COLLECTIVE_TIMEOUT", "20")  # (rank 0 waits for rank 1 in vain)
    out = _spawn_two(f"""
import os, torch, torch.distributed as dist
os.environ["EVERYSTEP_HOST"] = "host " + os.environ["RANK"]
from everystep import Checkpointer
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
try:
    Checkpointer({str(tmp_path / "c")!r}, model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="lightcheck",
                 region={str(tmp_path / "scratch" / "region-{rank}.bin")!r}, peers=True).close()
except Exception as e:
    print(dist.get_rank(), type(e).__name__, e)
""")
    assert f"1 CheckpointDirectoryError the mirror {mirror} belongs to another checkpoint directory" in out, out
    assert mirror.read_bytes() == before
