"""``Peers``: a rank's part in the replicas on peers (its mirroring thread, its traffic, the agreement at
a restart), which a mirroring strategy subclasses."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import Ranks
from ..background import BackgroundErrors, Worker
from ..errors import CorruptCheckpointError
from ..recovery import Candidate
from ..tree import check_skeleton, unflatten
from .plan import Holdings, Transfer, plan_recovery, put_together, warn_nothing_whole
from .team import Team, share_out
from .wire import swap, unpack

__all__ = ["Traffic", "Agreed", "Peers"]


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
