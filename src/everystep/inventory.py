"""What is stored in a checkpoint directory, and whether each checkpoint verifies."""

from __future__ import annotations

from typing import Any

from .errors import CorruptCheckpointError
from .storage.base import Store
from .storage.directory import CheckpointDirectory
from .recovery import read_full

__all__ = ["inspect_store", "verify_store"]


def inspect_store(directory: CheckpointDirectory) -> list[dict[str, Any]]:
    """One row per manifest, oldest step first: kind, step, bytes, valid, reason."""
    rows = []
    store = directory.store
    for record in store.manifests():
        m = record.manifest
        if m is None:
            rows.append({"name": record.name, "kind": "?", "step": -1, "bytes": 0, "valid": False, "reason": record.error})
            continue
        row = {"name": m.name, "kind": m.kind, "step": m.step, "bytes": m.nbytes, "valid": True, "reason": None}
        reasons: list[str] = []
        if m.kind != "full":
            reasons = _read_each(store, m)
        else:
            try:
                read_full(directory, m)  # reads and checks every object once, and rebuilds the state
            except CorruptCheckpointError as e:
                # Name every bad object, not only the first (each rank's part of a sharded checkpoint).
                reasons = _read_each(store, m) or [str(e)]
        if reasons and not store.committed(m.name):
            continue  # discarded by the directory's writer while it was read
        if reasons:
            row.update(valid=False, reason="; ".join(reasons))
        rows.append(row)
    return sorted(rows, key=lambda r: (r["step"], r["name"]))


def _read_each(store: Store, manifest: Any) -> list[str]:
    """Read and check every object of ``manifest``; the reasons of those that fail."""
    reasons = []
    for info in manifest.objects.values():
        try:
            store.read_object(info)
        except CorruptCheckpointError as e:
            reasons.append(str(e))
    return reasons


def verify_store(directory: CheckpointDirectory) -> list[str]:
    """Every problem in a checkpoint directory, each naming the file: checkpoints that fail to
    verify (checksum, size, missing object, unreadable manifest), and files that no checkpoint
    names (left by a crash, or copied in). An empty list means all is well."""
    store = directory.store
    problems = [f"{row['name']}: {row['reason']}" for row in inspect_store(directory) if not row["valid"]]
    named = {o.name for r in store.manifests() if r.manifest for o in r.manifest.objects.values()}
    for name in store.stored_files():
        if name not in named:
            problems.append(f"{store.object_path(name)}: no checkpoint names this file")
    return problems
