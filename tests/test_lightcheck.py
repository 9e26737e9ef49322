"""LightCheck, the ``lightcheck`` strategy over its two-slot region (whose own tests are
``test_region.py``): state lent out of a slot while training, kills anywhere in a copy or a commit,
slow copies, the update's waits, host loss, readers beside a live run, the slot hashed in parts."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from everystep import Checkpointer, _faults
from everystep.eval.kills.train import TrainConfig, run
from everystep.eval.workloads import build
from everystep.state import TrainingComponents
from everystep.tree import state_hash
from everystep.storage.region.slots import Region
from everystep.storage.region.lending import lending_supported
from everystep.storage.region.mapping import ALIGN, RegionLayout
from everystep.strategies.lightcheck import ONE_UNIT, LightCheck

from .conftest import ROOT, assert_recovered, call_cli, run_cli
from .forked import run_script

STEPS = 8


def _steps(w, steps: int) -> None:
    """``steps`` training steps of ``w``: forward, backward, the optimizer's step."""
    for _ in range(steps):
        w.loss(w.data.next()).backward()
        w.optimizer.step()
        w.optimizer.zero_grad()


@pytest.mark.skipif(not lending_supported(), reason="this kernel cannot make a private mapping's pages the process's own")
def test_a_fresh_optimizer_keeps_the_state_lent_out_of_the_slot_and_trains_on_bitwise(tmp_path):
    """A restore into a fresh optimizer whose load is torch's own: its state stays where the slot's
    private mapping holds it (lent, not copied), and training on through checkpoints that write both
    slots again ends where an uninterrupted run does."""
    uninterrupted = build("mlp", seed=3)
    _steps(uninterrupted, 8)
    w = build("mlp", seed=3)
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, data=w.data, strategy="lightcheck") as ckpt:
        ckpt.restore()
        _steps(w, 4)
    w2 = build("mlp", seed=3)
    with Checkpointer(tmp_path / "c", w2.model, w2.optimizer, data=w2.data, strategy="lightcheck", final=False) as again:
        assert again.restore() == 4 and again.recovered.source == "region"
        lent = again.strategy.region.lending.bytes
        _steps(w2, 4)
    state = [t for entry in w2.optimizer.state.values() for t in entry.values() if t.dim()]
    assert lent >= sum(t.nbytes for t in state)
    assert state_hash({"model": w2.model.state_dict(), "optimizer": w2.optimizer.state_dict()}) == \
        state_hash({"model": uninterrupted.model.state_dict(), "optimizer": uninterrupted.optimizer.state_dict()})


@pytest.mark.skipif(not lending_supported(), reason="this kernel cannot make a private mapping's pages the process's own")
@pytest.mark.parametrize("change", ["made anew", "cut short"])
def test_state_lent_out_of_a_region_is_the_processs_own_once_its_checkpointer_closes(tmp_path, change):
    """A process restored from a region (its optimizer's state lent out of the slot) closes its
    Checkpointer and trains on; the region file is then made anew by another writer (cut to nothing,
    grown, filled) or cut short: the optimizer's state keeps its bytes, and training on goes on, where
    the file's new bytes had shown in it (Linux drops a private mapping's pages past a file's new end,
    copied or not) or a bus error had ended it."""
    w = build("mlp", seed=3)
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, data=w.data, strategy="lightcheck", persist_every=0) as ckpt:
        ckpt.restore()
        _steps(w, 4)
    w2 = build("mlp", seed=3)
    with Checkpointer(tmp_path / "c", w2.model, w2.optimizer, data=w2.data, strategy="lightcheck", final=False) as again:
        assert again.restore() == 4 and again.recovered.source == "region" and again.strategy.region.lending.bytes
    state = [t for entry in w2.optimizer.state.values() for t in entry.values() if t.dim()]
    kept = [t.clone() for t in state]
    path = tmp_path / "c" / "region" / "rank-0.bin"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        os.ftruncate(f.fileno(), 0)
        if change == "made anew":
            os.ftruncate(f.fileno(), size)
            f.write(os.urandom(size))
    assert all(torch.equal(t, k) for t, k in zip(state, kept))
    _steps(w2, 2)  # (its pages are written: no bus error)


_CHANGED_WHILE_OPEN = """
import os, sys, torch
from everystep import Checkpointer
from everystep.errors import EverystepError
from everystep.eval.workloads import build
directory, change, strategy = sys.argv[1], sys.argv[2], sys.argv[3]
options = {"persist_every": 0} if strategy == "lightcheck" else {"memory": True, "persist_every": 1000,
                                                                 "region": directory + "-region-{rank}.bin"}

def steps(w, n):
    for _ in range(n):
        w.loss(w.data.next()).backward()
        w.optimizer.step()
        w.optimizer.zero_grad()

class Failed(Exception):
    pass

w = build("mlp", seed=3)
try:  # (a software failure: the region stays for the restart)
    with Checkpointer(directory, w.model, w.optimizer, data=w.data, strategy=strategy, **options) as ckpt:
        ckpt.restore()
        steps(w, 3)
        raise Failed
except Failed:
    pass
w = build("mlp", seed=3)
with Checkpointer(directory, w.model, w.optimizer, data=w.data, strategy=strategy, final=False, **options) as ckpt:
    assert ckpt.restore() and ckpt.recovered.source in ("region", "memory"), ckpt.recovered
    region = ckpt.strategy.region if strategy == "lightcheck" else ckpt.strategy.tier.region
    assert region.lending.bytes
    for _ in range(500):  # (the lent state leaves the file between updates)
        if region.lending.moved_out:
            break
        steps(w, 1)
    assert region.lending.moved_out and region.lending.detached_bytes
    ckpt.wait()
    state = [t for entry in w.optimizer.state.values() for t in entry.values() if t.dim()]
    kept = [t.clone() for t in state]
    with open(region.path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        os.ftruncate(f.fileno(), 0)
        if change == "made anew":
            os.ftruncate(f.fileno(), size)
            f.write(os.urandom(size))
    assert all(torch.equal(t, k) for t, k in zip(state, kept)), "the lent state changed with its file"
    try:
        steps(w, 3)
    except EverystepError as e:
        print("refused:", e)
"""


@pytest.mark.skipif(not lending_supported(), reason="this kernel cannot make a private mapping's pages the process's own")
@pytest.mark.parametrize("strategy", ["lightcheck", "checkfreq"])
@pytest.mark.parametrize("change", ["made anew", "cut short"])
def test_a_region_file_changed_while_training_holds_its_lent_state_is_refused_not_a_bus_error(tmp_path, change,
                                                                                               strategy):
    """Item 5: a process restored from a region (the optimizer's state lent out of a slot) trains on
    with its Checkpointer open; another process cuts the region file short, or makes it anew. The
    lent state left the file between updates after the restore: it keeps its bytes, and the next
    slot is refused with an error naming the region, where a bus error had ended the process."""
    done = run_script(_CHANGED_WHILE_OPEN, str(tmp_path / "c"), change, strategy,
                      env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout
    assert "refused:" in done.stdout and "by another process while this one writes it" in done.stdout, done.stdout


@pytest.fixture(scope="module")
def reference() -> dict:
    return run(TrainConfig(workload="mlp", strategy="none", steps=STEPS, seed=3, progress=False))


_KILLED = """
import sys, torch
from everystep import Checkpointer, _faults
from everystep._faults import arm
from everystep.eval.workloads import build
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
directory, point, nth, steps, progress = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
w = build("mlp", seed=3, in_backward=sys.argv[6] == "1")
arm(point, after=nth)
with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="lightcheck",
                  persist_every=3, region=sys.argv[7] or None, wait=sys.argv[8]) as ckpt:
    ckpt.restore()
    for t in range(1, steps + 1):
        w.loss(w.data.next()).backward()
        w.update()
        with open(progress, "a") as f:  # the step done, and what a restart may not lose: on storage, in memory
            f.write(f"{t} {ckpt.stats.last_durable_step} {ckpt.stats.last_memory_step}\\n")
"""


def _train(w, start: int, losses: list[float]) -> None:
    for _ in range(start + 1, STEPS + 1):
        loss = w.loss(w.data.next())
        loss.backward()
        losses.append(loss.item())
        w.update()


def _final_hash(w) -> str:
    components = TrainingComponents(model=w.model, optimizer=w.optimizer, scheduler=w.scheduler, data=w.data)
    return state_hash({"step": STEPS, **components.capture(), **components.capture_boundary()})


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """PyTorch's deterministic algorithms, as the killed runs have them, and the setting before after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def uninterrupted() -> dict[bool, tuple[list[float], str]]:
    """By whether the updates run in backward: the losses and the final state's hash."""
    torch.set_num_threads(1)  # as every test and the killed runs have it: the bits of a matmul depend on it
    found = {}
    with _deterministic():
        for in_backward in (False, True):
            w, losses = build("mlp", seed=3, in_backward=in_backward), []
            _train(w, 0, losses)
            found[in_backward] = losses, _final_hash(w)
    return found


def _resume(directory: str, losses: list[float], in_backward: bool = False) -> tuple[int, str, list[float]]:
    """Restore from ``directory`` and train to STEPS; the step restored, the final state's hash, the losses."""
    w = build("mlp", seed=3, in_backward=in_backward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn slot is warned about
        with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          strategy="lightcheck", persist_every=3) as ckpt:
            start = ckpt.restore()
            _train(w, start, losses)
    return start, _final_hash(w), losses


_POINTS = [("store.object.mid_write", 2, 7), ("lightcheck.copy.unit", 3, 20), ("store.region.before_header", 2, 7),
           ("store.region.mid_header", 3, 14)]
_CASES = [(point, random.Random(f"{point}/{mode}").randint(lo, hi), mode, False, "commit")
          for point, lo, hi in _POINTS for mode in ("software", "hardware")]
_CASES += [(point, random.Random(f"{point}/in-backward").randint(lo, hi), "software", True, "commit")
           for point, lo, hi in _POINTS]
_CASES += [(point, random.Random(f"{point}/copies").randint(lo, min(hi, STEPS - 1)), "software", False, "copies")
           for point, lo, hi in _POINTS]  # (one copy unit a step: the copies' points arrive once a step)


@pytest.mark.parametrize("point, nth, mode, in_backward, wait", _CASES)
def test_a_kill_anywhere_in_a_copy_or_a_commit_loses_at_most_one_step(tmp_path, point, nth, mode, in_backward, wait,
                                                                      uninterrupted):
    """I1, I2, I3: SIGKILL at the nth arrival at a point inside the copy or the commit of a slot; a
    software failure loses at most one step done (with updates in backward as well: the step's end
    waits for the commit) — two where the update waits for the copies alone (``wait="copies"``) —, a
    host loss (the region gone) what was not persisted; training goes on to the uninterrupted run's
    state bitwise."""
    directory, progress = str(tmp_path / "c"), tmp_path / "progress"
    # a host loss takes the region with the host's memory: it lies in /dev/shm, so that what the run
    # reports durable is what storage holds
    memory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="everystep-test-")) if mode == "hardware" else None
    try:
        killed = run_script(_KILLED, directory, point, str(nth), str(STEPS), str(progress), str(int(in_backward)),
                            str(memory / "rank-0.bin") if memory else "", wait,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    finally:
        if memory is not None:
            shutil.rmtree(memory)  # the host's memory is gone
    assert killed.returncode == -9, killed.stdout
    done, durable, in_memory = map(int, progress.read_text().splitlines()[-1].split()) if progress.exists() else (0, 0, 0)
    with _deterministic():
        start, final, losses = _resume(directory, [], in_backward)
    # The newest step recoverable in this failure mode when the last finished step ended, or a newer
    # one: a software failure loses at most one step done, a host loss what was not persisted.
    recoverable = max(in_memory, durable, done - (1 if wait == "commit" else 2)) if mode == "software" else durable
    assert recoverable <= start <= done, (start, done, durable, in_memory)
    ref_losses, ref_final = uninterrupted[in_backward]
    assert losses == ref_losses[start:] and final == ref_final


def _slowed(directory: Path, strategy: LightCheck, point: str, seconds: float) -> Checkpointer:
    """Four steps of the mlp checkpointed by ``strategy``, each arrival at ``point`` taking ``seconds``
    longer (a slow copy or commit, not synchronisation); the closed Checkpointer."""
    w = build("mlp", seed=3)
    _faults.arm(point, action=functools.partial(time.sleep, seconds), repeat=True)
    try:
        with Checkpointer(directory, w.model, w.optimizer, strategy=strategy) as ckpt:
            ckpt.restore()
            _steps(w, 4)
    finally:
        _faults.disarm(point)
    return ckpt


def test_slow_copies_make_the_update_wait_for_them_and_recovery_stays_exact(tmp_path, monkeypatch, reference):
    """The copies never see a half-updated state: the copy is slowed down, and a kill-and-recover run
    still ends bitwise where the reference does (an update that did not wait for the copy would
    change what the copy reads); the wait is in the stats, as the one unit of a whole-model update
    (one batched copy: the update waits for all of it anyway)."""
    monkeypatch.setenv("EVERYSTEP_DELAY", "lightcheck.copy.unit:1+=0.002")
    s = run(TrainConfig(workload="mlp", strategy="lightcheck", steps=STEPS, seed=3, directory=str(tmp_path / "c"),
                        every=1, fail_at=(5,), progress=False))
    assert s["losses"] == reference["losses"] and s["final_state_sha256"] == reference["final_state_sha256"]
    strategy = LightCheck(LightCheck.Config(persist_every=0))
    ckpt = _slowed(tmp_path / "d", strategy, "lightcheck.copy.unit", 0.01)
    assert set(strategy.layer_waits) == {ONE_UNIT} and strategy.layer_waits[ONE_UNIT] > 0  # (its copies slept)
    assert ckpt.stats.snapshot_wait_seconds >= sum(strategy.layer_waits.values())


@pytest.mark.parametrize("wait", ["commit", "copies"])
def test_the_update_waits_for_the_commit_or_for_the_copies_alone(tmp_path, wait):
    # Each slot's header is held back 50 ms: the update of the next step waits for it with
    # wait="commit", not with wait="copies", where the next copy waits for it instead. Every step is
    # committed in the end, and the newest slot is the final state either way.
    strategy = LightCheck(LightCheck.Config(persist_every=0, wait=wait))
    ckpt = _slowed(tmp_path / "c", strategy, "store.region.before_header", 0.05)
    assert strategy.setting()["wait"] == wait
    if wait == "commit":
        assert strategy.commit_wait_seconds >= 3 * 0.05
    else:
        assert strategy.commit_wait_seconds == 0
    assert ckpt.stats.last_memory_step == 4


def test_with_updates_in_backward_each_layer_waits_only_for_its_own_copy(tmp_path):
    """Per-layer updates: the copy of S_t's last unit is held until step t+1's first update (the last
    layer's, copied first) has begun — which it could not, were an update to wait for the whole copy."""
    w = build("mlp", seed=3, in_backward=True)
    units = 4  # "(rest)", "0", "3", "5": asserted below
    copies: list[tuple[int, int]] = []
    updates: list[tuple[int, str]] = []
    began = {t: threading.Event() for t in range(1, 5)}
    names = {p: n for n, p in w.model.named_parameters()}
    step = 0

    def before_unit() -> None:  # on the copy thread, before each unit of each copy
        copied, unit = divmod(len(copies), units)
        copies.append((copied + 1, unit))
        if unit == units - 1 and copied + 2 in began:  # S_(copied+1)'s last unit: after step copied+2's first update
            assert began[copied + 2].wait(60), f"step {copied + 2} waited for the whole copy of S_{copied + 1}"

    def on_update(opt, params) -> None:
        updates.append((step, names[params[0]]))
        began[step].set()

    strategy = LightCheck(LightCheck.Config(persist_every=0))
    _faults.arm("lightcheck.copy.unit", action=before_unit, repeat=True)
    try:
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, strategy=strategy) as ckpt:
            ckpt.restore()  # its layer hook comes first: the one below sees each update after its wait
            w.optimizer.register_layer_pre_hook(on_update)
            for step in range(1, 5):
                w.loss(w.data.next()).backward()
                w.update()
    finally:
        _faults.disarm("lightcheck.copy.unit")
    params = len(names)
    assert copies == [(t, u) for t in range(1, 5) for u in range(units)]  # S_1..S_4, the last one at close
    assert [n for _, n in updates[:params]] == list(reversed(names.values()))  # backward order
    assert [t for t, _ in updates] == [t for t in range(1, 5) for _ in range(params)]
    assert set(strategy.layer_waits) == {"(rest)", "0", "3", "5"}


def test_a_reader_beside_a_live_run_gets_a_verified_slot(tmp_path):
    directory = tmp_path / "c"
    w = build("mlp", seed=3)
    with Checkpointer(directory, w.model, w.optimizer, strategy="lightcheck", persist_every=0) as ckpt:
        ckpt.restore()
        for t in range(1, 6):
            w.loss(w.data.next()).backward()
            w.optimizer.step()
            w.optimizer.zero_grad()
            if t >= 3:
                reader = Region.open(directory / "region" / "rank-0.bin", access="read")
                slot, _, meta = reader.newest()
                assert t - 2 <= slot.step <= t and json.loads(json.dumps(meta["skeleton"]))
                reader.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("mode, source", [("software", "region"), ("hardware", "disk")])
def test_a_region_in_shared_memory_outlives_the_process_not_the_host(tmp_path, reference, mode, source):
    """Software failure: recovery reads the region (no storage read). Host loss: the region on tmpfs
    is gone, and recovery takes the newest full checkpoint the region was persisted to."""
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="everystep-test-")
    try:
        s = run(TrainConfig(workload="mlp", strategy="lightcheck", steps=STEPS, seed=3, directory=str(tmp_path / "c"),
                            fail_at=(6,), fail_mode=mode, progress=False,
                            options={"region": f"{shm}/rank-{{rank}}.bin", "persist_every": 2}))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert_recovered(s, sources={source}, lose=1 if mode == "software" else None)  # (software: at most one done step lost)
    assert s["losses"] == reference["losses"] and s["final_state_sha256"] == reference["final_state_sha256"]


def test_inspect_and_verify_list_the_region_slots_and_name_a_damaged_one(tmp_path, capsys):
    d = tmp_path / "c"
    assert run_cli("train", "--strategy", "lightcheck", "--steps", "5", "--dir", str(d)).returncode == 0
    code, listing, _ = call_cli(capsys, "inspect", str(d))
    assert code == 0 and listing.count("region step") == 2 and "valid" in listing
    path = d / "region" / "rank-0.bin"
    region = Region.open(path, access="read")
    newest = region.slots()[0]
    region.close()
    raw = bytearray(path.read_bytes())
    raw[newest.area_offset + 8] ^= 0x01  # the metadata of the newest slot
    path.write_bytes(raw)
    code, out, _ = call_cli(capsys, "verify", str(d))
    assert code == 1 and f"slot {newest.slot}" in out and "fails its checksum" in out


def _trained(directory: Path, **options) -> str:
    """Train mlp four steps under lightcheck into ``directory``: the state hash of its end."""
    w = build("mlp", seed=3)
    with Checkpointer(directory, w.model, w.optimizer, strategy="lightcheck", **options) as ckpt:
        ckpt.restore()
        _steps(w, 4)
    return state_hash({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()})


def test_a_corrupt_newest_slot_gives_way_to_the_same_step_persisted_in_the_directory(tmp_path):
    """Recovery takes the newest of the region's verified slots and the directory's verified full
    checkpoints: the newest slot damaged, the step persisted in the directory is restored."""
    directory = tmp_path / "c"
    expected = _trained(directory, persist_every=1)
    path = directory / "region" / "rank-0.bin"
    region = Region.open(path, access="read")
    newest = region.slots()[0]
    region.close()
    raw = bytearray(path.read_bytes())
    raw[newest.area_offset + 8] ^= 0x01
    path.write_bytes(raw)
    w2 = build("mlp", seed=3)
    with pytest.warns(UserWarning, match=f"slot {newest.slot}"):
        with Checkpointer(directory, w2.model, w2.optimizer, strategy="lightcheck", persist_every=1,
                          final=False) as again:
            assert again.restore() == 4 and again.recovered.source == "disk"
    assert state_hash({"model": w2.model.state_dict(), "optimizer": w2.optimizer.state_dict()}) == expected


def test_a_restore_into_an_optimizer_that_holds_its_state_fills_its_own_tensors_from_the_slot(tmp_path):
    """Recovery within a process whose optimizer has its state already: the region's slot is read
    in place (its optimizer state not copied out) and loaded into the optimizer's own tensors,
    which it keeps, now holding the checkpoint's values; the model's likewise."""
    directory = tmp_path / "c"
    expected = _trained(directory)
    w2 = build("mlp", seed=4)
    w2.loss(w2.data.next()).backward()
    w2.optimizer.step()
    held = {id(t) for entry in w2.optimizer.state.values() for t in entry.values()}
    with Checkpointer(directory, w2.model, w2.optimizer, strategy="lightcheck", final=False) as again:
        assert again.restore() == 4 and again.recovered.source == "region"
    assert state_hash({"model": w2.model.state_dict(), "optimizer": w2.optimizer.state_dict()}) == expected
    assert {id(t) for entry in w2.optimizer.state.values() for t in entry.values()} == held


def test_a_region_made_for_another_directory_is_refused_and_left_as_it_is(tmp_path):
    """I7: two runs given the same region= in turn: the second is refused, naming the region, and
    the first run's region and checkpoints are untouched."""
    region = str(tmp_path / "shared-region.bin")
    w = build("mlp", seed=3)
    with Checkpointer(tmp_path / "a", w.model, w.optimizer, strategy="lightcheck", region=region) as ckpt:
        ckpt.restore()
        w.loss(w.data.next()).backward()
        w.optimizer.step()
    before = (tmp_path / "shared-region.bin").read_bytes()
    w2 = build("mlp", seed=3)
    with pytest.raises(Exception, match="belongs to another checkpoint directory"):
        Checkpointer(tmp_path / "b", w2.model, w2.optimizer, strategy="lightcheck", region=region)
    assert (tmp_path / "shared-region.bin").read_bytes() == before
    with Checkpointer(tmp_path / "a", w2.model, w2.optimizer, strategy="lightcheck", region=region, final=False) as again:
        assert again.restore() == 1 and again.recovered.source == "region"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 1, 7, ALIGN // 4, ALIGN + 4, 3 * ALIGN, 40 * ALIGN]), min_size=1, max_size=6),
                min_size=1, max_size=6), st.integers(1, 6))
def test_the_slot_is_hashed_in_parts_each_after_every_copy_it_needs(units, count):
    """Units of tensors of any sizes (small ones, which the layout puts last, among them): the parts
    cover the layout's entries in order, the pieces are the copy order, each unit ends in a piece
    that says so, and a part is counted in only after the copy of every one of its entries."""
    from everystep.strategies.lightcheck_copy import hash_parts

    tensors, named = {}, []
    for u, sizes in enumerate(units):
        keys = [f"u{u}/t{i}" for i in range(len(sizes))]
        tensors.update({k: torch.zeros(n, dtype=torch.uint8) for k, n in zip(keys, sizes)})
        named.append((f"u{u}", keys))
    layout = RegionLayout.of(tensors, [k for _, keys in named for k in keys])
    parts, pieces = hash_parts(named, layout, count)
    assert len(parts) <= count and parts[0][0] == 0 and parts[-1][1] == len(layout.entries)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(parts, parts[1:]))
    assert [k for _, keys, _, _ in pieces for k in keys] == [k for _, keys in named for k in keys]
    assert [u for u, _, ends, _ in pieces if ends] == list(range(len(named)))
    copied: set[str] = set()
    counted = 0
    for _, keys, _, parts_in in pieces:
        copied.update(keys)
        assert parts_in >= counted
        counted = parts_in
        assert all(e.key in copied for first, stop in parts[:parts_in] for e in layout.entries[first:stop])
    assert counted == len(parts)


def test_a_slot_is_hashed_in_parts_of_about_256_mib():
    """The parts follow the slot's bytes, not a fixed count: gpt2-small's 265 MiB in 2, gpt2-medium's
    4 GiB in 16 (the hash after the last copy covers 256 MiB at most), a small slot in one."""
    from everystep.strategies.lightcheck_copy import HASH_PART_BYTES, part_count

    assert HASH_PART_BYTES == 256 << 20
    assert part_count(265 << 20) == 2 and part_count(4 << 30) == 16 and part_count(1000) == 1 and part_count(0) == 1
    assert part_count(256 << 20) == 1 and part_count((256 << 20) + 1) == 2


def test_a_slot_hashed_part_by_part_has_the_checksums_of_the_whole(tmp_path):
    """The hashing process asked for the parts in turn gives each tensor the checksum it gives when
    asked for the whole slot."""
    from everystep.strategies.lightcheck_copy import hash_parts

    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
               for i, n in enumerate([5000, 17, 90000, 3, 4096, 70000])}
    layout = RegionLayout.of(tensors)
    store = Region.open(tmp_path / "r.bin")
    try:
        writer = store.begin(layout, 100)
        for k, t in tensors.items():
            writer.views[k].copy_(t)
        parts, _ = hash_parts([("all", list(tensors))], layout, 3)
        assert len(parts) == 3
        together: dict[str, str] = {}
        for part in parts:
            together.update(store.checksums(writer, part))
        assert together == store.checksums(writer) and len(together) == len(tensors)
    finally:
        store.close()
