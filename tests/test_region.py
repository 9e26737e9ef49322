"""The two-slot region (:mod:`everystep.storage.region`): its layout, slots written and read back,
commits and their order of flushes, torn and corrupt slots, readers, one writer, the hashing process,
and the state a restarted writer lends out of a slot. The strategies that hold a region:
``test_lightcheck.py`` and ``test_memory_tier.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from everystep.storage.region.slots import Region
from everystep.storage.region.lending import lending_supported
from everystep.storage.region.mapping import ALIGN, RegionLayout


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(100, 10, generator=g), "tiny": torch.tensor([1, 2, 3]),
            "odd": torch.randn(33, generator=g), "half": torch.randn(7, generator=g).half(), "empty": torch.zeros(0)}


def _write(region: Region, step: int, tensors: dict[str, torch.Tensor]) -> None:
    writer = region.begin(RegionLayout.of(tensors), 100)
    for k, v in writer.views.items():
        v.copy_(tensors[k] + step if v.dtype != torch.int64 else tensors[k])
    region.commit(writer, step, {"step": step})



def test_the_layout_aligns_large_tensors_and_packs_small_ones_in_copy_order():
    layout = RegionLayout.of(_tensors(), order=["odd", "tiny", "big", "half", "empty"])
    where = {e.key: e for e in layout.entries}
    assert [e.key for e in layout.entries] == ["odd", "big", "tiny", "half", "empty"]  # large first, each in copy order
    assert where["odd"].offset == 0 and where["big"].offset % ALIGN == 0 and where["big"].offset >= 132
    assert where["tiny"].offset == where["big"].offset + 4000  # packed right after, no padding
    assert where["half"].offset == where["tiny"].offset + 24
    assert where["half"].offset + 14 <= layout.nbytes < where["half"].offset + 14 + 4  # the empty one, aligned


def test_slots_alternate_and_the_newest_complete_one_is_read_back(tmp_path):
    tensors = _tensors()
    region = Region.open(tmp_path / "r.bin")
    for step in (1, 2, 3):
        _write(region, step, tensors)
    assert [(s.slot, s.step) for s in region.slots()] == [(0, 3), (1, 2)]
    slot, got, meta = region.newest()
    assert slot.step == 3 and meta["skeleton"] == {"step": 3}
    assert torch.equal(got["big"], tensors["big"] + 3) and torch.equal(got["tiny"], tensors["tiny"])
    # metadata apart from data: the JSON section holds no tensor bytes, the data section no JSON
    manifest = max((r.manifest for r in region.objects.manifests() if r.manifest), key=lambda m: m.step)
    assert manifest.step == 3 and set(manifest.objects) == set(tensors)
    offset, nbytes = region.objects.object_location(manifest.objects["big"])
    raw = (tmp_path / "r.bin").read_bytes()
    assert raw[offset:offset + nbytes] == (tensors["big"] + 3).numpy().tobytes() and offset % ALIGN == 0
    assert bytes(region.objects.read_object(manifest.objects["big"])) == raw[offset:offset + nbytes]
    region.close()


def test_a_slots_checksums_come_from_a_process_without_pytorch_started_again_when_it_died(tmp_path):
    """The writer's checksums are computed by its hashing process, which imports no PyTorch: they are
    the ones a reader computes (a slot written with them verifies, one byte changed does not), and a
    hashing process that died is started again at the next commit."""
    from .conftest import torch_libraries

    tensors = {**_tensors(), "large": torch.randn(3 << 18)}  # (3 MiB: hashed on a thread of the hasher's)
    region = Region.open(tmp_path / "r.bin")
    _write(region, 1, tensors)
    hasher = region._hasher
    assert hasher is not None and hasher._process is not None
    first = hasher._process
    slot, got, _ = region.newest()
    assert slot.step == 1 and torch.equal(got["large"], tensors["large"] + 1)
    assert torch_libraries(first.pid) == []  # (having hashed a slot)
    first.kill()
    first.wait()
    _write(region, 2, tensors)  # (the hasher started again)
    second = hasher._process
    assert second is not None and second is not first
    assert region.newest()[0].step == 2
    writer = region.begin(RegionLayout.of(tensors), 100)
    for k, v in writer.views.items():
        v.copy_(tensors[k])
    sums = region.checksums(writer)
    writer.views["large"][5] += 1  # a byte changed after hashing: the committed slot must not verify
    region.commit(writer, 3, {"step": 3}, checksums=sums)
    with pytest.warns(UserWarning, match="tensor 'large' fails its checksum"):
        assert region.newest()[0].step == 2
    region.close()
    assert second.poll() == 0 and hasher._process is None  # (it exited with the region's close)


@pytest.mark.parametrize("flush", [True, False])
def test_a_commit_flushes_the_slot_marked_writing_then_its_area_then_its_header(tmp_path, monkeypatch, flush):
    import everystep.storage.region.slots as region_module

    tensors = _tensors()
    region = Region.open(tmp_path / "r.bin", flush=flush)
    _write(region, 1, tensors)
    seen, flush_pages = [], region_module._flush

    def recorded(view, offset, nbytes):
        seen.append([(s.slot, s.step) for s in region.slots(warn=False)])
        flush_pages(view, offset, nbytes)

    monkeypatch.setattr(region_module, "_flush", recorded)
    _write(region, 2, tensors)
    # marked writing (slot 1 not a checkpoint), the area before its header, then the header
    assert seen == ([[(0, 1)], [(0, 1)], [(1, 2), (0, 1)]] if flush else [])
    region.close()


@pytest.mark.parametrize("damage", ["flip a data byte", "flip a metadata byte", "tear the header", "truncate"])
def test_a_damaged_slot_is_skipped_with_a_warning_naming_it(tmp_path, damage):
    """I3/I4: the newest slot damaged in each way; recovery takes the other slot and says which was skipped."""
    tensors = _tensors()
    region = Region.open(tmp_path / "r.bin")
    _write(region, 1, tensors)
    _write(region, 2, tensors)
    newest = region.slots()[0]
    manifest = next(r.manifest for r in region.objects.manifests() if r.manifest and r.manifest.step == 2)
    offset, nbytes = region.objects.object_location(manifest.objects["big"])
    region.close()
    path = tmp_path / "r.bin"
    raw = bytearray(path.read_bytes())
    if damage == "flip a data byte":
        raw[offset + nbytes // 2] ^= 0x10
    elif damage == "flip a metadata byte":
        raw[newest.area_offset + 20] ^= 0x10
    elif damage == "tear the header":
        raw[(1 + newest.slot) * 4096 + 30] ^= 0x10
    else:
        raw = raw[:newest.area_offset + 10]
    path.write_bytes(raw)
    region = Region.open(path, access="read")
    with pytest.warns(UserWarning, match=f"slot {newest.slot}"):
        slot, got, _ = region.newest()
    assert slot.step == 1 and torch.equal(got["big"], tensors["big"] + 1)
    region.close()


def test_a_reader_changes_nothing_and_cannot_write(tmp_path):
    """I9: reading maps the file copy-on-write and refuses to begin a slot. (I5/I8, a pickle planted
    in a slot: ``test_trust.py::test_a_region_slot_forged_to_hold_a_pickle_is_refused_without_running_code``.)"""
    region = Region.open(tmp_path / "r.bin")
    _write(region, 1, _tensors())
    before = (tmp_path / "r.bin").read_bytes(), os.stat(tmp_path / "r.bin").st_mtime_ns
    reader = Region.open(tmp_path / "r.bin", access="read")
    slot, got, _ = reader.newest()
    got["big"].add_(1.0)  # a copy: the file does not change
    with pytest.raises(Exception, match="opened for reading"):
        reader.begin(RegionLayout.of(_tensors()), 10)
    reader.close()
    assert ((tmp_path / "r.bin").read_bytes(), os.stat(tmp_path / "r.bin").st_mtime_ns) == before
    region.close()


def test_one_writer_per_region(tmp_path):
    region = Region.open(tmp_path / "r.bin")
    with pytest.raises(Exception, match="in use by another process"):
        Region.open(tmp_path / "r.bin")
    region.close()


def test_the_hashing_process_holds_no_lock_of_its_writer(tmp_path):
    """``flock`` belongs to the open file: a hashing process that shared its writer's would keep the
    region locked once its writer was gone (killed: its descriptor and mappings released), until its
    own death a moment later, and a restarted writer would be refused meanwhile."""
    import fcntl

    path = tmp_path / "r.bin"
    region = Region.open(path)
    data = torch.arange(64, dtype=torch.uint8)
    writer = region.begin(RegionLayout.of({"data": data}), 100)
    writer.views["data"].copy_(data)
    region.commit(writer, 1, {"step": 1})  # (its hashing process starts)
    hasher = region._hasher
    assert hasher is not None and hasher._process is not None and hasher._process.poll() is None
    region._pool.shutdown()  # the writer gone, its hashing process alive:
    for area in region._areas.values():
        area.close()
    region._headers.close()
    os.close(region._fd)
    probe = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (raises while anything holds the writer's lock)
        assert hasher._process.poll() is None
    finally:
        os.close(probe)
        hasher.close()


def _lent_from_the_newest_slot(path: Path, tensors: dict[str, torch.Tensor]
                               ) -> tuple[Region, dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Steps 1 and 2 written, and a writer that opened the region again (as a restarted one does)
    reading the newest slot with all but ``tiny`` lent: the writer, what it read, what it should
    hold, and where ``big`` lies in the file."""
    region = Region.open(path)
    _write(region, 1, tensors)
    _write(region, 2, tensors)
    region.close()
    region = Region.open(path)
    lent, _ = region.read_slot(region.slots()[0], copy=True, lend=lambda key: key != "tiny")
    manifest = max((r.manifest for r in region.objects.manifests() if r.manifest), key=lambda m: m.step)
    return region, lent, {k: v + 2 if v.dtype != torch.int64 else v for k, v in tensors.items()}, \
        region.objects.object_location(manifest.objects["big"])[0]


@pytest.mark.skipif(not lending_supported(), reason="this kernel cannot make a private mapping's pages the process's own")
@pytest.mark.parametrize("settled", ["by the next begin", "in the background", "by close"])
def test_a_tensor_lent_out_of_a_slot_keeps_its_bytes_when_the_writer_writes_that_slot_again(tmp_path, settled):
    """A restarted writer lends a slot's tensors (``read_slot``'s ``lend``): tensors alone in their
    storage over the slot's private mapping, verified where they lie, not copied. Until a lent page
    is written it is the file's: before the writer writes a slot again (or another writer does,
    once this one is closed) the lent pages are made the process's own, and what the new
    checkpoints write over the slot does not show through."""
    path = tmp_path / "r.bin"
    tensors = _tensors()
    region, lent, expected, where = _lent_from_the_newest_slot(path, tensors)
    assert all(torch.equal(lent[k], expected[k]) for k in tensors)
    assert all(lent[k].untyped_storage().nbytes() == lent[k].nbytes for k in tensors)  # (torch.save writes its bytes alone)
    assert region.lending.bytes >= lent["big"].nbytes  # lent, not copied
    if settled == "in the background":
        region.lending.start()
    elif settled == "by close":
        region.close()
        region = Region.open(path)
    _write(region, 3, tensors)
    _write(region, 4, tensors)  # over the slot ``big`` was lent from, where it lay
    assert path.read_bytes()[where:where + 4000] == (tensors["big"] + 4).numpy().tobytes()
    assert all(torch.equal(lent[k], expected[k]) for k in tensors)
    assert settled == "by close" or region.lending.seconds > 0
    region.close()


def test_where_the_kernel_cannot_lend_a_restarted_writer_copies_the_slot_out(tmp_path, monkeypatch):
    monkeypatch.setattr("everystep.storage.region.slots.lending_supported", lambda: False)
    tensors = _tensors()
    region, got, expected, _ = _lent_from_the_newest_slot(tmp_path / "r.bin", tensors)
    assert region.lending.bytes == 0 and all(torch.equal(got[k], expected[k]) for k in tensors)
    _write(region, 3, tensors)
    _write(region, 4, tensors)
    assert all(torch.equal(got[k], expected[k]) for k in tensors)
    region.close()
