"""Replicas on peers: two hosts on loopback, each a ``torchrun`` of its own (elastic rendezvous,
restarts allowed) with its own scratch memory; a host lost — its torchrun and its training
processes SIGKILLed together at an instant drawn from the seed — and a replacement host started
with an empty scratch directory (:mod:`everystep.eval.kills.lost_hosts`). The job recovers from the survivors'
memory, bitwise."""

from __future__ import annotations

import random

import pytest

from everystep.eval.kills.lost_hosts import PHASES, TwoHosts, final_hashes, lose_hosts, rank0_losses
from everystep.eval.kills.train import TrainConfig, run
from everystep.peers import Holdings, Transfer, buddies, pack, plan_recovery, share_out, unpack
from everystep.errors import CorruptCheckpointError


def _reference(steps: int, local: int, parallel: str = "ddp") -> dict:
    return run(TrainConfig(workload="gpt2-tiny", strategy="none", steps=steps, nproc=2 * local, max_nproc=4,
                           parallel=parallel, progress=False))


def _plan(steps: int, losses: int, seed: int = 1) -> list[tuple[int, tuple[int, ...]]]:
    """``losses`` losses of one host, at steps and of hosts drawn from the seed."""
    rng = random.Random(seed)
    return [(4 + (i + 1) * (steps - 8) // (losses + 1) + rng.randint(-2, 2), (rng.randrange(2),)) for i in range(losses)]


def _assert_bitwise(job: TwoHosts, reference: dict) -> None:
    assert rank0_losses(job) == reference["losses"]
    assert final_hashes(job) == reference["rank_state_sha256"]


LONG = pytest.mark.long  # (make test-long: each restart of a host starts a torchrun and its ranks anew)


@pytest.mark.parametrize("strategy, local, parallel, steps, losses", [
    ("lightcheck", 1, "fsdp", 14, 1), pytest.param("lowdiff_plus", 1, "fsdp", 14, 1, marks=LONG),
    pytest.param("lowdiff_plus", 1, "ddp", 14, 1, marks=LONG), pytest.param("lightcheck", 1, "ddp", 30, 5, marks=LONG), pytest.param("lightcheck", 2, "ddp", 14, 1, marks=LONG),
    pytest.param("lowdiff_plus", 1, "ddp", 30, 5, marks=LONG), pytest.param("lowdiff_plus", 2, "ddp", 14, 1, marks=LONG),
    pytest.param("lowdiff_plus", 1, "fsdp", 30, 5, marks=LONG),
])
def test_a_host_lost_again_and_again_recovers_from_its_peers_memory_bitwise(tmp_path, strategy, local, parallel, steps,
                                                                             losses):
    """Two hosts of ``local`` ranks each, with peers; a host (its torchrun, training processes and
    checkpoint agents) lost at steps drawn from the seed. Storage holds no full checkpoint past step
    0 until the end (lightcheck's ``persist_every``, lowdiff_plus's ``every`` past the run), so every
    restart's state came from memory: lightcheck's regions and mirrors, lowdiff_plus's agents. Under
    FSDP2 nothing is replicated: the lost rank's shards come whole from its buddy's mirror (for
    lowdiff_plus, the buddy's agent's replica of the lost rank, brought forward by its gradient shards)."""
    reference = _reference(steps, local, parallel)
    job = TwoHosts(tmp_path, local=local, strategy=strategy, steps=steps, parallel=parallel)
    found = lose_hosts(job, _plan(steps, losses))
    own = "region" if strategy == "lightcheck" else "memory"
    for loss in found:
        assert len(loss.starts) == 2 * local and loss.resumed > 0, loss
        # the survivors from their own memory, the replacements from their buddies' (a survivor
        # renumbered by the rendezvous puts its new rank's state together from its host's memory)
        assert all(s["source"] == own or s["source"].startswith("peer memory (host ") for s in loss.starts), loss
        assert any(s["source"].startswith("peer memory") for s in loss.starts), loss
        assert loss.resumed >= loss.reached - 2, loss  # at most the step in flight and the one being committed
        assert all(s["read_bytes"] == 0 for s in loss.starts), loss  # no object read from storage
        for s in loss.starts:  # each phase of the start logged, in order, after the host was replaced
            ends = [s["phases"][name] for name in PHASES]
            assert loss.replaced_at - 1 <= ends[0] and ends == sorted(ends) and ends[-1] <= s["at"], s
    _assert_bitwise(job, reference)
    manifests = sorted(int(p.name.split("-")[1].split(".")[0]) for p in (job.shared / "manifests").glob("full-*"))
    assert manifests in ([steps], [0, steps])  # (lowdiff_plus's agents persist the state they start from)


@LONG
def test_both_hosts_lost_recover_from_storage_bitwise(tmp_path, monkeypatch):
    """One host lost (peer memory), then both at once: no memory survives, and the job resumes from
    the newest full checkpoint (``persist_every`` 5), bitwise. Every step's mirroring is slowed down
    (0.15 s): the region must not run ahead of the mirrors, or the first loss finds no step that both
    hold and goes to storage."""
    monkeypatch.setenv("EVERYSTEP_DELAY", "peers.mirror:1+=0.15,store.region.before_header:1+=0.1")
    steps = 16
    reference = _reference(steps, 1)
    job = TwoHosts(tmp_path, local=1, strategy="lightcheck", steps=steps, persist_every=5)
    one, both = lose_hosts(job, [(5, (1,)), (11, (0, 1))])
    assert any(s["source"].startswith("peer memory") for s in one.starts)
    assert {s["source"] for s in both.starts} == {"disk"}, both.starts
    assert all(s["read_bytes"] > 0 for s in both.starts)  # (what the other test's zero would miss)
    assert both.resumed % 5 == 0 and both.reached - 6 <= both.resumed <= both.reached
    _assert_bitwise(job, reference)


@pytest.mark.parametrize("hosts, expected", [
    (["a", "a", "b", "b"], [2, 3, 0, 1]),
    (["a", "b", "c"], [1, 2, 0]),
    (["a", "b", "b"], [1, 0, 0]),  # one rank on a: it mirrors both of b's
    (["a", "a"], [None, None]),
])
def test_each_rank_mirrors_to_a_rank_on_the_next_host(hosts, expected):
    assert buddies(hosts) == expected


@pytest.mark.parametrize("hosts, expected", [
    (["a", "a", "b", "b"], [[0, 2], [1, 3], [0, 2], [1, 3]]),
    (["a", "b", "b"], [[0, 1, 2], [0, 1], [2]]),  # a's one process reads all a holds
])
def test_the_ranks_of_a_host_share_out_its_memory_each_reading_its_own(hosts, expected):
    got = [share_out(hosts, me) for me in range(len(hosts))]
    assert got == expected
    for host in set(hosts):  # a host's memory (anyone's state, after a renumbering) read once, in all
        read = sorted(k for me, h in enumerate(hosts) if h == host for k in got[me])
        assert read == list(range(len(hosts)))
    assert all(me in mine for me, mine in enumerate(got))


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


def _replica_of(model, optimizer, step):
    """An agent's replica of ``model`` and ``optimizer`` at ``step``, in a region of its own."""
    from everystep.agent.replica import Replica, optimizer_class_path
    from everystep.layout import TensorLayout
    from everystep.transport.shared import SharedRegion
    from everystep.tree import flatten

    tensors, skeleton = flatten({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
    region, buffer = SharedRegion.holding(TensorLayout.of(tensors))
    for k, t in tensors.items():
        buffer.views[k].copy_(t)
    keys = [f"/model/{name}" for name, _ in model.named_parameters()]
    return Replica(step=step, region=region, layout=buffer.layout, skeleton=skeleton, index_keys=keys,
                   optimizer_class=optimizer_class_path(optimizer))


def test_a_wards_replica_serves_its_step_and_the_one_held_back_and_applies_that_one_only_when_asked():
    """Replicas on peers under sharding: the buddy's agent keeps the ward's newest step unapplied, as
    its own, so that it serves both; asked for the newer, it applies it, and equals the ward's state."""
    import torch

    from everystep.agent.replica import WardReplica
    from everystep.agent.replica import slot_layout
    from everystep.state import group_scalars
    from everystep.transport.shared import SharedRegion

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # (the optimizer's state exists: a replica starts from a state that has it)
    ward = WardReplica(_replica_of(model, optimizer, 1), "fits")
    assert ward.served() == [1]

    def step(n):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        grads = {i: p.grad.clone() for i, p in enumerate(model.parameters())}
        layout = slot_layout(grads, {})
        region, buffer = SharedRegion.holding(layout)
        for i, g in grads.items():
            buffer.views[f"g/{i}"].copy_(g)
        optimizer.step()
        ward.arrive({"step": n, "layout": layout, "groups": group_scalars(optimizer), "skipped": False,
                     "has_grad": list(grads), "skeleton": {"step": n}}, region)

    step(2)
    assert ward.served() == [1, 2]
    step(3)  # step 2 applied as step 3 arrives
    assert ward.served() == [2, 3] and ward.replica.step == 2
    with pytest.raises(ValueError, match="the ward's replica is at step 2 and cannot serve step 1"):
        ward.at(1)
    assert ward.at(2).step == 2 and ward.served() == [2, 3]  # the older asked for: nothing applied
    got = ward.at(3)
    assert got.step == 3 and ward.served() == [3]
    live = {f"/model/{name}": p.detach() for name, p in model.named_parameters()}
    assert all(torch.equal(got.tensors[k], t) for k, t in live.items())
    ward.close()


def test_a_step_a_wards_replica_cannot_take_drops_that_replica_not_the_agent(capsys):
    """The agent serves its own rank first: a ward's step that does not fit its replica (another
    shape: a peer's bug) drops the ward's replica, with a line on stderr, and the agent goes on."""
    import torch

    from everystep.agent.process import Agent
    from everystep.agent.replica import WardReplica
    from everystep.agent.replica import slot_layout
    from everystep.transport.shared import SharedRegion

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = Agent.__new__(Agent)  # (its ward replicas only: no directory, no connection)
    agent._wards = {1: WardReplica(_replica_of(model, optimizer, 5), "fits")}
    wrong = {0: torch.zeros(2, 2), 1: torch.zeros(3)}
    for step in (6, 7):  # step 6 is held back; step 7's arrival applies it, and it does not fit
        region, _ = SharedRegion.holding(slot_layout(wrong, {}))
        with agent._ward_failure({"ward": 1}, region, f"step {step}"):
            agent._wards[1].arrive({"step": step, "layout": slot_layout(wrong, {}), "groups": [{"lr": 0.1}],
                                    "skipped": False, "has_grad": [0, 1], "skeleton": {"step": step}}, region)
    assert agent._wards == {}
    assert "the replica of rank 1 could not take its step 7, and is dropped" in capsys.readouterr().err


def test_what_a_ward_sends_of_its_step_is_checked_before_its_buddys_agent_takes_it():
    import torch

    from everystep.strategies.mirrors import _ward_keys, _ward_step

    tensors = {"g/0": torch.zeros(3), "/model/w": torch.zeros(3)}
    good = {"groups": [{"lr": 0.1}], "skipped": False, "has_grad": [0]}
    assert _ward_step(good, tensors, 1) == ([{"lr": 0.1}], False, [0])
    assert _ward_keys(["/model/w"], tensors, 1) == ["/model/w"]
    for bad in ({**good, "has_grad": [1]}, {**good, "has_grad": ["0"]}, {**good, "skipped": 0},
                {**good, "groups": {"lr": 0.1}}, {k: v for k, v in good.items() if k != "groups"}):
        with pytest.raises(CorruptCheckpointError, match="rank 1 sent a step that is not one"):
            _ward_step(bad, tensors, 1)
    for bad in (["/model/v"], "/model/w", [0]):
        with pytest.raises(CorruptCheckpointError, match="rank 2 sent its state with parameter keys"):
            _ward_keys(bad, tensors, 2)


def test_a_size_a_peer_announces_is_refused_below_a_header_and_above_the_free_memory():
    import psutil
    import torch

    from everystep.peers.wire import _size

    assert _size(torch.tensor([4096], dtype=torch.int64), 1) == 4096
    with pytest.raises(CorruptCheckpointError, match="rank 1 announced a state of 2 bytes"):
        _size(torch.tensor([2], dtype=torch.int64), 1)
    huge = psutil.virtual_memory().total * 2
    with pytest.raises(CorruptCheckpointError, match=f"rank 3 announced a state of {huge} bytes, more than the"):
        _size(torch.tensor([huge], dtype=torch.int64), 3)


def test_a_mirror_another_directory_made_is_not_written_over(tmp_path, monkeypatch):
    from everystep.storage.region.slots import Region

    from .test_distributed import _spawn_two

    mirror = tmp_path / "scratch" / "region-0.bin.mirror"  # where rank 1, rank 0's buddy, keeps rank 0's part
    mirror.parent.mkdir(mode=0o700)
    Region.open(mirror, owner="another-run").close()
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


def test_an_agent_of_another_host_is_not_taken_for_this_hosts(tmp_path, recwarn):
    import os

    from everystep.agent.channel import AgentAddress
    from everystep.agent.client import AgentLink

    AgentAddress(address="\0everystep-test-none", authkey="k", pid=os.getpid(), host="host a").publish(tmp_path)
    assert AgentLink.find(tmp_path, host="host b") is None
    assert not recwarn.list  # (another host's agent is not "silent": it is not this host's to reach)
    with pytest.warns(RuntimeWarning, match="did not answer"):  # the same file, read on its own host
        assert AgentLink.find(tmp_path, host="host a") is None
