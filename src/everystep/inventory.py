"""What is stored in a checkpoint directory, and whether each checkpoint verifies."""

from __future__ import annotations

from typing import Any

from .errors import CorruptCheckpointError
from .storage.local import LocalStore
from .recovery import read_full

__all__ = ["inspect_store"]


def inspect_store(store: LocalStore) -> list[dict[str, Any]]:
    """One row per manifest, oldest step first: kind, step, bytes, valid, reason."""
    rows = []
    for record in store.manifests():
        m = record.manifest
        if m is None:
            rows.append({"name": record.name, "kind": "?", "step": -1, "bytes": 0, "valid": False, "reason": record.error})
            continue
        row = {"name": m.name, "kind": m.kind, "step": m.step, "bytes": m.nbytes, "valid": True, "reason": None}
        try:
            if m.kind == "full":
                read_full(store, m)
            else:
                for info in m.objects.values():
                    store.read_object(info)
        except CorruptCheckpointError as e:
            row.update(valid=False, reason=str(e))
        rows.append(row)
    return sorted(rows, key=lambda r: (r["step"], r["name"]))
