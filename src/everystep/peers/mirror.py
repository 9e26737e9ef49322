"""A mirror: the two-slot region a rank keeps of a ward's own state, beside its own region
(``<region>.mirror``); writing one, reading its steps, waiting for a step's mirroring."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ..background import settled
from ..errors import BackgroundWriteError, CorruptCheckpointError
from ..storage.region import Region, RegionLayout

__all__ = ["mirrored", "mirror_path", "read_steps", "read_step", "commit_mirror", "open_read"]


def mirrored(future: "Future[Any] | None") -> None:
    """Wait for the newest step's mirroring, and raise if it failed: a rank whose buddy did not
    receive a step must not move its own copy in memory (region, agent) past it, or after a lost
    host no step is held both by a survivor's copy and by its mirror of the lost rank. (A mirroring
    fails when a peer is gone: the job is failing too.)"""
    settled(future)
    error = future.exception() if future is not None else None
    if error is not None:
        raise BackgroundWriteError(f"mirroring to the buddy on another host failed ({type(error).__name__}: {error}); "
                                   "the copies in memory stay at the step it held") from error


def mirror_path(region: Path) -> Path:
    """Where the mirror of the rank whose region would lie at ``region`` lies, on its buddy's host."""
    return region.with_name(region.name + ".mirror")


def read_steps(store: Region | None) -> list[int]:
    """The steps of ``store``'s slots that verify (none without a store)."""
    return [] if store is None else [slot.step for slot, _, _ in store.verified(copy=True, warn=False)]


def read_step(store: Region, step: int) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors (copies) and skeleton of ``store``'s slot of ``step``, verified (a mirror's
    skeleton, of the whole state, is kept in its slot's ``meta``: see :func:`commit_mirror`)."""
    for slot, tensors, meta in store.verified(copy=True, warn=False):
        if slot.step == step:
            return tensors, meta["meta"].get("state", meta["skeleton"])
    raise CorruptCheckpointError(f"{store.path} no longer holds a slot of step {step} that verifies")


def commit_mirror(store: Region, step: int, tensors: dict[str, torch.Tensor], skeleton: Any) -> None:
    """Keep a rank's own part of S_step in its mirror: the tensors, and the skeleton of the whole
    state (in the slot's ``meta``: the slot's own skeleton names only what it holds)."""
    writer = store.begin(RegionLayout.of(tensors), len(json.dumps(skeleton, default=str)))
    with torch.no_grad():
        for key, t in tensors.items():
            writer.views[key].copy_(t)
    store.commit(writer, step, {"step": step}, meta={"state": skeleton})


def open_read(path: Path, owners: set[str]) -> Region | None:
    """The region or mirror at ``path`` for reading, or None where there is none, or where it
    belongs to no checkpoint directory of ``owners`` (the owner tokens one directory keeps)."""
    if not os.path.lexists(path):
        return None
    store = Region.open(path, access="read")
    if store.owner not in owners:
        store.close()
        return None
    return store
