"""The memory tier of the strategies that write the whole state (``memory=True``): every checkpoint
into a region in memory that outlives the training process, the directory every N steps.

A killed training process loses at most one finished step, recovered from the region; a lost host
(the region gone with its memory) at most N, recovered from the directory; the directory receives
one checkpoint every N steps, N measured from the disk's writes unless given; a region of another
run, or damaged, is refused or skipped by name and recovery falls back to the directory.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import stat
import time
import warnings
from pathlib import Path

import pytest
import torch

from everystep import Checkpointer
from everystep._faults import arm, disarm
from everystep.errors import CheckpointDirectoryError, ConfigError
from everystep.eval.kills.train import TrainConfig, run
from everystep.storage.directory import CheckpointDirectory
from everystep.storage.region.slots import Region
from everystep.storage.region.paths import memory_path

from .conftest import assert_recovered
from .test_checkpointer import attach, live_hash, loop, make

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the memory tier lies in /dev/shm")

FULL = ("full_sync", "checkfreq", "async", "checkflow", "gockpt", "gockpt_o", "gockpt:device")
"""The strategies that write the whole state (``gockpt:device``: its spread checkpoints, brought forward
at recovery, in the memory tier)."""
OPTIONS = {"gockpt": {"parts": 1, "reconstruct": "host"}, "gockpt_o": {"parts": 1, "reconstruct": "host"},
           "gockpt:device": {"parts": 1, "reconstruct": "device"}}
STEPS, PERSIST, SEED = 12, 4, 7


@pytest.fixture(scope="module")
def reference():
    return run(TrainConfig(workload="mlp", strategy="none", steps=STEPS, seed=SEED, progress=False))


def _options(strategy: str, shm: Path, **more) -> dict:
    return {"memory": True, "region": f"{shm}/rank-{{rank}}.bin", "persist_every": PERSIST, **OPTIONS.get(strategy, {}),
            **more}


@pytest.mark.parametrize("strategy", FULL)
def test_a_killed_training_process_recovers_from_memory_losing_at_most_one_step(tmp_path, shm, strategy, reference):
    """Every step checkpointed, a SIGKILL at a random step: the restart reads the region, loses at
    most one finished step, and ends bitwise where the uninterrupted run ends."""
    fail = random.Random(strategy).randint(3, STEPS - 1)
    s = run(TrainConfig(workload="mlp", strategy=strategy.split(":")[0], steps=STEPS, seed=SEED, every=1,
                        directory=str(tmp_path / "c"), fail_at=(fail,), progress=False, options=_options(strategy, shm)))
    spread = strategy == "gockpt:device"  # (parts brought forward at recovery)
    assert_recovered(s, sources={"memory (parts brought forward on cpu)" if spread else "memory"}, lose=1)
    assert s["losses"] == reference["losses"] and s["final_state_sha256"] == reference["final_state_sha256"]


def test_a_spread_checkpoint_of_many_chunks_fits_its_slot_and_recovers_bitwise(tmp_path, shm, reference):
    """GoCkpt's copy spread over three steps in chunks of 256 bytes: the slot's metadata holds the
    description of every chunk (tens of kilobytes, beside a skeleton of a few hundred bytes), and the
    restart brings the parts forward from it."""
    s = run(TrainConfig(workload="mlp", strategy="gockpt", steps=STEPS, seed=SEED, every=4, directory=str(tmp_path / "c"),
                        fail_at=(10,), progress=False,
                        options=_options("gockpt:device", shm, parts=3, chunk_bytes=256, persist_every=2)))
    assert_recovered(s, sources={"memory (parts brought forward on cpu)"}, lose=4)
    assert s["losses"] == reference["losses"] and s["final_state_sha256"] == reference["final_state_sha256"]


@pytest.mark.parametrize("strategy", ["checkfreq", "full_sync", "checkflow", "gockpt", "gockpt:device"])
def test_a_lost_host_recovers_from_the_directory_losing_at_most_n_steps(tmp_path, shm, strategy, reference):
    """The host lost (the region in its memory gone, helper processes killed): the restart reads the
    directory's newest checkpoint, persisted every N steps, and loses at most N finished steps."""
    fail = random.Random(f"host/{strategy}").randint(PERSIST + 2, STEPS - 1)
    s = run(TrainConfig(workload="mlp", strategy=strategy.split(":")[0], steps=STEPS, seed=SEED, every=1,
                        directory=str(tmp_path / "c"), fail_at=(fail,), fail_mode="hardware", progress=False,
                        options=_options(strategy, shm)))
    spread = strategy == "gockpt:device"  # (a spread checkpoint persisted, brought forward at recovery)
    assert_recovered(s, sources={"disk (parts brought forward on cpu)" if spread else "disk"}, lose=PERSIST)
    assert s["losses"] == reference["losses"] and s["final_state_sha256"] == reference["final_state_sha256"]


def test_the_directory_receives_one_checkpoint_every_n_steps_and_the_last_at_a_clean_close(tmp_path, shm):
    w = make("mlp", 0)
    with attach(w, tmp_path / "c", "checkfreq", keep=100, memory=True,
                      region=f"{shm}/rank-{{rank}}.bin", persist_every=3) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 10)
        ckpt.wait()
        tier = ckpt.strategy.tier
        assert tier is not None and tier.persisted == 3 and ckpt.stats.last_memory_step == 9
    directory = CheckpointDirectory.open(tmp_path / "c", access="read")
    assert sorted(m.step for m in directory.fulls()) == [3, 6, 9, 10]  # and the last one at the close
    assert tier.persisted == 4 and ckpt.stats.checkpoints == 10  # each one in memory


def test_n_comes_from_the_measured_write_and_step_times(tmp_path, shm):
    """A disk that takes 0.2 s a write under steps of a few milliseconds, busy at most a quarter of
    the time: after the first write, which measures it, none until the close."""

    def slow_disk() -> None:
        time.sleep(0.2)

    w = make("mlp", 0)
    arm("tier.persist", action=slow_disk, repeat=True)
    try:
        with attach(w, tmp_path / "c", "checkfreq", keep=100, memory=True,
                          region=f"{shm}/rank-{{rank}}.bin", busy=0.25) as ckpt:
            ckpt.restore()
            loop(w, ckpt, 0, 40)
            ckpt.wait()
            tier = ckpt.strategy.tier
            step_seconds = 0.2 / (0.25 * tier.interval())
            assert tier.interval() > 40 and step_seconds < 0.05  # (a step, as measured, of at most 50 ms)
    finally:
        disarm("tier.persist")
    directory = CheckpointDirectory.open(tmp_path / "c", access="read")
    assert sorted(m.step for m in directory.fulls()) == [1, 40]


def _slots(path: Path) -> list[int]:
    """The complete slots of the region at ``path``, newest first."""
    region = Region.open(path, access="read")
    try:
        return [s.slot for s in region.slots()]
    finally:
        region.close()


def _flip(path: Path, slot: int) -> None:
    """Flip a byte in the middle of the largest tensor of the region's ``slot``."""
    region = Region.open(path, access="read")
    try:
        manifest = next(r.manifest for r in region.objects.manifests() if r.manifest and r.manifest.meta["slot"] == slot)
        offset, nbytes = region.objects.object_location(max(manifest.objects.values(), key=lambda o: o.nbytes))
    finally:
        region.close()
    with open(path, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def _crashed(root: Path, w, steps: int, options: dict) -> dict[int, str]:
    """Train ``steps`` steps and fail with an error (nothing persisted at the end, the region left as
    a crash leaves it): each step's live state hash."""
    hashes = {}
    with pytest.raises(RuntimeError, match="training failed"):
        with attach(w, root, **options) as ckpt:
            ckpt.restore()
            for t in range(1, steps + 1):
                loop(w, ckpt, t - 1, t)
                hashes[t] = live_hash(w, t)
            ckpt.wait()
            raise RuntimeError("training failed")
    return hashes


@pytest.mark.parametrize("strategy", ["lightcheck", "checkfreq", "gockpt:device"])
def test_a_restore_from_memory_leaves_the_slot_as_it_was_and_the_live_objects_their_own_memory(tmp_path, shm,
                                                                                               strategy):
    """The region's writer verifies a slot where it lies and loads from it: whatever the live objects
    keep is memory of their own, or lent out of the slot's private mapping (which holds none of the
    writer's locks: the next run takes the region), writing into every tensor of theirs (as
    training does) leaves the slot as it was, and the next restore reads the same state from it."""
    name = strategy.split(":")[0]
    options = {"every": 1, "region": f"{shm}/rank-{{rank}}.bin", "persist_every": 4} if name == "lightcheck" else \
        {"every": 3, **_options(strategy, shm, parts=3)} if strategy == "gockpt:device" else \
        {"every": 1, **_options(strategy, shm)}  # (gockpt: three parts, each brought forward by the updates after it)
    hashes = _crashed(tmp_path / "c", make("mlp", 0), 7, {"strategy": name, **options})
    restored = []
    for _ in range(2):
        w = make("mlp", 0)
        with pytest.raises(RuntimeError, match="training failed"), warnings.catch_warnings():
            warnings.simplefilter("error")  # (a slot skipped as damaged: a warning)
            with attach(w, tmp_path / "c", strategy=name, **options) as again:
                restored.append(step := again.restore())
                assert step > 0 and again.recovered.source.startswith(("memory", "region"))
                assert live_hash(w, step) == hashes[step]
                with torch.no_grad():
                    tensors = [*w.model.parameters(), *(v for state in w.optimizer.state.values()
                                                        for v in state.values() if isinstance(v, torch.Tensor))]
                    for t in tensors:
                        t.add_(1)
                raise RuntimeError("training failed")
    assert restored[1] == restored[0]


def test_recovery_takes_the_newest_of_memory_and_directory_and_is_bitwise(tmp_path, shm):
    w = make("mlp", 0)
    options = dict(strategy="checkfreq", memory=True, region=f"{shm}/rank-{{rank}}.bin", persist_every=4)
    hashes = _crashed(tmp_path / "c", w, 7, options)  # slots of 5 and 6 in memory, step 4 on disk
    w2 = make("mlp", 0)
    with attach(w2, tmp_path / "c", **options) as again:
        assert again.restore() == 6 and again.recovered.source == "memory"
        assert live_hash(w2, 6) == hashes[6]
        assert again.stats.last_durable_step == 4  # (what a host loss would leave)


def test_a_damaged_region_is_skipped_by_name_and_the_directory_recovers(tmp_path, shm):
    w = make("mlp", 0)
    options = dict(strategy="checkfreq", memory=True, region=f"{shm}/rank-{{rank}}.bin", persist_every=2)
    hashes = _crashed(tmp_path / "c", w, 6, options)  # slots of 4 and 5 in memory, step 4 on disk
    for slot in _slots(shm / "rank-0.bin"):
        _flip(shm / "rank-0.bin", slot)
    w2 = make("mlp", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with attach(w2, tmp_path / "c", **options) as again:
            assert again.restore() == 4 and again.recovered.source == "disk"
            assert live_hash(w2, 4) == hashes[4]
    assert any("rank-0.bin" in str(c.message) and "fails its checksum" in str(c.message) for c in caught), \
        [str(c.message) for c in caught]


def test_a_region_of_another_run_is_refused_and_left_as_it_is(tmp_path, shm):
    w = make("mlp", 0)
    region = f"{shm}/rank-{{rank}}.bin"
    with attach(w, tmp_path / "a", "checkfreq", memory=True, region=region) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 2)
    before = (shm / "rank-0.bin").read_bytes()
    with pytest.raises(CheckpointDirectoryError, match="belongs to another checkpoint directory"):
        attach(w, tmp_path / "b", "checkfreq", memory=True, region=region)
    assert (shm / "rank-0.bin").read_bytes() == before


def test_the_default_region_lies_in_memory_and_goes_at_a_clean_close(tmp_path):
    w = make("mlp", 0)
    path = memory_path(tmp_path / "c", None, 0, 1)
    assert path.is_relative_to("/dev/shm") and f"everystep-{os.geteuid()}" in str(path)
    try:
        with attach(w, tmp_path / "c", "full_sync", memory=True) as ckpt:
            ckpt.restore()
            loop(w, ckpt, 0, 3)
            assert path.exists() and not ckpt.strategy.tier.region.flush  # in memory: nothing to flush
        assert not path.exists()  # its newest checkpoint is in the directory
        directory = CheckpointDirectory.open(tmp_path / "c", access="read")
        assert directory.newest_full_step() == 3
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def test_a_folder_of_memory_tiers_others_could_change_is_refused_by_name(tmp_path, shm, monkeypatch):
    """The user's folder of memory tiers has a name known in advance: one that another user made, or
    that others may write, is refused before anything is written there."""
    from everystep.storage.region import paths
    from everystep.storage.region.slots import UntrustedRegionError

    monkeypatch.setattr(paths, "MEMORY_ROOT", shm)
    theirs = shm / f"everystep-{os.geteuid()}"
    theirs.mkdir()
    theirs.chmod(0o777)
    w = make("mlp", 0)
    with pytest.raises(UntrustedRegionError, match=f"{theirs}.*lets others replace the files in it"):
        attach(w, tmp_path / "c", "checkfreq", memory=True)
    assert not list(theirs.iterdir())


@pytest.mark.parametrize("options, match", [
    ({"persist_every": 3}, "configure the memory tier: give memory=True"),
    ({"memory": True, "persist_every": 0}, "persist_every must be a positive number"),
    ({"memory": True, "busy": 0}, "busy must be a share of the time"),
    ({"memory": True, "persist": "process"}, "give one of them"),
])
def test_options_of_the_memory_tier_are_checked_by_name(tmp_path, options, match):
    w = make("mlp", 0)
    with pytest.raises(ConfigError, match=match):
        attach(w, tmp_path / "c", "checkfreq", **options)


def test_a_refused_option_makes_no_memory_tier(tmp_path, shm):
    w = make("mlp", 0)
    with pytest.raises(ConfigError, match="brings each part of a parameter forward on its own"):
        Checkpointer(tmp_path / "c", w.model, torch.optim.LBFGS(w.model.parameters()), strategy="gockpt", memory=True,
                     region=f"{shm}/rank-{{rank}}.bin")
    assert not list(shm.iterdir())  # nothing made


def test_state_written_by_the_tier_holds_every_tensor_bitwise(tmp_path, shm):
    """The slot and the checkpoint persisted from it are the live state of their step."""
    w = make("mlp", 0)
    with attach(w, tmp_path / "c", "checkfreq", memory=True,
                      region=f"{shm}/rank-{{rank}}.bin", persist_every=2, final=False) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 2)
        live = {k: v.clone() for k, v in w.model.state_dict().items()}
        loop(w, ckpt, 2, 3)  # (S_2 is handed over once step 3 begins)
        ckpt.wait()
        found = ckpt.strategy.tier.region.newest()
        assert found is not None and found[0].step == 2
        assert all(torch.equal(found[1][f"/model/{k}"], v) for k, v in live.items())


def test_inspect_and_verify_list_the_memory_tiers_slots_and_name_a_damaged_one(tmp_path, capsys):
    from .conftest import call_cli

    w = make("mlp", 0)
    path = memory_path(tmp_path / "c", None, 0, 1)
    try:
        with pytest.raises(RuntimeError):
            with attach(w, tmp_path / "c", "checkfreq", memory=True, persist_every=10) as ckpt:
                ckpt.restore()
                loop(w, ckpt, 0, 3)
                ckpt.wait()
                raise RuntimeError("training failed")  # the region stays, as a crash leaves it
        code, listing, _ = call_cli(capsys, "inspect", str(tmp_path / "c"))
        assert code == 0 and re.search(r"region\s+step\s+2\s.*valid", listing), listing
        newest = _slots(path)[0]
        _flip(path, newest)
        code, out, _ = call_cli(capsys, "verify", str(tmp_path / "c"))
        assert code == 1 and f"{path}:slot{newest}" in out and "fails its checksum" in out, out
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def test_a_reader_recovers_from_the_memory_tier_and_changes_nothing(tmp_path, shm, monkeypatch):
    from everystep.storage.region import paths

    from .conftest import files_of

    monkeypatch.setattr(paths, "MEMORY_ROOT", shm)  # (its default place, in a folder of the test's)
    w = make("mlp", 0)
    hashes = _crashed(tmp_path / "c", w, 5, dict(strategy="checkfreq", memory=True, persist_every=10))
    before = files_of(shm), files_of(tmp_path / "c")
    w2 = make("mlp", 0)
    reader = CheckpointDirectory.open(tmp_path / "c", create=False, access="read")
    with Checkpointer(reader, w2.model, w2.optimizer, scheduler=w2.scheduler, data=w2.data, strategy="checkfreq",
                      memory=True, persist_every=10) as again:
        assert again.restore() == 4 and again.recovered.source == "memory"  # (S_5 is handed over as step 6 begins)
    assert live_hash(w2, 4) == hashes[4]
    assert (files_of(shm), files_of(tmp_path / "c")) == before
    empty = shm / "elsewhere"  # a memory with no tier of this directory: the reader makes no folder there
    empty.mkdir()
    monkeypatch.setattr(paths, "MEMORY_ROOT", empty)
    with Checkpointer(CheckpointDirectory.open(tmp_path / "c", create=False, access="read"), w2.model, w2.optimizer,
                      scheduler=w2.scheduler, data=w2.data, strategy="checkfreq", memory=True) as again:
        again.restore()
    assert not list(empty.iterdir())


def test_a_listing_through_a_writable_directory_makes_no_region(tmp_path, shm, monkeypatch):
    """``verify_store`` on a directory opened for writing (as a test or a tool may) lists the regions
    that are there, and makes none: neither lightcheck's in the directory nor a memory tier in memory."""
    from everystep.inventory import verify_store
    from everystep.storage.region import paths

    from .conftest import files_of

    monkeypatch.setattr(paths, "MEMORY_ROOT", shm)
    w = make("mlp", 0)
    with attach(w, tmp_path / "c", "checkfreq") as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 2)
    before = files_of(tmp_path / "c")
    store = CheckpointDirectory.open(tmp_path / "c")
    try:
        assert verify_store(store) == []
    finally:
        store.close()
    assert not list(shm.iterdir())
    assert set(files_of(tmp_path / "c")) <= set(before) | {"everystep.lock"}


def test_a_clean_close_persists_the_step_restored_from_memory_and_leaves_no_region(tmp_path, shm, monkeypatch):
    """Restored from the region past the directory's newest and closed at once: the close writes that
    step to the directory before the region in its default place goes; a run that committed nothing
    leaves no region either."""
    from everystep.storage.region import paths

    monkeypatch.setattr(paths, "MEMORY_ROOT", shm)
    w = make("mlp", 0)
    options = dict(strategy="checkfreq", memory=True, persist_every=10)
    hashes = _crashed(tmp_path / "c", w, 5, options)  # slots of 3 and 4 in memory, step 1 on disk
    path = memory_path(tmp_path / "c", None, 0, 1)
    w2 = make("mlp", 0)
    with attach(w2, tmp_path / "c", **options) as again:
        assert again.restore() == 4 and again.recovered.source == "memory"
    assert not path.exists()
    assert CheckpointDirectory.open(tmp_path / "c", access="read").newest_full_step() == 4
    w3 = make("mlp", 0)
    with attach(w3, tmp_path / "c", **options) as third:
        assert third.restore() == 4 and third.recovered.source == "disk"
        assert live_hash(w3, 4) == hashes[4]
    with attach(make("mlp", 0), tmp_path / "empty", **options) as nothing:  # (nothing trained, nothing kept)
        nothing.restore()
    assert not memory_path(tmp_path / "empty", None, 0, 1).exists()


def test_a_region_read_hands_on_as_views_only_the_optimizer_state_that_its_load_copies_onto_a_gpu():
    """Which optimizer entries a restore may read out of a slot without a copy: those of parameters
    on a device (``meta`` stands for a GPU here), not step counters, and only where the optimizer's
    load is torch's own — which moves each such entry to its parameter's device, a copy. A tensor
    that stays on the host would otherwise keep pointing into the slot."""
    from everystep.state import replaces_state
    from everystep.strategies.context import LiveShards, LoadFate

    on_host, on_device = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")
    optimizer = torch.optim.AdamW([*on_host.parameters(), *on_device.parameters()])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    live = LiveShards({}, params, {}, onto_devices=replaces_state(optimizer))
    kept, moved, unknown = LoadFate.KEPT, LoadFate.MOVED, LoadFate.UNKNOWN
    assert [live.fate(f"/optimizer/state/{i}/exp_avg") for i in range(4)] == [kept, kept, moved, moved]
    assert live.fate("/optimizer/state/2/step") is unknown  # (a step counter stays where it is: on the host)
    assert live.fate("/optimizer/state/4/exp_avg") is unknown  # (no such parameter)
    assert live.fate("/model/weight") is unknown

    class OwnLoad(torch.optim.AdamW):
        def load_state_dict(self, state_dict):  # (may keep the tensors it is given)
            super().load_state_dict(state_dict)

    own = OwnLoad(params)
    assert not replaces_state(own)
    assert LiveShards({}, params, {}, onto_devices=replaces_state(own)).fate("/optimizer/state/2/exp_avg") is unknown
    in_place = LiveShards({}, params, {}, onto_devices=True, in_place=frozenset({"/optimizer/state/0/exp_avg"}))
    assert in_place.fate("/optimizer/state/0/exp_avg") is LoadFate.IN_PLACE


def test_every_slot_damaged_and_no_full_checkpoint_is_an_error_and_the_region_is_kept(tmp_path, shm):
    """A crashed run's memory tier, both slots damaged, and a directory with no full checkpoint:
    the restart refuses (as lightcheck does), naming the region, and leaves it where it is — it
    neither trains from step 0 nor deletes what may be the only copy of the run."""
    from everystep import NoValidCheckpointError
    from everystep.storage.region.slots import Region

    options = {"memory": True, "region": f"{shm}/rank-{{rank}}.bin", "persist_every": 1000}
    w = make("mlp", 0)
    with pytest.raises(KeyboardInterrupt):
        with attach(w, tmp_path / "c", "checkfreq", every=1, **options) as ckpt:  # (a crash: no final write)
            ckpt.restore()
            loop(w, ckpt, 0, 4)
            ckpt.wait()
            raise KeyboardInterrupt
    path = shm / "rank-0.bin"
    region = Region.open(path, access="read")
    spans = [(s.area_offset, s.meta_nbytes) for s in region.slots(warn=False)]
    region.close()
    raw = bytearray(path.read_bytes())
    for offset, n in spans:
        raw[offset:offset + n] = b"\0" * n
    path.write_bytes(raw)
    again = make("mlp", 0)
    with pytest.raises(NoValidCheckpointError, match=f"its memory tier holds none .* to start over, delete {path}"):
        with attach(again, tmp_path / "c", "checkfreq", every=1, **options) as ckpt:
            ckpt.restore()
    assert path.is_file() and path.read_bytes() == bytes(raw)


def test_a_directory_moved_after_a_crash_finds_its_memory_tier_and_a_copy_does_not_take_it(tmp_path):
    """B8: the memory tier's default place is drawn from the directory's path; the directory records
    where it lies, for that very folder. Moved (renamed) after a crash, it resumes from its tier, and
    its clean close removes it (it was ignored and left in /dev/shm for good); a copy of the directory
    is told its original's tier is not its own, and takes none."""
    import shutil

    from everystep.storage.region.paths import memory_path

    w = make("mlp", 0)
    with pytest.raises(KeyboardInterrupt):
        with attach(w, tmp_path / "c", "checkfreq", every=1, memory=True, persist_every=1000) as ckpt:
            ckpt.restore()
            loop(w, ckpt, 0, 4)
            ckpt.wait()
            raise KeyboardInterrupt  # (a crash: the tier holds the newest steps, the directory none of them)
    tier = memory_path(tmp_path / "c", None, 0, 1)
    assert tier.is_file()
    try:
        shutil.copytree(tmp_path / "c", tmp_path / "copy")
        (tmp_path / "c").rename(tmp_path / "moved")
        again = make("mlp", 0)
        with attach(again, tmp_path / "moved", "checkfreq", every=1, memory=True) as ckpt:
            assert ckpt.restore() >= 3 and ckpt.recovered.source == "memory" and ckpt.strategy.tier.path == tier
        assert not tier.exists()  # (its clean close wrote the directory and removed the tier)
        copy = make("mlp", 0)
        with pytest.warns(UserWarning, match="made for a folder elsewhere \\(a copy of it\\?\\): not used"):
            with attach(copy, tmp_path / "copy", "checkfreq", every=1, memory=True, final=False) as ckpt:
                assert ckpt.strategy.tier.path != tier and ckpt.restore() == 0
    finally:
        shutil.rmtree(tier.parent, ignore_errors=True)
        shutil.rmtree(memory_path(tmp_path / "copy", None, 0, 1).parent, ignore_errors=True)


def test_recover_reads_the_memory_tier_of_a_directory_written_through_the_python_api(tmp_path, capsys):
    """B14: a directory the Python API wrote (no run record), its newest steps in its memory tier
    after a crash: ``everystep recover`` reports the tier's newest step and its state, where it said
    step 0."""
    import shutil

    from everystep.storage.region.paths import memory_path

    from .conftest import call_cli

    w = make("mlp", 0)
    hashes = {}
    with pytest.raises(KeyboardInterrupt):
        with attach(w, tmp_path / "c", "checkfreq", every=1, memory=True, persist_every=1000) as ckpt:
            ckpt.restore()
            for step in range(1, 6):
                loop(w, ckpt, step - 1, step)
                hashes[step] = live_hash(w, step)
            ckpt.wait()
            newest = ckpt.stats.last_memory_step
            raise KeyboardInterrupt
    try:
        code, out, err = call_cli(capsys, "recover", "--dir", str(tmp_path / "c"))
        assert code == 0 and out.split(",")[0] == f"step {newest}" and newest >= 3, (out, err)
        assert out.rstrip().endswith("from memory") and hashes[newest] in out
    finally:
        shutil.rmtree(memory_path(tmp_path / "c", None, 0, 1).parent, ignore_errors=True)


def test_a_memory_tiers_folder_another_user_made_first_moves_the_tier_not_the_job(tmp_path, shm, monkeypatch):
    """B10: another user made ``everystep-UID`` (its name is known in advance) before this user's
    first run. The run keeps its memory tier in a folder of a name no one can know, with a warning;
    a killed run's restart finds it there through the directory's record, recovers from memory, and
    a clean close leaves nothing of it behind."""
    from everystep.storage.region import paths

    if os.geteuid() != 0:
        pytest.skip("making a folder another user owns needs root")
    monkeypatch.setattr(paths, "MEMORY_ROOT", shm)
    squatted = shm / f"everystep-{os.geteuid()}"
    squatted.mkdir(mode=0o755)
    os.chown(squatted, 4242, 4242)
    options = dict(strategy="checkfreq", memory=True, persist_every=10)
    with pytest.warns(RuntimeWarning, match=r"cannot be trusted \(it is owned by uid 4242.*lies in .*everystep-0-"):
        hashes = _crashed(tmp_path / "c", make("mlp", 0), 5, options)
    spare = [p for p in shm.iterdir() if p.name.startswith(f"everystep-{os.geteuid()}-")]
    assert len(spare) == 1 and stat.S_IMODE(spare[0].stat().st_mode) == 0o700
    w = make("mlp", 0)
    with attach(w, tmp_path / "c", **options) as again:
        assert again.restore() == 4 and again.recovered.source == "memory"
        assert live_hash(w, 4) == hashes[4]
    assert sorted(p.name for p in shm.iterdir()) == [squatted.name]  # (the spare folder gone with its tier)
