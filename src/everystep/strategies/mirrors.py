"""The two strategies' parts in the replicas on peers (:class:`everystep.peers.Peers`): LightCheck's,
whose buddy keeps each step's own part in a region of its own (a mirror), and LowDiff+'s, whose
buddy's checkpoint agent keeps it (under sharding, a replica of the rank's whole state)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import peers
from ..agent.client import AgentLink, fits, served
from ..errors import CheckpointDirectoryError, CorruptCheckpointError
from ..recovery import Candidate
from ..storage.region import Region, region_path
from .base import Strategy
from .context import as_shards

__all__ = ["RegionPeers", "AgentPeers"]


class RegionPeers(peers.Peers):
    """LightCheck's replicas on peers: each step's own part, read from the committed slot, goes to the
    buddy, which keeps it in its mirror of this rank (``<region>.mirror``); at a restart, what the
    regions and mirrors on this host hold. ``owner``: the LightCheck it serves (its region and
    configuration)."""

    thread = "everystep-lightcheck-peers"

    def __init__(self, owner: Strategy, directory: Any, team: peers.Team) -> None:
        super().__init__(directory.ranks, team, owner.errors)
        self.owner, self.directory = owner, directory
        self.mirrors: dict[int, Region] = {}
        self._reading: dict[tuple[str, int], Region | None] = {}
        assert owner.region is not None
        for ward in self.wards:
            path = self._path("mirror", ward)
            store = Region.open(path, ranks=self.ranks, flush=owner.config.flush, owner=owner.region.owner)
            self.mirrors[ward] = store
            if store.owner != owner.region.owner:  # as for a region: another run's memory is not written over
                self.close()
                raise CheckpointDirectoryError(
                    f"the mirror {path} belongs to another checkpoint directory than {directory.root} (it may hold "
                    f"that run's state, so nothing was changed): give this run its own region= or delete {path}")

    @classmethod
    def start(cls, owner: Strategy, directory: Any) -> "RegionPeers | None":
        """Collective: this rank's buddy and wards; None (with a warning) where the job runs on one
        host."""
        team = peers.Team.join(directory.ranks)
        if team is None or owner.region is None:  # (a region skipped with a warning: unreadable)
            return None
        return cls(owner, directory, team)

    def _path(self, kind: str, rank: int) -> Path:
        path = region_path(self.directory.root, self.owner.config.region, rank, self.ranks.world)
        return peers.mirror_path(path) if kind == "mirror" else path

    def own_part(self, step: int, views: dict[str, torch.Tensor], skeleton: Any, replicated: frozenset[str]) -> torch.Tensor:
        """(The mirroring thread.) This rank's own part of S_step, read from its committed slot, packed."""
        return peers.pack(step, self.ranks.rank, {k: t for k, t in views.items() if k not in replicated}, skeleton)

    def _keep(self, ward: int, step: int, tensors: dict[str, torch.Tensor], head: Any) -> None:
        peers.commit_mirror(self.mirrors[ward], step, tensors, head)

    def discard_newer(self, step: int) -> None:
        for store in self.mirrors.values():
            store.discard_newer(step)

    def recover(self, disk: int) -> Candidate | None:
        """Collective: the newest step not older than the disk's (``disk``) at which every rank's state
        can be put together from the regions and mirrors on the hosts, put together. None: storage."""
        t0 = time.perf_counter()
        tokens = {p.read_text().strip() for p in self.directory.root.glob("region-r*.owner")}  # this directory's
        assigned = self.assigned()
        self._reading = {(kind, k): peers.open_read(self._path(kind, k), tokens) for kind in ("region", "mirror")
                         for k in assigned}
        try:
            agreed = self.agree(peers.Holdings(self.host, {k: peers.read_steps(self._reading["region", k]) for k in assigned},
                                               {k: peers.read_steps(self._reading["mirror", k]) for k in assigned}), disk)
            if agreed is None:
                return None
            live = self.owner.ctx.live_shards()
            return self.gather(agreed, own_source="region", place=lambda tensors: as_shards(tensors, live), since=t0)
        finally:
            for store in self._reading.values():
                if store is not None:
                    store.close()
            self._reading = {}

    def _read(self, kind: str, rank: int, step: int) -> tuple[dict[str, torch.Tensor], Any]:
        store = self._reading[kind, rank]
        assert store is not None  # (what was read from it is what this rank said it holds)
        return peers.read_step(store, step)

    def close(self) -> None:
        super().close()
        for store in self.mirrors.values():
            store.close()


class AgentPeers(peers.Peers):
    """LowDiff+'s replicas on peers: every step this rank's own state goes to its buddy, whose agent
    keeps it (under sharding, a replica of this rank's whole state its steps bring forward); at a
    restart, what the agents this rank reaches hold. ``owner``: the LowDiff+ it serves (its agent session)."""

    thread = "everystep-lowdiff-peers"

    def __init__(self, owner: Strategy, team: peers.Team, *, sharded: bool) -> None:
        super().__init__(owner.ctx.ranks, team, owner.errors)
        self.owner, self.session = owner, owner.session
        self.sharded = sharded
        """Whether a rank's own state is its shards: its buddy's agent then keeps a replica of its whole
        state (:data:`~everystep.peers.WHOLE_STATE` and :data:`~everystep.peers.STATE_STEP` messages), else only
        its own state of each step."""
        self._reading: Callable[[str, int, int], tuple[dict[str, Any], Any]] | None = None

    def whole(self, step: int, tensors: dict[str, Any], skeleton: Any) -> Any:
        """(Under sharding.) This rank's state of ``step`` whole, packed (on the training thread:
        the live tensors change at the next update)."""
        head = {"step": step, "kind": peers.WHOLE_STATE, "state": skeleton, "index_keys": self.session.index_keys,
                "signature": self.session.signature()}
        return peers.pack(step, self.ranks.rank, tensors, head)

    def step_of(self, step: int, slot: Any, skeleton: Any, *, groups: list[dict[str, Any]], skipped: bool,
                has_grad: list[int]) -> Any:
        """(Under sharding, on the mirroring thread.) The step's slot sent to this rank's agent — the
        gradient shards its optimizer consumed and what they cannot rebuild — packed."""
        head = {"step": step, "kind": peers.STATE_STEP, "state": skeleton, "groups": groups, "skipped": skipped,
                "has_grad": has_grad}
        return peers.pack(step, self.ranks.rank, slot.views, head)

    def _keep(self, ward: int, step: int, tensors: dict[str, Any], head: Any) -> None:
        """Give ward ``ward``'s message of ``step`` to this rank's agent to keep."""
        if not self.sharded:
            self.session.send_mirror(ward, step, tensors, head)
            return
        kind = head.get("kind")
        if kind == peers.WHOLE_STATE:
            fitted = head.get("signature")
            if not isinstance(fitted, str):
                raise CorruptCheckpointError(f"rank {ward} sent its state without what it fits")
            self.session.send_ward_state(ward, step, tensors, head.get("state"),
                                         _ward_keys(head.get("index_keys"), tensors, ward), fitted)
        elif kind == peers.STATE_STEP:
            groups, skipped, has_grad = _ward_step(head, tensors, ward)
            self.session.send_ward_step(ward, step, tensors, groups=groups, skipped=skipped, has_grad=has_grad,
                                        skeleton=head.get("state"))
        else:
            raise CorruptCheckpointError(f"rank {ward} sent a message of unknown kind {kind!r}")

    def visit(self) -> dict[int, tuple[AgentLink, dict[str, Any]]]:
        """The agents on this host of the ranks whose memory this rank reads (other than its own),
        and what each answered."""
        found = {}
        for k in self.assigned():
            if k != self.ranks.rank and (visit := self.session.visit(k, host=self.host)) is not None:
                found[k] = visit
        return found

    def recover(self, visits: dict[int, tuple[AgentLink, dict[str, Any]]], disk: int) -> tuple[int | None, Candidate | None]:
        """Collective: every rank says what the agents it reached hold (each rank's replica, and
        the own states they keep for their wards); the ranks take the newest step not older than
        storage's at which every rank's state can be put together. Returns (the step every rank's
        own agent serves, None) when no host was lost, (None, the state put together) when one
        was, and (None, None) for storage. The other agents read here are ended."""
        t0 = time.perf_counter()
        me, session = self.ranks.rank, self.session
        # What each rank's replica must fit (under sharding each rank's shards lie elsewhere in the whole).
        expected = self.ranks.all_gather("control", session.signature())
        links = {k: link for k, (link, _) in visits.items()}
        greetings = {k: hello for k, (_, hello) in visits.items()}
        for k in [k for k, hello in greetings.items() if not fits(hello, expected[k])]:
            links.pop(k).kill()
            greetings.pop(k)
        if session.link is not None:
            links[me], greetings[me] = session.link, session.greeting
        keeper: dict[tuple[int, int], AgentLink] = {}  # (ward, step): the agent keeping that rank's own state
        whole: dict[tuple[int, int], AgentLink] = {}  # (ward, step): the agent keeping a replica of that rank
        for k, hello in greetings.items():
            for ward, steps in hello.get("mirrors", {}).items():
                keeper.update({(int(ward), step): links[k] for step in steps})
            for ward, kept in hello.get("wards", {}).items():
                if kept["signature"] == expected[int(ward)]:
                    whole.update({(int(ward), step): links[k] for step in kept["steps"]})
        own = {k: served(hello) or [] for k, hello in greetings.items()}
        mine = peers.Holdings(self.host, {k: list(v) for k, v in own.items()}, {})
        for ward, step in keeper:
            mine.mirror.setdefault(ward, []).append(step)
        for ward, step in whole:
            if step not in mine.region.setdefault(ward, []):
                mine.region[ward].append(step)

        def read(kind: str, k: int, step: int) -> tuple[dict[str, Any], Any]:
            if kind == "mirror":
                return session.read(keeper[k, step], step, ward=k)
            if step in own.get(k, ()):
                return session.read(links[k], step)
            return session.read(whole[k, step], step, ward=k, whole=True)

        self._reading = read
        try:
            agreed = self.agree(mine, disk)
            if agreed is None:
                return None, None
            if not agreed.transfers and agreed.step in own.get(me, ()):
                # this rank's own agent holds it (and, with no transfers, every rank's state is on its
                # own host): taken over as after a crash of the process
                return agreed.step, None
            live = self.owner.ctx.live_shards()
            return None, self.gather(agreed, own_source="memory", place=lambda tensors: as_shards(tensors, live), since=t0)
        finally:
            self._reading = None
            for link in (link for k, link in links.items() if k != me):
                link.kill()  # another rank's agent: its rank has (or gets) its own

    def _read(self, kind: str, rank: int, step: int) -> tuple[dict[str, Any], Any]:
        assert self._reading is not None
        return self._reading(kind, rank, step)


def _ward_keys(keys: Any, tensors: dict[str, Any], ward: int) -> list[str]:
    """The keys of a ward's parameters, as it sent them: names of tensors it sent."""
    if not isinstance(keys, list) or not all(isinstance(k, str) and k in tensors for k in keys):
        raise CorruptCheckpointError(f"rank {ward} sent its state with parameter keys that are not among its tensors")
    return keys


def _ward_step(head: dict[str, Any], tensors: dict[str, Any], ward: int) -> tuple[list[dict[str, Any]], bool, list[int]]:
    """A ward's step as it sent it — the optimizer's group settings, whether the update was skipped,
    the parameters that had a gradient — each checked for its shape, not trusted."""
    groups, skipped, has_grad = head.get("groups"), head.get("skipped"), head.get("has_grad")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or type(skipped) is not bool \
            or not isinstance(has_grad, list) or not all(type(i) is int and f"g/{i}" in tensors for i in has_grad):
        raise CorruptCheckpointError(f"rank {ward} sent a step that is not one (its group settings, whether it was "
                                     "skipped, or the gradients it names)")
    return groups, skipped, has_grad
