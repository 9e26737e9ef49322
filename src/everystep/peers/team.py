"""The team of the replicas on peers: a host's name, the buddies (which rank mirrors to which), and
which survivor sends what after a host is lost."""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass

from ..distributed import Ranks

__all__ = ["CHANNEL", "host_name", "Team", "buddies", "share_out"]


CHANNEL = "peers"
"""The gloo group of the mirrors (:meth:`~everystep.distributed.Ranks.add_channel`)."""


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


def share_out(hosts: list[str], me: int) -> list[int]:
    """The ranks whose memory (regions and mirrors, or agents) process ``me`` reads at a restart:
    the ranks of a host share out what it holds — each its own rank's, and a share of those of
    ranks now on other hosts — so that nothing there is read twice."""
    local = [r for r, h in enumerate(hosts) if h == hosts[me]]
    return [k for k in range(len(hosts)) if (k == me if k in local else local[k % len(local)] == me)]
