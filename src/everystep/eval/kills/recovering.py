"""``everystep recover``: the newest state a directory holds, read as a reader reads it — through
the strategy its marker names, with the live objects its run record describes (a directory written
by ``everystep train``), or, for one written through the Python API, the newest full checkpoint and
the newest slot of its regions; its step, its hash and where it was found."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...checkpointer import Checkpointer
from ...distributed import init_process_group
from ...errors import EverystepError
from ...recovery import recover
from ...storage import CheckpointDirectory
from ...storage.region import open_region, readable_region, region_places
from ...strategies import STRATEGIES
from ...tree import state_hash, unflatten
from ..workloads import build, needs_ddp

__all__ = ["recover_run", "training_state_hash"]


def recover_run(directory: str, *, region: str | None = None) -> dict[str, Any]:
    """Recover a directory written by ``everystep train``; returns step, hash and source. ``region``:
    where its region lies (its ``region=``; default: what its run record says, if in the directory or
    the memory tiers' folder)."""
    store = CheckpointDirectory.open(directory, create=False, access="read")
    try:
        return _recover_read(store, directory, region)
    finally:
        store.close()


def _recover_read(store: CheckpointDirectory, directory: str, region: str | None) -> dict[str, Any]:
    run = store.marker.get("run")
    if run is None:
        if any(r.manifest and r.manifest.kind != "full" for r in store.catalog.manifests()):
            raise EverystepError(f"{directory} holds differentials or spread checkpoints but no record of the model they "
                                 "replay into; restore it with Checkpointer.restore() in the training script")
        t0 = time.perf_counter()
        found = recover(store)
        newest = (found.step, found.tree, found.source) if found is not None else None
        for step, tree, source in _in_regions(store, region):  # (lightcheck's region, the memory tier)
            if newest is None or step > newest[0]:
                newest = (step, tree, source)
        if newest is None:
            return {"step": 0, "state_sha256": None, "source": "none"}
        return {"step": newest[0], "state_sha256": training_state_hash(newest[1]), "source": newest[2],
                "recovery_seconds": time.perf_counter() - t0}
    device = run.get("device", "cpu") if torch.cuda.is_available() else "cpu"  # the state is the same on either
    owns_group = init_process_group(one_process=needs_ddp(run["compress"]), device=device)
    try:
        return _recover_with(store, run, directory, device, region)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _recover_with(store: CheckpointDirectory, run: dict[str, Any], directory: str, device: str,
                  region: str | None) -> dict[str, Any]:
    w = build(run["workload"], seed=run["seed"], optimizer=run["optimizer"], compress=run["compress"], device=device,
              in_backward=run.get("in_backward", False))
    with Checkpointer(store, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, compression=w.compression,
                      strategy=store.marker["strategy"], every=run["every"], keep=run["keep"], final=False,
                      full_format=run.get("full_format", "safetensors"),
                      **_reader_options(store, run.get("options") or {}, region)) as ckpt:
        step = ckpt.restore()
        tree = {"step": step, **ckpt.components.capture(), **ckpt.components.capture_boundary()}
        found = ckpt.recovered
        return {"step": step, "state_sha256": training_state_hash(tree) if found else None,
                "source": found.source if found else "none", "recovery_seconds": found.seconds if found else 0.0}


def _in_regions(store: CheckpointDirectory, region: str | None) -> Iterator[tuple[int, Any, str]]:
    """Of a directory without a run record (written through the Python API), the newest slot that
    verifies of each region a reader looks in (:func:`~everystep.storage.region.paths.region_places`:
    lightcheck's, the memory tier's), rank 0's: its step, its state, and where it lies."""
    for rank, place in region_places(store, region):
        if rank:
            continue  # (one process reports rank 0's state, as a restore from full checkpoints does)
        try:
            found = open_region(store, place, rank=rank, read=True)
        except EverystepError as e:  # (one that cannot be read: the others, and the directory, still count)
            warnings.warn(f"skipping {e}", stacklevel=4)
            continue
        if found is None:
            continue
        try:
            newest = found.newest(copy=True)
        finally:
            found.close()
        if newest is not None:
            slot, tensors, meta = newest
            yield slot.step, unflatten(meta["skeleton"], tensors), "region" if place is None else "memory"


def _reader_options(store: CheckpointDirectory, options: Any, region: str | None) -> dict[str, Any]:
    """Of the options a run record holds (read from storage: anyone who could write the directory
    wrote them), those ``recover`` passes on: the strategy's own, but for what would make a reader
    contact or open something else — peers, or a region outside the directory and the memory tiers'
    folder (:func:`~everystep.storage.region.paths.readable_region`) unless the user named it
    (``region``); each left out said once."""
    from dataclasses import fields

    options = options if isinstance(options, dict) else {}
    name = store.marker.get("strategy")
    own = {f.name for f in fields(STRATEGIES[name].Config)} - {"every", "keep", "peers"} if name in STRATEGIES else set()
    taken = {k: v for k, v in options.items() if k in own and k != "region"}
    if (chosen := readable_region(options.get("region") if "region" in own else None, store.root, region)) is not None:
        taken["region"] = chosen
    if set(options) - set(taken) - {"region"}:  # (remote, peers, a Checkpointer's arguments: not a reader's)
        warnings.warn(f"{store.root}: its run record's options {', '.join(sorted(set(options) - set(taken)))} are not "
                      f"{name}'s own: not used by a reader", stacklevel=3)
    return taken


def training_state_hash(tree: dict[str, Any]) -> str:
    """The hash reported as ``final_state_sha256``: S_t without strategy-private bookkeeping."""
    return state_hash({k: v for k, v in tree.items() if k != "strategy"})
