"""The state tree as flat tensors and a JSON skeleton, its hash, and the distance between two states.

``flatten`` splits a tree of dicts, lists and tuples whose leaves are tensors or JSON scalars into a
``{key: tensor}`` table and a JSON skeleton that refers to the table, storing tensors that share
memory (tied weights) once. A sharded tensor (a DTensor: FSDP2, tensor parallelism) stands in the
table as its local shard, and the DTensor itself, whose placements say where that shard lies in the
whole, is handed to the caller. ``unflatten`` is its inverse; ``check_skeleton`` checks a skeleton
read from storage before anything rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from typing import Any

import torch

__all__ = ["flatten", "unflatten", "check_skeleton", "state_hash", "state_error", "storage_key", "local_shard",
           "union_optimizer_state", "merged_meta", "dtensor_class", "OPTIMIZER_STATE", "OPTIMIZER_STATE_ENTRY", "MAX_DEPTH"]


def dtensor_class() -> type | None:
    """DTensor, where ``torch.distributed.tensor`` is imported; None where it is not (then no tensor is
    one: importing it costs half a second, which a process that shards nothing does not pay)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its local shard where ``t`` is a DTensor, else ``t`` itself
    (``None`` too: a gradient not there)."""
    if type(t) is not torch.Tensor and (dtensor := dtensor_class()) is not None and isinstance(t, dtensor):
        with torch.no_grad():
            return t.to_local()
    return t


_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_INTKEYS = "__intkeys__"


def storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same view of the same memory (tied weights)."""
    return (t.data_ptr(), t.device, t.shape, t.stride(), t.dtype)  # data_ptr: the storage's, plus the offset


_PLAIN = frozenset({bool, int, float, str, type(None)})
"""Types of JSON scalars a state holds as they are (checked by exact type: the fast path)."""
_STR, _INT = frozenset({str}), frozenset({int})


def flatten(tree: Any, prefix: str = "", *, sharded: dict[str, torch.Tensor] | None = None
            ) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a state tree into ``{key: tensor}`` and a JSON-serialisable skeleton.

    A DTensor is stored as its local shard, and put in ``sharded`` under its key (what it is a shard
    of: its global shape, its mesh and placements); without ``sharded``, a DTensor is a TypeError.

    Tensors that are the same view of the same memory (tied weights) are stored once; the
    skeleton refers to the first key. Dicts with non-string keys (optimizer state) and tuples
    survive the round trip.

    It runs at every checkpoint (on the training thread, or a strategy's), so it makes no Python
    call per node: scalars of a plain type are kept as they are, a tensor's full identity
    (:func:`storage_key`) is computed only when its data pointer is another's, and the tree is
    walked with a stack of its own (so a deep tree cannot exhaust Python's recursion either).
    """
    tensors: dict[str, torch.Tensor] = {}
    by_ptr: dict[int, list[tuple[tuple[Any, ...] | None, str]]] = {}
    dtensor = dtensor_class()

    def tensor(node: torch.Tensor, path: str) -> dict[str, str]:
        if type(node) is not torch.Tensor and dtensor is not None and isinstance(node, dtensor):
            if sharded is None:
                raise TypeError(f"state entry {path!r} is a DTensor (a shard of a sharded tensor), which this "
                                "state does not store")
            sharded[path] = node
            node = local_shard(node)
        if node.layout != torch.strided:
            raise TypeError(f"state entry {path!r} is a {node.layout} tensor; only dense tensors are supported")
        if not node.numel():
            tensors[path] = node
            return {_TENSOR: path}
        ptr = node.data_ptr()
        same = by_ptr.get(ptr)
        if same is None:
            by_ptr[ptr] = [(None, path)]
            tensors[path] = node
            return {_TENSOR: path}
        identity = storage_key(node)
        for i, (other, key) in enumerate(same):
            if other is None:
                other = storage_key(tensors[key])
                same[i] = (other, key)
            if other == identity:
                return {_TENSOR: key}
        same.append((identity, path))
        tensors[path] = node
        return {_TENSOR: path}

    # An explicit stack, depth first in the order of the tree (the first of tied tensors keeps its
    # key): each node is placed into the container made for its parent, and a tensor that is not a
    # DTensor, not empty and not sharing memory takes its fast path inline. No Python call is made
    # per node, which matters on the threads that flatten the state at every step.
    strided, tensor_type = torch.strided, torch.Tensor
    root: list[Any] = [None]
    stack: list[tuple[Any, str, Any, Any]] = [(tree, prefix, root, 0)]
    pending: list[tuple[Any, str, Any, Any]] = []
    while stack:
        node, path, into, at = stack.pop()
        kind = type(node)
        if kind in _PLAIN:
            into[at] = node
        elif kind is tensor_type and node.layout is strided and (ptr := node.data_ptr()) not in by_ptr \
                and node.numel():
            by_ptr[ptr] = [(None, path)]
            tensors[path] = node
            into[at] = {_TENSOR: path}
        elif isinstance(node, torch.Tensor):
            into[at] = tensor(node, path)
        elif isinstance(node, dict):
            kinds = set(map(type, node))
            if kinds <= _STR or all(isinstance(k, str) for k in node):
                out: Any = dict.fromkeys(node)
                for k, v in node.items():
                    if type(v) in _PLAIN:
                        out[k] = v
                    else:
                        pending.append((v, f"{path}/{k}", out, k))
                into[at] = out
            elif kinds <= _INT or all(isinstance(k, int) for k in node):
                rows = [[k, v] for k, v in node.items()]
                for row in rows:
                    if type(row[1]) not in _PLAIN:
                        pending.append((row[1], f"{path}/{row[0]}", row, 1))
                into[at] = {_INTKEYS: rows}
            else:
                raise TypeError(f"state entry {path!r} is a dict with keys that are neither all str nor all int")
        elif isinstance(node, (list, tuple)):
            items = list(node)
            for i, v in enumerate(items):
                if type(v) not in _PLAIN:
                    pending.append((v, f"{path}/{i}", items, i))
            into[at] = {_TUPLE: items} if isinstance(node, tuple) else items
        elif node is None or isinstance(node, (bool, int, float, str)):
            into[at] = node
        else:
            raise TypeError(
                f"state entry {path!r} has type {type(node).__name__}, which cannot be stored without pickle; "
                "expose it as tensors or JSON scalars"
            )
        if pending:
            pending.reverse()  # (popped in the tree's order)
            stack += pending
            pending.clear()
    skeleton = root[0]
    if sharded:
        for key in [k for k in sharded if k not in tensors]:
            del sharded[key]  # a tied DTensor: stored once, under the first key
    return tensors, skeleton


OPTIMIZER_STATE = "/optimizer/state/"
"""Where the optimizer's per-parameter state lies in a flat state."""

OPTIMIZER_STATE_ENTRY = re.compile(r"/optimizer/state/(\d+)/[^/]+")
"""The key of an entry of the i-th parameter's optimizer state (its group 1: i), in a flat state."""


def union_optimizer_state(skeleton: Any, others: list[Any]) -> Any:
    """``skeleton`` (a state's) with the optimizer state of the parameters only ``others`` (other ranks'
    skeletons of the same checkpoint) hold added: under ZeRO-1 each rank holds its partition's. What is
    not a well-formed optimizer state of a skeleton is left as it is (checked when it is rebuilt)."""
    def pairs(node: Any) -> list[list[Any]] | None:
        opt = node.get("optimizer") if isinstance(node, dict) else None
        state = opt.get("state") if isinstance(opt, dict) else None
        if state == {}:
            return []
        if isinstance(state, dict) and list(state) == [_INTKEYS] and isinstance(state[_INTKEYS], list):
            return [list(p) for p in state[_INTKEYS] if isinstance(p, list) and len(p) == 2 and type(p[0]) is int]
        return None

    mine = pairs(skeleton)
    if mine is None:
        return skeleton
    have = {k for k, _ in mine}
    for other in others:
        for key, value in pairs(other) or ():
            if key not in have:
                mine.append([key, value])
                have.add(key)
    return {**skeleton, "optimizer": {**skeleton["optimizer"], "state": {_INTKEYS: mine}}}


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`."""
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            key = skeleton[_TENSOR]
            if key not in tensors:
                raise KeyError(f"the checkpoint refers to tensor {key!r} but does not store it")
            return tensors[key]
        if _TUPLE in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton[_TUPLE])
        if _INTKEYS in skeleton:
            return {int(k): unflatten(v, tensors) for k, v in skeleton[_INTKEYS]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


MAX_DEPTH = 64
"""How deeply a stored skeleton may nest (a training state is a few levels deep)."""


def check_skeleton(skeleton: Any, keys: set[str]) -> None:
    """Raise ValueError unless ``skeleton`` is one :func:`flatten` could have made over tensors
    named ``keys``: JSON values, tagged nodes of the right shape, references to ``keys`` only, at
    most :data:`MAX_DEPTH` levels deep."""
    stack = [(skeleton, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"it nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            if _TENSOR in node:
                if len(node) != 1 or node[_TENSOR] not in keys:
                    raise ValueError(f"it refers to tensor {node[_TENSOR]!r}, which it does not store")
            elif _TUPLE in node:
                if len(node) != 1 or not isinstance(node[_TUPLE], list):
                    raise ValueError("a tuple of it is not a list")
                stack.extend((v, depth + 1) for v in node[_TUPLE])
            elif _INTKEYS in node:
                pairs = node[_INTKEYS]
                if len(node) != 1 or not isinstance(pairs, list) or \
                        not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int for p in pairs):
                    raise ValueError("a dict of it with integer keys is not a list of [key, value] pairs")
                stack.extend((v, depth + 1) for _, v in pairs)
            else:
                stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif not (node is None or isinstance(node, (bool, int, float, str))):
            raise ValueError(f"it holds a {type(node).__name__}")


def state_hash(tree: Any) -> str:
    """SHA-256 of every tensor's dtype, shape and values and every scalar, by path.

    Independent of memory layout, device, dict order and of whether tied tensors are stored once.
    Of a DTensor, it hashes this rank's shard.
    """
    h = hashlib.sha256()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            t = local_shard(node.detach()).to("cpu").contiguous()
            h.update(f"T|{path}|{t.dtype}|{tuple(t.shape)}|".encode())
            if t.numel():
                h.update(t.view(-1).view(torch.uint8).numpy().data)
            return
        if isinstance(node, dict):
            h.update(f"D|{path}|{len(node)}|".encode())
            for k in sorted(node, key=lambda x: (str(type(x)), x)):
                walk(node[k], f"{path}/{k}")
            return
        if isinstance(node, (list, tuple)):
            h.update(f"L|{path}|{len(node)}|".encode())
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
            return
        h.update(f"S|{path}|{json.dumps(node)}|".encode())

    walk(tree, "")
    return h.hexdigest()


def state_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Relative L2 distance ‖a − b‖ / ‖b‖ over the floating-point tensors of ``b``: one that ``a``
    lacks (a restore that left out the optimizer's state) counts as all wrong, as zeros would."""
    num = den = 0.0
    for k, t in b.items():
        if t.is_floating_point():
            num += float(((a[k].double() - t.double()) if k in a else t.double()).square().sum())
            den += float(t.double().square().sum())
    return math.sqrt(num / den) if den else 0.0


def merged_meta(parts: list[dict[str, Any]], mine: int, other_world: bool) -> dict[str, Any]:
    """The meta of a sharded checkpoint's part ``mine``; read at another world size than the
    writer's, its skeleton holds every part's optimizer state (:func:`union_optimizer_state`)."""
    meta = parts[mine]["meta"]
    if not other_world or not isinstance(meta, dict) or "skeleton" not in meta:
        return meta
    others = [p["meta"].get("skeleton") for p in parts if isinstance(p.get("meta"), dict)]
    return {**meta, "skeleton": union_optimizer_state(meta["skeleton"], others)}
