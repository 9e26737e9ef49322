"""``make test-mutations``'s bugs still fit the code and name tests that exist (the bugs themselves
run there, not here: each needs its tests run against it)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

from .conftest import ROOT


def _mutations():
    spec = importlib.util.spec_from_file_location("mutations", ROOT / "tools" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        del sys.modules[spec.name]
    return module.MUTATIONS


def test_each_bug_replaces_text_the_code_holds_once_and_names_tests_that_exist():
    mutations = _mutations()
    assert len({m.name for m in mutations}) == len(mutations)
    for m in mutations:
        assert (ROOT / m.path).read_text().count(m.before) == 1, m.name
        assert m.before != m.after and m.tests, m.name
        compile((ROOT / m.path).read_text().replace(m.before, m.after), m.path, "exec")  # the bug is still Python
        for test in m.tests:
            path, _, name = test.partition("::")
            tree = ast.parse((ROOT / path).read_text())
            functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert not name or name.partition("[")[0] in functions, test


def test_every_test_a_bug_names_is_collected():
    """A test named with its parameters (``name[id]``) exists as such: a renamed parameter would
    leave the bug with no test to run, which ``make test-mutations`` reports only when it runs."""
    named = sorted({t for m in _mutations() for t in m.tests})
    found = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *named],
                           cwd=ROOT, capture_output=True, text=True)
    collected = set(found.stdout.splitlines())
    missing = [t for t in named if "[" in t and t not in collected]
    assert found.returncode == 0 and not missing, (missing, found.stdout[-2000:], found.stderr[-2000:])
