from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from everystep.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
S3_SECRET = "everystep-test-secret-key"


LONG_FIRST = (
    "test_gpu_check.py::test_the_dry_run",
    "test_lowdiff_plus.py::test_sigkill_at_20_instants",
    "test_bench.py::test_peers_run_in_the_same_comparison",
    "test_integrations.py::test_killed_and_resumed",
)
"""The longest tests that share no module fixture: run first, so that the workers finish together
rather than one running a minute-long test alone at the end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, name in enumerate(LONG_FIRST) if name in item.nodeid), len(LONG_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order


class _AgentZygote:
    """Forks the checkpoint agents a test process starts (:attr:`AgentLink.launcher`) from one process
    that imported torch once (:func:`everystep.eval.zygote.shared`: started at the first agent, ended
    at exit): a fresh interpreter spends seconds of CPU on its imports, and the suite starts tens of
    agents. A training process a test forks from a zygote (:mod:`tests.forked`, the kill tests') has
    its agents forked from that zygote, as a rank of ``everystep train`` does; one a test starts as a
    fresh interpreter (a trainer's script, a launcher's rank) starts them as a user's process does."""

    @staticmethod
    def fork(env: dict[str, str], argv: list[str], *, entry: str) -> Any:
        from everystep.eval.zygote import shared

        return shared(entry).fork(env, argv)


@pytest.fixture(scope="session", autouse=True)
def _agents_forked_from_one_process():
    from everystep.agent.client import AgentLink

    if not hasattr(os, "pidfd_open"):  # (what a zygote needs: Linux)
        yield
        return
    AgentLink.launcher = _AgentZygote()
    yield
    AgentLink.launcher = None


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


def running(pid: int) -> bool:
    """``pid`` runs: neither gone nor a zombie its parent has yet to reap."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def torch_libraries(pid: int) -> list[str]:
    """The PyTorch libraries process ``pid`` has loaded: none where it never imported torch."""
    import psutil

    return sorted({Path(m.path).name for m in psutil.Process(pid).memory_maps() if "torch" in Path(m.path).name})


def loss_gap(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference between two runs' losses, step by step."""
    return max(abs(x - y) / abs(y) for x, y in zip(losses, reference, strict=True))


def assert_recovered(summary: dict[str, Any], *, sources: set[str] | None = None, lose: int | None = None) -> None:
    """Each restart of a run with planned kills recovered what the lifetime it replaced left behind.

    Each kill is armed after a commit (:mod:`everystep.eval.kills.faults`), so something is recoverable
    before it: a restart from nothing fails here. Each restart resumed from a step no older than the
    newest one the failed lifetime saw recoverable in this failure mode (``recoverable_before``) and
    no newer than the step the kill landed in; from one of ``sources``; and with ``lose``, at most
    that many finished steps before the kill's (a per-iteration strategy's bound after a software
    failure: 1).
    """
    assert summary["recoveries"], "the run had no restart"
    for r in summary["recoveries"]:
        assert r["recoverable_before"] >= 1, f"nothing was recoverable before the kill at step {r['failed_at']}: {r}"
        assert r["recoverable_before"] <= r["resumed_from"] <= r["failed_at"], f"lost a recoverable step: {r}"
        assert sources is None or r["source"] in sources, f"recovered from {r['source']!r}, not {sources}: {r}"
        assert r["source"] != "none", r
        if lose is not None:
            assert r["failed_at"] - 1 - lose >= 1, f"a bound of {lose} lost step(s) proves nothing at step {r['failed_at']}"
            assert r["resumed_from"] >= r["failed_at"] - 1 - lose, f"lost more than {lose} finished step(s): {r}"


def run_cli(*args: str, env: dict[str, str] | None = None, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``everystep ARGS`` as a user would, in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-m", "everystep", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"everystep {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def call_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``everystep ARGS`` in this process (no interpreter start-up): exit status, stdout, stderr."""
    from everystep.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory`` with its content, to prove nothing was touched."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class FullDisk:
    """Makes every object write of ``directory``'s store fail with ENOSPC once ``full`` is set, and
    records the names of the objects whose writes failed (through the store's write seam)."""

    def __init__(self, directory: Any) -> None:
        self.full = False
        self.failed: list[str] = []
        catalog = directory.catalog
        write_object, os_write = catalog.write_object, catalog.store._os_write

        def recording(name: str, chunks: Any) -> Any:
            if self.full:
                self.failed.append(name)
            return write_object(name, chunks)

        def failing(fd: int, view: memoryview) -> int:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return os_write(fd, view)

        catalog.write_object, catalog.store._os_write = recording, failing


@pytest.fixture
def shm():
    """A folder in memory (``/dev/shm``) standing for the host's: a host loss takes what lies there."""
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="everystep-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A moto S3 server in a process of its own; the environment a job reaching it would have."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "log"  # (a file: a pipe nobody reads fills, and the server stops)
    with log.open("w") as err:  # (the server has its own copy of the descriptor)
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
    deadline = time.monotonic() + 60
    while True:  # until it accepts connections (it says nothing on a pipe when it does)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                pytest.fail(f"the S3 server (moto) did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.kill()
    proc.wait()


@pytest.fixture
def bucket(server, request):
    import boto3

    import hashlib

    name = "b-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]  # one per test (and parameter)
    boto3.client("s3").create_bucket(Bucket=name)
    return name


class TamperedClient:
    """A boto3 client whose HEAD answers are changed as a server (or someone between) might send them."""

    def __init__(self, client, edit):
        self._client, self._edit = client, edit

    def __getattr__(self, name):
        return getattr(self._client, name)

    def head_object(self, **kwargs):
        head = self._client.head_object(**kwargs)
        self._edit(head)
        return head
