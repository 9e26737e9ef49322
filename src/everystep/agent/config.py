"""The checkpoint agent's configuration: what the training process tells the agent it starts."""

from __future__ import annotations

from dataclasses import dataclass

from .channel import DISCOVERY_FILE, HANDSHAKE_SECONDS, rank_file

__all__ = ["AgentConfig"]


@dataclass(kw_only=True)
class AgentConfig:
    directory: str
    strategy: str
    keep: int = 2
    every: int | None = None
    """Persist every this many steps; None: as often as keeps the writer busy ``busy`` of the time."""
    busy: float = 0.25
    grace: float = 30.0
    threads: int = 1
    """The agent's CPU threads (``torch.set_num_threads``)."""
    fused: bool = False
    """The replica's optimizer runs torch's fused CPU kernel where its class has one (Adam, AdamW):
    the same update, in another order of arithmetic (see :class:`~everystep.agent.replica.Replica`)."""
    handshake: float = HANDSHAKE_SECONDS
    """Seconds a connecting process has to authenticate before it is dropped."""
    rank: int = 0
    world: int = 1
    """The job's ranks: more than one makes the agent write parts and defer each step by one."""
    host: str = ""
    """The host it runs on (:func:`everystep.peers.host_name`) where its ranks mirror to peers: a
    process on another host does not take it for its own."""

    @property
    def discovery(self) -> str:
        return rank_file(DISCOVERY_FILE, self.rank, self.world)
