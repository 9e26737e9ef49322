"""The wire of the replicas on peers: a length (int64), then one buffer — a JSON header (what a region
slot's metadata holds: the step, the rank whose state it is, the skeleton, each tensor's dtype, shape,
place and checksum) followed by the tensors' bytes. Nothing received is unpickled; every checksum is
verified before a tensor is used (I8)."""

from __future__ import annotations

import json
import struct
from typing import Any

import psutil
import torch
import torch.distributed as dist

from .._faults import crash_point
from ..distributed import Ranks
from ..errors import CorruptCheckpointError
from ..storage import MALFORMED, checksum, refuse_constant
from ..storage.region import RegionLayout
from .team import CHANNEL

__all__ = ["WHOLE_STATE", "STATE_STEP", "pack", "unpack", "send", "receive", "swap"]


_LENGTH = struct.Struct("<Q")


WHOLE_STATE, STATE_STEP = "whole", "step"
"""The kinds of message a rank sends its buddy where the buddy keeps a replica of its whole state
(LowDiff+ under sharding): the state whole, or one step's update to it. Elsewhere a message is the
rank's own part of the state at its step."""


def pack(step: int, rank: int, tensors: dict[str, torch.Tensor], skeleton: Any) -> torch.Tensor:
    """One buffer (uint8) holding ``tensors`` (CPU) of rank ``rank``'s state at ``step`` and the skeleton."""
    layout = RegionLayout.of(tensors)
    data = torch.empty(layout.nbytes, dtype=torch.uint8)
    for e in layout.entries:
        if e.nbytes:
            data[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.key])
    view = memoryview(data.numpy()) if layout.nbytes else memoryview(b"")
    sums = {e.key: checksum(view[e.offset:e.offset + e.nbytes]) for e in layout.entries}
    head = json.dumps({"format": "everystep-peer", "step": step, "rank": rank, "skeleton": skeleton,
                       "data_nbytes": layout.nbytes, "tensors": layout.to_json(sums)}, separators=(",", ":")).encode()
    head += b" " * (-(_LENGTH.size + len(head)) % 64)  # (JSON's whitespace) the tensors aligned for their views
    return torch.cat([torch.frombuffer(bytearray(_LENGTH.pack(len(head)) + head), dtype=torch.uint8), data])


def unpack(buffer: torch.Tensor, *, sender: int, expect: tuple[int, int] | None = None
           ) -> tuple[int, int, dict[str, torch.Tensor], Any]:
    """What :func:`pack` packed: (step, rank, tensors, skeleton), every checksum verified (the
    tensors are views of ``buffer``); raises :class:`CorruptCheckpointError` naming ``sender``, also
    when it is not the state of ``expect`` (step, rank)."""
    raw = memoryview(buffer.numpy())
    try:
        (n,) = _LENGTH.unpack(raw[:_LENGTH.size])
        head = json.loads(bytes(raw[_LENGTH.size:_LENGTH.size + n]), parse_constant=refuse_constant)
        if not isinstance(head, dict) or head.get("format") != "everystep-peer":
            raise ValueError("not a peer's state")
        step, rank, data_nbytes = head["step"], head["rank"], head["data_nbytes"]
        if type(step) is not int or type(rank) is not int or type(data_nbytes) is not int \
                or _LENGTH.size + n + data_nbytes != len(raw):
            raise ValueError("its size is not what its header says")
        layout, sums = RegionLayout.from_json(head["tensors"], data_nbytes)
        if not isinstance(head["skeleton"], dict) or head["skeleton"].get("step") != step:
            raise ValueError(f"its skeleton is not that of step {step}")  # (a part: checked whole, once put together)
    except MALFORMED as e:
        raise CorruptCheckpointError(f"the state rank {sender} sent is unreadable ({type(e).__name__}: {e})") from None
    if expect is not None and (step, rank) != expect:
        raise CorruptCheckpointError(f"rank {sender} sent the state of rank {rank} at step {step} for that of rank "
                                     f"{expect[1]} at step {expect[0]}")
    base = _LENGTH.size + n
    tensors = {}
    for e in layout.entries:
        if checksum(raw[base + e.offset:base + e.offset + e.nbytes]) != sums[e.key]:
            raise CorruptCheckpointError(f"the state rank {sender} sent: tensor {e.key!r} fails its checksum")
        tensors[e.key] = buffer[base + e.offset:base + e.offset + e.nbytes].view(e.dtype).view(e.shape)
    return step, rank, tensors, head["skeleton"]


def send(ranks: Ranks, buffer: torch.Tensor, dst: int) -> None:
    group = ranks.groups[CHANNEL]
    dist.send(torch.tensor([buffer.numel()], dtype=torch.int64), dst, group=group)
    dist.send(buffer, dst, group=group)


def _size(n: torch.Tensor, sender: int) -> int:
    """A buffer's size as a peer announced it: at least a length field, and no more than this host's
    memory has free (a size garbled in transit, or a peer's bug, is refused here, not by the kernel's
    out-of-memory killer)."""
    size = int(n.item())
    if size < _LENGTH.size:
        raise CorruptCheckpointError(f"rank {sender} announced a state of {size} bytes")
    free = psutil.virtual_memory().available
    if size > free:
        raise CorruptCheckpointError(f"rank {sender} announced a state of {size} bytes, more than the "
                                     f"{free} bytes this host has free")
    return size


def receive(ranks: Ranks, src: int) -> torch.Tensor:
    group = ranks.groups[CHANNEL]
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    buffer = torch.empty(_size(n, src), dtype=torch.uint8)
    dist.recv(buffer, src, group=group)
    return buffer


def swap(ranks: Ranks, buffer: torch.Tensor, buddy: int, wards: list[int]) -> list[torch.Tensor]:
    """Send ``buffer`` to ``buddy`` and receive each ward's, all at once (every rank sends one and
    receives from each of its wards, so no order among them can deadlock)."""
    crash_point("peers.mirror")
    group = ranks.groups[CHANNEL]
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in wards]
    works = [dist.isend(torch.tensor([buffer.numel()], dtype=torch.int64), buddy, group=group)]
    works += [dist.irecv(n, w, group=group) for n, w in zip(sizes, wards)]
    for work in works:
        work.wait()
    received = [torch.empty(_size(n, w), dtype=torch.uint8) for n, w in zip(sizes, wards)]
    works = [dist.isend(buffer, buddy, group=group)] + [dist.irecv(b, w, group=group) for b, w in zip(received, wards)]
    for work in works:
        work.wait()
    return received
