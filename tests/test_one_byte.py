"""One data byte changed past the first page of a stored tensor — in a full checkpoint's object, in
a region's slot, in a remote object — and the restore refuses that checkpoint for the one before:
every byte is checked, not a header or a first page."""

from __future__ import annotations

import warnings
from pathlib import Path

from everystep.storage.remote import RemoteConfig

from .test_checkpointer import attach, loop, make
from .test_hostile import newest_slot_meta

PAGE = 4096


def _flip(raw: bytearray, at: int) -> bytearray:
    raw[at] ^= 0x01
    return raw


def _trained(directory: Path, strategy: str, steps: int, **options):
    w = make("mlp", 0)
    with attach(w, directory, strategy, every=1, **options) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, steps)


def _restored(directory: Path, strategy: str, **options) -> tuple[int, str]:
    w = make("mlp", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the skipped checkpoint is warned about)
        with attach(w, directory, strategy, every=1, final=False, **options) as ckpt:
            step = ckpt.restore()
            return step, ckpt.recovered.source


def test_a_byte_of_a_full_checkpoints_tensor_past_its_first_page(tmp_path):
    _trained(tmp_path / "c", "checkfreq", 4)
    newest = sorted((tmp_path / "c" / "objects").glob("full-000000000004*"))
    assert len(newest) == 1 and newest[0].stat().st_size > 4 * PAGE
    newest[0].write_bytes(_flip(bytearray(newest[0].read_bytes()), newest[0].stat().st_size - PAGE - 7))
    assert _restored(tmp_path / "c", "checkfreq") == (3, "disk")


def test_a_byte_of_a_region_slots_tensor_past_its_first_page(tmp_path):
    _trained(tmp_path / "c", "lightcheck", 4, persist_every=0, final=False)  # (its newest steps are in the region alone)
    path = tmp_path / "c" / "region" / "rank-0.bin"
    newest, raw, meta = newest_slot_meta(path)
    key, _, _, offset, nbytes = max(meta["tensors"], key=lambda row: row[4])[:5]
    assert nbytes > 2 * PAGE, key
    at = newest.area_offset + meta["meta_section"] + offset + nbytes - PAGE - 7  # (past the tensor's first page)
    path.write_bytes(_flip(raw, at))
    assert _restored(tmp_path / "c", "lightcheck", persist_every=0) == (newest.step - 1, "region")


def test_a_byte_of_a_remote_objects_tensor_past_its_first_page(tmp_path, bucket):
    """A new machine (an empty local directory) resumes from the remote checkpoint before the one
    whose object has the byte changed."""
    import boto3

    url = f"s3://{bucket}/job"
    _trained(tmp_path / "first", "checkfreq", 6, remote=RemoteConfig(url, every=2))
    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="job/")["Contents"]
    steps = sorted(int(o["Key"].rsplit("-", 1)[1][:12]) for o in listed if "/manifests/full-" in o["Key"])
    key = next(o["Key"] for o in listed if "/objects/full-000000000006" in o["Key"])
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert len(body) > 4 * PAGE and steps[-1] == 6 and len(steps) > 1
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(_flip(body, len(body) - PAGE - 7)))
    assert _restored(tmp_path / "new", "checkfreq", remote=url) == (steps[-2], "remote")
