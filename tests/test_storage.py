"""Storage: stores, the catalog of checkpoints over them, crash safety, retention, refusing foreign
directories.

Every Store implementation passes the tests that take ``store`` (``STORES``), and the catalog over each
the tests that take ``catalog`` (``CATALOGS``). What reads checkpoints (manifests, objects, checksums,
discard, readers that change nothing) is tested through ``READERS``, which adds a region's slots
(``Region.objects``): they are written by copying into a slot (``begin``/``commit``), not through
``write_object``.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import struct
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from everystep.errors import CheckpointDirectoryError, CorruptCheckpointError, ReadOnlyStoreError
from everystep.storage import Catalog, CheckpointDirectory, LocalStore, Manifest, plan_retention
from everystep.storage.directory import marker_bytes
from everystep.storage.region.objects import SlotObjects
from everystep.storage.region.slots import Region
from everystep.storage.stores.s3 import S3Store
from everystep.storage.region.mapping import RegionLayout
from everystep.storage.formats.tensorfile import load_tensors, tensor_chunks
from everystep.transport import HostBuffer, TensorLayout, snapshot_into
from everystep.storage.formats.tensorfile import buffer_chunks

from .conftest import ROOT, FullDisk, files_of
from .forked import run_script

def _s3(where: Path | str, access: str = "write") -> S3Store:
    """An S3Store for ``where``: a bucket of its own for a new path (made here), or a store's URL."""
    if str(where).startswith("s3://"):
        return S3Store(str(where), access=access)
    import hashlib

    import boto3

    bucket = "st-" + hashlib.sha256(str(where).encode()).hexdigest()[:16]
    boto3.client("s3").create_bucket(Bucket=bucket)
    return S3Store(f"s3://{bucket}/root", access=access)


STORES = {"local": LocalStore, "s3": _s3}
"""Every Store implementation: each passes the tests that take ``store`` (made at a path, with an access;
``s3``: against moto's server, a process of its own, reached over HTTP)."""


@pytest.fixture(params=sorted(STORES))
def store(request, tmp_path):
    if request.param == "s3":
        request.getfixturevalue("server")
    return STORES[request.param](tmp_path / "root")


def _reopen(catalog: Catalog, access: str = "write") -> Catalog:
    """A new catalog over a new store of the same kind at the same place (what a recovery opens)."""
    return Catalog(type(catalog.store)(catalog.root, access=access), catalog.ranks)


CATALOGS = {
    # (the catalog over S3 is tested in test_s3_store.py: these tests damage its files on a local disk)
    **{name: (lambda path, make=make: Catalog(make(path))) for name, make in STORES.items() if name != "s3"},
    "local in a directory": lambda path: CheckpointDirectory.open(path, strategy="test").catalog,
}
"""A catalog over every Store implementation, and as a directory's caller gets it; each passes the tests
that take ``catalog``."""


@pytest.fixture(params=sorted(CATALOGS))
def catalog(request, tmp_path):
    return CATALOGS[request.param](tmp_path / "ckpt")


def _commit(catalog, step, payload=b"x" * 100, kind="full", requires=()):
    info = catalog.write_object(f"{kind}-{step:012d}.bin", [payload])
    m = Manifest(kind=kind, step=step, objects={"data": info}, requires=requires)
    catalog.commit(m)
    return m


# -- the Store protocol: every implementation ---------------------------------------------------------


def test_every_store_puts_a_value_whole_and_lists_it_with_a_version_that_a_rewrite_changes(store):
    assert store.put("objects/a.bin", [b"hello ", memoryview(b"world")]) == 11
    assert bytes(store.get("objects/a.bin")) == b"hello world"
    listed = store.list("objects/")
    assert list(listed) == ["objects/a.bin"] and store.list("objects/a") == listed and store.list("manifests/") == {}
    store.put("objects/a.bin", [b"HELLO WORLD!"])
    assert store.list("objects/")["objects/a.bin"] != listed["objects/a.bin"]
    assert bytes(store.get("objects/a.bin")) == b"HELLO WORLD!"
    with pytest.raises(FileNotFoundError):
        store.get("objects/b.bin")


def test_every_store_keeps_the_old_value_when_a_put_fails_midway_and_leaves_nothing_listed(store):
    store.put("objects/a.bin", [b"old"])

    def failing():
        yield b"new, half"
        raise OSError(errno.EIO, "the chunk's source failed")

    with pytest.raises(OSError, match="source failed"):
        store.put("objects/a.bin", failing())
    assert bytes(store.get("objects/a.bin")) == b"old"
    assert list(store.list("")) == ["objects/a.bin"] and store.leftovers() == []


def test_every_store_deletes_a_value_or_a_directory_value_and_nothing_else(store):
    store.put("objects/a.bin", [b"a"])
    store.put("objects/b.bin", [b"b"])

    def fill(folder: Path) -> str:
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"shard")
        (folder / ".metadata").write_bytes(b"meta")
        return "filled"

    assert store.put_directory("objects/full-000000000001.dcp", fill) == "filled"
    assert list(store.list("objects/full")) == ["objects/full-000000000001.dcp/.metadata",
                                                "objects/full-000000000001.dcp/__0_0.distcp"]
    assert (store.fetch("objects/full-000000000001.dcp") / ".metadata").read_bytes() == b"meta"
    store.delete("objects/a.bin")
    store.delete("objects/full-000000000001.dcp")
    store.delete("objects/never-written.bin")
    assert list(store.list("objects/")) == ["objects/b.bin"]


def test_every_store_refuses_keys_outside_it(store, tmp_path):
    (tmp_path / "victim").write_bytes(b"precious")
    for key in ("../victim", "/etc/passwd", "objects/../../victim", "", "objects//a", "objects/."):
        for call in (lambda: store.put(key, [b"x"]), lambda: store.get(key), lambda: store.delete(key),
                     lambda: store.fetch(key)):
            with pytest.raises(ValueError, match="is not a key of the store"):
                call()
    assert (tmp_path / "victim").read_bytes() == b"precious"


def test_every_store_opened_for_reading_refuses_every_change(store, tmp_path):
    store.put("objects/a.bin", [b"a"])
    reader = (_s3 if isinstance(store, S3Store) else type(store))(store.root, access="read")
    before = files_of(tmp_path), _contents(store)
    assert bytes(reader.get("objects/a.bin")) == b"a" and list(reader.list("objects/")) == ["objects/a.bin"]
    for change in (lambda: reader.put("objects/b.bin", [b"b"]), lambda: reader.delete("objects/a.bin"),
                   lambda: reader.put_directory("objects/c.dcp", lambda folder: folder.mkdir())):
        with pytest.raises(ReadOnlyStoreError):
            change()
    reader.close()
    assert (files_of(tmp_path), _contents(store)) == before  # the local files, and what the store holds (a bucket's)


def _contents(store) -> dict[str, tuple[str, bytes]]:
    """Every value the store holds, by key: its version and its bytes, as the store lists and reads them."""
    return {key: (str(version), bytes(store.get(key))) for key, version in store.list("").items()}


# -- the catalog: objects and manifests over a store ---------------------------------------------------


def test_object_round_trip_and_checksum(catalog):
    info = catalog.write_object("a.bin", [b"hello ", memoryview(b"world")])
    assert info.nbytes == 11
    assert bytes(catalog.read_object(info)) == b"hello world"
    assert catalog.bytes_written >= 11


def test_object_is_invisible_until_its_manifest_is_committed(catalog):
    info = catalog.write_object("full-000000000001.bin", [b"data"])
    assert catalog.manifests() == []
    catalog.commit(Manifest(kind="full", step=1, objects={"data": info}))
    [record] = catalog.manifests()
    assert record.manifest.step == 1 and record.manifest.objects["data"] == info


def test_flipped_byte_and_truncation_are_detected(catalog):
    m = _commit(catalog, 1, b"0123456789" * 10)
    path = catalog.root / "objects" / m.objects["data"].name
    raw = bytearray(path.read_bytes())
    raw[37] ^= 0x01
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        catalog.read_object(m.objects["data"])
    path.write_bytes(raw[:50])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        catalog.read_object(m.objects["data"])


def test_tampered_manifest_is_reported_not_trusted(catalog):
    m = _commit(catalog, 3)
    path = catalog.root / "manifests" / f"{m.name}.json"
    assert '"step":3' in path.read_text()
    tampered = path.read_text().replace('"step":3', '"step":4')
    path.write_text(tampered)
    # a new catalog (every recovery) reads every file; the writer's own catalog sees a changed file by its
    # inode, size and modification time (here the same size within one tick of the clock: not seen)
    [record] = _reopen(catalog).manifests()
    assert record.manifest is None and "checksum" in record.error
    path.write_text(tampered.replace('"step":4', '"step":40'))
    [record] = catalog.manifests()
    assert record.manifest is None and "checksum" in record.error


def test_a_manifest_discarded_as_it_is_committed_is_not_remembered(catalog, monkeypatch):
    """Another writer thread's retention may discard a manifest between its commit and the stat that
    records it: the commit succeeds, and the catalog remembers nothing of it."""
    put = type(catalog.store).put

    def put_then_discard(self, key, chunks):
        n = put(self, key, chunks)
        if key.startswith("manifests/"):
            self.delete(key)
        return n

    monkeypatch.setattr(type(catalog.store), "put", put_then_discard)
    _commit(catalog, 5)
    assert catalog.manifests() == []


def test_discard_removes_manifest_then_unshared_objects(catalog):
    m1, m2 = _commit(catalog, 1), _commit(catalog, 2)
    catalog.discard(m1.name)
    assert [r.name for r in catalog.manifests()] == [m2.name]
    assert not (catalog.root / "objects" / m1.objects["data"].name).exists()
    assert (catalog.root / "objects" / m2.objects["data"].name).exists()


def test_the_file_of_a_discarded_object_is_written_over_by_the_next_and_deleted_at_close(catalog):
    """Retention at every checkpoint would free one file's blocks and allocate another's: the file
    of the object a discarded checkpoint alone used is kept, named as a leftover (so that garbage
    collection after a crash removes it), and the next object is written over it, shorter or
    longer; ``close`` deletes what is kept."""
    m1, m2 = _commit(catalog, 1, b"a" * 5000), _commit(catalog, 2, b"b" * 5000)
    objects = catalog.root / "objects"
    inode = (objects / m1.objects["data"].name).stat().st_ino
    catalog.discard(m1.name)
    assert catalog.object_names() == [m2.objects["data"].name]
    assert [final for _, final in catalog.interrupted_writes()] == ["objects/" + m1.objects["data"].name]
    m3 = _commit(catalog, 3, b"c" * 100)
    assert (objects / m3.objects["data"].name).stat().st_ino == inode
    assert bytes(catalog.read_object(m3.objects["data"])) == b"c" * 100 and catalog.interrupted_writes() == []
    catalog.discard(m2.name)
    m4 = _commit(catalog, 4, b"d" * 9000)
    assert bytes(catalog.read_object(m4.objects["data"])) == b"d" * 9000
    catalog.discard(m3.name)
    catalog.discard(m4.name)  # a spare is kept already: this one is deleted
    assert len(catalog.interrupted_writes()) == 1
    catalog.close()
    assert list(objects.iterdir()) == [] and catalog.manifests() == []


def test_a_spare_file_left_by_a_crash_is_collected_at_the_next_open(tmp_path):
    d = CheckpointDirectory.open(tmp_path / "ckpt", strategy="test")
    m1, m2 = _commit(d.catalog, 1), _commit(d.catalog, 2)
    d.catalog.discard(m1.name)  # then the process dies: close() never runs
    [(token, _)] = d.catalog.interrupted_writes()
    assert d.collect_garbage() == [token]  # what open() runs
    assert d.catalog.interrupted_writes() == [] and d.catalog.object_names() == [m2.objects["data"].name]


def test_an_object_may_be_a_directory_written_in_place_then_installed_whole(catalog):
    def fill(folder: Path) -> int:
        folder.mkdir()
        (folder / "a").write_bytes(b"alpha")
        (folder / "b").write_bytes(b"beta")
        return 2

    assert catalog.write_directory("full-000000000001.dcp", fill) == 2
    assert sorted(catalog.stored_files()) == ["full-000000000001.dcp/a", "full-000000000001.dcp/b"]
    assert (catalog.object_path("full-000000000001.dcp") / "b").read_bytes() == b"beta"

    def fail(folder: Path) -> None:
        folder.mkdir()
        (folder / "a").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        catalog.write_directory("full-000000000002.dcp", fail)
    assert catalog.object_names() == ["full-000000000001.dcp"] and catalog.interrupted_writes() == []


def test_what_an_interrupted_write_leaves_is_listed_under_its_final_name_and_can_be_removed(catalog):
    _commit(catalog, 1)
    leftover = catalog.root / "objects" / ".tmp-full-000000000002.bin-0123abcd"
    leftover.write_bytes(b"half")
    [(token, final)] = catalog.interrupted_writes()
    assert final == "objects/full-000000000002.bin" and catalog.object_names() == ["full-000000000001.bin"]
    assert catalog.delete_leftover(token) == "objects/.tmp-full-000000000002.bin-0123abcd"
    assert not leftover.exists() and catalog.interrupted_writes() == []
    with pytest.raises(ValueError, match="not a leftover"):
        catalog.delete_leftover("objects/full-000000000001.bin")


def test_a_store_opened_for_reading_refuses_every_change(catalog, tmp_path):
    m = _commit(catalog, 1)
    reader = _reopen(catalog, access="read")
    assert [r.manifest for r in reader.manifests()] == [m] and reader.committed(m.name)
    assert bytes(reader.read_object(m.objects["data"])) == b"x" * 100
    before = files_of(catalog.root)
    for change in (lambda: reader.write_object("full-000000000002.bin", [b"y"]), lambda: reader.commit(m),
                   lambda: reader.discard(m.name), lambda: reader.delete_object("full-000000000001.bin"),
                   lambda: reader.write_directory("full-000000000003.dcp", lambda folder: folder.mkdir()),
                   lambda: reader.store.put("everystep.json", [b"{}"]), reader.check_writable):
        with pytest.raises(ReadOnlyStoreError):
            change()
    assert files_of(catalog.root) == before


def test_crash_mid_write_leaves_previous_checkpoint_and_no_visible_garbage(tmp_path):
    """I3: SIGKILL in the middle of writing an object, then in the commit: the old one survives."""
    root = tmp_path / "ckpt"
    directory = CheckpointDirectory.open(root, strategy="test")
    _commit(directory.catalog, 1, b"first" * 1000)
    directory.close()
    points = ("store.object.mid_write", "store.object.before_rename", "store.commit.before_manifest",
              "store.manifest.mid_write", "store.manifest.before_rename")
    for point in points:
        script = textwrap.dedent(f"""
            from everystep.storage import CheckpointDirectory, LocalStore, Manifest
            s = CheckpointDirectory.open({str(root)!r}, strategy="test").catalog
            info = s.write_object("full-000000000002.bin", [b"second" * 1000, b"more"])
            s.commit(Manifest(kind="full", step=2, objects={{"data": info}}))
        """)
        proc = run_script(script, env={"EVERYSTEP_CRASH": point, "PYTHONPATH": str(ROOT / "src")})
        assert proc.returncode == -9, (point, proc.stdout)
        reopened = CheckpointDirectory.open(root, strategy="test")
        assert [r.manifest.step for r in reopened.catalog.manifests()] == [1], point
        assert bytes(reopened.catalog.read_object(reopened.catalog.manifests()[0].manifest.objects["data"])) == b"first" * 1000
        reopened.collect_garbage()
        reopened.close()  # (an object garbage collection removed may be kept to write over until then)
        assert sorted(p.name for p in (reopened.root / "objects").iterdir()) == ["full-000000000001.bin"]


def test_a_full_checkpoint_killed_in_the_middle_of_its_write_commits_nothing(tmp_path):
    """I3 on the path every strategy's full checkpoint takes (``write_full``): SIGKILL half-way
    through its object: no manifest of it, the checkpoint before it whole."""
    root = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import sys
        from everystep.storage import CheckpointDirectory
        from everystep.storage.full import write_full
        catalog = CheckpointDirectory.open({str(root)!r}, strategy="test").catalog
        write_full(catalog, int(sys.argv[1]), [memoryview(b"state" * 1000)], {{"step": int(sys.argv[1])}})
    """)
    assert run_script(script, "1", env={"PYTHONPATH": str(ROOT / "src")}).returncode == 0
    killed = run_script(script, "2", env={"EVERYSTEP_CRASH": "store.object.mid_write", "PYTHONPATH": str(ROOT / "src")})
    assert killed.returncode == -9, killed.stdout
    assert sorted(p.name for p in (root / "manifests").iterdir()) == ["full-000000000001.json"]
    reopened = CheckpointDirectory.open(root, strategy="test", access="read")
    (only,) = reopened.catalog.manifests()
    assert bytes(reopened.catalog.read_object(only.manifest.objects["tensors"])) == b"state" * 1000
    reopened.close()


def test_write_error_removes_the_temporary_and_names_the_file(tmp_path):
    directory = CheckpointDirectory.open(tmp_path / "ckpt", strategy="test")
    FullDisk(directory).full = True
    catalog = directory.catalog
    with pytest.raises(OSError, match=r"writing .*a\.bin failed: No space left on device — free space"):
        catalog.write_object("a.bin", [b"data"])
    assert not (catalog.root / "objects").exists() or list((catalog.root / "objects").iterdir()) == []


def test_foreign_directory_is_refused_and_untouched(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    before = files_of(foreign)
    with pytest.raises(CheckpointDirectoryError, match="not empty and is not an everystep checkpoint directory.*notes.txt"):
        CheckpointDirectory.open(foreign, strategy="full_sync")
    assert files_of(foreign) == before


def test_directory_of_another_strategy_or_world_size_is_refused(tmp_path):
    CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    with pytest.raises(CheckpointDirectoryError, match="written by strategy 'checkfreq'; this run uses 'full_sync'"):
        CheckpointDirectory.open(tmp_path / "c", strategy="full_sync")
    marker = tmp_path / "c" / "everystep.json"
    marker.write_bytes(marker_bytes({**json.loads(marker.read_text()), "world_size": 2}))
    with pytest.raises(CheckpointDirectoryError, match="written by 2 process.*this run has 1"):
        CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    assert CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq", other_world=True).marker["world_size"] == 1
    with pytest.raises(CheckpointDirectoryError, match="no everystep checkpoint directory"):
        CheckpointDirectory.open(tmp_path / "missing", create=False)


def _m(kind, step, requires=()):
    return Manifest(kind=kind, step=step, objects={}, requires=requires)


def test_retention_keeps_newest_by_step_number_not_by_name():
    ms = [_m("full", s) for s in (9, 10, 100, 11)]
    assert plan_retention(ms, keep=2) == ["full-000000000009", "full-000000000010"]
    assert plan_retention(ms, keep=5) == []


def test_retention_keeps_what_recoverable_points_require():
    ms = [_m("full", 10), _m("full", 20), _m("diff", 5, ("full-000000000000",)), _m("diff", 21, ("full-000000000020",)),
          _m("diff", 15, ("full-000000000010",)), _m("full", 30)]
    # differentials no newer than the newest full (30) go, whatever keep is.
    assert plan_retention(ms, keep=1) == ["diff-000000000005", "full-000000000010", "diff-000000000015",
                                          "full-000000000020", "diff-000000000021"]
    keep2 = plan_retention(ms, keep=2)
    assert "full-000000000020" not in keep2 and "diff-000000000021" in keep2
    ms.append(_m("diff", 31, ("full-000000000010",)))  # a differential newer than 30 whose base is old: its base stays
    assert "full-000000000010" not in plan_retention(ms, keep=1)


def test_retention_keeps_a_pinned_checkpoint_in_every_process_until_it_is_unpinned(tmp_path):
    ms = [_m("full", 4), _m("diff", 5, ("full-000000000004",)), _m("full", 8), _m("full", 9)]
    assert plan_retention(ms, keep=1, pinned=["diff-000000000005", "gone"]) == ["full-000000000008"]  # and its base
    writer = CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    for step in (1, 2, 3):
        writer.catalog.commit(Manifest(kind="full", step=step, objects={}))
    writer.pin(["full-000000000001"])  # (the remote tier's upload of step 1)
    other = CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq", create=False, access="shared")  # a writer process
    assert other.retain(1) == ["full-000000000002"]
    writer.pin([])
    assert writer.retain(1) == ["full-000000000001"]
    writer.catalog.commit(Manifest(kind="full", step=4, objects={}))
    for found in (b"not json", b'{"manifests": "full-000000000003"}', b'{"manifests": [3, ["x"], "../everystep"]}'):
        (tmp_path / "c" / "pinned.json").write_bytes(found)  # written by someone else: it pins nothing, breaks nothing
        assert writer._pinned() == ([] if b"../" not in found else ["../everystep"])
    assert writer.retain(1) == ["full-000000000003"] and (tmp_path / "c" / "everystep.json").exists()
    writer.pin(["full-000000000004"])
    writer.close()  # (as a crash in the middle of an upload leaves it)
    again = CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    again.collect_garbage()
    assert not (tmp_path / "c" / "pinned.json").exists()


def test_retention_counts_a_spread_checkpoint_as_a_point_that_recovers_on_its_own():
    ms = [_m("full", 4), _m("spread", 7), _m("spread", 11), _m("diff", 6, ("full-000000000004",))]
    assert plan_retention(ms, keep=2) == ["full-000000000004", "diff-000000000006"]
    assert plan_retention(ms, keep=1) == ["full-000000000004", "diff-000000000006", "spread-000000000007"]


dtypes = st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(dtypes, st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6))
def test_tensor_files_are_valid_safetensors_both_from_tensors_and_from_a_flat_buffer(specs):
    tensors = {f"t{i}/x": (torch.rand(shape) * 100).to(dtype) for i, (dtype, shape) in enumerate(specs)}
    layout = TensorLayout.of(tensors)
    direct = b"".join(bytes(c) for c in tensor_chunks(layout, tensors))
    buf = HostBuffer(layout)
    snapshot_into(buf, tensors)
    flat = b"".join(bytes(c) for c in buffer_chunks(layout, buf.memoryview()))
    assert direct == flat
    for key, value in load_tensors(flat, what="test").items():
        assert value.dtype == tensors[key].dtype and torch.equal(value, tensors[key])


def test_tensor_file_opens_with_the_safetensors_library(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.tensor(2.0)}
    layout = TensorLayout.of(tensors)
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"".join(bytes(c) for c in tensor_chunks(layout, tensors)))
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        assert torch.equal(f.get_tensor("a"), tensors["a"])


_EVERY_DTYPE = {"f64": torch.randn(3, dtype=torch.float64), "bf16": torch.randn(2, 3).bfloat16(),
                "f16": torch.randn(4).half(), "i8": torch.arange(-3, 3, dtype=torch.int8), "bool": torch.tensor([True, False]),
                "u8": torch.arange(7, dtype=torch.uint8), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
                "i64": torch.arange(5)}


def test_the_safetensors_librarys_files_are_read_once_each_byte_into_tensors_of_their_own(tmp_path):
    """A file the safetensors library wrote (every dtype, a 0-d and an empty tensor) reads back bitwise
    from memory and from a file; from a file each byte is read once, straight into a tensor that owns
    its memory (no view of a buffer the size of the file)."""
    import io

    from safetensors.torch import save

    from everystep.storage.base import checksum
    from everystep.storage.formats.tensorfile import read_tensors

    data = save(_EVERY_DTYPE)
    for got in (load_tensors(data, what="object x"), load_tensors(bytearray(data), what="object x")):
        assert got.keys() == _EVERY_DTYPE.keys() and all(torch.equal(got[k], v) and got[k].dtype == v.dtype
                                                          for k, v in _EVERY_DTYPE.items())

    class Counted(io.BytesIO):
        read_bytes = 0

        def readinto(self, b):
            n = super().readinto(b)
            Counted.read_bytes += n
            return n

    f = Counted(data)
    got = read_tensors(f, len(data), checksum(data), what="object x")
    assert Counted.read_bytes == len(data)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in _EVERY_DTYPE.items())
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in got.values())


def test_a_tensor_file_with_holes_reads_back_the_same_tensors(tmp_path):
    """A filesystem may store blocks of zeros as holes (ZFS with compression): a file with holes
    reads back bitwise, the large tensors' holes left unread in zeroed memory, small ones and the
    data around the holes read."""
    from everystep.layout import TensorLayout
    from everystep.storage.base import CHECKSUM_ALGORITHM, new_hasher
    from everystep.storage.formats.tensorfile import read_tensors, tensor_chunks

    tensors = {"a": torch.arange(1000, dtype=torch.float32), "zeros": torch.zeros(3 << 20, dtype=torch.float32),
               "b": torch.randn(5 << 18), "small": torch.zeros(100, dtype=torch.int64)}
    tensors["zeros"][-5:] = 7.0  # (data in the last block of a tensor that is mostly hole)
    layout = TensorLayout.of(tensors)
    path, hasher = tmp_path / "t.safetensors", new_hasher()
    with open(path, "wb") as f:
        for chunk in tensor_chunks(layout, tensors):  # (the header first)
            hasher.update(chunk)
            if any(chunk.tobytes()):
                f.write(chunk)
            else:
                f.seek(len(chunk), os.SEEK_CUR)  # a hole
        f.truncate()
    size = path.stat().st_size
    with open(path, "rb") as probe:
        if os.lseek(probe.fileno(), 0, os.SEEK_HOLE) >= size:
            pytest.skip("this filesystem makes no holes")
    with open(path, "rb") as f:
        got = read_tensors(f, size, f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}", what="object t")
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def _header_file(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("header, data, why", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
     bytes(8), "starts at 4"),  # overlapping
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "starts at 4"),  # a gap
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "not those of its shape"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), "not at the end of its data"),
    ({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16), "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "not whole numbers"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, bytes(8), "not described by"),
    ({"__metadata__": {"k": 1}}, b"", "metadata is not strings"),
    ([1, 2], b"", "not a JSON object"),
])
def test_a_tensor_file_whose_header_the_format_does_not_allow_is_refused(tmp_path, header, data, why):
    from everystep.storage.base import checksum
    from everystep.storage.formats.tensorfile import read_tensors

    raw = _header_file(header, data)
    with pytest.raises(CorruptCheckpointError, match=f"not a valid safetensors file.*{why}"):
        load_tensors(raw, what="object x")
    with pytest.raises(CorruptCheckpointError, match=f"not a valid safetensors file.*{why}"):
        read_tensors(io.BytesIO(raw), len(raw), checksum(raw), what="object x")


@pytest.mark.parametrize("source", ["stream", "file"])
def test_a_tensor_file_read_once_is_refused_when_a_byte_changed_or_it_is_shorter_or_longer(tmp_path, source):
    """From a stream (read in turn) and from a file on disk (its two halves read at once), wherever
    the byte that changed lies."""
    from everystep.storage.base import checksum
    from everystep.storage.formats.tensorfile import read_tensors

    def read(raw: bytes, size: int, digest: str):
        if source == "stream":
            return read_tensors(io.BytesIO(raw), size, digest, what="object x")
        (tmp_path / "x").write_bytes(raw)
        with open(tmp_path / "x", "rb", buffering=0) as f:
            return read_tensors(f, size, digest, what="object x")

    good = bytes(b"".join(bytes(c) for c in tensor_chunks(TensorLayout.of(_EVERY_DTYPE), _EVERY_DTYPE)))
    data = 8 + struct.unpack("<Q", good[:8])[0]
    middle = data + (len(good) - data) // 2  # (where a file's two halves meet)
    for at in (data, middle - 1, middle, len(good) - 1):
        flipped = bytearray(good)
        flipped[at] ^= 1
        with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
            read(bytes(flipped), len(good), checksum(good))
    wrong_size = "shorter than its manifest says" if source == "stream" else "not the .* bytes its manifest says"
    with pytest.raises(CorruptCheckpointError, match=wrong_size):
        read(good[:-3], len(good), checksum(good))
    with pytest.raises(CorruptCheckpointError, match="longer than" if source == "stream" else wrong_size):
        read(good + b"x", len(good), checksum(good))
    header_too_long = struct.pack("<Q", 1 << 40) + good[8:]
    with pytest.raises(CorruptCheckpointError, match="a header of"):
        read(header_too_long, len(good), checksum(header_too_long))
    got = read(good, len(good), checksum(good))
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in _EVERY_DTYPE.items())


def test_corrupt_tensor_file_is_refused():
    with pytest.raises(CorruptCheckpointError, match="not a valid safetensors file"):
        load_tensors(b"\x80\x04garbage", what="object x")


class _Written:
    """A reader of ``READERS`` with what each one needs to be written to and damaged."""

    def __init__(self, reader, open_reader, commit, locate) -> None:
        self.reader, self.open_reader, self.commit, self.locate = reader, open_reader, commit, locate


def _catalog_written(path: Path) -> _Written:
    catalog = Catalog(LocalStore(path))

    def commit(step: int, payload: bytes) -> Manifest:
        return _commit(catalog, step, payload)

    def locate(info) -> tuple[Path, int, int]:
        p = catalog.root / "objects" / info.name
        return p, 0, p.stat().st_size

    return _Written(catalog, lambda: _reopen(catalog, access="read"), commit, locate)


def _region_written(path: Path) -> _Written:
    store = Region.open(path)

    def commit(step: int, payload: bytes) -> Manifest:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        writer = store.begin(RegionLayout.of({"data": data}), 100)
        writer.views["data"].copy_(data)
        store.commit(writer, step, {"step": step})
        return next(r.manifest for r in store.objects.manifests() if r.manifest and r.manifest.step == step)

    def locate(info) -> tuple[Path, int, int]:
        return (path, *store.objects.object_location(info))

    return _Written(store.objects, lambda: Region.open(path, access="read").objects, commit, locate)


def _memory_tier_written(path: Path) -> _Written:
    """A memory tier's: a region in memory (``/dev/shm``), its commits not flushed."""
    folder = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="everystep-test-"))
    w = _region_written(folder / path.name)
    assert not w.reader.region.flush
    w.folder = folder
    return w


READERS = {"catalog": _catalog_written, "region": _region_written}
"""Every Reader implementation."""
if os.path.isdir("/dev/shm"):
    READERS["memory tier"] = _memory_tier_written


@pytest.fixture(params=sorted(READERS))
def written(request, tmp_path):
    w = READERS[request.param](tmp_path / "ckpt")
    yield w
    if isinstance(w.reader, SlotObjects):
        w.reader.region.close()
    if hasattr(w, "folder"):
        shutil.rmtree(w.folder, ignore_errors=True)


def test_every_store_reads_back_what_it_committed_and_lists_it(written):
    m = written.commit(1, b"0123456789" * 10)
    assert [r.manifest.step for r in written.reader.manifests()] == [1]
    assert bytes(written.reader.read_object(m.objects["data"])) == b"0123456789" * 10
    assert written.reader.committed(m.name)


def test_every_store_detects_a_flipped_byte_in_an_object(written):
    m = written.commit(1, b"0123456789" * 10)
    path, offset, nbytes = written.locate(m.objects["data"])
    raw = bytearray(path.read_bytes())
    raw[offset + nbytes // 2] ^= 0x01
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        written.reader.read_object(m.objects["data"])


def test_every_store_discards_a_checkpoint_and_keeps_the_other(written):
    m1, m2 = written.commit(1, b"a" * 64), written.commit(2, b"b" * 64)
    written.reader.discard(m1.name)
    assert [r.manifest.name for r in written.reader.manifests() if r.manifest] == [m2.name]
    assert not written.reader.committed(m1.name) and written.reader.committed(m2.name)


def test_every_store_opened_for_reading_changes_nothing(written, tmp_path):
    m = written.commit(1, b"x" * 100)
    reader = written.open_reader()
    try:
        assert [r.manifest.step for r in reader.manifests() if r.manifest] == [1]
        assert bytes(reader.read_object(m.objects["data"])) == b"x" * 100
        root = getattr(written, "folder", tmp_path)  # (a memory tier's region lies in /dev/shm)
        before = files_of(root)
        for change in (lambda: reader.discard(m.name), reader.check_writable):
            with pytest.raises(ReadOnlyStoreError):
                change()
        assert files_of(root) == before and before
    finally:
        if isinstance(reader, SlotObjects):
            reader.region.close()


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_region_is_offered_for_pinning_only_in_memory_and_says_why_not(tmp_path, where):
    """Linux refuses to pin a writable shared mapping of a file whose pages it writes back (and the
    refusal is left behind as the thread's CUDA error), so a region off tmpfs is not offered to the
    driver at all; one on tmpfs is, and without a GPU says so."""
    from everystep.storage.region.mapping import on_volatile_memory

    root = tmp_path if where == "disk" else Path("/dev/shm")
    if (where == "disk") == on_volatile_memory(root):
        pytest.skip(f"{root} is {'' if where == 'disk' else 'not '}in memory on this machine")
    path = root / f"everystep-pin-{tmp_path.name}.bin"
    store = Region.open(path)
    try:
        data = torch.arange(64, dtype=torch.uint8)
        writer = store.begin(RegionLayout.of({"data": data}), 100)
        why = store.register(writer)
        if where == "disk":
            assert why is not None and "does not pin" in why
        elif not torch.cuda.is_available():
            assert why == "no GPU"
        else:
            assert why is None
    finally:
        store.close()
        path.unlink(missing_ok=True)
