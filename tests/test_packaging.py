"""What ``pip install everystep`` alone gives a user: every strategy runs with the runtime
dependencies, and nothing that only an extra brings is needed for it."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import textwrap

from packaging.requirements import Requirement

from everystep.strategies import STRATEGIES

from .conftest import ROOT


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions() -> set[str]:
    """everystep's runtime dependencies and theirs, transitively (no extras), as canonical names."""
    found, todo = set(), ["everystep"]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                try:
                    metadata.distribution(req.name)
                except metadata.PackageNotFoundError:
                    continue  # an optional requirement of another platform
                todo.append(_canonical(req.name))
    return found


def modules_of_extras() -> set[str]:
    """Top-level modules that only distributions outside the runtime closure provide here."""
    runtime = runtime_distributions()
    return {module for module, dists in metadata.packages_distributions().items()
            if module.isidentifier() and module not in sys.stdlib_module_names
            and not any(_canonical(d) in runtime for d in dists)}


_BLOCKER = '''
import sys

BLOCKED = {blocked!r}


class _RuntimeOnly:
    """A finder that does not find what only an extra installs, as where it is absent."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [_RuntimeOnly(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''

_RUN_EVERY_STRATEGY = '''
import sys, tempfile
from everystep.eval.kills.train import TrainConfig, recover_run, run
from everystep.strategies import STRATEGIES

try:
    import matplotlib  # an extra's: must be out of reach here
except ModuleNotFoundError:
    pass
else:
    sys.exit("the extras are within reach: this environment proves nothing")
for name in sys.argv[1:]:
    with tempfile.TemporaryDirectory() as d:
        s = run(TrainConfig(workload="mlp", strategy=name, steps=5, every=2, directory=None if name == "none" else d,
                            compress="topk:0.05" if name == "lowdiff" else None, progress=False))
        # what it committed, read back by a reader: the final checkpoint, bitwise the state trained (a
        # lossy strategy's: its own approximation)
        found = {"step": 0, "state_sha256": s["final_state_sha256"]} if name == "none" else recover_run(d)
        same = found["state_sha256"] == s["final_state_sha256"] if STRATEGIES[name].exact else "lossy"
        print(name, len(s["losses"]), found["step"], same, flush=True)
'''


def test_every_strategy_runs_with_the_runtime_dependencies_alone(tmp_path):
    """In a process where everything that only the extras (bench, lightning, transformers, test)
    install cannot be imported, as after ``pip install everystep``, every strategy trains, writes and
    commits; the checkpoint agent and the writer process inherit the same restriction."""
    blocked = modules_of_extras()
    assert {"matplotlib", "lightning", "transformers", "hypothesis"} <= blocked
    assert "scipy" not in blocked and "torch" not in blocked
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER.format(blocked=sorted(blocked)))
    names = sorted(STRATEGIES)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_RUN_EVERY_STRATEGY), *names], cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT / 'src'}"},
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [w for name in names for w in (name, "5", "0" if name == "none" else "5",
                                                                 "True" if STRATEGIES[name].exact else "lossy")]


def test_the_suites_xdist_groups_keep_their_tests_on_one_worker(tmp_path):
    """``make test`` runs ``--dist loadgroup``: the tests that share an expensive fixture (the GPU
    check's dry run, the trainers imported in-process) are one ``xdist_group`` each, on one worker.
    A pytest and pytest-xdist that disagree on test ids spread a group silently (pytest 9.2 with
    pytest-xdist 3.8 did), and each worker then runs the group's fixture."""
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent("""
        import os, pytest
        together = pytest.mark.xdist_group("together")

        @together
        def test_a(): print("ran", os.environ["PYTEST_XDIST_WORKER"])
        @together
        def test_b(): print("ran", os.environ["PYTEST_XDIST_WORKER"])
        @together
        def test_c(): print("ran", os.environ["PYTEST_XDIST_WORKER"])
        def test_d(): pass
        def test_e(): pass
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist", "-n", "2", "--dist", "loadgroup", "-v",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # (xdist alone is what is tested)
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    workers = {m[1] for m in re.finditer(r"\[(gw\d+)\] .*PASSED .*::test_[abc]@together", done.stdout)}
    assert len(workers) == 1, done.stdout[-3000:]
