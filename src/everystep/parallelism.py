"""How a job's training state is laid out over its ranks: replicated, or sharded, and by what.

Data parallelism (one process, or DistributedDataParallel) keeps the whole state on every rank;
everystep stores it once, split across the ranks. A sharded layout keeps on each rank only its
shards: FSDP2 (``fully_shard``: parameters are DTensors sharded over a 1-D mesh), HSDP (a 2-D mesh,
replicated across its first dimension and sharded across its second), tensor parallelism
(``parallelize_module``: DTensors placed by a TP plan), FSDP and TP on a 2-D mesh, FSDP1
(``FullyShardedDataParallel``) and ZeRO-1 (``ZeroRedundancyOptimizer``: each rank holds the optimizer
state of its parameters). :func:`sharded_layout` names which, from the objects themselves (DTensor
placements, the wrapper and optimizer classes), never from private attributes.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .state import zero_redundancy
from .tree import OPTIMIZER_STATE_ENTRY, dtensor_class

__all__ = ["sharded_layout", "restart_rounding", "shard_like", "shard_box", "ShardBox", "state_boxes", "LAYOUTS", "DTENSOR_LAYOUTS", "SHARDED_LAYOUTS"]

LAYOUTS = ("FSDP2", "HSDP", "TP", "FSDP+TP", "FSDP1", "ZeRO-1")
"""The sharded layouts :func:`sharded_layout` tells apart."""

DTENSOR_LAYOUTS = frozenset({"FSDP2", "HSDP", "TP", "FSDP+TP"})
"""The layouts whose sharded state is DTensors: each rank's shards, and where they lie in the whole,
are read from the tensors themselves."""

SHARDED_LAYOUTS = DTENSOR_LAYOUTS | {"ZeRO-1"}
"""The layouts whose ranks' shards a strategy that writes each rank's state as it is checkpoints (all
but FSDP1): DTensors, and ZeRO-1's optimizer partitions."""


def shard_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` (a copy of this rank's shard of the DTensor ``like``, wherever it lies: a host buffer)
    as a DTensor placed as ``like`` is, without communication or a copy."""
    from torch.distributed.tensor import DTensor

    if local.device.type == like.device_mesh.device_type:
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    # A host copy of a device shard: from_local would copy it back to the device; the constructor
    # keeps it where it is, as DCP's own staging of DTensors to host memory does.
    return DTensor(local, like._spec, requires_grad=False)


def restart_rounding(model: torch.nn.Module, world: int) -> str | None:
    """Why a restart of this job equals the uninterrupted run only up to rounding, or None when it is
    bitwise.

    DistributedDataParallel all-reduces the gradients bucket by bucket. Unless built with
    ``find_unused_parameters=True``, it regroups its buckets after the first step of each process, in
    the order the gradients became ready. So the first step after a restart all-reduces in other
    buckets than the run did at that step. Above two ranks, the order in which an all-reduce adds
    the ranks' values depends on where a value lies in its bucket, and the step's result can
    differ in its last bits. With two ranks the sum is the same either way.
    """
    if world <= 2 or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    if model.find_unused_parameters and not getattr(model, "static_graph", False):
        return None
    return (f"DistributedDataParallel over {world} ranks regroups its gradient buckets after the first step of "
            "each process, so the first step after a restart adds the ranks' gradients in another order and "
            "recovery is exact only up to rounding; build it with find_unused_parameters=True (it then keeps its "
            "first buckets) for bitwise restarts")


def _dtensor_layout(model: torch.nn.Module) -> str | None:
    """FSDP2, HSDP, TP or FSDP+TP, from the placements of the model's DTensor parameters; None when
    it has none."""
    if dtensor_class() is None:
        return None  # (DTensor's module not imported: no parameter is one)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    fsdp = _fully_sharded(model)
    layouts = set()
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        placements = tuple(p.placements)
        if len(placements) == 2 and fsdp:
            layouts.add("HSDP" if isinstance(placements[0], Replicate) else "FSDP+TP")
        elif fsdp:
            layouts.add("FSDP2")
        elif any(isinstance(q, (Shard, Replicate)) for q in placements):
            layouts.add("TP")
    if not layouts:
        return None
    # a model's modules under several plans (TP inside, FSDP over it): name the most complete
    for name in ("FSDP+TP", "HSDP", "FSDP2", "TP"):
        if name in layouts:
            return name
    return None


def _fully_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to the model or one of its modules (FSDP2)."""
    module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)  # (not imported: none is one)
    return module is not None and any(isinstance(m, module) for m in model.modules())


def sharded_layout(model: torch.nn.Module, optimizer: Any) -> str | None:
    """The sharded layout of a job's model and optimizer (one of :data:`LAYOUTS`), or None when its
    state is replicated (one process, DistributedDataParallel)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # (not imported: no module is one)
    if fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in model.modules()):
        return "FSDP1"
    found = _dtensor_layout(model)  # (DistributedDataParallel's modules and parameters are its module's)
    if found is not None:
        return found
    return "ZeRO-1" if zero_redundancy(optimizer) else None



class ShardBox(NamedTuple):
    """Where a rank's shard of a DTensor lies in the whole, and who else holds it."""

    offsets: list[int]
    sizes: list[int]
    shape: list[int]
    """The whole tensor's."""
    index: int
    replicas: int
    """This rank is the ``index``-th of ``replicas`` ranks that hold the same shard (the mesh's
    Replicate dimensions: HSDP's first; 1 under FSDP2)."""


def shard_box(dtensor: Any) -> ShardBox:
    """The :class:`ShardBox` of this rank's shard of ``dtensor``, from the chunk DCP itself saves
    for it (``__create_chunk_list__``) and the placements."""
    (chunk,) = dtensor.__create_chunk_list__()
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    index, replicas = 0, 1
    for dim, placement in enumerate(dtensor.placements):
        if placement.is_replicate():
            index, replicas = index * mesh.size(dim) + coordinate[dim], replicas * mesh.size(dim)
    return ShardBox([int(v) for v in chunk.offsets], [int(v) for v in chunk.sizes], [int(v) for v in dtensor.shape],
                    index, replicas)


def state_boxes(boxes: Mapping[str, ShardBox], params: list[str], tensors: Mapping[str, torch.Tensor]
                ) -> dict[str, ShardBox]:
    """``boxes`` (of the model's shards by key) and, for each optimizer state entry of ``tensors``
    shaped as its parameter's shard (``exp_avg``, not a step counter), its parameter's box
    (``params``: the key of each parameter, in the optimizer's order)."""
    found = dict(boxes)
    for key, t in tensors.items():
        entry = OPTIMIZER_STATE_ENTRY.fullmatch(key)
        if entry is None or key in found or int(entry[1]) >= len(params):
            continue
        box = boxes.get(params[int(entry[1])])
        if box is not None and list(t.shape) == list(box.sizes):
            found[key] = box
    return found
