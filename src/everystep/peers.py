"""Replicas on peers: each rank's own state kept, every step, in the memory of a rank on another host.

Under data parallelism what a lost host takes with it is only what is per rank — random
generators, the data position, buffers, compression residuals — and, in a sharded job, the rank's
shards: the replicated parameters and optimizer state are in every survivor's memory. So each rank
sends that part of the state (its *own* keys, and the skeleton with the scalars) to its *buddy*,
a rank on the next host, which keeps it in a two-slot region of its own (a *mirror*, beside its
region: ``<region>.mirror``, one per rank it mirrors; LowDiff+'s agents keep it instead, and under
sharding keep a replica of the rank's whole state that its gradient shards bring forward:
:mod:`everystep.strategies.lowdiff_plus`). After a restart the ranks agree on the
newest step for which every rank's own part is in some survivor's memory (its region, or its
buddy's mirror) and the replicated part in some region; the ranks that lost theirs receive them
from the survivors over the job's own process group, storage untouched.

Hosts: ``EVERYSTEP_HOST`` where set, else the machine's name. (Not torchrun's node rank: an elastic
restart may number the nodes anew, and a host must keep its name to find its own memory.)
Buddies: the hosts in the order of their first rank; the i-th rank of a host mirrors to the i-th
rank (modulo their number) of the next host, so losing any one host leaves every rank's own state
on another. Two hosts lost at once may take a rank's state and its mirror: recovery then reads
storage, as without mirrors.

The wire: a length (int64), then one buffer — a JSON header (what a region slot's metadata holds:
the step, the rank whose state it is, the skeleton, each tensor's dtype, shape, place and
checksum) followed by the tensors' bytes. Nothing received is unpickled; every checksum is
verified before a tensor is used (I8).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import struct
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ._faults import crash_point
from .distributed import Ranks
from .background import BackgroundErrors, Worker, settled
from .errors import BackgroundWriteError, CorruptCheckpointError
from .recovery import Candidate
from .tree import check_skeleton, unflatten
from .storage import MALFORMED, checksum, refuse_constant
from .storage.region import Region, RegionLayout

__all__ = ["host_name", "Peers", "Agreed", "Team", "buddies", "mirrored", "pack", "unpack", "mirror_path", "Holdings",
           "plan_recovery", "Transfer", "commit_mirror", "read_step", "read_steps", "open_read", "send", "receive", "swap",
           "share_out", "put_together", "warn_nothing_whole", "Traffic", "WHOLE", "STEP"]

CHANNEL = "peers"
"""The gloo group of the mirrors (:meth:`~everystep.distributed.Ranks.add_channel`)."""

_LENGTH = struct.Struct("<Q")

WHOLE, STEP = "whole", "step"
"""The kinds of message a rank sends its buddy where the buddy keeps a replica of its whole state
(LowDiff+ under sharding): the state whole, or one step's update to it. Elsewhere a message is the
rank's own part of the state at its step."""


def host_name() -> str:
    """This process's host: ``EVERYSTEP_HOST``, else the machine's name."""
    return os.environ.get("EVERYSTEP_HOST") or socket.gethostname()


@dataclass(frozen=True)
class Team:
    """This rank's place among the hosts: its host, every rank's, its buddy, and its wards (the
    ranks it mirrors)."""

    host: str
    hosts: list[str]
    buddy: int
    wards: list[int]

    @classmethod
    def join(cls, ranks: Ranks) -> "Team | None":
        """Collective: this rank's team, with the mirrors' channel made; None in a job of one process,
        and (with a warning) where every rank of the job runs on one host."""
        if not ranks.distributed:
            return None
        ranks.add_channel(CHANNEL)
        hosts = ranks.all_gather("control", host_name())
        chosen = buddies(hosts)
        buddy = chosen[ranks.rank]
        if buddy is None:
            warnings.warn("peers=True, but every rank of the job runs on one host: nothing is mirrored (a lost host "
                          "loses every rank)", stacklevel=5)
            return None
        return cls(hosts[ranks.rank], hosts, buddy, [r for r, b in enumerate(chosen) if b == ranks.rank])


@dataclass
class Traffic:
    """What a rank's mirroring sent its buddy, and the CPU time its mirroring thread spent (packing
    where it packs, sending, receiving and checking its wards', handing them on)."""

    bytes: int = 0
    steps: int = 0
    cpu_seconds: float = 0.0

    def count(self, nbytes: int, since: float) -> None:
        """One step mirrored: ``nbytes`` sent, the thread's CPU clock ``since`` (``time.thread_time()``) at its start."""
        self.bytes += nbytes
        self.steps += 1
        self.cpu_seconds += time.thread_time() - since

    def per_step(self) -> dict[str, float] | None:
        """Bytes sent and CPU seconds per step mirrored; None before the first."""
        if not self.steps:
            return None
        return {"peer_bytes_per_step": self.bytes / self.steps, "peer_cpu_seconds_per_step": self.cpu_seconds / self.steps}


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed at a restart (:meth:`Peers.agree`): the step, and the transfers that put
    every rank's state of it together (none: each rank's own memory holds its state)."""

    step: int
    transfers: list[Transfer]
    held: list[Holdings]


class Peers:
    """This rank's part in the replicas on peers: its place among the hosts (:class:`Team`), the
    thread that mirrors every step and what it sent (:class:`Traffic`), and the agreement at a
    restart. A mirroring strategy subclasses it and supplies what it does with each ward's message
    (:meth:`_keep`) and how it reads what its host holds (:meth:`_read`); it hands :meth:`submit`
    what it sends each step, and :meth:`agree` what its host holds."""

    thread: str = "everystep-peers"

    def __init__(self, ranks: Ranks, team: Team, errors: BackgroundErrors) -> None:
        self.ranks = ranks
        self.host, self.hosts, self.buddy, self.wards = team.host, team.hosts, team.buddy, team.wards
        self.worker = Worker(self.thread, errors)
        self.traffic = Traffic()
        """Sent to the buddy since the start."""

    # -- every step (the mirroring thread) --------------------------------------------------------

    def submit(self, step: int, message: "torch.Tensor | Callable[[], torch.Tensor]") -> "Future[Any]":
        """Mirror ``step`` on the mirroring thread: ``message`` is the packed buffer, or what packs it there."""
        return self.worker.submit(f"mirroring of the state at step {step}", self.mirror, step, message)

    def mirror(self, step: int, message: "torch.Tensor | Callable[[], torch.Tensor]") -> None:
        """Send this rank's message of ``step`` to its buddy; receive each ward's, checked, and keep it."""
        since = time.thread_time()
        buffer = message() if callable(message) else message
        received = swap(self.ranks, buffer, self.buddy, self.wards)
        for ward, theirs in zip(self.wards, received):
            _, _, tensors, head = unpack(theirs, sender=ward, expect=(step, ward))
            self._keep(ward, step, tensors, head)
        self.traffic.count(buffer.numel(), since)

    def _keep(self, ward: int, step: int, tensors: dict[str, torch.Tensor], head: Any) -> None:
        """Keep ward ``ward``'s message of ``step`` (its tensors and the rest of what it packed)."""
        raise NotImplementedError

    # -- at a restart ------------------------------------------------------------------------------

    def assigned(self) -> list[int]:
        """The ranks whose memory on this host this rank reads at a restart (:func:`share_out`)."""
        return share_out(self.hosts, self.ranks.rank)

    def agree(self, mine: Holdings, disk: int) -> Agreed | None:
        """Collective: every rank says what it read its host holds (``mine``); the ranks take the
        newest step not older than storage's (``disk``) at which every rank's state can be put
        together. None (with a warning where memory held something): storage, as without peers."""
        held = [Holdings.from_json(h) for h in self.ranks.all_gather("control", mine.as_json())]
        found = plan_recovery(held, disk - 1)
        if found is None:
            warn_nothing_whole(held, disk, self.ranks.rank)
            return None
        return Agreed(found[0], found[1], held)

    def gather(self, agreed: Agreed, *, own_source: str, place: Callable[[dict[str, torch.Tensor]], None],
               since: float) -> Candidate:
        """Collective: carry out the transfers agreed (:func:`put_together`, reading with :meth:`_read`)
        and return this rank's state, checked whole and its shards placed (``place``), as a candidate
        (``since``: when the agreement began)."""
        step = agreed.step
        tensors, skeleton, source = put_together(self.ranks, step, agreed.transfers, agreed.held,
                                                 functools.cache(lambda kind, k: self._read(kind, k, step)),
                                                 own_source=own_source)
        try:
            check_skeleton(skeleton, set(tensors))
        except ValueError as e:
            raise CorruptCheckpointError(f"the state of step {step} put together from the peers' memory is not whole: "
                                         f"{e}") from None
        place(tensors)
        return Candidate(step=step, tree=unflatten(skeleton, tensors), source=source, manifest=None,
                         seconds=time.perf_counter() - since)

    def _read(self, kind: str, rank: int, step: int) -> tuple[dict[str, torch.Tensor], Any]:
        """Rank ``rank``'s state at ``step`` from this host's memory (``kind``: as :data:`ReadHeld`)."""
        raise NotImplementedError

    def close(self) -> None:
        self.worker.close()


def buddies(hosts: list[str]) -> list[int | None]:
    """Each rank's buddy (``hosts``: each rank's host): the same-numbered rank of the next host, or
    None where the job has one host (nothing to mirror to)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    order = list(by_host)
    if len(order) < 2:
        return [None] * len(hosts)
    found: list[int | None] = []
    for rank, host in enumerate(hosts):
        mine = by_host[host]
        nxt = by_host[order[(order.index(host) + 1) % len(order)]]
        found.append(nxt[mine.index(rank) % len(nxt)])
    return found


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


@dataclass
class Holdings:
    """What one process holds in memory, by kind (``region``: a rank's whole state; ``mirror``: a
    rank's own part), rank whose state it is, and the steps that verified."""

    host: str
    region: dict[int, list[int]]
    mirror: dict[int, list[int]]

    def as_json(self) -> dict[str, Any]:
        return {"host": self.host, "region": {str(k): v for k, v in self.region.items()},
                "mirror": {str(k): v for k, v in self.mirror.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Holdings":
        return cls(data["host"], {int(k): v for k, v in data["region"].items()},
                   {int(k): v for k, v in data["mirror"].items()})


@dataclass(frozen=True)
class Transfer:
    """Rank ``src`` sends rank ``dst`` the ``part`` (``whole``, ``own`` or ``replicated``) of the
    state of rank ``of`` at the agreed step, from its ``kind`` (``region`` or ``mirror``)."""

    src: int
    dst: int
    part: str
    kind: str
    of: int


def plan_recovery(held: list[Holdings], newer_than: int) -> tuple[int, list[Transfer]] | None:
    """The newest step after ``newer_than`` at which every rank's state can be put together from
    the processes' memory, and the transfers that do it (each rank ``r`` needs rank ``r``'s state:
    whole from a region, or its own part from a region or a mirror and the replicated part from any
    region), the same on every rank. None when there is no such step."""
    world = len(held)
    steps = sorted({s for h in held for found in h.region.values() for s in found if s > newer_than}, reverse=True)
    for step in steps:
        regions = [(p, k) for p, h in enumerate(held) for k, found in sorted(h.region.items()) if step in found]
        transfers: list[Transfer] = []
        for rank in range(world):
            whole = [p for p, k in regions if k == rank]
            if rank in whole:
                continue  # its own region holds it
            if whole:
                transfers.append(Transfer(whole[0], rank, "whole", "region", rank))
                continue
            mirrors = sorted((p for p, h in enumerate(held) if step in h.mirror.get(rank, ())), key=lambda p: p != rank)
            if not mirrors:
                break
            if mirrors[0] != rank:
                transfers.append(Transfer(mirrors[0], rank, "own", "mirror", rank))
            if not any(p == rank for p, _ in regions):  # it holds no region of that step to take the rest from
                src, of = regions[rank % len(regions)]
                transfers.append(Transfer(src, rank, "replicated", "region", of))
        else:
            return step, transfers
    return None


def warn_nothing_whole(held: list[Holdings], disk: int, me: int) -> None:
    """Warn (rank 0) that the hosts' memory holds states, but none recovery can put together."""
    if me == 0 and any(h.region.get(k) or h.mirror.get(k) for h in held for k in range(len(held))):
        said = "; ".join(f"rank {r} on {h.host}: whole {h.region or '{}'}, own {h.mirror or '{}'}"
                         for r, h in enumerate(held))
        warnings.warn(f"the hosts' memory holds no step newer than storage's ({disk}) at which every rank's state "
                      f"can be put together ({said}); recovering from storage", stacklevel=3)


def share_out(hosts: list[str], me: int) -> list[int]:
    """The ranks whose memory (regions and mirrors, or agents) process ``me`` reads at a restart:
    the ranks of a host share out what it holds — each its own rank's, and a share of those of
    ranks now on other hosts — so that nothing there is read twice."""
    local = [r for r, h in enumerate(hosts) if h == hosts[me]]
    return [k for k in range(len(hosts)) if (k == me if k in local else local[k % len(local)] == me)]


ReadHeld = Callable[[str, int], tuple[dict[str, torch.Tensor], Any]]
"""``read(kind, rank)``: rank ``rank``'s state at the agreed step from this process's memory —
``region`` (the whole state) or ``mirror`` (its own part) — as (tensors, skeleton of the whole)."""


def put_together(ranks: Ranks, step: int, transfers: list[Transfer], held: list[Holdings], read: ReadHeld, *,
                 own_source: str) -> tuple[dict[str, torch.Tensor], Any, str]:
    """Collective: carry out ``transfers`` (every rank, in their order: what this rank sends it reads
    with ``read``) and return this rank's state at ``step`` — (tensors, skeleton, source) — whole
    from its own memory (the source is then ``own_source``) or a peer's, or its own part and the
    replicated rest put together."""
    me = ranks.rank
    mine = held[me]
    whole: tuple[dict[str, torch.Tensor], Any] | None = None
    own: tuple[dict[str, torch.Tensor], Any] | None = None
    rest: dict[str, torch.Tensor] | None = None
    source = own_source
    if step in mine.region.get(me, ()):
        whole = read("region", me)
    for t in transfers:
        if t.src == me:  # (a part of a region: the whole of it; the receiver keeps what it lacks)
            send(ranks, pack(step, t.of, *read(t.kind, t.of)), t.dst)
        if t.dst == me:
            _, _, part, skeleton = unpack(receive(ranks, t.src), sender=t.src, expect=(step, t.of))
            if t.part == "whole":
                whole = part, skeleton
            elif t.part == "own":
                own = part, skeleton
            else:
                rest = part
            if t.part != "replicated":
                source = f"peer memory (host {held[t.src].host})"
    if whole is not None:
        return whole[0], whole[1], source
    if own is None:  # this process holds this rank's own part, in a mirror
        own = read("mirror", me)
        source = f"peer memory (host {mine.host})"
    if rest is None:  # and the rest in a region of another rank
        rest = read("region", next(k for k in sorted(mine.region) if step in mine.region[k]))[0]
    return {**{k: v for k, v in rest.items() if k not in own[0]}, **own[0]}, own[1], source


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
