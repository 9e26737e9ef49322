"""What is stored in a checkpoint directory, and whether each checkpoint verifies."""

from __future__ import annotations

import re
from typing import Any

from .errors import CorruptCheckpointError
from .storage import Reader, CheckpointDirectory, elsewhere
from .recovery import read_full
from .storage.region import UnreadableRegionError, UntrustedRegionError, open_region, region_path, region_places

__all__ = ["inspect_store", "verify_store", "region_rows"]


def inspect_store(directory: CheckpointDirectory, region: str | None = None) -> list[dict[str, Any]]:
    """One row per manifest, oldest step first: kind, step, bytes, valid, reason; and ``where``, for a
    checkpoint written to node-local directories (:func:`~everystep.storage.hosts.elsewhere`): of
    such a checkpoint only the parts this directory holds are read, each object verified. ``region``:
    where the regions lie (:func:`region_rows`)."""
    rows = []
    catalog = directory.catalog
    for record in catalog.manifests():
        m = record.manifest
        if m is None:
            rows.append({"name": record.name, "kind": "?", "step": -1, "bytes": 0, "valid": False, "reason": record.error})
            continue
        row = {"name": m.name, "kind": m.kind, "step": m.step, "bytes": m.nbytes, "valid": True, "reason": None}
        reasons: list[str] = []
        away = elsewhere(m, catalog)
        if away is not None:  # each host's own directory: what is here is verified, the rest is named
            reasons, row["where"] = _read_each(catalog, m, skip=set(away[0])), away[1]
        elif m.kind != "full":
            reasons = _read_each(catalog, m)
        else:
            try:
                read_full(directory, m)  # reads and checks every object once, and rebuilds the state
            except CorruptCheckpointError as e:
                # Name every bad object, not only the first (each rank's part of a sharded checkpoint).
                reasons = _read_each(catalog, m) or [str(e)]
        if reasons and not catalog.committed(m.name):
            continue  # discarded by the directory's writer while it was read
        if reasons:
            row.update(valid=False, reason="; ".join(reasons))
        rows.append(row)
    rows += region_rows(directory, region)
    return sorted(rows, key=lambda r: (r["step"], r["name"]))


def region_rows(directory: CheckpointDirectory, region: str | None = None) -> list[dict[str, Any]]:
    """lightcheck's regions and the memory tiers of ``directory``, where :func:`region_places` says:
    one row per complete or damaged slot, verified (read as a reader reads, as a copy)."""
    return [row for rank, place in region_places(directory, region) for row in _slot_rows(directory, place, rank)]


def _slot_rows(directory: CheckpointDirectory, option: str | None, rank: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        region = open_region(directory, option, rank=rank, read=True)  # (what is there: a listing makes nothing)
    except (UnreadableRegionError, UntrustedRegionError) as e:  # (one row: the rest of the directory is still read)
        path = region_path(directory.root, option, rank, int(directory.marker.get("world_size", 1)))
        return [{"name": str(path), "kind": "region", "step": -1, "bytes": 0, "valid": False, "reason": str(e)}]
    if region is not None:
        try:
            complete = {s.slot: s for s in region.slots(warn=False)}
            for record in region.objects.manifests():
                if record.manifest is None:
                    rows.append({"name": f"{region.path}:{record.name}", "kind": "region", "step": -1, "bytes": 0,
                                 "valid": False, "reason": record.error})
                    continue
                number = record.manifest.meta["slot"]
                row = {"name": f"{region.path}:slot{number}", "kind": "region", "step": record.manifest.step,
                       "bytes": record.manifest.nbytes, "valid": True, "reason": None}
                slot = complete.get(number)
                if slot is None or slot.step != record.manifest.step:
                    continue  # rewritten by the run while it was listed
                try:
                    region.read_slot(slot, copy=True)
                except CorruptCheckpointError as e:
                    if region.objects.committed(record.name):
                        row.update(valid=False, reason=str(e))
                rows.append(row)
        finally:
            region.close()
    return rows


def _read_each(catalog: Reader, manifest: Any, skip: set[str] = set()) -> list[str]:
    """Read and check every object of ``manifest`` (but those named in ``skip``); the reasons of
    those that fail."""
    reasons = []
    for info in manifest.objects.values():
        if info.name in skip:
            continue
        try:
            catalog.read_object(info)
        except CorruptCheckpointError as e:
            reasons.append(str(e))
    return reasons


def verify_store(directory: CheckpointDirectory, rows: list[dict[str, Any]] | None = None) -> list[str]:
    """Every problem in a checkpoint directory, each naming the file: checkpoints (and lightcheck's
    region slots) that fail to verify (checksum, size, missing object, unreadable manifest), and
    files that no checkpoint names (left by a crash, or copied in). While a process holds the
    directory for writing, its temporaries are its writes in progress (and the file its store keeps
    to write over), not problems. An empty list means all is well. ``rows``: what
    :func:`inspect_store` already returned."""
    catalog = directory.catalog
    rows = inspect_store(directory) if rows is None else rows
    problems = [f"{row['name']}: {row['reason']}" for row in rows if not row["valid"]]
    held = CheckpointDirectory.owner(directory.root) is not None
    live = held and directory.access == "read"  # a writer other than the caller (which may hold it itself)
    files = catalog.stored_files()  # before the manifests: a writer renames an object into place, then commits
    records = [r.manifest for r in catalog.manifests() if r.manifest]
    named = {o.name for m in records for o in m.objects.values()}
    newest = max((m.step for m in records), default=-1)
    in_progress = {token.split("/", 1)[1] for token, _ in catalog.interrupted_writes()} if held else set()
    for name in files:
        top = name.split("/", 1)[0]
        step = _STEP.match(top)
        if name in named or top in in_progress or (live and step is not None and int(step[1]) > newest):
            continue  # named, or a live writer's write in progress (its manifest not committed yet)
        problems.append(f"{catalog.where(f'objects/{name}')}: no checkpoint names this file")
    return problems


_STEP = re.compile(r"^[a-z_]+-(\d{12})")
