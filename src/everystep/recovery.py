"""Finding and loading the newest recoverable point."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

from .errors import CorruptCheckpointError, NoValidCheckpointError
from .storage.base import Manifest
from .storage.local import LocalStore
from .state import unflatten
from .storage.sharded import read_parts

__all__ = ["Recovered", "read_full", "latest_full", "recover"]


@dataclass(frozen=True, kw_only=True)
class Recovered:
    """A recovered state: ``tree`` is S_step; ``source`` says where it came from."""

    step: int
    tree: dict[str, Any]
    source: str
    manifest: Manifest | None
    seconds: float


def read_full(store: LocalStore, manifest: Manifest) -> dict[str, Any]:
    """Read, verify and rebuild the state tree of a full checkpoint."""
    tensors, meta = read_parts(store, manifest)
    if "skeleton" not in meta:
        raise CorruptCheckpointError(f"manifest {manifest.name} lacks the skeleton of its state tree")
    try:
        tree = unflatten(meta["skeleton"], tensors)
    except KeyError as e:
        raise CorruptCheckpointError(f"checkpoint {manifest.name}: {e.args[0]}") from None
    if tree.get("step") != manifest.step:
        raise CorruptCheckpointError(f"checkpoint {manifest.name} holds step {tree.get('step')}, not {manifest.step}")
    return tree


def latest_full(store: LocalStore) -> tuple[Manifest, dict[str, Any]] | None:
    """The newest full checkpoint that verifies, with its state; ``None`` when there is none.

    Each checkpoint that fails verification is skipped with a warning naming why; if every one
    fails, :class:`NoValidCheckpointError` lists the reasons.
    """
    for _ in range(_RELISTS):
        skipped: list[tuple[str, str]] = []
        found = _latest_listed(store, skipped)
        if found is _DISCARDED:
            continue  # warn only about the listing that is answered
        for warning, _ in skipped:
            warnings.warn(warning, stacklevel=3)
        if found is None and skipped:
            raise NoValidCheckpointError(f"no valid checkpoint in {store.root}: " + "; ".join(r for _, r in skipped))
        return found  # type: ignore[return-value]
    raise NoValidCheckpointError(f"no checkpoint in {store.root} stayed committed long enough to be read: the "
                                 f"process writing there discarded each one that was being read, {_RELISTS} times")


_RELISTS = 16
_DISCARDED = object()


def _latest_listed(store: LocalStore, skipped: list[tuple[str, str]]) -> tuple[Manifest, dict[str, Any]] | None | object:
    """:func:`latest_full` over one listing of the manifests, each skipped one added to ``skipped``
    (its warning, its reason); ``_DISCARDED`` when a checkpoint was discarded by the directory's
    writer while it was read (list again: a newer one is there)."""
    records = store.manifests()
    skipped.extend((f"skipping {r.name}: {r.error}", r.error) for r in records if r.error)
    fulls = sorted((r.manifest for r in records if r.manifest and r.manifest.kind == "full"), key=lambda m: -m.step)
    for manifest in fulls:
        try:
            return manifest, read_full(store, manifest)
        except CorruptCheckpointError as e:
            if not store.committed(manifest.name):
                return _DISCARDED
            skipped.append((f"skipping the checkpoint at step {manifest.step}: {e}", f"step {manifest.step}: {e}"))
    return None


def recover(store: LocalStore) -> Recovered | None:
    """The newest recoverable state in ``store``, or ``None`` for an empty store."""
    t0 = time.perf_counter()
    found = latest_full(store)
    if found is None:
        return None
    manifest, tree = found
    return Recovered(step=manifest.step, tree=tree, source="disk", manifest=manifest, seconds=time.perf_counter() - t0)
