"""I8, the trust boundary: nothing read from storage or a socket runs code, and nothing is sent to
a process whose identity was not checked.

Each malicious payload here would create a file if it ran; every test checks that it does not.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import stat
import sys
import time
from multiprocessing import connection
from pathlib import Path

import psutil
import pytest
import torch

from everystep import Checkpointer
from everystep.agent.channel import (
    AgentAddress,
    AgentIdentityError,
    connect,
    create_private,
    listen,
    Plain,
    message,
    recv,
    send,
)
from everystep.agent.client import AgentLink
from everystep.agent.config import AgentConfig
from everystep.errors import CorruptCheckpointError
from everystep.eval.workloads import build
from everystep.storage import CheckpointDirectory
from everystep.storage.base import Manifest, ObjectInfo, checksum
from everystep.storage.formats.dcp import load_metadata
from everystep.transport import TensorLayout



def _gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` (a child of another process) ends within ``seconds``."""
    try:
        psutil.Process(pid).wait(seconds)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


class _RunsCode:
    """Unpickling this creates ``path``: the proof that a loader ran code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _train(w, ckpt, start: int, stop: int) -> None:
    for _ in range(start, stop):
        w.loss(w.data.next()).backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
        w.scheduler.step()


def _checkpoints(directory: Path, steps: int, full_format: str) -> None:
    w = build("mlp", seed=0)
    with Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy="full_sync",
                      full_format=full_format, keep=10) as ckpt:
        _train(w, ckpt, ckpt.restore(), steps)


def _plant(store_dir: Path, manifest: Manifest) -> None:
    """Commit ``manifest`` as an attacker who can write the directory would: checksums recomputed."""
    (store_dir / "manifests" / f"{manifest.name}.json").write_bytes(manifest.to_bytes())


def _poison_dcp(directory: Path, step: int, payload: bytes) -> Manifest:
    """Replace the ``.metadata`` of the DCP checkpoint of ``step`` by ``payload``, manifest re-signed."""
    path = directory / "manifests" / f"full-{step:012d}.json"
    manifest = Manifest.from_bytes(path.read_bytes())
    objects = dict(manifest.objects)
    for key, info in objects.items():
        if info.name.endswith("/.metadata"):
            (directory / "objects" / info.name).write_bytes(payload)
            objects[key] = ObjectInfo(info.name, len(payload), checksum(payload))
    forged = Manifest(kind="full", step=step, objects=objects, meta=manifest.meta)
    _plant(directory, forged)
    return forged


def test_dcp_metadata_loader_admits_dcp_metadata_and_refuses_a_payload(tmp_path):
    _checkpoints(tmp_path / "d", 2, "dcp")
    metadata = sorted((tmp_path / "d" / "objects").glob("*.dcp/.metadata"))[-1]
    loaded = load_metadata(metadata)
    assert any("model" in k for k in loaded.state_dict_metadata)
    bad = tmp_path / "evil.metadata"
    for payload in (_RunsCode(tmp_path / "pwned"), [os.system], {"x": shutil.rmtree}):
        bad.write_bytes(pickle.dumps(payload))
        with pytest.raises(CorruptCheckpointError, match="refused|not DCP's Metadata"):
            load_metadata(bad)
    assert not (tmp_path / "pwned").exists()


def test_a_dcp_checkpoint_planted_in_a_safetensors_directory_is_refused_without_running_code(tmp_path):
    """The report's attack: a DCP checkpoint with a malicious ``.metadata`` copied into a directory of
    safetensors checkpoints, its manifest re-signed. Loading refuses it by format, and its metadata
    would be refused anyway; recovery falls back to the newest checkpoint that is the directory's own."""
    _checkpoints(tmp_path / "st", 6, "safetensors")
    _checkpoints(tmp_path / "dcp7", 7, "dcp")
    name = "full-000000000007"
    shutil.copytree(tmp_path / "dcp7" / "objects" / f"{name}.dcp", tmp_path / "st" / "objects" / f"{name}.dcp")
    shutil.copy(tmp_path / "dcp7" / "manifests" / f"{name}.json", tmp_path / "st" / "manifests")
    _poison_dcp(tmp_path / "st", 7, pickle.dumps(_RunsCode(tmp_path / "pwned")))
    w = build("mlp", seed=0)
    with pytest.warns(UserWarning, match="format 'dcp'.*safetensors"):
        with Checkpointer(tmp_path / "st", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          strategy="full_sync", final=False) as ckpt:
            assert ckpt.restore() == 6
    assert not (tmp_path / "pwned").exists()


def test_a_malicious_metadata_in_a_dcp_directory_is_refused_and_recovery_falls_back(tmp_path):
    _checkpoints(tmp_path / "d", 3, "dcp")
    _poison_dcp(tmp_path / "d", 3, pickle.dumps(_RunsCode(tmp_path / "pwned")))
    w = build("mlp", seed=0)
    with pytest.warns(UserWarning, match="DCP metadata .* was refused"):
        with Checkpointer(tmp_path / "d", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          strategy="full_sync", full_format="dcp", final=False) as ckpt:
            assert ckpt.restore() == 2
    assert not (tmp_path / "pwned").exists()


def test_a_dcp_metadata_that_names_a_file_outside_its_checkpoint_is_refused_and_recovery_falls_back(tmp_path):
    """A re-signed ``.metadata`` of step 3 that sends DCP's reads to step 2's data file: loaded, it
    would give step 2's tensors as step 3's. DCP opens only the checkpoint's own files, verified."""
    import dataclasses

    _checkpoints(tmp_path / "d", 3, "dcp")
    objects = tmp_path / "d" / "objects"
    metadata = load_metadata(objects / "full-000000000003.dcp" / ".metadata")
    [elsewhere] = (objects / "full-000000000002.dcp").glob("*.distcp")
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=f"../{elsewhere.parent.name}/{elsewhere.name}")
                             for index, info in metadata.storage_data.items()}
    _poison_dcp(tmp_path / "d", 3, pickle.dumps(metadata))
    w = build("mlp", seed=0)
    with pytest.warns(UserWarning, match="skipping the checkpoint at step 3: .*not one of the checkpoint's files"):
        with Checkpointer(tmp_path / "d", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                          strategy="full_sync", full_format="dcp", final=False) as ckpt:
            assert ckpt.restore() == 2


def test_a_dcp_checkpoint_is_read_once_and_dcp_reads_only_verified_bytes(tmp_path, monkeypatch):
    """Each of the checkpoint's files is read from storage once, whole, verified; DCP reads its
    items from those bytes in memory and opens no file itself."""
    from pathlib import Path as P

    _checkpoints(tmp_path / "d", 3, "dcp")
    opened: list[str] = []
    real_open = P.open
    monkeypatch.setattr(P, "open", lambda self, *a, **k: (opened.append(self.name), real_open(self, *a, **k))[1])
    w = build("mlp", seed=0)
    with Checkpointer(tmp_path / "d", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                      strategy="full_sync", full_format="dcp", final=False) as ckpt:
        assert ckpt.restore() == 3
        manifest = Manifest.from_bytes((tmp_path / "d" / "manifests" / "full-000000000003.json").read_bytes())
        assert ckpt.directory.catalog.bytes_read == sum(info.nbytes for info in manifest.objects.values())
    assert not [name for name in opened if name.endswith(".distcp") or name == ".metadata"]


def test_messages_are_json_and_a_pickle_on_the_socket_is_refused_without_running(tmp_path):
    a, b = connection.Pipe()
    layout = TensorLayout.of({"x": torch.zeros(3, dtype=torch.bfloat16), "y": torch.zeros(2, 2)})
    msg = message("init", layout=layout, betas=(0.9, 0.999), groups=[{"lr": 0.1, "nesterov": False}], none=None)
    send(a, msg)
    assert recv(b) == msg
    a.send_bytes(pickle.dumps(_RunsCode(tmp_path / "pwned")))
    with pytest.raises(ValueError):
        recv(b)
    a.send_bytes(json.dumps({"kind": "init", "layout": {"$layout": [["x", "system", [1], 0, 1]], "nbytes": 1}}).encode())
    with pytest.raises(ValueError, match="unknown dtype"):
        recv(b)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(TypeError, match="cannot carry"):
        send(a, message("step", grad=torch.zeros(1)))
    skeleton = {"model": {"w": {"__tensor__": "/model/w"}}, "groups": [{"lr": 0.1, "betas": {"__tuple__": [0.9, 0.99]}}]}
    send(a, message("step", skeleton=Plain(skeleton), betas=(0.9, 0.99)))  # plain JSON goes as it is
    assert recv(b) == {"kind": "step", "skeleton": skeleton, "betas": (0.9, 0.99)}
    tagged = {"$tuple": [1, 2], "$layout": "x", "$plain": {}, "inner": [{"$tuple": []}]}  # a state's own keys
    send(a, message("step", skeleton=Plain(tagged)))
    assert recv(b) == {"kind": "step", "skeleton": tagged}  # read back as they are, none taken for a tag


def test_agent_json_is_created_private_and_never_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "agent.json").symlink_to(victim)
    address = AgentAddress.new()
    address.publish(tmp_path)
    assert victim.read_text() == "precious"
    st = os.lstat(tmp_path / "agent.json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert AgentAddress.find(tmp_path) == address
    (tmp_path / "planted").write_text("")
    with pytest.raises(FileExistsError):
        create_private(tmp_path / "planted")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_private(tmp_path / "link")
    assert victim.read_text() == "precious"


def test_an_agent_json_readable_by_others_or_a_link_is_not_trusted(tmp_path):
    AgentAddress.new().publish(tmp_path)
    os.chmod(tmp_path / "agent.json", 0o644)
    with pytest.raises(AgentIdentityError, match="mode -rw-r--r--"):
        AgentAddress.find(tmp_path)
    with pytest.warns(RuntimeWarning, match="not using the checkpoint agent"):
        assert AgentLink.find(tmp_path) is None
    os.chmod(tmp_path / "agent.json", 0o600)
    os.rename(tmp_path / "agent.json", tmp_path / "real.json")
    (tmp_path / "agent.json").symlink_to(tmp_path / "real.json")
    with pytest.raises(AgentIdentityError, match="symbolic link"):
        AgentAddress.find(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_agent_json_of_another_user_is_not_trusted(tmp_path):
    AgentAddress.new().publish(tmp_path)
    os.chown(tmp_path / "agent.json", 65534, 65534)
    with pytest.raises(AgentIdentityError, match="owned by uid 65534"):
        AgentAddress.find(tmp_path)


class _Impostor:
    """A second process listening at an agent's address with its own key (as another user with
    ``uid``), recording how many bytes it receives before the connection ends."""

    def __init__(self, uid: int | None = None) -> None:
        self.address = AgentAddress.new()
        ready_r, ready_w = os.pipe()
        self._got_r, got_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # only the standard library here, then exit
            try:
                if uid is not None:
                    os.setgid(uid)
                    os.setuid(uid)
                listener = listen(self.address)
                os.write(ready_w, b"1")
                sock, _ = listener.accept()
                sock.settimeout(20)
                got = b""
                try:
                    while chunk := sock.recv(65536):
                        got += chunk
                except OSError:
                    pass
                os.write(got_w, str(len(got)).encode())
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(got_w)
        assert os.read(ready_r, 1) == b"1"
        os.close(ready_r)

    def received(self) -> int:
        """Bytes it received; waits for it to end."""
        os.waitpid(self.pid, 0)
        return int(os.read(self._got_r, 64))


def test_an_impostor_listening_in_place_of_the_agent_is_refused_before_anything_is_sent(tmp_path):
    """A process of the same user that is not the pid ``agent.json`` names (an impostor that took
    over the socket's name, or a stale file) receives nothing."""
    impostor = _Impostor()
    with pytest.raises(AgentIdentityError, match=f"the peer is process {impostor.pid}, not process {os.getpid()}"):
        connect(impostor.address, pid=os.getpid(), timeout=5)
    assert impostor.received() == 0


@pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"), reason="needs root to run a process "
                    "as another user, and SO_PEERCRED")
def test_an_impostor_of_another_user_receives_nothing(tmp_path):
    """A second process, of another user, listening where ``agent.json`` points, with the key it
    wrote there: the training process sends it nothing."""
    impostor = _Impostor(uid=65534)
    address = impostor.address
    AgentAddress(address=address.address, authkey=address.authkey, pid=impostor.pid).publish(tmp_path)
    with pytest.warns(RuntimeWarning, match="runs as uid 65534"):
        assert AgentLink.find(tmp_path) is None
    assert impostor.received() == 0


def test_bad_connections_neither_end_the_agent_nor_hold_it_past_its_grace(tmp_path):
    """The report: one connection with a wrong key ended a waiting agent (recovery from memory lost);
    one that never spoke kept it alive 175 s against a 30 s grace."""
    grace = 10.0  # (the wrong key, the silent connection and the next link all come within it, on a slow machine too)
    CheckpointDirectory.open(tmp_path, strategy="lowdiff_plus").close()
    link = AgentLink.spawn(AgentConfig(directory=str(tmp_path), strategy="lowdiff_plus", grace=grace, handshake=0.5))
    address = AgentAddress.find(tmp_path)
    assert address is not None and address.pid == link.pid
    link.hang_up()  # its training process is gone: the agent waits `grace` seconds for another
    t0 = time.monotonic()
    wrong = AgentAddress(address=address.address, authkey="0" * 32, pid=address.pid)
    with pytest.raises(ConnectionRefusedError, match="did not authenticate"):
        connect(wrong, pid=address.pid, timeout=5)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(address.address)
    again = AgentLink.find(tmp_path)  # served after the silent one is dropped
    assert again is not None
    assert again.call("hello", reply="hello", timeout=10)["pid"] == address.pid
    again.hang_up()
    assert _gone_within(address.pid, grace + 0.5 + 10), "the agent outlived its grace"
    assert time.monotonic() - t0 < grace * 2 + 10
    silent.close()
    log = (tmp_path / "agent.log").read_text()
    assert log.count("dropped a connection") >= 2 and "failed the handshake" in log


def test_a_region_slot_forged_to_hold_a_pickle_is_refused_without_running_code(tmp_path):
    """I5/I8 for lightcheck's region: someone who can write the file replaces the newest slot's
    metadata with a pickle and recomputes every checksum; loading skips that slot as unreadable,
    runs nothing, and recovers the other slot."""
    from everystep.storage.region import slots as rg

    w = build("mlp", seed=0)
    with Checkpointer(tmp_path / "c", w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                      strategy="lightcheck", persist_every=0, final=False) as ckpt:  # nothing in the directory
        ckpt.restore()
        _train(w, ckpt, 0, 3)
    path = tmp_path / "c" / "region" / "rank-0.bin"
    reader = rg.Region.open(path, access="read")
    newest, older = reader.slots()
    reader.close()
    payload = pickle.dumps(_RunsCode(tmp_path / "pwned"))
    raw = bytearray(path.read_bytes())
    raw[newest.area_offset:newest.area_offset + len(payload)] = payload
    body = rg._SLOT.pack(rg._SLOT_MAGIC, rg._COMPLETE, newest.slot, newest.step, newest.generation, newest.area_offset,
                         newest.area_nbytes, len(payload), rg._digest(payload))
    at = (1 + newest.slot) * rg.PAGE
    raw[at:at + len(body) + 16] = body + rg._digest(body)
    path.write_bytes(raw)
    w2 = build("mlp", seed=0)
    with pytest.warns(UserWarning, match=f"slot {newest.slot} .*unreadable metadata"):
        with Checkpointer(tmp_path / "c", w2.model, w2.optimizer, scheduler=w2.scheduler, data=w2.data,
                          strategy="lightcheck", persist_every=0, final=False) as again:
            assert again.restore() == older.step and again.recovered.source == "region"
    assert not (tmp_path / "pwned").exists()
