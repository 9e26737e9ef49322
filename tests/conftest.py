from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


def loss_gap(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference between two runs' losses, step by step."""
    return max(abs(x - y) / abs(y) for x, y in zip(losses, reference, strict=True))


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
