"""Checkpoints written by every rank of a job, each rank writing its share, committed by rank 0.

Under data parallelism most of the state (parameters, optimizer state, the gradients a
differential records) is the same on every rank; the rest (random generators, the data
position, compression residuals) is each rank's own. A :class:`RankShare` lays the replicated
tensors end to end in key order and gives rank r the r-th of ``world`` equal byte ranges, cut at
element boundaries; each rank's object holds its pieces (flat slices, stored under the tensor's
own key) and its own per-rank tensors. So each rank writes about 1/world of the replicated bytes.

Commit (:func:`commit_parts`): every rank writes its object (durable, invisible), then all ranks
exchange what they wrote over the channel's own group; rank 0 commits one manifest naming every
part only when every part was written. A single process writes the plain one-object format.

Manifest of a checkpoint written by W > 1 ranks::

    objects: {"tensors-r0": ..., "tensors-r1": ...}
    meta:    {..., "world_size": W, "parts": [{"pieces": {key: [start, end, shape]}, "meta": {...}}, ...]}

where a part's ``meta`` holds what differs per rank (the skeleton of its state tree).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ..distributed import Ranks
from ..errors import CorruptCheckpointError
from .base import Manifest, ObjectInfo, Reader, malformed
from .catalog import Catalog
from ..layout import TensorLayout
from .tensorfile import load_tensors, tensor_chunks
from ..tree import OPTIMIZER_STATE, union_optimizer_state

__all__ = ["RankShare", "commit_parts", "commit_tensors", "commit_written", "read_parts", "write_part"]


@dataclass(frozen=True)
class RankShare:
    """What this rank writes: ``local`` (tensor views) and, for replicated tensors, the piece ranges."""

    local: dict[str, torch.Tensor]
    pieces: dict[str, list[Any]]
    replicated: frozenset[str] = frozenset()
    sharded: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Keys whose tensor is this rank's shard of a DTensor, with the DTensor (its placements say where
    the shard lies); written whole (``split`` False), by a format that knows shards (DCP)."""

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], replicated: set[str], ranks: Ranks, *, split: bool = True,
           sharded: Mapping[str, torch.Tensor] | None = None) -> "RankShare":
        """``split`` False: every tensor whole (a format that spreads replicated tensors itself)."""
        if not ranks.distributed or not split:
            return cls(dict(tensors), {}, frozenset(replicated), dict(sharded or {}))
        assert not sharded, "the shards of DTensors are written by DCP (split=False)"
        keys = sorted(k for k in tensors if k in replicated)
        total = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
        lo, hi = total * ranks.rank // ranks.world, total * (ranks.rank + 1) // ranks.world
        local = {k: t for k, t in tensors.items() if k not in replicated}
        pieces: dict[str, list[Any]] = {}
        offset = 0
        for key in keys:
            t = tensors[key]
            size, n = t.element_size(), t.numel()
            # Element i belongs to the rank whose byte range holds the element's first byte.
            start = min(n, max(0, -(-(lo - offset) // size)))
            end = min(n, max(0, -(-(hi - offset) // size)))
            offset += n * size
            if n == 0 and ranks.rank == 0:
                start, end = 0, 0
            elif start >= end:
                continue
            local[key] = t.detach().reshape(-1)[start:end]
            pieces[key] = [start, end, list(t.shape)]
        return cls(local, pieces, frozenset(replicated))


def object_name(kind: str, step: int, ranks: Ranks) -> str:
    suffix = f"-r{ranks.rank}" if ranks.distributed else ""
    return f"{kind}-{step:012d}{suffix}.safetensors"


def write_part(catalog: Catalog, kind: str, step: int, chunks: Iterable[memoryview], ranks: Ranks) -> ObjectInfo:
    """Write one rank's part of a checkpoint, durable but not yet part of any manifest."""
    return catalog.write_object(object_name(kind, step, ranks), chunks)


def commit_parts(
    catalog: Catalog,
    channel: str,
    *,
    kind: str,
    step: int,
    chunks: Iterable[memoryview] | None,
    share: RankShare,
    meta: dict[str, Any],
    rank_meta: dict[str, Any],
    requires: tuple[str, ...] = (),
    error: BaseException | None = None,
) -> Manifest:
    """Write this rank's part and, on rank 0, commit the checkpoint once every part is durable.

    Every rank must call this for the same checkpoints in the same order (``chunks`` None with
    ``error`` set when this rank's part could not even be prepared), so that no rank waits alone;
    a failure on any rank is raised on every rank and nothing is committed.
    """
    info: ObjectInfo | None = None
    if error is None:
        try:
            assert chunks is not None
            info = write_part(catalog, kind, step, chunks, catalog.ranks)
        except BaseException as e:  # reported to every rank below
            error = e
    return commit_written(catalog, channel, kind=kind, step=step, info=info, pieces=share.pieces, meta=meta,
                          rank_meta=rank_meta, requires=requires, error=error)


def commit_written(
    catalog: Catalog,
    channel: str,
    *,
    kind: str,
    step: int,
    info: ObjectInfo | None,
    pieces: dict[str, list[Any]],
    meta: dict[str, Any],
    rank_meta: dict[str, Any],
    requires: tuple[str, ...] = (),
    error: BaseException | None = None,
) -> Manifest:
    """The commit half of :func:`commit_parts`, for a part written elsewhere (``info``) or not at
    all (``error``): the ranks exchange what they wrote, and rank 0 commits if every part is there."""
    ranks: Ranks = catalog.ranks
    if not ranks.distributed:
        if error is not None:
            raise error
        assert info is not None
        manifest = Manifest(kind=kind, step=step, objects={"tensors": info}, meta={**meta, **rank_meta}, requires=requires)
        catalog.commit(manifest)
        return manifest
    report = {"info": info.to_json() if info else None, "pieces": pieces, "meta": rank_meta}
    parts = ranks.exchange(channel, report, error, f"the {kind} checkpoint of step {step}")
    manifest = Manifest(
        kind=kind, step=step, requires=requires,
        objects={f"tensors-r{r}": ObjectInfo.from_json(p["info"]) for r, p in enumerate(parts)},
        meta={**meta, "world_size": ranks.world, "parts": [{"pieces": p["pieces"], "meta": p["meta"]} for p in parts]},
    )
    if ranks.rank == 0:
        catalog.commit(manifest)
    return manifest


def commit_tensors(
    catalog: Catalog,
    channel: str,
    *,
    kind: str,
    step: int,
    tensors: dict[str, torch.Tensor],
    replicated: set[str],
    meta: dict[str, Any],
    rank_meta: dict[str, Any],
    requires: tuple[str, ...] = (),
    share: RankShare | None = None,
) -> Manifest:
    """:func:`commit_parts` for tensors at hand: share this rank's share (unless the caller has
    ``share``, made by :meth:`RankShare.of` from the same arguments) and stream it from them."""
    share = share or RankShare.of(tensors, replicated, catalog.ranks)
    layout = TensorLayout.of(share.local)
    return commit_parts(catalog, channel, kind=kind, step=step, chunks=tensor_chunks(layout, share.local), share=share,
                        meta=meta, rank_meta=rank_meta, requires=requires)


def read_parts(catalog: Reader, manifest: Manifest, *, full_format: str = "safetensors",
               shards: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors of a checkpoint, replicated ones reassembled, and its per-rank meta.

    ``shards``: the live DTensors of a sharded job by key; a DCP checkpoint's tensors of those keys
    are read as this rank's shards of them (DCP reshards what another layout or world size wrote),
    and a checkpoint in everystep's own format is refused.

    At another world size than the writer's, rank r takes the per-rank state of stored rank
    r mod W (only what is replicated is the same for every rank). A checkpoint in the DCP format
    is read only where ``full_format`` (the directory's marker) says ``dcp``.
    """
    what = f"checkpoint {manifest.name}"
    if manifest.meta.get("format") == "dcp":
        if full_format != "dcp":
            # IMPORTANT: the marker, not the manifest, says which loader may run on this directory.
            raise CorruptCheckpointError(
                f"{what} is in format 'dcp', but {catalog.root} holds full checkpoints in format {full_format!r} "
                "(its everystep.json): it was not written there, and is not loaded")
        from .dcp import read_dcp  # torch.distributed.checkpoint takes a second to import
        return read_dcp(catalog, manifest, catalog.ranks.rank, shards=shards)
    if shards:
        raise CorruptCheckpointError(
            f"{what} is in everystep's own format, whose parts a sharded job (DTensors) does not read: "
            "a sharded job's full checkpoints are in DCP's format (full_format='dcp')")
    if "parts" not in manifest.meta:
        info = manifest.objects.get("tensors")
        if info is None:
            raise CorruptCheckpointError(f"{what} lacks its tensor object")
        return load_tensors(catalog.read_object(info), what=f"object {info.name}"), manifest.meta
    with malformed(what):
        parts = _check_parts(manifest.meta["parts"])
    world = len(parts)
    mine = catalog.ranks.rank % world
    other_world = world != catalog.ranks.world
    tensors: dict[str, torch.Tensor] = {}
    flat: dict[str, torch.Tensor] = {}
    for r, part in enumerate(parts):
        info = manifest.objects.get(f"tensors-r{r}")
        if info is None:
            raise CorruptCheckpointError(f"{what} lacks the part of rank {r}")
        loaded = load_tensors(catalog.read_object(info), what=f"object {info.name}")
        for key, (start, end, shape) in part["pieces"].items():
            piece = loaded.pop(key, None)
            if piece is None or piece.numel() != end - start:
                raise CorruptCheckpointError(f"{what}: the part of rank {r} lacks elements {start}:{end} of {key!r}")
            whole = flat.get(key)
            if whole is None:
                whole = flat[key] = torch.empty(math.prod(shape), dtype=piece.dtype)
                tensors[key] = whole.view(shape)
            if whole.dtype != piece.dtype:
                raise CorruptCheckpointError(f"{what}: the parts of {key!r} differ in dtype")
            whole[start:end] = piece
        if r == mine:
            tensors.update(loaded)
        elif other_world:  # ZeRO-1: every rank's optimizer state, each rank to load its new partition's
            tensors.update((k, t) for k, t in loaded.items() if k.startswith(OPTIMIZER_STATE) and k not in tensors)
    return tensors, merged_meta(parts, mine, other_world)


def merged_meta(parts: list[dict[str, Any]], mine: int, other_world: bool) -> dict[str, Any]:
    """The meta of part ``mine``; read at another world size than the writer's, its skeleton holds
    every part's optimizer state (:func:`~everystep.tree.union_optimizer_state`)."""
    meta = parts[mine]["meta"]
    if not other_world or not isinstance(meta, dict) or "skeleton" not in meta:
        return meta
    others = [p["meta"].get("skeleton") for p in parts if isinstance(p.get("meta"), dict)]
    return {**meta, "skeleton": union_optimizer_state(meta["skeleton"], others)}


def _check_parts(parts: Any) -> list[dict[str, Any]]:
    """The ``parts`` of a manifest, checked before anything is allocated from them: each a dict with
    ``pieces`` (key → [start, end, shape]) and ``meta``; each key's pieces, over the parts, cover
    its elements once, in order (so what is allocated is what the parts hold)."""
    if not isinstance(parts, list) or not parts:
        raise ValueError("its parts are not a non-empty list")
    spans: dict[str, list[tuple[int, int]]] = {}
    shapes: dict[str, list[int]] = {}
    for part in parts:
        if not isinstance(part, dict) or not isinstance(part.get("pieces"), dict) or not isinstance(part.get("meta"), dict):
            raise ValueError("a part is not a dict with pieces and meta")
        for key, piece in part["pieces"].items():
            start, end, shape = piece
            if not all(type(v) is int for v in (start, end, *shape)) or not 0 <= start <= end or min(shape, default=0) < 0:
                raise ValueError(f"the piece {piece!r} of {key!r} is not [start, end, shape] in whole numbers")
            if shapes.setdefault(key, list(shape)) != list(shape):
                raise ValueError(f"the parts give {key!r} two shapes")
            spans.setdefault(key, []).append((start, end))
    for key, found in spans.items():
        at = 0
        for start, end in sorted(found):
            if start != at:
                raise ValueError(f"the parts do not cover {key!r} once (a gap or an overlap at element {at})")
            at = end
        if at != math.prod(shapes[key]):
            raise ValueError(f"the parts do not cover {key!r}")
    return parts
