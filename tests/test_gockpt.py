"""GoCkpt and GoCkpt-O: the part plan, the reconstruction (bitwise on the CPU), kills anywhere in a
spread checkpoint, mixed precision with skipped steps, clipping."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from everystep import Checkpointer, ConfigError
from everystep.eval.workloads import build
from everystep.policy.parts import ALIGN, PartSplit, Unit, choose_parts
from everystep.strategies import create
from everystep.storage import CheckpointDirectory
from everystep import spread
from everystep.spread import SPREAD_KIND
from everystep.strategies.gockpt import GoCkpt

from .conftest import ROOT, assert_recovered
from .forked import run_script
from .test_checkpointer import live_hash

STEPS = 12
SPREAD = {"every": 4, "parts": 3, "chunk_bytes": 4096}
"""Checkpoints start after steps 4 and 8 and are complete at 7 and 11; parameters span several parts."""


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 100_000), st.sampled_from([4, 8, 12])), min_size=1, max_size=8),
       parts=st.integers(1, 9), chunk=st.sampled_from([1024, 4096, 65536]))
def test_parts_cover_the_state_once_in_aligned_chunks_of_nearly_equal_size(sizes, parts, chunk):
    units = [Unit(f"/p{i}", n, b) for i, (n, b) in enumerate(sizes)]
    plan = PartSplit.of(units, parts, chunk)
    chunks = [c for part in plan.parts for c in part]
    for i, unit in enumerate(units):  # every element of every parameter (with its state) once, in order
        mine = [c for c in chunks if c.unit == i]
        assert mine[0].start == 0 and mine[-1].stop == unit.numel
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
        assert all(c.start % ALIGN == 0 and c.nbytes == (c.stop - c.start) * unit.bytes_per_element for c in mine)
    assert len(plan.parts) == min(parts, len(chunks)) and all(plan.parts)
    mean = sum(plan.part_bytes()) / len(plan.parts)
    assert all(abs(b - mean) <= max(c.nbytes for c in chunks) for b in plan.part_bytes())


def test_the_number_of_parts_is_the_fewest_whose_copy_fits_under_a_step_at_most_seven():
    assert choose_parts(250, bandwidth=100.0, step_seconds=1.0) == 3
    assert choose_parts(100, bandwidth=1000.0, step_seconds=1.0) == 1
    assert choose_parts(10**9, bandwidth=1.0, step_seconds=1.0) == 7
    assert choose_parts(10**9, bandwidth=1.0, step_seconds=1.0, limit=4) == 4


def _loop(w, ckpt, start, stop, losses=None, *, scaler=None, inf_at=()):
    """Training with clipping; with ``scaler``, bf16 autocast and a GradScaler, whose step is
    skipped where a gradient is made infinite (``inf_at``)."""
    for t in range(start + 1, stop + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
            loss = w.loss(w.data.next())
        (scaler.scale(loss) if scaler else loss).backward()
        if t in inf_at:
            next(w.model.parameters()).grad.view(-1)[0] = float("inf")
        if scaler is not None:
            scaler.unscale_(w.optimizer)
        torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(w.optimizer)
            scaler.update()
        else:
            w.optimizer.step()
        w.optimizer.zero_grad()
        w.scheduler.step()
        if losses is not None:
            losses.append(loss.item())


@pytest.mark.parametrize("strategy", ["gockpt", "gockpt_o"])
@pytest.mark.parametrize("workload", ["gpt2-tiny", "resnet"])
@pytest.mark.parametrize("reconstruct", ["host", "device"])
def test_the_reconstruction_is_the_live_state_of_its_step_bitwise(tmp_path, strategy, workload, reconstruct):
    """The checkpoint started after step 4 is complete at step 7: parts copied at steps 4, 5, 6,
    brought forward by the gradients of steps 5..7 (1, 2, 3 parts' worth), equal to S_7 bitwise —
    on the host as they arrive, or (``device``) at recovery, from the parts and gradients written."""
    w, hashes, shipped = build(workload, seed=1), {}, []
    s = create(strategy, reconstruct=reconstruct, **SPREAD)
    assert isinstance(s, GoCkpt)
    original = s._copy_gradients

    def spy(spread, step, parts, grads, groups, ready):
        shipped.append((step - spread.start, parts, sorted({c.param for p in spread.copied[:parts] for c in p})))
        original(spread, step, parts, grads, groups, ready)

    s._copy_gradients = spy
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=s,
                      final=False) as ckpt:
        ckpt.restore()
        for t in range(1, 10):  # the second checkpoint starts after step 8, and is left unfinished
            _loop(w, ckpt, t - 1, t)
            hashes[t] = live_hash(w, t)
    assert s.parts_used == [3, 3] and len(s.reconstruct_seconds) == (reconstruct == "host")
    assert [(k, parts) for k, parts, _ in shipped] == [(1, 1), (2, 2), (3, 3), (1, 1)]  # gradients of parts 1..k
    assert set(shipped[0][2]) < set(shipped[2][2])
    kinds = {r.manifest.kind for r in CheckpointDirectory.open(tmp_path / "c", access="read").catalog.manifests()}
    assert kinds == {"full" if reconstruct == "host" else SPREAD_KIND}
    again = build(workload, seed=1)
    with Checkpointer(tmp_path / "c", again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                      strategy=strategy, **SPREAD) as ckpt:
        assert ckpt.restore() == 7
    assert live_hash(again, 7) == hashes[7]


@pytest.mark.parametrize("reconstruct", ["host", "device"])
def test_later_checkpoints_reuse_the_host_memory_of_earlier_ones_and_still_restore_bitwise(tmp_path, reconstruct):
    """Four checkpoints (begun after steps 3, 6, 9, 12; the first three complete at 5, 8, 11) take
    their host memory from pools of two buffers each: the later ones are copied into memory the
    earlier ones were written from."""
    w, hashes = build("gpt2-tiny", seed=1), {}
    s = create("gockpt", reconstruct=reconstruct, every=3, parts=2, chunk_bytes=4096, keep=1)
    assert isinstance(s, GoCkpt)
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=s,
                      final=False) as ckpt:
        made: dict[str, int] = {}

        def counted(name, make):
            def counting(layout):
                made[name] = made.get(name, 0) + 1
                return make(layout)
            return counting

        for name in ("_part_buffers", "_gradient_buffers", "_rest_buffers"):
            pool = getattr(s, name)
            pool._make = counted(name, pool._make)
        ckpt.restore()
        for t in range(1, 15):
            _loop(w, ckpt, t - 1, t)
            hashes[t] = live_hash(w, t)
    assert s.parts_used == [2, 2, 2, 2]
    assert set(made) == {"_part_buffers", "_rest_buffers", "_gradient_buffers"}  # (host: a step's, until applied)
    assert all(n <= 2 for n in made.values()), made  # (two where a checkpoint began before the last was written)
    again = build("gpt2-tiny", seed=1)
    with Checkpointer(tmp_path / "c", again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                      strategy="gockpt", every=3, parts=2) as ckpt:
        assert ckpt.restore() == 11
    assert live_hash(again, 11) == hashes[11]


def test_a_spread_checkpoint_is_brought_forward_from_its_parts_and_a_damaged_one_is_skipped(tmp_path, monkeypatch):
    """Device reconstruction: the parts as written are not S_7 (recovery without the gradients is
    not), and a spread checkpoint whose gradients are damaged is skipped for the one before."""
    w, hashes = build("gpt2-tiny", seed=1), {}
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="gockpt",
                      reconstruct="device", final=False, **SPREAD) as ckpt:
        for t in range(1, 13):
            _loop(w, ckpt, t - 1, t)
            hashes[t] = live_hash(w, t)

    def restored(**patches):
        again = build("gpt2-tiny", seed=1)
        with monkeypatch.context() as m:
            for name, value in patches.items():
                m.setattr(spread, name, value)  # the spread format's module brings the parts forward
            with Checkpointer(tmp_path / "c", again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                              strategy="gockpt", reconstruct="device", final=False, **SPREAD) as ckpt:
                return ckpt.restore(), live_hash(again, 11)

    assert restored() == (11, hashes[11])
    with pytest.warns(UserWarning) as caught:
        assert restored(replay_step=lambda *a, **k: None)[0] == 0  # the parts alone are not a state: both skipped
    assert [str(w.message).split(":")[0] for w in caught] == [f"skipping the spread checkpoint at step {s}" for s in (11, 7)]
    assert all("brought forward disagrees with the state of the step on 'step'" in str(w.message) for w in caught)
    objects = tmp_path / "c" / "objects"
    newest = max(objects.glob("spread-*"))
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="skipping the spread checkpoint at step 11"):
        step, _ = restored()
    assert step == 7



def test_a_damaged_full_checkpoint_falls_back_to_the_spread_one_before_it(tmp_path):
    """The last checkpoint of a run is a full one (written at close, step 12); damaged, recovery
    takes the spread checkpoint of step 11, not nothing."""
    w, hashes = build("gpt2-tiny", seed=1), {}
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="gockpt",
                      reconstruct="device", **SPREAD) as ckpt:
        for t in range(1, 13):
            _loop(w, ckpt, t - 1, t)
            hashes[t] = live_hash(w, t)
    full = tmp_path / "c" / "objects" / "full-000000000012.safetensors"
    data = bytearray(full.read_bytes())
    data[-5] ^= 0xFF
    full.write_bytes(bytes(data))
    again = build("gpt2-tiny", seed=1)
    with pytest.warns(UserWarning, match="skipping the checkpoint at step 12: .* fails its checksum"):
        with Checkpointer(tmp_path / "c", again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                          strategy="gockpt", reconstruct="device", final=False, **SPREAD) as ckpt:
            assert ckpt.restore() == 11
    assert live_hash(again, 11) == hashes[11]


_KILLED = """
import sys, torch
from everystep import Checkpointer
from everystep._faults import arm
from everystep.eval.workloads import build
from tests.test_gockpt import SPREAD, _loop
torch.set_num_threads(1)
directory, strategy, point, nth, steps, amp, reconstruct = sys.argv[1:4] + [int(a) for a in sys.argv[4:7]] + sys.argv[7:]
w = build("gpt2-tiny", seed=1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
arm(point, after=nth)
with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, scaler=scaler, strategy=strategy,
                  reconstruct=reconstruct, **SPREAD) as ckpt:
    ckpt.restore()
    with open(directory + ".durable", "w", buffering=1) as seen:  # what a restart may not lose, step by step
        for t in range(1, steps + 1):
            _loop(w, ckpt, t - 1, t, scaler=scaler, inf_at=(6,) if amp else ())
            seen.write(f"{ckpt.stats.last_durable_step}\\n")
"""


def _resume(directory, strategy, amp, losses, reconstruct):
    w = build("gpt2-tiny", seed=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
    with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, scaler=scaler,
                      strategy=strategy, reconstruct=reconstruct, **SPREAD) as ckpt:
        start = ckpt.restore()
        _loop(w, ckpt, start, STEPS, losses, scaler=scaler, inf_at=(6,) if amp else ())
    return start, live_hash(w, STEPS), w


@pytest.fixture(scope="module")
def uninterrupted():
    torch.set_num_threads(1)
    found = {}
    for amp in (False, True):
        w, losses = build("gpt2-tiny", seed=1), []
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
        _loop(w, None, 0, STEPS, losses, scaler=scaler, inf_at=(6,) if amp else ())
        found[amp] = losses, live_hash(w, STEPS)
    return found


_POINTS = [("gockpt.copy.chunk", 1, 400), ("gockpt.reconstructed", 1, 2), ("store.object.mid_write", 1, 2)]
_CASES = [(s, point, random.Random(f"{s}{point}").randint(lo, hi), amp, "host")
          for s, amp in (("gockpt", False), ("gockpt_o", True)) for point, lo, hi in _POINTS]
_CASES += [("gockpt", "gockpt.copy.chunk", random.Random("amp").randint(1, 400), True, "host")]
_CASES += [(s, point, random.Random(f"device{s}{point}").randint(lo, hi), amp, "device")
           for (s, amp), (point, lo, hi) in zip((("gockpt_o", True), ("gockpt", True), ("gockpt", False)), _POINTS)]


@pytest.mark.parametrize("strategy, point, nth, amp, reconstruct", _CASES)
def test_a_kill_in_a_copy_a_reconstruction_or_a_write_leaves_the_previous_checkpoint(tmp_path, strategy, point, nth,
                                                                                  amp, reconstruct, uninterrupted):
    """I1, I3: SIGKILL while a part is copied, once the parts are reconstructed (or, ``device``,
    their gradients all copied), or while the checkpoint is written; recovery takes the previous
    committed checkpoint, and training goes on to the uninterrupted run's state bitwise — with
    bf16 autocast, a GradScaler that skips step 6 (inside the first spread) and clipping too."""
    directory = str(tmp_path / "c")
    killed = run_script(_KILLED, directory, strategy, point, str(nth), str(STEPS), str(int(amp)), reconstruct,
                        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}, cwd=ROOT)
    assert killed.returncode == -9, killed.stdout
    durable = int(Path(directory + ".durable").read_text().split()[-1])  # at the end of the last finished step
    start, final, _ = _resume(directory, strategy, amp, losses := [], reconstruct)
    assert start in (0, 7, 11) and start >= durable, (start, durable)
    ref_losses, ref_final = uninterrupted[amp]
    assert losses == ref_losses[start:] and final == ref_final


def test_mistakes_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"parts must lie in 1..every \(4\)"):
        create("gockpt", every=4, parts=5)
    with pytest.raises(ConfigError, match="reconstruct must be 'host' or 'device'"):
        create("gockpt", reconstruct="gpu")
    w = build("mlp", seed=0)
    w.optimizer = torch.optim.LBFGS(w.model.parameters())
    with pytest.raises(ConfigError, match="updates each element from its own gradient and state .* got LBFGS"):
        Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy="gockpt")


@pytest.mark.parametrize("strategy, mode", [("gockpt", "software"), ("gockpt_o", "hardware")])
def test_the_training_driver_recovers_from_spread_checkpoints_bitwise(tmp_path, strategy, mode):
    """The parts brought forward at recovery, by the training driver's restarts (software: the
    process killed; hardware: what was not durable lost too), as on a GPU where this is the default."""
    from everystep.eval.kills.train import TrainConfig, run

    ref = run(TrainConfig(workload="gpt2-tiny", strategy="none", steps=14, progress=False))
    got = run(TrainConfig(workload="gpt2-tiny", strategy=strategy, steps=14, directory=str(tmp_path / "c"),
                          fail_at=(9, 13), fail_mode=mode, every=4, progress=False,
                          options={"parts": 3, "chunk_bytes": 1 << 16, "reconstruct": "device"}))
    assert_recovered(got, sources={"disk (parts brought forward on cpu)"})
    assert got["losses"] == ref["losses"] and got["final_state_sha256"] == ref["final_state_sha256"]
