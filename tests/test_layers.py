"""Imports run one way: a lower floor never imports a higher one, and no module reaches into
another package's private names. Read from the source, so a new import that breaks a rule fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .conftest import ROOT

PACKAGE = ROOT / "src" / "everystep"

TOP = frozenset({"agent", "checkpointer", "cli", "cli_args", "demo", "eval", "integrations", "inventory", "plan",
                 "strategies"})
"""The parts that drive the others: no floor below them imports one."""

FORBIDDEN = {
    "storage": {"transport", "strategies", "agent", "eval", "checkpointer", "recovery", "cli", "inventory",
                "integrations"},
    "layout": {"transport", "storage", "strategies", "agent", "eval", "checkpointer", "integrations"},
    "transport": {"storage", "strategies", "agent", "eval", "checkpointer", "recovery", "integrations"},
    "agent": {"strategies", "eval", "checkpointer", "cli", "integrations"},
    "compress": {"strategies", "agent", "eval", "checkpointer", "storage", "integrations"},
    "policy": {"storage", "transport", "strategies", "agent", "eval", "checkpointer", "integrations"},
    "strategies": {"eval", "checkpointer", "cli", "integrations"},
    "capture": {"storage", "strategies", "agent", "eval", "checkpointer", "recovery", "integrations", "optim"},
    "background": {"transport", "storage", "strategies", "agent", "eval", "checkpointer", "recovery", "capture",
                   "integrations"},
    "replay": {"storage", "strategies", "agent", "eval", "checkpointer", "recovery", "integrations"},
    "recovery": {"strategies", "agent", "eval", "checkpointer", "cli", "integrations"},
    "spread": {"strategies", "agent", "eval", "checkpointer", "cli", "integrations", "transport"},
    "optim": {"storage", "transport", "strategies", "agent", "eval", "checkpointer", "recovery", "cli", "integrations"},
    "integrations": {"storage", "transport", "strategies", "agent", "eval", "recovery", "cli"},
    **dict.fromkeys(("_faults", "_forking", "_lazy", "_memory", "_process", "errors", "files", "tree", "units",
                     "distributed", "state", "state_checks", "rng", "parallelism", "stopping", "peers", "arguments", "tracing",
                     "slow_storage"),
                   TOP),
    "plan": TOP - {"plan"},
    "inventory": TOP - {"inventory"},
    "checkpointer": TOP - {"checkpointer", "strategies"},
    "cli_args": TOP - {"cli_args", "eval"},
    "demo": TOP - {"demo", "eval", "strategies"},
    "eval": {"agent", "cli", "demo", "inventory", "plan"},
    "cli": {"agent", "checkpointer", "integrations"},
}
"""Top-level part of the package (a sub-package or a module) → parts it must not import; every part
has a row (the package's ``__init__`` and ``__main__`` aside: they only name what is above)."""


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module imported, names imported from it) for each import in ``path``."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "everystep" and len(parts) > 1 else None


def test_no_lower_floor_imports_a_higher_one_and_no_private_name_crosses_a_package():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _part(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        own_package = ".".join(path.relative_to(PACKAGE.parent).parent.parts)
        for target, names in _imports(path):
            part = _part(target)
            if part is not None and part in FORBIDDEN.get(own or "", set()):
                broken.append(f"{path.relative_to(ROOT)} imports {target} ({own} must not import {part})")
            home = target.rsplit(".", 1)[0] if target.split(".")[-1].startswith("_") else target
            private = [n for n in names if n.startswith("_") and n != "__future__"]
            if target.startswith("everystep") and private and not own_package.startswith(home):
                broken.append(f"{path.relative_to(ROOT)} imports private {', '.join(private)} from {target}")
            if target.startswith("everystep.") and target.split(".")[-1].startswith("_") and \
                    not own_package.startswith(target.rsplit(".", 1)[0]):
                broken.append(f"{path.relative_to(ROOT)} imports the private module {target}")
    assert not broken, "\n".join(broken)


def test_the_rules_are_read_from_real_imports():
    """The reader sees relative imports as absolute ones (else the rules above could pass vacuously)."""
    found = dict(_imports(PACKAGE / "agent" / "process.py"))
    assert "everystep.storage" in found and "everystep.agent.channel" in found


def test_the_fork_server_imports_no_training_driver():
    """``eval/zygote.py`` runs the entry point it is given (``module:function``); it imports neither
    the driver nor anything above it, so that the two cannot import each other."""
    found = {target for target, _ in _imports(PACKAGE / "eval" / "zygote.py")}
    assert not {t for t in found if t.startswith("everystep.eval.") or t.startswith("everystep.strategies")}, found


def test_no_package_imports_another_that_imports_it():
    """No cycle between the package's parts (sub-packages and top-level modules), read from the source."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        own = _part(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for target, _ in _imports(path):
            part = _part(target)
            if own and part and part != own:
                edges.setdefault(own, set()).add(part)
    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and a in edges.get(b, set()))
    assert not cycles, cycles


def test_tools_read_storage_without_knowing_a_strategy():
    """``inventory.py`` imports no strategy; the training driver takes strategies from the registry
    alone (``everystep.strategies``), not a strategy's module."""
    assert not [t for t, _ in _imports(PACKAGE / "inventory.py") if t.startswith("everystep.strategies")]
    driver = [t for t, _ in _imports(PACKAGE / "eval" / "kills" / "train.py") if t.startswith("everystep.strategies")]
    assert driver and set(driver) == {"everystep.strategies"}, driver


def test_no_module_of_a_package_imports_one_that_imports_it_back():
    """No cycle between the modules of one package (``storage/directory`` ↔ ``storage/remote``,
    ``storage/dcp`` ↔ ``storage/sharded`` were two), a lazy import inside a function included."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.rsplit(".", 1)[0]
        for target, names in _imports(path):
            for found in (target, *(f"{target}.{n}" for n in names)):
                if found in modules and found != name and found.rsplit(".", 1)[0] == package != "everystep":
                    edges.setdefault(name, set()).add(found)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(edges.get(here, ()))
        return False

    cycles = sorted(f"{a} -> {b} -> … -> {a}" for a in edges for b in edges[a] if reaches(b, a))
    assert not cycles, cycles


def test_every_part_of_the_package_has_a_row_of_rules():
    parts = {_part(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)) for p in PACKAGE.rglob("*.py")}
    assert not sorted(parts - set(FORBIDDEN) - {"__init__", "__main__", None}), "give each new part a row in FORBIDDEN"


CEILING = 500
"""Lines a module may have."""


def test_no_module_is_over_500_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > CEILING}
    assert not over, f"over {CEILING} lines: {over}; split them"


def test_one_place_tells_a_remote_location_from_a_local_path():
    tests = re.compile(r"""startswith\(\s*["']s3:|["']s3://["']\s+(not\s+)?in\b|\[:5\]\s*==""")
    found = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if tests.search(p.read_text()))
    assert found == ["storage/stores/location.py"], f"only storage/stores/location.py tests for s3://; found in {found}"


def test_no_strategy_loads_what_it_recovers():
    """A strategy returns what it recovers (a Candidate); the Checkpointer loads it through
    recovery.load, the one place a recovered state enters the live objects."""
    loading = re.compile(r"components\.restore\(|\.restore\(\s*(found|tree|candidate)")
    found = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if loading.search(p.read_text()))
    assert found == ["recovery.py"], found


STORAGE_FACES = frozenset({"everystep.storage", *(f"everystep.storage.{room}" for room in ("stores", "formats", "region",
                                                                                           "remote"))})
"""What code outside ``storage`` may import of it: its face and its sub-packages' faces."""


def test_outside_storage_only_its_faces_are_imported():
    """Outside ``storage/`` an import names ``everystep.storage`` or one of its sub-packages, and a
    name from it that is not a module inside: what lies behind a face can move without a change outside."""
    inside = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
              for p in (PACKAGE / "storage").rglob("*.py")}
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "storage") in path.parents:
            continue
        for target, names in _imports(path):
            if not target.startswith("everystep.storage"):
                continue
            behind = [n for n in names if f"{target}.{n}" in inside - STORAGE_FACES]
            if target not in STORAGE_FACES or behind:
                broken.append(f"{path.relative_to(ROOT)} imports {target}{' ' + ', '.join(behind) if behind else ''}")
    assert not broken, "\n".join(broken)


def test_the_storage_faces_are_read_from_real_imports():
    found = {t for t, _ in _imports(PACKAGE / "strategies" / "lightcheck.py")}
    assert "everystep.storage.region" in found and "everystep.storage.formats" in found
