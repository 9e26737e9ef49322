"""The README's and the docs' examples run as written (the trainers' in ``tests/test_integrations.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

SCRIPT = Path(__file__).with_name("docs_examples.py")


def test_every_python_example_of_the_readme_and_the_docs_runs_as_written(tmp_path):
    fences = sum(p.read_text().count("```python\n") for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=280,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == fences - 2  # all but the two trainers' examples
    assert {name: error for name, error in results.items() if error} == {}
