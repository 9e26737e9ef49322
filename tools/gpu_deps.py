"""Copy the test runner (pytest and the plugins ``tests/test_cuda.py`` runs under), and the
pure-Python checkpointing libraries the bench compares with where installed, out of this
environment into a folder that a GPU machine with no network puts on its ``PYTHONPATH``.

    python tools/gpu_deps.py .gpu-deps      (``make gpu-deps``)

Only pure-Python distributions are copied, with their metadata (so that pytest finds its plugins by
their entry points); compiled caches and scripts are left behind.
"""

from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path

DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "pytest-timeout", "pytest-xdist", "execnet")

LIBRARIES = ("lm-resiliency", "torch-checkpointing", "typing-extensions")
"""The checkpointing libraries the GPU check's bench part compares with, where installed here (``make
install-peers``): the pure-Python ones. DLRover's flash checkpoint needs grpcio and psutil, compiled
for this Python: the check reports it not run."""


def copy(to: Path) -> int:
    if to.exists():
        shutil.rmtree(to)
    count = 0
    for name in DISTRIBUTIONS + LIBRARIES:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name in DISTRIBUTIONS:
                raise
            continue  # (the peers extra is not installed here)
        for file in dist.files or ():
            parts = Path(file).parts
            if parts[0] == ".." or "__pycache__" in parts or file.suffix in (".so", ".pyd", ".pyc"):
                continue  # scripts outside site-packages, caches of this Python
            source = Path(dist.locate_file(file))
            if source.is_file():
                (to / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, to / file)
                count += 1
    return count


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu-deps")
    print(f"{copy(target)} files of {', '.join(DISTRIBUTIONS + LIBRARIES)} (those installed) copied into {target}")
