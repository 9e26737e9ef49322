"""LowDiff+: the agent's replica, recovery from its memory, fallbacks and the agent's lifecycle."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
import torch

from everystep import Checkpointer, _faults
from everystep.agent.channel import AgentAddress, message, send
from everystep.agent.client import AgentLink
from everystep.agent.session import AgentSession
from everystep.background import BackgroundErrors
from everystep.distributed import Ranks
from everystep.errors import BackgroundWriteError, ConfigError, StateMismatchError
from everystep.eval.kills.summary import summarise
from everystep.eval.kills.train import WORKER, Journal, TrainConfig, run, training_state_hash, worker_argv
from everystep.eval.zygote import Zygote
from everystep.eval.workloads import build
from everystep.recovery import latest_full
from everystep.tree import state_hash
from everystep.storage import CheckpointDirectory

pytestmark = pytest.mark.timeout(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _agent_pid(directory: Path) -> int:
    address = AgentAddress.find(directory)
    assert address is not None, "no agent.json"
    return address.pid


def _train(w, steps: int, *, clip: bool = True) -> None:
    for _ in range(steps):
        loss = w.loss(w.data.next())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
        w.optimizer.step()
        w.optimizer.zero_grad()
        w.scheduler.step()


def _live_hash(w, step: int) -> str:
    return state_hash({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict(),
                       "scheduler": w.scheduler.state_dict(), "data": w.data.state_dict(), "step": step})


def _stored_hash(tree) -> str:
    return state_hash({k: tree[k] for k in ("model", "optimizer", "scheduler", "data", "step")})


def _attach(w, directory: Path, **options) -> Checkpointer:
    return Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                        strategy="lowdiff_plus", **options)


def _assert_stored(directory: Path, w, step: int) -> None:
    """The newest full checkpoint is S_step of the live objects, bitwise."""
    manifest, tree = latest_full(CheckpointDirectory.open(directory))
    assert manifest.step == step and _stored_hash(tree) == _live_hash(w, step)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_replica_equals_the_live_state_bitwise_after_every_step(tmp_path, overlap):
    w = build("gpt2-tiny", seed=0, optimizer="adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a divergence would be a RuntimeWarning
        with _attach(w, tmp_path / "c", every=4, verify_every=1, verify_sample=0, overlap=overlap) as ckpt:
            ckpt.restore()
            _train(w, 9)
            pid = _agent_pid(tmp_path / "c")
    assert ckpt.stats.last_memory_step == 9 and ckpt.stats.checkpoints == 9
    assert _gone_within(pid, 10), "the agent outlived a clean close"
    assert not (tmp_path / "c" / "agent.json").exists()
    _assert_stored(tmp_path / "c", w, 9)


@pytest.mark.parametrize("clip", [False, True])
def test_gradients_are_copied_during_backward_until_clipping_changes_them_every_step(tmp_path, clip):
    # Clipping multiplies every gradient in place: the copies made during backward are made again at
    # the step, and after two such steps only the copies at the step remain. The replica stays exact.
    w = build("mlp", seed=0, optimizer="adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a divergence would be a RuntimeWarning
        with _attach(w, tmp_path / "c", every=100, verify_every=1, verify_sample=0) as ckpt:
            ckpt.restore()
            _train(w, 5, clip=clip)
    s, n = ckpt.strategy, len(list(w.model.parameters()))
    assert (s.early_copies, s.recopies, s.layerwise) == ((2 * n, 2 * n, False) if clip else (5 * n, 0, True))
    _assert_stored(tmp_path / "c", w, 5)


def _accumulate(w, steps: int, *, micro: int) -> None:
    """Steps of ``micro`` backward passes each, the gradients zeroed in place (set_to_none=False)."""
    for _ in range(steps):
        for _ in range(micro):
            w.loss(w.data.next()).backward()
        w.optimizer.step()
        w.optimizer.zero_grad(set_to_none=False)
        w.scheduler.step()


def test_with_overlap_gradients_changed_in_place_after_the_step_wait_for_their_copies(tmp_path, monkeypatch):
    # The copies of a step are still running when the step ends; the gradients then change in place
    # twice before the next update (zero_grad without set_to_none, then accumulation over three
    # backward passes). Each copy is slowed so that it is still under way when they do: the guard
    # must hold them back, or the slot would hold zeros or the next step's gradients.
    from everystep.capture import grads
    copy = grads.GradientCapture._copy_all_into

    def slow(self, *args):
        time.sleep(0.05)  # (a slow copy, not synchronisation: the guard is what is tested)
        return copy(self, *args)

    monkeypatch.setattr(grads.GradientCapture, "_copy_all_into", slow)
    w = build("mlp", seed=0, optimizer="adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a divergence would be a RuntimeWarning
        with _attach(w, tmp_path / "c", every=100, verify_every=1, verify_sample=0, overlap=True) as ckpt:
            ckpt.restore()
            _accumulate(w, 6, micro=3)
            assert vars(w.optimizer)["zero_grad"] is not None  # guarded while attached
    assert "zero_grad" not in vars(w.optimizer) and "zero_grad" not in vars(w.model)
    assert ckpt.stats.last_memory_step == 6
    _assert_stored(tmp_path / "c", w, 6)


def test_overlap_is_refused_where_the_gradients_must_be_in_the_slot_at_the_step(tmp_path):
    w = build("mlp", seed=0, optimizer="adam")
    with pytest.raises(ConfigError, match="overlap=True with peers=True"):
        _attach(w, tmp_path / "c", overlap=True, peers=True)


def test_a_divergence_is_reported_and_repaired(tmp_path):
    w = build("mlp", seed=0, optimizer="adam")
    with _attach(w, tmp_path / "c", every=100, verify_every=1, verify_sample=16) as ckpt:
        ckpt.restore()
        _train(w, 2)
        with torch.no_grad():
            next(w.model.parameters()).view(-1)[0] += 1.0  # a change the optimizer did not make
        _train(w, 1)
        ckpt.wait()
        with pytest.warns(RuntimeWarning, match="replica diverged from the live state .*step 2.*sending it the full state"):
            _train(w, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _train(w, 2)
    _assert_stored(tmp_path / "c", w, 6)


def _reference(tmp_path: Path, **kw) -> dict:
    return run(TrainConfig(workload="mlp", strategy="none", optimizer="adamw", **kw))


KILL_POINTS = ("lowdiff_plus.gradients.copy", "lowdiff_plus.update", "lowdiff_plus.step.before_send",
               "lowdiff_plus.step.sent")
"""Where a training process of lowdiff_plus is killed: mid-copy of the gradients (on the copier
thread, the update running), before the update, with the slot filled but the agent not told, and
with the agent told but the slot not handed over."""


def test_sigkill_at_20_instants_recovers_from_memory_bit_exactly(tmp_path):
    """The training process is killed 20 times — in the middle of the gradients' copy, an update, a
    message — at a random step each time, and restarted; every restart takes the replica from the
    agent. Each lifetime is killed by an armed crash point (SIGKILL, as from outside): 20 kills on
    any machine. Every other lifetime hands its slots over after their copies (``overlap``)."""
    steps, lifetimes = 120, 20
    cfg = TrainConfig(workload="mlp", strategy="lowdiff_plus", optimizer="adamw", steps=steps,
                      directory=str(tmp_path / "c"), options={"verify_every": 1, "verify_sample": 0}, progress=False)
    journal = tmp_path / "journal.jsonl"
    rng = random.Random(0)
    kills = [(KILL_POINTS[i % len(KILL_POINTS)], rng.randint(1, 5)) for i in range(lifetimes)]
    with Zygote(WORKER) as zygote:  # each lifetime forked from one process that imported torch (as `everystep train` does)
        for i, kill in enumerate([*kills, None]):  # the last lifetime runs to the end
            env = dict(os.environ)
            if kill is not None:
                env["EVERYSTEP_CRASH"] = f"{kill[0]}:{kill[1]}"  # SIGKILL at that point's kill[1]-th arrival
            life = dataclasses.replace(cfg, options={**cfg.options, "overlap": i % 2 == 1})
            code = zygote.fork(env, worker_argv(life, str(journal))).wait()
            assert code == (-signal.SIGKILL if kill else 0), f"killed at {kill}: exit status {code}"
    records = Journal.read(str(journal))
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == lifetimes + 1
    for before, after in zip(starts, starts[1:]):
        done = max((r["step"] for r in records if r["event"] == "step" and _pid_of(records, r) == before["pid"]),
                   default=before["resumed_from"])
        assert after["source"] == "memory", after
        assert after["resumed_from"] >= done - 1, f"lost more than one step: finished {done}, resumed {after['resumed_from']}"
    summary = summarise(cfg, records)
    reference = _reference(tmp_path, steps=steps)
    assert summary["losses"] == reference["losses"]
    assert summary["final_state_sha256"] == reference["final_state_sha256"]
    assert _gone_within(_agent_pid_or(tmp_path / "c"), 30)


def _records(path: Path) -> list[dict]:
    return Journal.read(str(path)) if path.exists() else []


def _pid_of(records: list[dict], record: dict) -> int:
    """The pid of the lifetime a journal record belongs to (the newest start before it)."""
    pid = 0
    for r in records:
        if r["event"] == "start":
            pid = r["pid"]
        if r is record:
            return pid
    return pid


def _agent_pid_or(directory: Path) -> int:
    address = AgentAddress.find(directory)
    return address.pid if address else 2**22 + 1


@pytest.mark.parametrize("mode,compress", [("hardware", None), ("software", "topk:0.01")])
def test_failures_in_both_modes_dense_and_compressed(tmp_path, mode, compress):
    cfg = TrainConfig(workload="mlp", strategy="lowdiff_plus", optimizer="adamw", steps=14, every=3,
                      directory=str(tmp_path / "c"), fail_at=(8,), fail_mode=mode, compress=compress, progress=False)
    summary = run(cfg)
    reference = _reference(tmp_path, steps=14, compress=compress)
    assert summary["losses"] == reference["losses"]
    assert summary["final_state_sha256"] == reference["final_state_sha256"]
    sources = {r["source"] for r in summary["recoveries"]}
    assert sources == ({"disk"} if mode == "hardware" else {"memory"})


def _spawn_trainer(tmp_path: Path, *, steps: int, options: dict, every: int | None = None) -> subprocess.Popen:
    cfg = TrainConfig(workload="mlp", strategy="lowdiff_plus", optimizer="adamw", steps=steps, every=every,
                      directory=str(tmp_path / "c"), options=options, progress=False)
    return subprocess.Popen([sys.executable, "-m", "everystep.eval.kills.worker",
                             *worker_argv(cfg, str(tmp_path / "journal.jsonl"))], start_new_session=True)


def _wait_for_steps(tmp_path: Path, n: int, proc: subprocess.Popen) -> None:
    while sum(r["event"] == "step" for r in _records(tmp_path / "journal.jsonl")) < n:
        assert proc.poll() is None, "the trainer ended early"
        time.sleep(0.02)


def test_an_orphaned_agent_persists_its_newest_step_and_exits_after_the_grace_period(tmp_path):
    proc = _spawn_trainer(tmp_path, steps=10_000, options={"grace": 1.0}, every=1000)
    _wait_for_steps(tmp_path, 5, proc)
    pid = _agent_pid(tmp_path / "c")
    proc.kill()
    proc.wait()
    assert _gone_within(pid, 30), "the agent outlived its training process"
    assert not (tmp_path / "c" / "agent.json").exists()
    done = max(r["step"] for r in _records(tmp_path / "journal.jsonl") if r["event"] == "step")
    manifest, _ = latest_full(CheckpointDirectory.open(tmp_path / "c"))
    assert manifest.step >= done - 1


def test_a_killed_agent_leaves_training_on_disk_checkpoints(tmp_path):
    w = build("mlp", seed=0, optimizer="adamw")
    with _attach(w, tmp_path / "c", every=4) as ckpt:
        ckpt.restore()
        _train(w, 3)
        ckpt.wait()
        os.kill(_agent_pid(tmp_path / "c"), signal.SIGKILL)
        with pytest.warns(RuntimeWarning, match="checkpoint agent .* is lost: .*writes full checkpoints every 4 steps"):
            _train(w, 6)
    _assert_stored(tmp_path / "c", w, 9)


def test_a_failed_write_in_the_agent_surfaces_in_the_training_process(tmp_path, monkeypatch):
    monkeypatch.setenv("EVERYSTEP_FAIL", "store.object.mid_write:2")  # the agent's second write: step 2
    w = build("mlp", seed=0, optimizer="adamw")
    ckpt = _attach(w, tmp_path / "c", every=2)
    ckpt.restore()
    _train(w, 2)
    loss = w.loss(w.data.next())  # S_2 goes to the agent with the next forward; its write fails
    with pytest.raises(BackgroundWriteError, match="agent's write of the checkpoint at step 2 failed: .*No space left"):
        ckpt.wait()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
    w.optimizer.step()
    w.optimizer.zero_grad()
    w.scheduler.step()
    ckpt.close()
    _assert_stored(tmp_path / "c", w, 3)  # the final write succeeded


def test_a_slow_write_delays_the_next_one_and_skips_none(tmp_path, monkeypatch):
    """With ``every``, each multiple of P is written even when the write before it is still running
    (the agent's third write, step 6, takes 1.5 s; the ten steps take far less)."""
    monkeypatch.setenv("EVERYSTEP_DELAY", "store.object.before_rename:3=1.5")
    w = build("mlp", seed=0, optimizer="adamw")
    with _attach(w, tmp_path / "c", every=3, keep=10) as ckpt:
        ckpt.restore()
        _train(w, 10)
    steps = sorted(r.manifest.step for r in CheckpointDirectory.open(tmp_path / "c").catalog.manifests())
    assert steps == [0, 3, 6, 9, 10]
    assert ckpt.stats.stall_seconds > 1.0  # the wait for the write shows in the measured stall


def test_a_slow_persist_copy_holds_the_next_step_back_and_each_checkpoint_is_its_step(tmp_path, monkeypatch):
    """The agent copies its replica for a write on the writer's thread, off the thread that applies
    steps: the next step, were it applied before the copy is done, would change the replica under
    it. Each copy is slowed down (every step written): every checkpoint is still its own step's
    state, bitwise."""
    from everystep.storage.full import read_state

    monkeypatch.setenv("EVERYSTEP_DELAY", "agent.persist.copy:1+=0.05")
    w = build("mlp", seed=0, optimizer="adamw")
    live: dict[int, str] = {}
    with _attach(w, tmp_path / "c", every=1, keep=20) as ckpt:
        live[ckpt.restore()] = _live_hash(w, 0)
        for step in range(1, 7):
            _train(w, 1)
            live[step] = _live_hash(w, step)
    directory = CheckpointDirectory.open(tmp_path / "c")
    stored = {m.step: _stored_hash(read_state(directory, m)[0]) for m in directory.fulls()}
    assert sorted(stored) == list(range(7)) and stored == live


@pytest.mark.parametrize("exited_first", [False, True])
def test_an_optimizer_the_agent_cannot_import_is_named_and_training_goes_on(tmp_path, exited_first):
    """``exited_first``: the agent has failed and exited before the session sends it the slots
    (sending them then fails; what the agent said before it exited must still be read)."""
    w = build("mlp", seed=0, optimizer="adamw")
    local = type("Adam", (torch.optim.Adam,), {"__qualname__": "f.<locals>.Adam", "__module__": __name__})
    w.optimizer = local(w.model.parameters(), lr=1e-3)
    w.scheduler = torch.optim.lr_scheduler.StepLR(w.optimizer, step_size=2)
    with _attach(w, tmp_path / "c", every=100) as ckpt:
        if exited_first:
            _faults.arm("lowdiff_plus.start.slots", action=lambda: ckpt.strategy.session.link.process.wait(timeout=60))
        try:
            ckpt.restore()
        finally:
            _faults.disarm("lowdiff_plus.start.slots")
        ckpt.wait()  # the agent has read the state it was sent, and failed
        with pytest.warns(RuntimeWarning, match="taking over the training state of step 0 failed: .*cannot import "
                                                "the optimizer class .*f.<locals>.Adam"):
            _train(w, 3)
    _assert_stored(tmp_path / "c", w, 3)


def test_an_agent_that_stops_answering_is_ended_and_training_goes_on(tmp_path):
    w = build("mlp", seed=0, optimizer="adamw")
    with _attach(w, tmp_path / "c", every=100, queue=1, agent_timeout=1.0) as ckpt:
        ckpt.restore()
        _train(w, 2)
        ckpt.wait()
        pid = _agent_pid(tmp_path / "c")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="is lost: it freed no slot within 1 s"):
            _train(w, 4)
        assert time.perf_counter() - t0 < 30  # the stall is bounded by agent_timeout
    assert _gone_within(pid, 10), "a stopped agent was left behind"
    assert ckpt.stats.snapshot_wait_seconds >= 1.0  # the wait was measured
    _assert_stored(tmp_path / "c", w, 6)


def test_recovery_from_memory_restores_what_a_fresh_process_needs(tmp_path):
    """In-process view of a software failure: the trainer goes away without closing, a new one
    attaches. The optimizer keeps its state where the agent handed it over, not a copy of it."""
    proc = _spawn_trainer(tmp_path, steps=10_000, options={"grace": 30.0})
    _wait_for_steps(tmp_path, 6, proc)
    proc.kill()
    proc.wait()
    done = max(r["step"] for r in _records(tmp_path / "journal.jsonl") if r["event"] == "step")
    w = build("mlp", seed=0, optimizer="adamw")
    with _attach(w, tmp_path / "c", final=False) as ckpt:
        step = ckpt.restore()
        assert ckpt.recovered.source == "memory" and step >= done - 1
        held = [t for entry in w.optimizer.state.values() for name, t in entry.items() if name != "step"]
        assert held and len({t.untyped_storage().data_ptr() for t in held}) == 1  # (all in the one region)
        recovered = training_state_hash({"step": step, **ckpt.components.capture(), **ckpt.components.capture_boundary()})
    assert recovered == _reference(tmp_path, steps=step)["final_state_sha256"]


def _leave_agent_on_an_error(directory: Path) -> int:
    """Train 3 steps and leave the ``with`` block on an exception, as a rank whose peer died does; the
    agent's pid (it outlives the block)."""
    w = build("mlp", seed=0, optimizer="adamw")
    with pytest.raises(RuntimeError, match="a peer died"):
        with _attach(w, directory, every=100) as ckpt:
            ckpt.restore()
            _train(w, 3)
            pid = _agent_pid(directory)
            raise RuntimeError("a peer died")
    return pid


def test_an_exception_in_the_with_block_leaves_the_agent_for_the_restart(tmp_path):
    """A rank whose peer died leaves its block on an exception: that must not end its agent."""
    pid = _leave_agent_on_an_error(tmp_path / "c")
    # The restarted process takes the replica's optimizer state over without a copy and trains on:
    # the agent must have moved out of that memory (else both would update it), so the replica stays
    # equal to the live state (a divergence warns) and the run to an uninterrupted one.
    again = build("mlp", seed=0, optimizer="adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with _attach(again, tmp_path / "c", every=100, verify_every=1, verify_sample=0) as ckpt:
            assert ckpt.restore() == 2  # S_3 would have gone to the agent with the next forward
            assert ckpt.recovered.source == "memory" and _agent_pid(tmp_path / "c") == pid
            _train(again, 3)
    assert _gone_within(pid, 30)
    ref = build("mlp", seed=0, optimizer="adamw")
    _train(ref, 5)
    assert _live_hash(again, 5) == _live_hash(ref, 5)
    _assert_stored(tmp_path / "c", again, 5)


def test_a_replica_of_another_model_or_layout_is_not_taken(tmp_path):
    # The agent says what its replica fits (the model's keys, each shard's shape and place in the
    # whole); a process whose state is laid out otherwise (another sharding at the same world size,
    # or another model) ends that agent and goes to storage, where the mismatch is named.
    pid = _leave_agent_on_an_error(tmp_path / "c")
    other = build("mlp", seed=0, optimizer="adamw")
    other.model.extra = torch.nn.Linear(2, 2)  # one more layer: keys the replica does not have
    other.optimizer.add_param_group({"params": list(other.model.extra.parameters())})
    with pytest.warns(RuntimeWarning, match="holds the state of another layout"):
        with pytest.raises(StateMismatchError):
            _attach(other, tmp_path / "c", every=100).restore()
    assert _gone_within(pid, 30)


def test_full_checkpoints_in_dcp_format_are_refused_naming_why(tmp_path):
    w = build("mlp", seed=0, optimizer="adamw")
    with pytest.raises(ConfigError, match="strategy 'lowdiff_plus' writes full checkpoints in 'safetensors' format, not "
                                          "full_format='dcp': its checkpoint agent"):
        _attach(w, tmp_path / "c", full_format="dcp")
    assert not (tmp_path / "c").exists()
    with pytest.raises(ConfigError, match=r"lowdiff_plus writes no --full-format dcp \(its checkpoint agent.*\): drop --full-format$"):
        TrainConfig(workload="mlp", strategy="lowdiff_plus", directory=str(tmp_path / "c"), full_format="dcp")


def test_hanging_up_closes_the_descriptor_only_after_the_reader_has_ended():
    # A descriptor closed while the reader thread may still read it can be given to the next
    # connection this process opens (a restarted Checkpointer's), whose messages the old reader
    # would then take — the agent's 'released' among them, which the restart waits for.
    ours, agents = multiprocessing.Pipe()  # a connected pair of Unix sockets
    inside, leave = threading.Event(), threading.Event()

    def busy(msg):  # the reader is between two reads when the link hangs up
        inside.set()
        leave.wait(10)

    link = AgentLink(ours, os.getpid(), None)
    link.start_reader({"busy": busy}, lambda reason: None)
    send(agents, message("busy"))
    assert inside.wait(10)
    threading.Timer(0.3, leave.set).start()
    link.hang_up()
    assert not link._reader.is_alive() and ours.closed
    with pytest.raises(EOFError):
        agents.recv()  # and the agent saw the hang-up


def test_a_release_that_arrives_while_the_first_update_waits_ends_the_wait():
    # After recovery from memory, the first optimizer.step() waits for the agent's 'released'; the
    # reader thread that delivers it may come at any moment of that wait.
    waits: list[float] = []
    components = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[]))
    s = AgentSession(None, Ranks(), components, types.SimpleNamespace(waited=waits.append),  # type: ignore[arg-type]
                     BackgroundErrors(), timeout=5.0, slots=2, keep=2, verify_sample=0,
                     shards=types.SimpleNamespace())  # type: ignore[arg-type]
    s.link, s._handover = object(), threading.Event()  # type: ignore[assignment]
    threading.Timer(0.2, s._on_released, args=({"kind": "released", "step": 2},)).start()
    t0 = time.monotonic()
    s.take_over()
    assert time.monotonic() - t0 < 4 and s.lost is None and s._handover is None and len(waits) == 1


def test_the_agents_fused_replica_applies_adamw_as_the_optimizers_own_path_does_to_rounding():
    """GPU training's configuration of the agent: torch's fused CPU kernel for the replica's AdamW —
    the same update, in another order of arithmetic; an optimizer without one keeps its own path."""
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("agent_speed", ROOT / "tools" / "agent_speed.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    own = tool.agent_step_seconds("mlp", fused=False, threads=1, repeats=1)
    fused = tool.agent_step_seconds("mlp", fused=True, threads=1, repeats=1)
    assert own["fused"] is False and fused["fused"] is True and own["seconds"] > 0 and fused["seconds"] > 0

    import torch

    from everystep.agent.replica import fusable

    assert fusable(torch.optim.AdamW, [torch.zeros(2)]) and not fusable(torch.optim.SGD, [torch.zeros(2)])
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    own_opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    fused_opt = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g, g.clone()
        own_opt.step()
        fused_opt.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


def test_the_agents_defaults_keep_the_bitwise_path_and_one_thread_for_training_on_the_cpu(tmp_path):
    w = build("mlp", seed=0)
    with _attach(w, tmp_path / "c", every=100) as ckpt:
        ckpt.restore()
        assert ckpt.strategy._agent_threads() == 1 and ckpt.strategy._fused() is False
        assert ckpt.strategy.agent_seconds_per_step is None  # no step applied yet
        _train(w, 3)
        ckpt.wait()
        assert ckpt.strategy.agent_seconds_per_step > 0


def test_on_a_gpu_the_agent_leaves_the_training_process_its_cores(monkeypatch):
    """Where training runs on a GPU, the agent takes this rank's share of the host's cores less those
    the training process needs (its training thread and gradient copier), one at least: on 16 cores
    for one rank, 14 (it took all 16, beside the training thread); for 8 ranks, none to spare: one."""
    import everystep.strategies.lowdiff_plus as module
    from everystep.strategies.lowdiff_plus import TRAINING_CORES, LowDiffPlus

    strategy = LowDiffPlus()
    monkeypatch.setattr(strategy, "_on_gpu", lambda: True)
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(module, "local_world_size", lambda: 1)
    assert TRAINING_CORES == 2 and strategy._agent_threads() == 14
    monkeypatch.setattr(module, "local_world_size", lambda: 8)
    assert strategy._agent_threads() == 1
