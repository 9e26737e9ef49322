"""A file of the checkpoint directory swapped for something that is not a file everystep wrote — a
FIFO (which an open would wait on for ever), a link to ``/dev/zero`` (which a read would follow for
gigabytes), bytes that are no region: ``verify``, ``inspect`` and ``train`` answer at once, name the
file, and a reader still reads the rest of the directory. And a reader opens, or contacts, nothing
the directory's marker names outside it."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from .conftest import call_cli

pytestmark = pytest.mark.timeout(120)  # (a hang fails here, not at the suite's end)

REGION = "region/rank-0.bin"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A lightcheck directory of the mlp at step 4: a full checkpoint, its region and the region's claim."""
    from everystep.eval.kills.train import TrainConfig, run

    directory = tmp_path_factory.mktemp("special") / "c"
    run(TrainConfig(workload="mlp", strategy="lightcheck", steps=4, directory=str(directory), progress=False))
    return directory


def _swapped(trained, tmp_path, name: str, kind: str):
    directory = tmp_path / "c"
    shutil.copytree(trained, directory)
    path = directory / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    else:
        path.write_bytes(os.urandom(300_000))
        path.chmod(0o600)
    return directory, path


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("name", ["everystep.json", "everystep.lock"])
def test_a_marker_or_lock_that_is_no_file_is_one_line_naming_it(trained, tmp_path, capsys, name, kind):
    directory, path = _swapped(trained, tmp_path, name, kind)
    for args in (("verify", str(directory)), ("inspect", str(directory)),
                 ("train", "--workload", "mlp", "--strategy", "lightcheck", "--steps", "6", "--dir", str(directory))):
        code, out, err = call_cli(capsys, *args)
        if name == "everystep.lock" and args[0] != "train":  # (a reader takes no lock: it reads on)
            assert code == 0, err
            continue
        assert code == 2 and str(path) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (os.path.islink(path) if kind == "zero" else not path.is_file())  # (left as it was)


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_region_claim_that_is_no_file_is_skipped_by_a_reader_and_refused_to_a_writer(trained, tmp_path, capsys, kind):
    directory, path = _swapped(trained, tmp_path, "region-r0.owner", kind)
    with pytest.warns(UserWarning, match=f"is not read: its claim {path}"):
        code, out, err = call_cli(capsys, "verify", str(directory))
    assert code == 0 and "1 checkpoint(s), all verify" in out
    code, out, err = call_cli(capsys, "train", "--workload", "mlp", "--strategy", "lightcheck", "--steps", "6", "--dir",
                              str(directory))
    assert code == 2 and f"the region's claim {path}" in err and "delete it" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["fifo", "zero", "garbage"])
def test_a_region_that_is_no_region_is_one_problem_and_the_rest_is_verified(trained, tmp_path, capsys, kind):
    """B1 and B13: verify names the region and verifies the full checkpoint beside it (exit 1), inspect
    lists it as invalid with the rest; a writer refuses it, naming it."""
    directory, path = _swapped(trained, tmp_path, REGION, kind)
    code, out, err = call_cli(capsys, "verify", str(directory))
    assert code == 1 and out.startswith(f"{path}: ") and "1 problem(s)" in out, (out, err)
    code, out, err = call_cli(capsys, "inspect", str(directory))
    assert code == 0 and "INVALID" in out and "full step        4" in out and "valid" in out.split("full step")[1]
    code, out, err = call_cli(capsys, "train", "--workload", "mlp", "--strategy", "lightcheck", "--steps", "6", "--dir",
                              str(directory))
    assert code in (0, 2) and "Traceback" not in err
    if kind != "garbage":  # (bytes that are no region are made anew from the full checkpoint, with a warning)
        assert code == 2 and str(path) in err


# -- B2: a reader opens and contacts nothing the marker names ------------------------------------


def _remark(directory, **options) -> None:
    """The marker's run record given ``options``, re-signed as anyone who can write the directory can."""
    from everystep.storage.directory import MARKER, marker_bytes

    marker = json.loads((directory / MARKER).read_text())
    marker["run"]["options"] = {**marker["run"]["options"], **options}
    (directory / MARKER).write_bytes(marker_bytes(marker))


def test_a_region_the_marker_names_elsewhere_is_opened_only_when_the_user_names_it(tmp_path, capsys):
    """The marker re-signed to name a FIFO outside the directory as the run's region: verify, inspect
    and recover neither open nor wait on it, and say how to read a region that lies there; given
    ``--region``, the user's word, they read the one there."""
    from everystep.eval.kills.train import TrainConfig, run

    elsewhere = tmp_path / "elsewhere"
    option = f"{elsewhere}/r-{{rank}}.bin"
    directory = tmp_path / "c"
    run(TrainConfig(workload="mlp", strategy="lightcheck", steps=4, directory=str(directory), progress=False,
                    options={"region": option}))
    trap = tmp_path / "trap"
    trap.mkdir()
    os.mkfifo(trap / "r-0.bin")
    _remark(directory, region=f"{trap}/r-{{rank}}.bin")
    for args in (("verify", str(directory)), ("inspect", str(directory)), ("recover", "--dir", str(directory))):
        with pytest.warns(UserWarning, match="outside the directory .* not opened by a reader; give --region"):
            code, out, err = call_cli(capsys, *args)
        assert code == 0 and "region" not in out.replace(str(directory), ""), (args, out, err)
    code, out, _ = call_cli(capsys, "recover", "--dir", str(directory), "--region", option)
    assert code == 0 and out.startswith("step 4,") and out.rstrip().endswith("from region")
    code, out, _ = call_cli(capsys, "inspect", str(directory), "--region", option)
    assert code == 0 and out.count("region step") == 2


def test_a_remote_the_marker_names_is_never_contacted_by_recover(tmp_path, capsys, monkeypatch):
    """A run record re-signed to hold ``remote`` (and other arguments of a Checkpointer's) among its
    options: recover recovers from the directory, names what it left out, and asks no server."""
    from everystep.eval.kills.train import TrainConfig, run

    directory = tmp_path / "c"
    run(TrainConfig(workload="mlp", strategy="checkfreq", steps=4, directory=str(directory), progress=False))
    _remark(directory, remote="s3://someone-elses-bucket/job", remote_every=1, every=3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # (a request would fail: nothing listens there)
    with pytest.warns(UserWarning, match="options every, remote, remote_every are not checkfreq's own"):
        code, out, err = call_cli(capsys, "recover", "--dir", str(directory))
    assert code == 0 and out.startswith("step 4,") and out.rstrip().endswith("from disk"), err


# -- B3/B4: a shape no tensor can have -------------------------------------------------------------

HUGE = [0, 2**62, 4]
"""No bytes, and strides that overflow 64 bits: torch refuses to make it with a RuntimeError."""


def _forge_tensor_file(directory, step: int) -> None:
    """Give the first model tensor of the full checkpoint of ``step`` the shape :data:`HUGE` (its
    bytes taken out, the later tensors moved up), file and manifest re-signed as anyone can."""
    import struct

    from everystep.storage.base import checksum

    obj = sorted((directory / "objects").glob(f"full-{step:012d}*"))[0]
    raw = obj.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    key = next(k for k in header if k != "__metadata__" and "/model/" in k)
    start, end = header[key]["data_offsets"]
    header[key] = {"dtype": header[key]["dtype"], "shape": HUGE, "data_offsets": [start, start]}
    for k, v in header.items():
        if k not in ("__metadata__", key) and v["data_offsets"][0] >= end:
            v["data_offsets"] = [o - (end - start) for o in v["data_offsets"]]
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    forged = struct.pack("<Q", len(body)) + body + data[:start] + data[end:]
    obj.write_bytes(forged)
    path = directory / "manifests" / f"full-{step:012d}.json"
    manifest = json.loads(path.read_text())
    for o in manifest["objects"].values():
        if o["name"] == obj.name:
            o.update(nbytes=len(forged), checksum=checksum(forged))
    manifest.pop("checksum")
    manifest["checksum"] = checksum(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(manifest))


def test_a_tensor_file_with_a_shape_no_tensor_can_have_is_skipped_for_the_checkpoint_before(tmp_path, capsys):
    from everystep.eval.kills.train import TrainConfig, run

    directory = tmp_path / "c"
    run(TrainConfig(workload="mlp", strategy="checkfreq", steps=3, directory=str(directory), progress=False))
    _forge_tensor_file(directory, 3)
    code, out, _ = call_cli(capsys, "verify", str(directory))
    assert code == 1 and "strides overflow" in out
    with pytest.warns(UserWarning, match="skipping the checkpoint at step 3: .* strides overflow"):
        code, out, err = call_cli(capsys, "recover", "--dir", str(directory))
    assert code == 0 and out.startswith("step 2,"), err


def test_a_region_slot_with_a_shape_no_tensor_can_have_is_skipped_for_the_slot_before(tmp_path):
    """The newest slot's metadata given :data:`HUGE` for one tensor, its checksum that of no bytes,
    re-signed: the restore takes the slot before, where it failed with a RuntimeError."""
    from everystep.storage.base import checksum

    from .test_checkpointer import attach, loop, make
    from .test_hostile import _rewrite_slot_meta

    w = make("mlp", 0)
    with attach(w, tmp_path / "c", "lightcheck", every=1, persist_every=0, final=False) as ckpt:
        ckpt.restore()
        loop(w, ckpt, 0, 5)

    def forge(meta):
        i = next(i for i, row in enumerate(meta["tensors"]) if row[0].startswith("/model/"))
        meta["tensors"][i][2], meta["tensors"][i][4], meta["checksums"][i] = HUGE, 0, checksum(b"")
        return meta

    newest = _rewrite_slot_meta(tmp_path / "c" / "region" / "rank-0.bin", forge)
    again = make("mlp", 0)
    with pytest.warns(UserWarning, match="strides overflow"):
        with attach(again, tmp_path / "c", "lightcheck", every=1, persist_every=0, final=False) as ckpt:
            assert ckpt.restore() == newest - 1 and ckpt.recovered.source == "region"


@pytest.mark.parametrize("field, value", [("world_size", None), ("world_size", 0), ("world_size", "2"),
                                          ("strategy", 7), ("full_format", ["dcp"])])
def test_a_marker_re_signed_with_a_field_of_another_type_is_one_line_naming_it(trained, tmp_path, capsys, field, value):
    """Readers use the marker's world size and names as they are: one of another type, re-signed, is
    refused by ``verify``, ``inspect`` and ``recover`` naming the marker (a TypeError's traceback before)."""
    from everystep.storage.directory import MARKER, marker_bytes

    directory = tmp_path / "c"
    shutil.copytree(trained, directory)
    marker = json.loads((directory / MARKER).read_text())
    (directory / MARKER).write_bytes(marker_bytes({**marker, field: value}))
    for args in (("verify", str(directory)), ("inspect", str(directory)), ("recover", "--dir", str(directory))):
        code, out, err = call_cli(capsys, *args)
        assert code == 2 and f"{directory / MARKER}" in err and "Traceback" not in err, (args, code, out, err)
