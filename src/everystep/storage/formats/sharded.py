"""Checkpoints written by every rank of a job, each rank writing its share, committed by rank 0.

Under data parallelism most of the state (parameters, optimizer state, the gradients a
differential records) is the same on every rank; the rest (random generators, the data
position, compression residuals) is each rank's own. A :class:`RankShare` lays the replicated
tensors end to end in key order and gives rank r the r-th of ``world`` equal byte ranges, cut at
element boundaries; each rank's object holds its pieces (flat slices, stored under the tensor's
own key) and its own per-rank tensors. So each rank writes about 1/world of the replicated bytes.

Commit (:func:`commit_parts`): every rank writes its object (durable, invisible), then all ranks
exchange what they wrote over the channel's own group; rank 0 commits one manifest naming every
part only when every part was written — under node-local disks (:mod:`~everystep.storage.hosts`)
each host's first rank commits it in its own directory. A single process writes the plain
one-object format.

Manifest of a checkpoint written by W > 1 ranks::

    objects: {"tensors-r0": ..., "tensors-r1": ...}
    meta:    {..., "world_size": W, "parts": [{"pieces": {key: [start, end, shape]}, "meta": {...}}, ...]}

where a part's ``meta`` holds what differs per rank (the skeleton of its state tree).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ...distributed import Ranks
from ...errors import CorruptCheckpointError
from ..base import Manifest, ObjectInfo, Reader, malformed
from ..catalog import Catalog
from ...layout import TensorLayout
from ...parallelism import ShardBox, shard_box, shard_like
from .tensorfile import read_object_tensors, tensor_chunks
from ...tree import OPTIMIZER_STATE, merged_meta

__all__ = ["RankShare", "commit_parts", "commit_tensors", "commit_written", "part_rank", "parts_read", "read_parts", "write_part"]


@dataclass(frozen=True)
class RankShare:
    """What this rank writes: ``local`` (tensor views) and, for replicated tensors, the piece ranges."""

    local: dict[str, torch.Tensor]
    pieces: dict[str, list[Any]]
    replicated: frozenset[str] = frozenset()
    sharded: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Keys whose tensor is this rank's shard of a DTensor, with the DTensor (its placements say where
    the shard lies); for DCP, which writes them itself (``split`` False)."""
    boxes: dict[str, list[Any]] = field(default_factory=dict)
    """Keys of ``local`` that are a box of a sharded tensor: ``[offsets, sizes, shape]`` — where the
    box lies in the whole tensor (of that ``shape``)."""
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    """For each of ``boxes``: the elements of this rank's shard (flattened) that its box holds."""

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], replicated: set[str], ranks: Ranks, *, split: bool = True,
           sharded: Mapping[str, torch.Tensor] | None = None, boxes: Mapping[str, ShardBox] | None = None
           ) -> "RankShare":
        """``split`` False: every tensor whole (a format that spreads replicated tensors itself).
        ``sharded`` (DTensors by key), or their ``boxes`` where the DTensors are elsewhere (the
        checkpoint agent's): those keys' tensors are this rank's shards, written as boxes of the whole
        tensor; a shard that ``replicas`` ranks hold (HSDP) is cut into as many boxes, one each."""
        if not split:
            return cls(dict(tensors), {}, frozenset(replicated), dict(sharded or {}))
        if boxes is None:
            boxes = {k: shard_box(dt) for k, dt in (sharded or {}).items()}
        local: dict[str, torch.Tensor] = {}
        written: dict[str, list[Any]] = {}
        rows: dict[str, tuple[int, int]] = {}
        for key, box in boxes.items():
            t = tensors.get(key)
            if t is not None and (part := _replica_rows(t, box)) is not None:
                local[key], written[key], rows[key] = part
        if not ranks.distributed:
            local.update((k, t) for k, t in tensors.items() if k not in boxes)
            return cls(local, {}, frozenset(replicated), boxes=written, rows=rows)
        keys = sorted(k for k in tensors if k in replicated and k not in boxes)
        total = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
        lo, hi = total * ranks.rank // ranks.world, total * (ranks.rank + 1) // ranks.world
        local.update((k, t) for k, t in tensors.items() if k not in replicated and k not in boxes)
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
        return cls(local, pieces, frozenset(replicated), boxes=written, rows=rows)

    def span(self, key: str) -> tuple[int, int] | None:
        """The elements of this rank's tensor of ``key`` (flattened) that it writes, as a range;
        None where it writes none. (A replicated tensor's piece; rows of a shard several ranks hold.)"""
        if key in self.pieces:
            start, end, _ = self.pieces[key]
            return start, end
        if key in self.rows:
            return self.rows[key]
        return (0, self.local[key].numel()) if key in self.local else None


def _replica_rows(shard: torch.Tensor, box: ShardBox) -> tuple[torch.Tensor, list[Any], tuple[int, int]] | None:
    """What of this rank's ``shard`` it writes, as a box of the whole tensor, and which of the shard's
    elements that is: all of it; where ``box.replicas`` ranks hold it, the ``box.index``-th of as many
    ranges of its rows (a shard without rows, or without elements: the first replica). None: nothing."""
    offsets, sizes, shape = list(box.offsets), list(box.sizes), list(box.shape)
    if list(shard.shape) != sizes:
        raise ValueError(f"a shard of shape {list(shard.shape)} does not fill its box of sizes {sizes}")
    if box.replicas == 1 or not sizes or not shard.numel():
        return (shard, [offsets, sizes, shape], (0, shard.numel())) if box.index == 0 else None
    lo, hi = sizes[0] * box.index // box.replicas, sizes[0] * (box.index + 1) // box.replicas
    if lo == hi:
        return None
    row = shard.numel() // sizes[0]
    return shard[lo:hi], [[offsets[0] + lo, *offsets[1:]], [hi - lo, *sizes[1:]], shape], (lo * row, hi * row)


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
    return commit_written(catalog, channel, kind=kind, step=step, info=info, pieces=share.pieces, boxes=share.boxes,
                          meta=meta, rank_meta=rank_meta, requires=requires, error=error)


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
    boxes: dict[str, list[Any]] | None = None,
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
    report = {"info": info.to_json() if info else None, "pieces": pieces, "boxes": boxes or {}, "meta": rank_meta}
    if catalog.hosts is not None and ranks.rank == 0:
        report["pins"] = catalog.pinned()  # (what rank 0's remote uploads: kept on every host)
    parts = ranks.exchange(channel, report, error, f"the {kind} checkpoint of step {step}")
    manifest = Manifest(
        kind=kind, step=step, requires=requires,
        objects={f"tensors-r{r}": ObjectInfo.from_json(p["info"]) for r, p in enumerate(parts)},
        meta={**meta, "world_size": ranks.world,
              **({"hosts": [list(g) for g in catalog.hosts]} if catalog.hosts is not None else {}),
              "parts": [{"pieces": p["pieces"], **({"boxes": p["boxes"]} if p["boxes"] else {}), "meta": p["meta"]}
                        for p in parts]},
    )
    if catalog.leads:  # (every host's first rank, in its own directory, under node-local disks)
        catalog.job_pins = parts[0].get("pins", [])
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


def part_rank(key: str) -> int | None:
    """The rank whose part a manifest's object key names (``tensors-r3``: 3), or None for another key."""
    found = _PART_KEY.fullmatch(key)
    return int(found[1]) if found else None


_PART_KEY = re.compile(r"tensors-r(\d{1,7})")


def parts_read(manifest: Manifest, rank: int, world: int, shards: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """The objects (keys of ``manifest.objects``) that rank ``rank`` of a job of ``world`` reads of
    the checkpoint (:func:`read_parts`; ``shards`` as there)."""
    if "parts" not in manifest.meta:
        return list(manifest.objects)
    with malformed(f"checkpoint {manifest.name}"):
        parts = _check_parts(manifest.meta["parts"])
    mine, other_world, boxes = rank % len(parts), len(parts) != world, _Boxes(shards or {})
    return [f"tensors-r{r}" for r, part in enumerate(parts)
            if r == mine or part["pieces"] or other_world or boxes.wants(part.get("boxes", {}))]


def read_parts(catalog: Reader, manifest: Manifest, *, full_format: str = "safetensors",
               shards: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors of a checkpoint, replicated ones reassembled, and its per-rank meta.

    ``shards``: the live DTensors of a sharded job by key; a stored tensor of such a key and of the
    DTensor's global shape is read as this rank's shard of it, placed as the live one is, whatever
    layout and world size wrote it (a DCP checkpoint through DCP; everystep's own from the boxes
    its parts hold, or from the whole tensor). Any other tensor is read whole.

    At another world size than the writer's, rank r takes the per-rank state of stored rank
    r mod W (only what is replicated is the same for every rank). A checkpoint in the DCP format
    is read only where ``full_format`` (the directory's marker) says ``dcp``.
    """
    what = f"checkpoint {manifest.name}"
    shards = shards or {}
    if manifest.meta.get("format") == "dcp":
        if full_format != "dcp":
            # IMPORTANT: the marker, not the manifest, says which loader may run on this directory.
            raise CorruptCheckpointError(
                f"{what} is in format 'dcp', but {catalog.root} holds full checkpoints in format {full_format!r} "
                "(its everystep.json): it was not written there, and is not loaded")
        from .dcp import read_dcp  # torch.distributed.checkpoint takes a second to import
        return read_dcp(catalog, manifest, catalog.ranks.rank, shards=shards)
    if "parts" not in manifest.meta:
        info = manifest.objects.get("tensors")
        if info is None:
            raise CorruptCheckpointError(f"{what} lacks its tensor object")
        return _as_shards(read_object_tensors(catalog, info), shards), manifest.meta
    read = set(parts_read(manifest, catalog.ranks.rank, catalog.ranks.world, shards))
    parts = manifest.meta["parts"]  # (checked by parts_read)
    world = len(parts)
    mine = catalog.ranks.rank % world
    other_world = world != catalog.ranks.world
    boxes = _Boxes(shards)
    tensors: dict[str, torch.Tensor] = {}
    flat: dict[str, torch.Tensor] = {}
    for r, part in enumerate(parts):
        if f"tensors-r{r}" not in read:
            continue  # (a sharded job's part that holds nothing this rank reads)
        info = manifest.objects.get(f"tensors-r{r}")
        if info is None:
            raise CorruptCheckpointError(f"{what} lacks the part of rank {r}")
        loaded = read_object_tensors(catalog, info)
        for key, (start, end, shape) in part["pieces"].items():
            piece = loaded.pop(key, None)
            if piece is None or piece.numel() != end - start:
                raise CorruptCheckpointError(f"{what}: the part of rank {r} lacks elements {start}:{end} of {key!r}")
            whole = flat.get(key)
            if whole is None and start == 0 and end == math.prod(shape) and _own(piece):
                flat[key], tensors[key] = piece, piece.view(shape)  # (one part holds it all: taken, not copied)
                continue
            if whole is None:
                whole = flat[key] = torch.empty(math.prod(shape), dtype=piece.dtype)
                tensors[key] = whole.view(shape)
            if whole.dtype != piece.dtype:
                raise CorruptCheckpointError(f"{what}: the parts of {key!r} differ in dtype")
            whole[start:end] = piece
        for key, (offsets, sizes, shape) in part.get("boxes", {}).items():
            box = loaded.pop(key, None)
            if box is None or list(box.shape) != sizes:
                raise CorruptCheckpointError(f"{what}: the part of rank {r} lacks the box {offsets}+{sizes} of {key!r}")
            with malformed(what):
                boxes.add(key, offsets, box, shape)
        if r == mine:
            tensors.update(loaded)
        elif other_world:  # ZeRO-1: every rank's optimizer state, each rank to load its new partition's
            tensors.update((k, t) for k, t in loaded.items() if k.startswith(OPTIMIZER_STATE) and k not in tensors)
    with malformed(what):
        assembled = boxes.finish()
    return {**_as_shards(tensors, shards), **assembled}, merged_meta(parts, mine, other_world)


class _Boxes:
    """The tensors this rank reads, assembled from the boxes of the whole that the parts hold: for a
    key of a live DTensor of the same shape, this rank's shard of it (as a DTensor placed as the live
    one is); for any other, the whole tensor."""

    def __init__(self, shards: Mapping[str, torch.Tensor]) -> None:
        self.shards = shards
        self._targets: dict[str, tuple[list[int], list[int]]] = {}
        self._placed: set[str] = set()
        """Keys read as this rank's shard of a live DTensor."""
        self._out: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}

    def _target(self, key: str, shape: list[int]) -> tuple[list[int], list[int]]:
        found = self._targets.get(key)
        if found is None:
            like = self.shards.get(key)
            if like is not None and list(like.shape) == list(shape):
                box = shard_box(like)
                found = (box.offsets, box.sizes)
                self._placed.add(key)
            else:
                found = ([0] * len(shape), list(shape))
            self._targets[key] = found
        return found

    def wants(self, boxes: dict[str, list[Any]]) -> bool:
        """Whether any of ``boxes`` (a part's) holds an element of what this rank reads."""
        for key, (offsets, sizes, shape) in boxes.items():
            at, wanted = self._target(key, shape)
            if _overlap(offsets, sizes, at, wanted) is not None or not math.prod(wanted):
                return True  # (a tensor without elements: any part that has it gives its dtype)
        return False

    def add(self, key: str, offsets: list[int], box: torch.Tensor, shape: list[int]) -> None:
        """Copy what of ``box`` (at ``offsets`` in the whole) this rank reads."""
        at, sizes = self._target(key, shape)
        out = self._out.get(key)
        if out is None and offsets == at and list(box.shape) == sizes and _own(box):
            self._out[key], self._filled[key] = box, box.numel()  # (the box is what this rank reads: taken, not copied)
            return
        if out is None:
            out = self._out[key] = torch.empty(sizes, dtype=box.dtype)
            self._filled[key] = 0
        if out.dtype != box.dtype:
            raise ValueError(f"the parts of {key!r} differ in dtype")
        common = _overlap(offsets, list(box.shape), at, sizes)
        if common is None:
            return
        lo, hi = common
        out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, at))] = \
            box[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
        self._filled[key] += math.prod(b - a for a, b in zip(lo, hi))

    def finish(self) -> dict[str, torch.Tensor]:
        """Every key's tensor; raises ValueError where the parts read did not fill one."""
        found = {}
        for key, out in self._out.items():
            if self._filled[key] != out.numel():
                raise ValueError(f"the parts fill {self._filled[key]} of the {out.numel()} elements of {key!r} read here")
            found[key] = shard_like(out, self.shards[key]) if key in self._placed else out
        return found


def _own(t: torch.Tensor) -> bool:
    """Whether ``t`` is the whole of its storage, laid out in order (an object's tensor as read, not a
    view of a larger buffer): a read can then hand it on as it is instead of copying it."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _overlap(offsets: list[int], sizes: list[int], at: list[int], wanted: list[int]) -> tuple[list[int], list[int]] | None:
    """Where two boxes of a tensor meet (from, to; a 0-d tensor's boxes always meet), or None."""
    lo = [max(a, b) for a, b in zip(offsets, at)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, at, wanted)]
    return (lo, hi) if all(a < b for a, b in zip(lo, hi)) else None


def _as_shards(tensors: dict[str, torch.Tensor], shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` read whole, each that a sharded job holds as a DTensor of its shape cut to this rank's
    shard of it and placed as the live one is (a checkpoint of a job that did not shard it): a whole
    tensor is the one box of itself."""
    boxes = _Boxes(shards)
    for key, t in tensors.items():
        like = shards.get(key)
        if like is not None and list(like.shape) == list(t.shape):
            boxes.add(key, [0] * t.dim(), t, list(t.shape))
    return {**tensors, **boxes.finish()}


def _check_parts(parts: Any) -> list[dict[str, Any]]:
    """The ``parts`` of a manifest, checked before anything is allocated from them: each a dict with
    ``pieces`` (key → [start, end, shape]), optionally ``boxes`` (key → [offsets, sizes, shape]), and
    ``meta``; each key's pieces, over the parts, cover its elements once, in order, and its boxes
    cover the whole tensor without overlapping (so what is allocated is what the parts hold)."""
    if not isinstance(parts, list) or not parts:
        raise ValueError("its parts are not a non-empty list")
    spans: dict[str, list[tuple[int, int]]] = {}
    shapes: dict[str, list[int]] = {}
    boxes: dict[str, list[tuple[list[int], list[int]]]] = {}
    for part in parts:
        if not isinstance(part, dict) or not isinstance(part.get("pieces"), dict) or not isinstance(part.get("meta"), dict) \
                or not isinstance(part.get("boxes", {}), dict):
            raise ValueError("a part is not a dict with pieces, boxes and meta")
        for key, piece in part["pieces"].items():
            start, end, shape = piece
            if not all(type(v) is int for v in (start, end, *shape)) or not 0 <= start <= end or min(shape, default=0) < 0:
                raise ValueError(f"the piece {piece!r} of {key!r} is not [start, end, shape] in whole numbers")
            if shapes.setdefault(key, list(shape)) != list(shape):
                raise ValueError(f"the parts give {key!r} two shapes")
            spans.setdefault(key, []).append((start, end))
        for key, box in part.get("boxes", {}).items():
            offsets, sizes, shape = box
            if key in part["pieces"] or not all(type(v) is int for v in (*offsets, *sizes, *shape)) or \
                    not len(offsets) == len(sizes) == len(shape) or \
                    not all(0 <= o and 0 <= n and o + n <= m for o, n, m in zip(offsets, sizes, shape)):
                raise ValueError(f"the box {box!r} of {key!r} is not [offsets, sizes, shape] of a box inside the shape")
            if shapes.setdefault(key, list(shape)) != list(shape):
                raise ValueError(f"the parts give {key!r} two shapes")
            boxes.setdefault(key, []).append((offsets, sizes))
    for key, found in spans.items():
        if key in boxes:
            raise ValueError(f"the parts hold {key!r} both as pieces and as boxes")
        at = 0
        for start, end in sorted(found):
            if start != at:
                raise ValueError(f"the parts do not cover {key!r} once (a gap or an overlap at element {at})")
            at = end
        if at != math.prod(shapes[key]):
            raise ValueError(f"the parts do not cover {key!r}")
    for key, found in boxes.items():
        filled = sorted(((o, n) for o, n in found if math.prod(n)), key=lambda box: box[0][:1])
        for i, (o, n) in enumerate(filled):  # (sorted by their first offset: only those that start in this one's rows)
            for other in itertools.takewhile(lambda b: not o or b[0][0] < o[0] + n[0], filled[i + 1:]):
                if _overlap(o, n, *other) is not None:
                    raise ValueError(f"two boxes of {key!r} overlap")
        if sum(math.prod(n) for _, n in filled) != math.prod(shapes[key]):
            raise ValueError(f"the boxes of {key!r} do not cover it")
    return parts
