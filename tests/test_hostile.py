"""I8 and I9 against a hostile or careless user who can write the checkpoint directory or the
region: nothing outside the directory is deleted or written, no foreign region is trusted, a
malformed record is skipped for the one before it, never a traceback or a wrong state.

Each attack is run as the attacker would run it: a manifest re-signed (its checksum proves nothing
about who wrote it), a file swapped for a link, a region made by someone else.
"""

from __future__ import annotations

import json
import os
import re
import stat
import warnings
from pathlib import Path

import pytest
import torch

from everystep import Checkpointer, NoValidCheckpointError, StateMismatchError
from everystep.errors import CheckpointDirectoryError
from everystep.eval.workloads import build
from everystep.state import TrainingComponents
from everystep.tree import state_hash
from everystep.storage import CheckpointDirectory
from everystep.storage.base import checksum
from everystep.storage.region.slots import Region, UntrustedRegionError

from .conftest import files_of


def _train(directory: Path, start_expected: int | None, steps: int, strategy: str = "full_sync", **options):
    """Train the mlp to ``steps`` in ``directory`` (resuming), one checkpoint a step; the workload."""
    w = build("mlp", seed=0)
    with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=strategy,
                      **options) as ckpt:
        start = ckpt.restore()
        if start_expected is not None:
            assert start == start_expected
        for _ in range(start, steps):
            _step(w)
    return w


def _step(w) -> None:
    """One training step of the workload ``w``."""
    w.loss(w.data.next()).backward()
    w.optimizer.step()
    w.optimizer.zero_grad()
    w.scheduler.step()


def _resign(directory: Path, filename: str, body: dict) -> None:
    """Store ``body`` as the manifest ``filename``, its checksum recomputed as an attacker would."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["checksum"] = checksum(raw)
    (directory / "manifests" / filename).write_text(json.dumps(body))


def _body(directory: Path, step: int) -> dict:
    return json.loads((directory / "manifests" / f"full-{step:012d}.json").read_text())


@pytest.mark.parametrize("attack", ["absolute", "climbing", "kind"])
def test_a_resigned_manifest_naming_paths_outside_makes_nothing_outside_deleted(tmp_path, attack):
    """Item 1: an old manifest re-signed with an object named ``/abs/victim`` or ``../../victim``,
    or a kind ``../../victim/k``, is skipped with a warning; the next run's retention deletes
    nothing outside the directory and no kept checkpoint."""
    root = tmp_path / "c"
    _train(root, 0, 3, keep=3)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"keep me")
    (victim / "k-000000000001.json").write_bytes(b"keep me too")
    body = _body(root, 1)
    if attack == "absolute":
        body["objects"]["tensors"]["name"] = str(victim / "precious")
    elif attack == "climbing":
        body["objects"]["tensors"]["name"] = "../../victim/precious"
    else:
        body["kind"] = "../../victim/k"
    _resign(root, "full-000000000001.json", body)
    outside = files_of(victim)
    with pytest.warns(UserWarning, match="not one everystep writes"):
        _train(root, 3, 6, keep=1)
    assert files_of(victim) == outside
    assert (root / "manifests" / "full-000000000006.json").exists()
    assert _train(root, 6, 6, keep=1) is not None  # the kept checkpoint restores


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me" * 100)
    return victim


@pytest.mark.parametrize("link", ["symbolic", "hard"])
@pytest.mark.parametrize("strategy,options", [("full_sync", {}), ("checkfreq", {"persist": "process"})])
def test_an_object_swapped_for_a_link_is_never_written_through(tmp_path, link, strategy, options):
    """Item 2: the file of a checkpoint that retention will discard is swapped for a link to a file
    outside; retention keeps discarded files to write over, and the next write refuses the link
    (a warning names it) instead of writing the checkpoint's bytes into its target."""
    root, victim = tmp_path / "c", _victim(tmp_path)
    before = victim.read_bytes()
    w = build("mlp", seed=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Checkpointer(root, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=strategy, keep=1,
                          **options) as ckpt:
            ckpt.restore()
            for step in range(1, 7):
                _step(w)
                ckpt.wait()
                for path in (root / "objects").iterdir():
                    if not path.name.startswith(".") and not path.is_symlink() and path.stat().st_nlink == 1:
                        path.unlink()
                        if link == "symbolic":
                            path.symlink_to(victim)
                        else:
                            os.link(victim, path)
    assert victim.read_bytes() == before
    if "persist" not in options:  # (the writer process warns in its own process)
        assert any(("not followed" if link == "symbolic" else "hard link") in str(m.message) for m in seen)


def _region_attack(tmp_path: Path, mode: int) -> Path:
    region = tmp_path / "shm" / "region.bin"
    region.parent.mkdir()
    region.touch()
    os.chmod(region, mode)
    return region


def test_a_region_others_can_write_is_refused_by_name(tmp_path):
    """Item 3: a region file that others can write (pre-created 0666, as another user would in
    /dev/shm), or a symbolic link, is refused, naming the file and what is wrong; so is a
    ``region/`` folder that is a link out of the directory."""
    region = _region_attack(tmp_path, 0o666)
    with pytest.raises(UntrustedRegionError, match=r"region\.bin cannot be trusted: its mode -rw-rw-rw-"):
        _train(tmp_path / "c", 0, 2, strategy="lightcheck", region=str(region))
    region.unlink()
    region.symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(UntrustedRegionError, match="symbolic link"):
        _train(tmp_path / "c", 0, 2, strategy="lightcheck", region=str(region))
    assert not (tmp_path / "elsewhere.bin").exists()
    root = tmp_path / "d"
    _train(root, 0, 2, strategy="lightcheck")
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in (root / "region").iterdir():
        f.unlink()
    (root / "region").rmdir()
    (root / "region").symlink_to(outside)
    with pytest.raises(UntrustedRegionError, match="is a symbolic link"):
        _train(root, None, 4, strategy="lightcheck")
    assert list(outside.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_region_of_another_user_is_refused(tmp_path):
    region = _region_attack(tmp_path, 0o600)
    os.chown(region, 65534, 65534)
    with pytest.raises(UntrustedRegionError, match="owned by uid 65534"):
        _train(tmp_path / "c", 0, 2, strategy="lightcheck", region=str(region))


def _region_of(root: Path) -> Path:
    return root / "region" / "rank-0.bin"


def test_a_zeroed_region_header_is_never_made_anew_silently(tmp_path):
    """Item 5: a region whose header does not parse is not overwritten: with no full checkpoint in
    the directory the writer refuses (saying how to start over), file untouched; with one, it
    resumes from it with a warning and makes the region anew."""
    root = tmp_path / "c"
    _train(root, 0, 4, strategy="lightcheck", persist_every=0, final=False)
    path = _region_of(root)
    raw = bytearray(path.read_bytes())
    raw[:64] = bytes(64)
    path.write_bytes(raw)
    with pytest.raises(CheckpointDirectoryError, match="to start over, delete"):
        _train(root, None, 6, strategy="lightcheck")
    assert path.read_bytes() == raw
    _train(tmp_path / "d", 0, 3, strategy="lightcheck", persist_every=2, final=False)
    other = _region_of(tmp_path / "d")
    other.write_bytes(bytes(4096) + other.read_bytes()[4096:])
    with pytest.warns(UserWarning, match="resumes from the full checkpoints"):
        _train(tmp_path / "d", 2, 5, strategy="lightcheck")


def _damage_slots(path: Path, which: list[int]) -> None:
    region = Region.open(path, access="read")
    spans = []
    try:
        for slot in region.slots(warn=False):
            if slot.slot in which:
                spans.append((slot.area_offset, slot.meta_nbytes))
    finally:
        region.close()
    raw = bytearray(path.read_bytes())
    for offset, n in spans:
        raw[offset + n // 2] ^= 0xFF
    path.write_bytes(raw)


def test_both_region_slots_damaged_and_no_full_checkpoint_is_an_error_not_step_0(tmp_path):
    """Item 7: as a directory whose every checkpoint fails: NoValidCheckpointError, not step 0."""
    root = tmp_path / "c"
    _train(root, 0, 3, strategy="lightcheck", persist_every=0, final=False)
    _damage_slots(_region_of(root), [0, 1])
    with pytest.warns(UserWarning, match="skipping"), pytest.raises(NoValidCheckpointError, match="complete slot"):
        _train(root, None, 5, strategy="lightcheck")


def newest_slot_meta(path: Path):
    """The region file's newest complete slot, the file's bytes, and that slot's metadata as JSON."""
    store = Region.open(path, access="read")
    try:
        newest = store.slots(warn=False)[0]
    finally:
        store.close()
    raw = bytearray(path.read_bytes())
    return newest, raw, json.loads(bytes(raw[newest.area_offset:newest.area_offset + newest.meta_nbytes]))


def _rewrite_slot_meta(path: Path, edit) -> int:
    """Rewrite the metadata of the newest slot with ``edit(meta)``, its digests recomputed (the
    metadata's in its header, the header's own), as someone with the file would."""
    import xxhash

    from everystep.storage.region import slots as rg

    newest, raw, meta = newest_slot_meta(path)
    start = newest.area_offset
    body = json.dumps(edit(meta)).encode()
    raw[start:start + len(body)] = body
    at = (1 + newest.slot) * rg.PAGE
    header = rg._SLOT.pack(rg._SLOT_MAGIC, rg._COMPLETE, newest.slot, newest.step, newest.generation,
                           newest.area_offset, newest.area_nbytes, len(body), xxhash.xxh3_128_digest(body))
    raw[at:at + len(header) + 16] = header + xxhash.xxh3_128_digest(header)
    path.write_bytes(raw)
    return newest.step


def _relabel(meta):
    meta["skeleton"]["step"] -= 1
    return meta


def _missing_tensor(meta):
    meta["tensors"] = meta["tensors"][1:]
    return meta


def _deep(meta):
    node = meta["skeleton"]["data"] = []
    for _ in range(200):
        node.append([])
        node = node[0]
    return meta


@pytest.mark.parametrize("edit", [_relabel, _missing_tensor, _deep, lambda m: [m], lambda m: "slot",
                                  lambda m: {**m, "data_nbytes": -5}, lambda m: {**m, "tensors": [[1, 2]]}],
                         ids=["relabelled", "missing-tensor", "deep", "list", "string", "negative", "short-row"])
def test_malformed_region_metadata_falls_back_to_the_older_slot(tmp_path, edit):
    """Items 6 and 8: metadata that passes its checksum but is malformed (or names another step than
    its state holds) makes the slot unreadable, with a warning, and the older slot is restored,
    bitwise S_{k-1}."""
    root = tmp_path / "c"
    hashes = {}
    w = build("mlp", seed=0)
    with Checkpointer(root, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="lightcheck",
                      persist_every=0, final=False) as ckpt:
        ckpt.restore()
        for step in range(1, 5):
            _step(w)
            c = TrainingComponents(model=w.model, optimizer=w.optimizer, scheduler=w.scheduler, data=w.data)
            hashes[step] = state_hash({**c.capture(), **c.capture_boundary()})  # S_step, as restore builds it
    newest = _rewrite_slot_meta(_region_of(root), edit)
    w2 = build("mlp", seed=5)
    w2.data.seed = 0
    with pytest.warns(UserWarning, match="slot"):
        with Checkpointer(root, w2.model, w2.optimizer, scheduler=w2.scheduler, data=w2.data, strategy="lightcheck",
                          final=False) as again:
            assert again.restore() == newest - 1
    c = TrainingComponents(model=w2.model, optimizer=w2.optimizer, scheduler=w2.scheduler, data=w2.data)
    assert state_hash({**c.capture(), **c.capture_boundary()}) == hashes[newest - 1]


def _find(node, key):
    """The first value under ``key`` anywhere in a JSON tree."""
    if isinstance(node, dict):
        if key in node:
            return node[key]
        node = list(node.values())
    if isinstance(node, list):
        for v in node:
            found = _find(v, key)
            if found is not None:
                return found
    return None


def test_a_rejected_spread_checkpoint_leaves_nothing_in_the_live_objects(tmp_path):
    """Item 4: spread checkpoints re-signed with one update fewer to bring their parts forward fail
    the check of its counters; with no other checkpoint, restore() gives step 0 and the live model,
    optimizer, RNG and data position are exactly what they were (a fresh start), bitwise."""
    from .test_checkpointer import live_hash

    options = {"every": 4, "parts": 3, "chunk_bytes": 4096, "reconstruct": "device", "final": False}
    w = build("gpt2-tiny", seed=1)
    root = tmp_path / "c"
    with Checkpointer(root, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="gockpt",
                      **options) as ckpt:
        for _ in range(12):
            _step(w)
    for path in (root / "manifests").iterdir():
        body = json.loads(path.read_text())
        if body["kind"] == "full":
            path.unlink()  # no other checkpoint to fall back to
            continue
        records = _find(body["meta"], "records")
        assert records, "a spread checkpoint brings its parts forward by the updates it records"
        records.pop()
        _resign(root, path.name, body)
    torch.manual_seed(123)
    fresh, again = build("gpt2-tiny", seed=2), build("gpt2-tiny", seed=2)
    fresh.data.seed = again.data.seed = 1  # the checkpoint's data position would load
    before = live_hash(fresh, 0)
    assert live_hash(again, 0) == before
    with pytest.warns(UserWarning, match="skipping the spread checkpoint at step 11"):
        with Checkpointer(root, again.model, again.optimizer, scheduler=again.scheduler, data=again.data,
                          strategy="gockpt", **options) as ckpt:
            assert ckpt.restore() == 0
            assert live_hash(again, 0) == before


# -- fuzzing: any value in any field, re-signed ------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from everystep.errors import EverystepError  # noqa: E402

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False)
    | st.sampled_from([1e30, -1.0, 0, 10**12, "..", "/abs/victim", "../../victim", "full", "x" * 300]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _paths(node, path=()):
    """Every path to a node of a JSON tree (dict keys and list indexes)."""
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


def _replace(node, path, value):
    if not path:
        return value
    node[path[0]] = value if len(path) == 1 else _replace(node[path[0]], path[1:], value)
    return node


_CONTENT = (("meta", "skeleton"), ("meta", "end"), ("meta", "steps"), ("meta", "spread", "scalars"),
            ("meta", "spread", "records"), ("skeleton",))
"""Where a manifest (or a region slot's metadata) holds the state's own values, not the checkpoint's
structure: the scalars of the state tree, each step's context (learning rates, what an update
reads). Re-signed, a forged value there is a state as valid as any (a checksum proves nothing about
who wrote it) and is loaded as written; a field anywhere else may end in a fallback or an error, and a
state restored is bitwise the run's."""


def _forges_content(path: tuple) -> bool:
    return any(path[:len(prefix)] == prefix for prefix in _CONTENT)


_FUZZED = {"full_sync": {}, "lowdiff": {"every": 3}, "gockpt": {"every": 2, "parts": 2, "chunk_bytes": 2048,
                                                               "reconstruct": "device"}}


@pytest.fixture(scope="module")
def fuzz_dirs(tmp_path_factory):
    """A small run of each kind of checkpoint (full, differential chain, spread), made once, with the
    hash of the run's state at each step."""
    from .test_checkpointer import live_hash, make

    made = {}
    for strategy, options in _FUZZED.items():
        root = tmp_path_factory.mktemp(strategy) / "c"
        w = make("mlp", 0, strategy)
        hashes = {0: live_hash(w, 0)}
        with Checkpointer(root, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, compression=w.compression,
                          strategy=strategy, final=False, keep=5, **options) as ckpt:
            ckpt.restore()
            for t in range(1, 7):
                _step(w)
                hashes[t] = live_hash(w, t)
        made[strategy] = root, hashes
    return made


def _restore_after(root: Path, strategy: str):
    """Restore a copy of ``root`` with a fresh workload: the step and the hash of the state restored,
    or the EverystepError raised."""
    from .test_checkpointer import live_hash, make

    w = make("mlp", 0, strategy)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Checkpointer(root, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                              compression=w.compression, strategy=strategy, final=False, **_FUZZED[strategy]) as ckpt:
                step = ckpt.restore()
                return step, live_hash(w, step)
    except EverystepError as e:
        return e


@pytest.mark.parametrize("strategy", sorted(_FUZZED))
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_in_any_manifest_field_ends_in_a_fallback_or_one_clear_error(tmp_path_factory, fuzz_dirs, strategy,
                                                                               data):
    """Every field of a committed manifest (full, differential, spread) replaced by a random JSON
    value and re-signed: restore() falls back to an older point or raises one EverystepError,
    never another exception; a point restored is bitwise the run's state there, unless the field
    forged is one of the state's own values (:data:`_CONTENT`); nothing outside the directory is touched."""
    import shutil

    root = tmp_path_factory.mktemp("fuzz") / "c"
    made, hashes = fuzz_dirs[strategy]
    shutil.copytree(made, root, symlinks=True)
    (root.parent / "victim").write_bytes(b"keep me")  # beside the directory: what an escape would reach first
    names = sorted(p.name for p in (root / "manifests").iterdir())
    name = data.draw(st.sampled_from(names), label="manifest")
    body = json.loads((root / "manifests" / name).read_text())
    body.pop("checksum")
    path = data.draw(st.sampled_from([p for p in _paths(body) if p]), label="field")
    _resign(root, name, _replace(body, path, data.draw(_JSON, label="value")))
    result = _restore_after(root, strategy)
    assert isinstance(result, (tuple, EverystepError)), result
    if isinstance(result, tuple):  # a step the run passed through, and bitwise its state there
        step, restored = result
        assert 0 <= step <= 6 and (restored == hashes[step] or _forges_content(path)), (step, path)
    assert sorted(p.name for p in root.parent.iterdir()) == ["c", "victim"]
    assert (root.parent / "victim").read_bytes() == b"keep me"


def test_a_spread_chunk_resigned_to_another_range_is_a_fallback_not_a_crash(tmp_path_factory, fuzz_dirs):
    """A case the fuzzer found: a spread checkpoint's chunk re-signed to start elsewhere, so that the
    gradients it holds no longer fit it: skipped for the checkpoint before, not a RuntimeError."""
    import shutil

    root = tmp_path_factory.mktemp("chunk") / "c"
    made, hashes = fuzz_dirs["gockpt"]
    shutil.copytree(made, root, symlinks=True)
    name = "spread-000000000004.json"
    body = json.loads((root / "manifests" / name).read_text())
    x = next(x for x, chunk in enumerate(body["meta"]["spread"]["chunks"]) if chunk[2] > 0)  # one inside its parameter
    _resign(root, name, _replace(body, ("meta", "spread", "chunks", x, 2), 0))  # made to start at 0: longer
    result = _restore_after(root, "gockpt")
    assert isinstance(result, tuple) and result[1] == hashes[result[0]], result


@pytest.mark.parametrize("field, value", [("capturable", True), ("betas", [True, 0.999])])
def test_a_spread_update_resigned_with_settings_its_optimizer_refuses_is_a_fallback_not_a_crash(
        tmp_path_factory, fuzz_dirs, field, value):
    """Cases the fuzzer found: an update's settings in a spread checkpoint re-signed so that AdamW
    refuses to replay it (capturable on the CPU; a beta of 1, a division by zero): the checkpoint
    is skipped for the one before, not an AssertionError or a ZeroDivisionError."""
    import shutil

    root = tmp_path_factory.mktemp("settings") / "c"
    made, hashes = fuzz_dirs["gockpt"]
    shutil.copytree(made, root, symlinks=True)
    name = "spread-000000000004.json"
    body = json.loads((root / "manifests" / name).read_text())
    _resign(root, name, _replace(body, ("meta", "spread", "records", 0, "groups", 0, field), value))
    result = _restore_after(root, "gockpt")
    assert isinstance(result, tuple) and result[0] < 4 and result[1] == hashes[result[0]], result


@pytest.fixture(scope="module")
def fuzz_region(tmp_path_factory):
    """A region of the mlp's first 4 steps, and the hash of the run's state at each step."""
    from .test_checkpointer import live_hash

    root = tmp_path_factory.mktemp("region") / "c"
    _train(root, 0, 4, strategy="lightcheck", persist_every=0, final=False)
    w = build("mlp", seed=0)  # the same run again, without checkpointing
    hashes = {0: live_hash(w, 0)}
    for t in range(1, 5):
        _step(w)
        hashes[t] = live_hash(w, t)
    return root, hashes


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_in_any_region_metadata_field_falls_back_to_the_older_slot(tmp_path_factory, fuzz_region, data):
    """Every field of the newest slot's metadata replaced by a random JSON value, its digests
    recomputed: the slot is restored only if it still reads as a state of its step, else the older
    slot is, bitwise the run's state (unless the value forged is one of the state's own); never
    another exception than an EverystepError."""
    import shutil

    root = tmp_path_factory.mktemp("fuzzr") / "c"
    made, hashes = fuzz_region
    shutil.copytree(made, root, symlinks=True)
    value = data.draw(_JSON, label="value")
    chosen = []

    def edit(meta):
        path = data.draw(st.sampled_from([p for p in _paths(meta) if p]), label="field")
        chosen.append(path)
        return _replace(meta, path, value)

    newest = _rewrite_slot_meta(_region_of(root), edit)
    result = _restore_lightcheck(root)
    assert isinstance(result, (tuple, EverystepError)), result
    if isinstance(result, tuple):  # that slot or the older one, bitwise the run's state at its step
        step, restored = result
        assert step in (newest, newest - 1) and (restored == hashes[step] or _forges_content(chosen[0])), (step, chosen)


def _restore_lightcheck(root: Path):
    """As :func:`_restore_after`, for the region."""
    from .test_checkpointer import live_hash

    w = build("mlp", seed=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Checkpointer(root, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="lightcheck",
                              final=False) as ckpt:
                step = ckpt.restore()
                return step, live_hash(w, step)
    except EverystepError as e:
        return e


# -- items 9, 15, 18: wrong types and kinds, one clear error -----------------------------------

@pytest.mark.parametrize("field,value", [(("meta",), []), (("meta", "skeleton"), 7), (("meta", "parts"), 7),
                                         (("step",), 10**30), (("objects",), "x")])
def test_a_resigned_manifest_with_a_field_of_another_type_is_skipped_for_the_one_before(tmp_path, field, value):
    """Item 9: the newest manifest re-signed with a field of a wrong type (or a step of 10^30) is
    skipped with a warning and the checkpoint before it restored."""
    root = tmp_path / "c"
    _train(root, 0, 3, keep=3)
    body = _body(root, 3)
    body.pop("checksum")
    _resign(root, "full-000000000003.json", _replace(body, field, value))
    with pytest.warns(UserWarning, match="skipping"):
        _train(root, 2, 2)


def test_an_optimizer_of_another_kind_is_refused_at_restore_naming_both(tmp_path):
    """Item 15: an AdamW checkpoint restored into SGD (and the reverse) is refused at restore(),
    nothing loaded, instead of a KeyError in the first step."""
    root = tmp_path / "c"
    _train(root, 0, 2)
    w = build("mlp", seed=0)
    sgd = torch.optim.SGD(w.model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(StateMismatchError, match=r"the optimizer \(SGD\) has the settings .*lack .*'momentum'.*another optimizer"):
        with Checkpointer(root, w.model, sgd, data=w.data, scheduler=None, strategy="full_sync", final=False) as c:
            c.restore()


def test_arguments_of_a_wrong_type_are_named():
    """Item 18: the Checkpointer names the Python argument of a wrong type; strategy options too."""
    w = build("mlp", seed=0)
    cases = [({"model": "x"}, "model must be a torch.nn.Module"),
             ({"optimizer": None}, "optimizer must be a torch.optim.Optimizer"),
             ({"scheduler": 3}, "scheduler must have state_dict"),
             ({"every": "3"}, "every must be a whole number, got '3'"),
             ({"every": 2.5}, "every must be a whole number"),
             ({"keep": 1.5}, "keep must be a whole number"),
             ({"final": "yes"}, "final must be True or False"),
             ({"deadline": float("nan")}, "deadline must be a finite number"),
             ({"strategy": "lightcheck", "flush": "maybe"}, "flush must be True or False or None")]
    for extra, message in cases:
        args = {"model": w.model, "optimizer": w.optimizer, "strategy": "none", **extra}
        with pytest.raises((TypeError, ValueError), match=re.escape(message)):
            Checkpointer(None, **args)


def test_a_damaged_newest_dcp_checkpoint_is_skipped_and_its_step_written_again(tmp_path):
    """Item 12: the newest DCP checkpoint fails to verify; the run resumes from the one before and
    writes that step again over the damaged one's files (no 'Directory not empty')."""
    root = tmp_path / "c"
    _train(root, 0, 3, full_format="dcp", keep=3)
    [data] = sorted((root / "objects" / "full-000000000003.dcp").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(raw)
    with pytest.warns(UserWarning, match="skipping the checkpoint at step 3"):
        _train(root, 2, 5, full_format="dcp", keep=3)
    assert _train(root, 5, 5, full_format="dcp", keep=3) is not None


def test_a_stopped_writer_process_ends_training_with_an_error_not_a_wait(tmp_path):
    """Item 14: the writer process stopped (SIGSTOP): the write goes unanswered for writer_timeout
    seconds, then training fails naming the writer and the option, and close() does not hang."""
    import signal

    from everystep.errors import BackgroundWriteError

    w = build("mlp", seed=0)
    with pytest.raises(BackgroundWriteError, match=r"has not answered the write of step \d+ in 1 s.*writer_timeout"):
        with Checkpointer(tmp_path / "c", w.model, w.optimizer, data=w.data, strategy="checkfreq", persist="process",
                          writer_timeout=1.0) as ckpt:
            ckpt.restore()
            os.kill(ckpt.strategy._writer.process.pid, signal.SIGSTOP)
            for _ in range(4):
                w.loss(w.data.next()).backward()
                w.optimizer.step()
                w.optimizer.zero_grad()
            ckpt.wait()


def test_verify_beside_a_live_writer_reports_only_what_is_wrong(tmp_path):
    """Item 11: an object renamed into place whose manifest is not committed yet is a write in
    progress while its writer holds the directory, and a leftover once it is gone."""
    from everystep.inventory import verify_store

    root = tmp_path / "c"
    _train(root, 0, 2)
    writer = CheckpointDirectory.open(root, strategy="full_sync")
    try:
        writer.catalog.write_object("full-000000000003.safetensors", [b"not committed yet"])
        reader = CheckpointDirectory.open(root, create=False, access="read")
        assert verify_store(reader) == []
    finally:
        writer.close()
    reader = CheckpointDirectory.open(root, create=False, access="read")
    assert [p.split(": ")[1] for p in verify_store(reader)] == ["no checkpoint names this file"]


def test_a_clean_lowdiff_plus_run_leaves_nothing_verify_objects_to(tmp_path):
    """Item 13: the agent closes its store when it exits: no file kept to write over stays behind."""
    from everystep.inventory import verify_store

    root = tmp_path / "c"
    _train(root, 0, 6, strategy="lowdiff_plus", every=2)
    assert not [p.name for p in (root / "objects").iterdir() if p.name.startswith(".tmp-")]
    assert verify_store(CheckpointDirectory.open(root, create=False, access="read")) == []


@pytest.mark.parametrize("make_optimizer", [
    lambda ps: torch.optim.Adafactor(ps, lr=0.01),  # its entries differ by the parameter's shape
    lambda ps: torch.optim.Adam([{"params": ps[:1], "amsgrad": True}, {"params": ps[1:]}], lr=0.01),
    lambda ps: torch.optim.SGD([{"params": ps[:1], "momentum": 0.9}, {"params": ps[1:]}], lr=0.01)],
    ids=["adafactor", "adam-amsgrad-in-one-group", "sgd-momentum-in-one-group"])
def test_the_checks_before_loading_refuse_no_real_optimizer_state(tmp_path, make_optimizer):
    """What restore checks before loading holds for states real optimizers make: entries that
    differ by the parameter's shape or by group, a 0-d parameter, a scheduler made after restore."""
    def parts():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        model.register_parameter("temperature", torch.nn.Parameter(torch.tensor(1.0)))
        return model, make_optimizer(list(model.parameters()))

    def step(model, opt):
        (model(torch.randn(2, 4)) * model.temperature).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = parts()
    with Checkpointer(tmp_path / "c", model, opt, strategy="full_sync") as ckpt:
        ckpt.restore()
        step(model, opt)
        step(model, opt)
    saved = state_hash(opt.state_dict())
    model2, opt2 = parts()
    with Checkpointer(tmp_path / "c", model2, opt2, strategy="full_sync") as ckpt:
        assert ckpt.restore() == 2
        assert state_hash(opt2.state_dict()) == saved
        torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)  # made after restore: adds initial_lr to the groups
        step(model2, opt2)  # and the final checkpoint, step 3, holds them
    saved = state_hash(opt2.state_dict())
    assert "initial_lr" in opt2.state_dict()["param_groups"][0]
    model3, opt3 = parts()  # an optimizer without a scheduler: its groups lack initial_lr
    with Checkpointer(tmp_path / "c", model3, opt3, strategy="full_sync", final=False) as ckpt:
        assert ckpt.restore() == 3
    assert state_hash(opt3.state_dict()) == saved


def test_dcp_metadata_resigned_with_a_huge_tensor_allocates_nothing(tmp_path):
    """A DCP checkpoint's metadata (admitted by the restricted unpickler) re-signed to describe a
    tensor of 10^12 elements is refused before anything is allocated from it, and the checkpoint
    before it restored."""
    import pickle

    from everystep.storage.formats.dcp import load_metadata

    from .test_trust import _poison_dcp

    root = tmp_path / "c"
    _train(root, 0, 3, full_format="dcp", keep=3)
    metadata = load_metadata(root / "objects" / "full-000000000003.dcp" / ".metadata")
    key = next(k for k, md in metadata.state_dict_metadata.items() if hasattr(md, "size"))
    metadata.state_dict_metadata[key].size = torch.Size([10**12])
    _poison_dcp(root, 3, pickle.dumps(metadata))
    with pytest.warns(UserWarning, match="describes more bytes than its"):
        _train(root, 2, 2, full_format="dcp", keep=3)


# -- the third round: the directory's own folders and files -------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "link to a fifo"])
def test_a_pinned_file_that_is_not_a_regular_file_is_neither_waited_on_nor_removed(tmp_path, kind):
    """A ``pinned.json`` that is a FIFO (or a link to one): training starts, goes on and closes
    without opening it for a read that would wait forever; it is left where it is."""
    root = tmp_path / "c"
    _train(root, 0, 2)
    fifo = tmp_path / "fifo" if kind == "link to a fifo" else root / "pinned.json"
    os.mkfifo(fifo)
    if kind == "link to a fifo":
        (root / "pinned.json").symlink_to(fifo)
    _train(root, 2, 4)  # (keep=2: retention reads the pin after each checkpoint)
    assert os.path.lexists(root / "pinned.json") and stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("folder", ["objects", "manifests"])
def test_a_folder_of_the_directory_that_is_a_link_is_refused_and_nothing_is_written_or_deleted_through_it(
        tmp_path, folder):
    """``objects/`` (or ``manifests/``) replaced by a symbolic link to a folder outside, which holds
    files of everystep's names: training refuses the directory naming the link, and nothing in the
    folder it points to is written or deleted."""
    root = tmp_path / "c"
    _train(root, 0, 2)
    outside = tmp_path / "outside"
    (root / folder).rename(outside)
    (outside / "full-000000000099.safetensors").write_bytes(b"not yours")  # named like an object no manifest names
    (root / folder).symlink_to(outside)
    before = files_of(outside)
    with pytest.raises(CheckpointDirectoryError, match=rf"{folder} is a symbolic link: a checkpoint directory's own"):
        _train(root, None, 4)
    assert files_of(outside) == before


def test_a_folder_of_the_directory_others_can_write_is_refused(tmp_path):
    root = tmp_path / "c"
    _train(root, 0, 2)
    (root / "objects").chmod(0o777)
    with pytest.raises(CheckpointDirectoryError, match="objects is writable by others"):
        _train(root, None, 4)


def test_a_restore_refused_in_another_world_size_leaves_the_marker_as_it_was(tmp_path):
    """A directory two ranks wrote, restored in one process by a model that does not fit: refused,
    and its marker still says two ranks; one that fits carries it to one process, and says so."""
    from everystep.storage.directory import MARKER, marker_bytes

    root = tmp_path / "c"
    _train(root, 0, 2)
    marker = json.loads((root / MARKER).read_bytes())
    marker.pop("checksum", None)
    (root / MARKER).write_bytes(marker_bytes({**marker, "world_size": 2}))  # (as two ranks of full_sync write it)
    before = (root / MARKER).read_bytes()
    model = torch.nn.Linear(3, 2)
    with pytest.raises(StateMismatchError):
        with Checkpointer(root, model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="full_sync") as ckpt:
            ckpt.restore()
    assert (root / MARKER).read_bytes() == before
    _train(root, 2, 3)
    assert json.loads((root / MARKER).read_bytes())["world_size"] == 1


_SPARSE_RESTORE = """
import resource, sys, warnings
from everystep import Checkpointer
from everystep.eval.workloads import build
w = build("mlp", seed=0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with Checkpointer(sys.argv[1], w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="full_sync",
                      final=False) as ckpt:
        step = ckpt.restore()
print(step, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
print(*(str(c.message) for c in caught), sep="\\n")
"""


def test_a_sparse_tensor_file_of_gigabytes_is_refused_without_taking_its_size_in_memory(tmp_path):
    """B5: the newest checkpoint's tensor file swapped for a sparse one of 4 GiB (a valid header, one
    tensor over the rest, nothing but a hole), its manifest re-signed with that size. The restore
    refuses it by its checksum and takes the checkpoint before, its memory peak far below the
    file's size: the hole is not read into memory."""
    from everystep.layout import TensorLayout
    from everystep.storage.formats.tensorfile import header_bytes

    from .forked import run_script
    from .conftest import ROOT

    root = tmp_path / "c"
    _train(root, 0, 2)
    body = _body(root, 2)
    (name, info), = body["objects"].items()
    nbytes = 4 << 30
    head = header_bytes(TensorLayout.of({"x": torch.empty(nbytes // 4, dtype=torch.float32, device="meta")}))
    path = root / "objects" / info["name"]
    path.unlink()
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)
    body["objects"][name] = {**info, "nbytes": len(head) + nbytes}
    _resign(root, "full-000000000002.json", body)
    done = run_script(_SPARSE_RESTORE, str(root), env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout
    step, peak_mib = map(int, done.stdout.splitlines()[0].split())
    assert step == 1 and "full-000000000002" in done.stdout, done.stdout
    assert peak_mib < 1024, f"the restore peaked at {peak_mib} MiB for a 4 GiB sparse file"


def test_a_refused_run_leaves_nothing_that_blocks_a_fresh_start(tmp_path):
    """B9: a first run refused once its region's claim is written (a region= where no region can be
    made) left the claim, and every later start was refused as a foreign directory. The claim goes
    with the refusal, the refusal names the option, and a directory holding only what a run writes
    before its marker (a run killed there) starts afresh."""
    from everystep.errors import ConfigError

    root = tmp_path / "c"
    w = build("mlp", seed=0)
    (tmp_path / "file").write_text("a file where the region's folder would be")
    with pytest.raises(ConfigError, match=r"region=.*cannot be made there"):
        with Checkpointer(root, w.model, w.optimizer, strategy="lightcheck",
                          region=str(tmp_path / "file" / "x" / "{rank}.bin")) as ckpt:
            ckpt.restore()
    assert list(root.iterdir()) == []
    (root / "region-r0.owner").write_text("0" * 32)  # (what a run killed before its marker leaves)
    _train(root, 0, 2, strategy="lightcheck")
    _train(root, 2, 3, strategy="lightcheck")
