"""``lowdiff_plus``: LowDiff+ — every step's gradients update a CPU replica in a checkpoint agent.

Each parameter's gradient is copied into a slot of shared memory as soon as it is final, and again
before ``optimizer.step()`` where clipping or unscaling changed it (:mod:`everystep.capture.grads`);
the agent (:mod:`everystep.agent`), a process of its own, applies the step to its replica with the
same optimizer on the CPU, persists the replica every ``every`` steps, and serves recovery from
memory after a software failure. Under several ranks each rank has its agent, and the ranks agree on
the steps persisted, on a step every agent can serve at recovery, and on falling back to full
checkpoints when an agent is lost. The design, the backpressure and the failure modes:
``docs/strategies.md`` (LowDiff+ and its checkpoint agent).

The strategy is a composition: :class:`~everystep.capture.grads.GradientCapture` fills the slots
of the :class:`~everystep.agent.session.AgentSession`, which owns the link, the slots and what the
agent reports; the strategy decides, at each step, what the session sends, and when the ranks
agree, persist, or fall back.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import peers
from .._faults import crash_point
from ..agent.config import AgentConfig
from ..agent.session import AgentSession
from ..capture.grads import GradientCapture
from ..distributed import local_world_size
from ..errors import ConfigError
from ..parallelism import DTENSOR_LAYOUTS
from ..policy.interval import busy_interval, due, median_gap, next_multiple
from ..recovery import Candidate, common_step
from ..state import group_scalars
from .base import Strategy, StrategyConfig
from .mirrors import AgentPeers
from .checkfreq import CheckFreq, CheckFreqConfig

__all__ = ["LowDiffPlus", "LowDiffPlusConfig"]


TRAINING_CORES = 2
"""Of a rank's share of the host's cores on a GPU, those the agent leaves to the training process:
its training thread, which launches the kernels, and its gradient copier."""


@dataclass(kw_only=True, slots=True)
class LowDiffPlusConfig(StrategyConfig):
    every: int | None = None  # type: ignore[assignment]
    """P: the agent persists its replica every P steps; None: from the measured write bandwidth."""
    queue: int = 2
    """Steps in flight to the agent before training waits."""
    verify_every: int = 50
    """Compare the replica with the live state every this many steps (0: never)."""
    verify_sample: int = 1024
    """Elements per tensor the comparison reads (0: all)."""
    grace: float = 30.0
    """Seconds the agent waits for a restarted training process before it exits."""
    agent_timeout: float = 60.0
    """Seconds without a free slot or an answer after which the agent counts as lost."""
    agent_threads: int | None = None
    """The agent's CPU threads; None: one where training runs on the CPU (its threads are training's),
    else this rank's share of the cores this process may use (shared among the ranks on this host),
    less :data:`TRAINING_CORES` left to the training process."""
    fused: bool | None = None
    """The replica's optimizer runs torch's fused CPU kernel where its class has one (Adam, AdamW):
    the same update in another order of arithmetic, several times faster. None: where training runs on
    a GPU (whose arithmetic the CPU does not reproduce bitwise either way); on the CPU, the training
    optimizer's own path, bitwise."""
    layerwise: bool | None = None
    """Copy gradients while backward produces them: True always, False never (at the optimizer
    step), None until most of those copies turn out changed before the step two steps in a row."""
    overlap: bool | None = None
    """The training thread never waits for the gradients' copies into the slot: the copier hands
    the slot to the agent once they are done, and the copies are guarded only where the gradients
    next change in place (the next backward, ``zero_grad(set_to_none=False)``; on CUDA by the
    training stream waiting for their event, not the host: :mod:`everystep.capture.grads`). None:
    on a GPU, where the layout is plain or DDP and there are no peers (a sharded layout changes its
    gradients outside backward's hooks; the peers' mirroring reads the slot as it is handed over);
    False: the step waits for its copies at its end."""
    busy: float = 0.25
    """With ``every=None``: the share of time the agent's writer may spend writing."""
    peers: bool = False
    """Replicas on peers: every step, each rank's own state (what its agent's replica holds beyond
    the replicated parameters and optimizer state) is also kept by the agent of a rank on another
    host, so that a lost host's ranks recover from the survivors' agents (:mod:`everystep.peers`).
    Under sharding a rank's own state is its shards: that agent keeps a replica of the rank's whole
    state, brought forward by the gradient shards and the rest of each step's slot."""

    def _check_every(self) -> None:
        if self.every is not None and self.every < 1:
            raise ConfigError(f"every must be a positive number of steps or None, got {self.every}")

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if self.queue < 1 or (self.agent_threads is not None and self.agent_threads < 1):
            raise ConfigError("queue and agent_threads must be at least 1")
        if self.verify_every < 0 or self.verify_sample < 0:
            raise ConfigError("verify_every and verify_sample must be >= 0")
        if self.grace <= 0 or self.agent_timeout <= 0 or not 0 < self.busy <= 1:
            raise ConfigError("grace and agent_timeout must be positive and busy in (0, 1]")
        if self.overlap and self.peers:
            raise ConfigError("overlap=True with peers=True: the peers' mirroring reads the slot as the step hands it "
                              "over, so its gradients must be in it when the step ends (overlap=None or False)")


class LowDiffPlus(Strategy):
    name: ClassVar[str] = "lowdiff_plus"
    sharded_layouts: ClassVar[frozenset[str]] = DTENSOR_LAYOUTS
    sharded_refusal: ClassVar[str] = (
        "its checkpoint agent brings a replica of every parameter this rank holds forward with the optimizer, "
        "and under ZeRO-1 a rank's optimizer updates only its partition: the optimizer state of the others is "
        "not this rank's")
    full_formats: ClassVar[tuple[str, ...]] = ("safetensors",)
    full_formats_reason: ClassVar[str] = (
        "its checkpoint agent, a process outside the job's process group, writes them, and DCP's writer needs "
        "the group; everystep's own format loads at another world size or sharded layout too")
    needs_restore: ClassVar[bool] = True
    shares_store: ClassVar[bool] = True
    mirrors_to_peers: ClassVar[bool] = True
    Config = LowDiffPlusConfig
    config: LowDiffPlusConfig
    peers: AgentPeers | None

    def __init__(self, config: LowDiffPlusConfig | None = None) -> None:
        super().__init__(config)
        self.fallback: CheckFreq | None = None
        self.rebases = 0
        """Times the replica was replaced by the live state because the arithmetic differs (GPU)."""
        self._target: int | None = None  # the step agree_restore chose to take from the agent's memory
        self._updated = False
        self._groups: list[dict[str, Any]] = []
        self._skipped = False
        self._has_grad: list[int] = []
        self._next_check = 0
        self._step_marks: list[float] = []
        self._mirrored: Future[Any] | None = None
        """The newest step's mirroring (one thread mirrors the steps in turn)."""
        self._from_peers: Candidate | None = None

    # -- what the parts report -------------------------------------------------------------------

    @property
    def layerwise(self) -> bool:
        """Whether gradients are still copied during backward."""
        return self.capture.layerwise

    @property
    def early_copies(self) -> int:
        """Gradients copied while backward produced them."""
        return self.capture.early_copies

    @property
    def recopies(self) -> int:
        """Of those, the ones copied again at the step because they changed in place (clipping)."""
        return self.capture.recopies

    # -- lifecycle -----------------------------------------------------------------------------

    def _attach(self) -> None:
        ctx, c = self.ctx, self.ctx.components
        assert ctx.directory is not None
        self.shared = ctx.ranks.distributed
        layerwise = self.config.layerwise
        if ctx.layout in DTENSOR_LAYOUTS:
            if layerwise:
                raise ConfigError(f"layerwise=True: under {ctx.layout} the gradients are reduce-scattered into the sharded "
                                  "parameters once backward is done, and lowdiff_plus copies them at the step "
                                  "(layerwise=None or False)")
            layerwise = False
        self.session = AgentSession(ctx.directory, ctx.ranks, c, ctx, self.errors, timeout=self.config.agent_timeout,
                                    slots=self.config.queue, keep=self.config.keep,
                                    verify_sample=self.config.verify_sample, shards=ctx)
        self._rebase = any(p.device.type != "cpu" for p in self.session.params)
        if self.config.peers and ctx.directory.access != "read":
            team = peers.Team.join(ctx.ranks)
            self.peers = AgentPeers(self, team, sharded=ctx.layout is not None) if team is not None else None
        overlap = self.config.overlap
        if overlap and ctx.layout in DTENSOR_LAYOUTS:
            raise ConfigError(f"overlap=True: under {ctx.layout} the gradients change outside backward's hooks and "
                              "must be in the slot when the step ends (overlap=None or False)")
        if overlap is None:
            overlap = self._rebase and ctx.layout not in DTENSOR_LAYOUTS and not self.config.peers
        self.capture = GradientCapture(c.model, self.session.params, c.compression, layerwise=layerwise,
                                       errors=self.errors, target=self.session.slot, overlap=overlap,
                                       optimizer=c.optimizer)
        if overlap:
            self.session.quiesce = self.capture.quiesce

    def _agree_restore(self) -> None:
        """Every rank asks its agent what it holds; together they choose a step every agent can
        serve and that is no older than storage's newest, or storage. (Collective.)"""
        directory, ranks = self.ctx.directory, self.ctx.ranks
        assert directory is not None
        if directory.access == "read":  # a reader takes nothing from a live agent: storage alone
            return
        team = self.peers
        reachable = self.session.hello(host=team.host if team else None)
        visits = team.visit() if team else {}  # (the other agents this rank reads on its host)
        on_disk = directory.newest_full_step()
        views = ranks.all_gather("control", {"agent": self.session.link is not None, "reachable": reachable, "disk": on_disk})
        # What a crash left is garbage once no agent writes: in one process, when there is no agent;
        # under several ranks, always (an agent finishes its writes before it answers hello).
        if directory.catalog.leads and (ranks.distributed or not any(v["agent"] for v in views)):
            directory.collect_garbage()
        ranks.barrier("control")
        if team is not None:
            self._target, self._from_peers = team.recover(visits, max(v["disk"] for v in views))
            return
        target = common_step([v["reachable"] for v in views], max(v["disk"] for v in views))
        if target is None and self.shared and reachable is not None:
            ahead = [f"rank {r}: {v['reachable']}" for r, v in enumerate(views)]
            warnings.warn(f"the checkpoint agents hold no step in common that is newer than storage's ({', '.join(ahead)}); "
                          "recovering from storage", RuntimeWarning, stacklevel=3)
        self._target = target

    def _recover(self) -> Candidate | None:
        """The agent's replica if :meth:`agree_restore` chose it, else the newest full checkpoint."""
        target, self._target = self._target, None
        found, self._from_peers = self._from_peers, None
        if found is not None:  # put together from the peers' agents
            return found
        if target is None:
            return super()._recover()
        t0 = time.perf_counter()
        step, tree = self.session.fetch(target)
        return Candidate(step=step, tree=tree, source="memory", manifest=None, seconds=time.perf_counter() - t0)

    def _on_start(self, step: int) -> None:
        directory, ranks = self.ctx.directory, self.ctx.ranks
        assert directory is not None
        tensors, skeleton = self.ctx.flatten_state(step)
        if self.shared:
            self._next_check = self._check_after(step)
        self.session.start(step, tensors, skeleton, AgentConfig(
            directory=str(directory.root), strategy=self.name, keep=self.config.keep, every=self.config.every,
            busy=self.config.busy, grace=self.config.grace, threads=self._agent_threads(), fused=self._fused(),
            rank=ranks.rank, world=ranks.world, host=self.peers.host if self.peers else ""))
        if self.peers is not None and self.peers.sharded and self.session.lost is None:
            # The buddy's agent starts its replica of this rank from the state whole, on a fresh host too.
            self._mirrored = self.peers.submit(step, self.peers.whole(step, tensors, skeleton))

    def _on_gpu(self) -> bool:
        return any(p.device.type != "cpu" for p in self.session.params)

    def setting(self) -> dict[str, Any]:
        return {**super().setting(), "agent_threads": self._agent_threads(), "fused": self._fused(),
                "overlap": self.capture.overlap}

    def _agent_threads(self) -> int:
        """``agent_threads``, or its default (see :class:`LowDiffPlusConfig`)."""
        if self.config.agent_threads is not None:
            return self.config.agent_threads
        if not self._on_gpu():
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // local_world_size() - TRAINING_CORES)

    def _fused(self) -> bool:
        return self._on_gpu() if self.config.fused is None else self.config.fused

    @property
    def agent_seconds_per_step(self) -> float | None:
        """The median time the agent took to apply one of the newest steps to its replica; None
        before the first."""
        seconds = list(self.session.apply_seconds)
        return statistics.median(seconds) if seconds else None

    def _check_after(self, step: int) -> int:
        """The next step at which the ranks agree (several ranks): each multiple of ``every``, or
        every 8 steps with the measured interval."""
        every = self.config.every
        return next_multiple(step, every) if every else step + 8

    # -- training path -------------------------------------------------------------------------

    def _before_update(self, step: int) -> None:
        self.session.take_over()
        if self.fallback is not None:
            self.fallback.before_update(step)
        if not self.session.active:
            return
        self._updated = True
        self._has_grad = self.capture.at_update()
        crash_point("lowdiff_plus.update")  # the gradients' copy posted, the update about to run

    def _on_step_end(self, step: int) -> None:
        if self.fallback is not None:
            self.fallback.on_step_end(step)
        self._groups = group_scalars(self.ctx.components.optimizer)
        self._skipped = not self._updated
        t0 = time.perf_counter()
        self.capture.settle()  # the slot must hold this step's gradients before they can change again
        self.ctx.waited(time.perf_counter() - t0)
        self._updated = False
        self.errors.raise_pending()

    def _on_state_ready(self, step: int, final: bool) -> None:
        session = self.session
        persist = False
        if self.fallback is None and self.shared:
            self._step_marks = (self._step_marks + [time.perf_counter()])[-21:]
            if final or step >= self._next_check:
                persist = self._agree(step, final=final)
        elif self.fallback is None and session.lost is not None:
            self._fall_back(step, session.lost)
            return
        if self.fallback is not None:
            self.fallback.on_state_ready(step, final=final)
            return
        if session.lost is not None:
            return  # several ranks: every rank falls back at the next agreement
        tensors, skeleton = self.ctx.flatten_state(step)
        replayed, volatile = session.split(tensors)
        every = self.config.verify_every
        checked = bool(every) and due(step, every)
        rebase = self._rebase and (final or checked)
        diverged = session.diverged()
        mates = self.peers
        if mates is not None:
            # The agent applies a step when the next arrives: the step before must be in the
            # buddies' agents first, so that they always hold a step this agent's replica holds
            # (and, under sharding, the slot the buddy's copy was read from is still this step's).
            t0 = time.perf_counter()
            try:
                peers.mirrored(self._mirrored)
            finally:
                self.ctx.waited(time.perf_counter() - t0)
        sent = None
        if diverged or rebase or not session.fits(volatile):
            if diverged:
                warnings.warn(f"the checkpoint agent's replica diverged from the live state ({'; '.join(diverged)}); "
                              f"sending it the full state of step {step}", RuntimeWarning, stacklevel=2)
            self.rebases += rebase
            if session.resync(step, tensors, skeleton, persist=persist if self.shared else None):
                self.ctx.in_memory(step)  # the agent's replica is S_step
        else:
            sent = session.send_step(step, tensors, skeleton, replayed, volatile, groups=self._groups,
                                     skipped=self._skipped, has_grad=self._has_grad, persist=persist,
                                     verify=checked and not self._rebase,
                                     after_copies=self.capture.after_copies if self.capture.overlap else None)
        if mates is not None and session.lost is None:
            if not mates.sharded:
                message: Any = peers.pack(step, self.ctx.ranks.rank, volatile, skeleton)
            elif sent is None:  # a new replica: the buddy's starts anew too
                message = mates.whole(step, tensors, skeleton)
            else:  # (read from the slot by the mirroring thread: it stays until this agent applies the step)
                message = functools.partial(mates.step_of, step, sent, skeleton, groups=self._groups,
                                            skipped=self._skipped, has_grad=[] if self._skipped else self._has_grad)
            self._mirrored = mates.submit(step, message)
        if final:
            session.sync(persist=True)
            self.errors.raise_pending()
            if session.lost is not None and not self.shared:
                # IMPORTANT: a final checkpoint the agent did not make durable is written here, never dropped.
                self._fall_back(step, session.lost)

    def _agree(self, step: int, *, final: bool) -> bool:
        """Several ranks: whether every rank persists ``step``; falls back on every rank if any
        rank's agent is lost. One all-gather on the ``control`` channel, on every rank at once."""
        session = self.session
        views = self.ctx.ranks.all_gather("control", {"lost": session.lost, "write": session.write_seconds,
                                                      "step": median_gap(self._step_marks)})
        self._next_check = self._check_after(step)
        lost = [f"rank {r}: {v['lost']}" for r, v in enumerate(views) if v["lost"]]
        if lost:
            self._fall_back(step, "; ".join(lost))
            return False
        if final or self.config.every:
            return True
        writes, steps = [v["write"] for v in views], [v["step"] for v in views]
        if min(writes) <= 0:
            return True  # no write measured yet (a start from storage): this one measures it
        if any(x is None for x in steps):
            return False
        return step - session.last_persist >= busy_interval(max(writes), max(steps), self.config.busy)

    def _fall_back(self, step: int, reason: str) -> None:
        """Stop using the agent (under several ranks: every rank's, at the same step) and write full
        checkpoints from the training process, the first of S_step now."""
        session = self.session
        assert session.link is not None
        persisted = session.persisted
        interval = self.config.every or (persisted[1] - persisted[0] if len(persisted) == 2 else 10)
        warnings.warn(
            f"the checkpoint agent (pid {session.link.pid}) is lost: {reason}; recovery from memory is off and the "
            f"training process writes full checkpoints every {interval} steps from now on", RuntimeWarning, stacklevel=3)
        if self.shared:
            if session.lost is None:
                session.sync(persist=False)  # the parts of steps already marked, then their commits
            session.drain()
            session.lose(reason)
        session.kill()
        self.fallback = CheckFreq(CheckFreqConfig(every=max(1, interval), keep=self.config.keep))
        self.fallback.attach(self.ctx)
        self.fallback.on_start(step)
        self.fallback.on_state_ready(step, final=True)  # S_step durable now, not at the next multiple

    # -- waiting and ending --------------------------------------------------------------------

    def _wait(self) -> None:
        if self.fallback is not None:
            self.fallback.wait()
        elif self.session.active:
            self.session.sync(persist=False)
        self.session.drain()

    def _close(self) -> None:
        try:
            if self.peers is not None:
                self.peers.worker.close()
            self.capture.close()
            self.session.close(clean=True)
        finally:
            if self.fallback is not None:
                self.fallback.close()

    def _abandon(self) -> None:
        """Leave the agent as a crashed training process would: no goodbye, no final persist.

        The agent keeps the replica for a restarted process (this is how the benchmark measures
        recovery from memory, and how a Checkpointer leaves on an exception).
        """
        if self.peers is not None:
            self.peers.worker.close(wait=False)  # (a mirroring under way waits on the buddy, as a crash would not)
        self.capture.close()
        self.session.close(clean=False)
