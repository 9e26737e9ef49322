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
    import boto3

    from everystep.distributed import free_port

    from .test_s3_tier import _moto

    fences = sum(p.read_text().count("```python\n") for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    port = free_port()
    server = _moto(port)  # the S3 endpoint the remote tier's example uploads to, its bucket made
    s3 = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "docs", "AWS_SECRET_ACCESS_KEY": "docs",
          "AWS_DEFAULT_REGION": "us-east-1"}
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **s3}
    try:
        boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], aws_access_key_id="docs", aws_secret_access_key="docs",
                     region_name="us-east-1").create_bucket(Bucket="my-bucket")
        done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=280,
                              env=env, cwd=tmp_path)
    finally:
        server.kill()
        server.wait()
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == fences - 2  # all but the two trainers' examples
    assert {name: error for name, error in results.items() if error} == {}


README_LINES = 300


def test_the_readme_stays_under_300_lines():
    """The README says what everystep is, how to start and the loop; figures and their analysis live
    in docs/measurements.md, not in a README that grows with every measurement."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_LINES, f"README.md has {lines} lines; move figures and analysis to docs/"
