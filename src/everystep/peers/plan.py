"""The plan that puts every rank's state together after a lost host: what each rank holds, the newest
step every rank's own part and the replicated part are held for, the transfers, and carrying them out."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import Ranks
from .wire import pack, receive, send, unpack

__all__ = ["Holdings", "Transfer", "ReadHeld", "plan_recovery", "warn_nothing_whole", "put_together"]


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
