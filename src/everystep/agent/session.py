"""The training process's session with its checkpoint agent: what is sent, what comes back.

The agent (:mod:`everystep.agent.process`) holds S_t in shared memory and advances it with the
same optimizer class on the CPU. The session gives it the state whole (``init``: at the start,
and again whenever the replica must be replaced), then one step at a time through a pool of slots
(:class:`~everystep.transport.slots.SlotPool`): the step's gradients, written there by the
gradient capture, and what gradients cannot rebuild (RNG, data position, scheduler, buffers,
residuals), written here. The agent frees each slot when it has applied the step (``done``).

The agent's messages arrive on the link's reader thread and update the session: a slot freed,
a checkpoint persisted (one process) or a part written (several ranks: handed to
:class:`~everystep.agent.commits.PartCommits`), a divergence found by verification, an error.
A broken connection, or a slot not freed within ``timeout`` seconds, makes the agent *lost*: the
session stops sending, and its strategy falls back to checkpoints written by the training process.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from .._faults import crash_point
from ..background import BackgroundErrors
from ..distributed import Ranks
from ..errors import ConfigError
from ..layout import TensorLayout
from ..state import TrainingComponents
from ..parallelism import shard_box, shard_like
from ..tree import local_shard, storage_key, unflatten
from ..storage import CheckpointDirectory
from ..transport.host import HostBuffer, snapshot_into
from ..transport.shared import SharedRegion
from ..transport.slots import SlotPool
from .channel import DISCOVERY_FILE, Plain, digest, rank_file
from .client import AgentLink, AgentLostError, fits, served, signature
from .commits import PartCommits
from .config import AgentConfig
from .replica import optimizer_class_path, replayed_keys, slot_layout

__all__ = ["AgentSession", "Progress", "ShardedState"]


class ShardedState(Protocol):
    """Where the session learns how the state is sharded (the strategy's context)."""

    @property
    def sharded(self) -> dict[str, torch.Tensor]: ...

    def flatten_state(self, step: int) -> tuple[dict[str, torch.Tensor], Any]: ...

    def live_shards(self) -> Mapping[str, torch.Tensor]: ...


class Progress(Protocol):
    """Where the session reports what became recoverable."""

    def record_durable(self, step: int, *, count: bool = True, seconds: float = 0.0) -> None: ...

    def in_memory(self, step: int) -> None: ...

    def waited(self, seconds: float) -> None: ...


class AgentSession:
    """One training process's link to its agent, the slots they share and what the agent reported.

    ``timeout``: seconds without a free slot or an answer after which the agent counts as lost;
    ``slots``: steps in flight before training waits (one more under several ranks, for the step
    an agent holds back); ``verify_sample``: on how many elements per tensor the agent compares its
    replica with the live state, at the steps sent with ``verify``.
    """

    def __init__(self, directory: CheckpointDirectory, ranks: Ranks, components: TrainingComponents, progress: Progress,
                 errors: BackgroundErrors, *, timeout: float, slots: int, keep: int, verify_sample: int,
                 shards: ShardedState) -> None:
        self.directory, self.ranks, self.components, self.progress = directory, ranks, components, progress
        self.shards, self.errors, self.verify_sample = shards, errors, verify_sample
        self.timeout, self.slots, self.keep = timeout, slots, keep
        self.shared = ranks.distributed
        self.params = [p for g in components.optimizer.param_groups for p in g["params"]]
        """The optimizer's parameters (DTensors where the state is sharded: the agent holds their local shards)."""
        self.link: AgentLink | None = None
        self.lost: str | None = None
        self.pool = SlotPool()
        self.persisted: list[int] = []
        """The two newest steps persisted (or marked for persistence, several ranks)."""
        self.last_persist, self.write_seconds = 0, 0.0
        """How long the agent's newest write of its part took (several ranks)."""
        self.commits: PartCommits | None = None
        self.apply_seconds: collections.deque[float] = collections.deque(maxlen=64)
        """How long the agent took to apply each of the newest steps to its replica."""
        self._diverged: list[str] = []
        self._fetched, self._released = False, False
        self._handover: threading.Event | None = None
        """Set when the agent has moved its replica out of the region recovery took over."""
        self._index_keys: list[str] = []
        self._volatile: TensorLayout | None = None
        self.greeting: dict[str, Any] = {}
        """What this rank's agent answered to ``hello``, if one was found."""
        self.quiesce: Callable[[], None] = lambda: None
        """Waits for the steps ``send_step`` handed on after their copies: run before any other message."""

    @property
    def index_keys(self) -> list[str]:
        """The keys of the optimizer's parameters in the flat state, in the optimizer's order."""
        return self._index_keys

    # -- finding the agent, recovery from its memory ---------------------------------------------

    def hello(self, *, host: str | None = None) -> list[int] | None:
        """Find this rank's agent (``host``: only one running there); the steps its replica can
        serve, or None (no agent, or it failed). What it said is kept in :attr:`greeting`."""
        found = self.visit(self.ranks.rank, host=host, expect=self.signature())
        if found is None:
            return None
        self.link, self.greeting = found
        return served(self.greeting)

    def signature(self) -> str:
        """What a replica of this rank's state must fit (:func:`signature`)."""
        tensors, _ = self.shards.flatten_state(0)
        return signature(tensors, self.shards.sharded)

    def visit(self, rank: int, *, host: str | None = None, expect: str | None = None
              ) -> tuple[AgentLink, dict[str, Any]] | None:
        """The agent of rank ``rank``'s state (``host``: only one running there) and its answer to
        ``hello``; None where there is none, or it cannot serve, or its replica does not fit
        ``expect`` (a :func:`signature`; None: not checked here) — it is then ended."""
        link = AgentLink.find(self.directory.root, rank_file(DISCOVERY_FILE, rank, self.ranks.world), host=host)
        if link is None:
            return None
        try:
            hello = link.call("hello", reply="hello", timeout=self.timeout + 600)
        except AgentLostError as e:
            warnings.warn(f"the checkpoint agent (pid {link.pid}) could not serve its replica ({e}); "
                          "recovering from storage", RuntimeWarning, stacklevel=5)
            link.kill()
            return None
        if expect is not None and not fits(hello, expect):
            link.kill()
            return None
        return link, hello

    def read(self, link: AgentLink, step: int, ward: int | None = None, *, whole: bool = False
             ) -> tuple[dict[str, torch.Tensor], Any]:
        """A copy of what an agent holds of ``step`` (before its reader starts): its replica, or
        with ``ward`` what it keeps for that rank (replicas on peers): its own state, or with
        ``whole`` (under sharding) its replica of the rank's whole state."""
        if ward is None:
            reply = link.call("fetch", reply="replica", timeout=self.timeout, step=step)
        elif whole:
            reply = link.call("ward_fetch", reply="ward", timeout=self.timeout, ward=ward, step=step)
        else:
            reply = link.call("mirror_get", reply="mirrored", timeout=self.timeout, ward=ward, step=step)
        (fd,) = link.receive_fds(1)
        region, buffer = SharedRegion.holding(reply["layout"], fd=fd)
        try:
            return {k: v.clone() for k, v in buffer.views.items()}, reply["skeleton"]
        finally:
            region.close()

    def send_mirror(self, ward: int, step: int, tensors: dict[str, torch.Tensor], skeleton: Any) -> None:
        """Give the agent a ward's own state of ``step`` to keep (replicas on peers)."""
        self._to_agent("mirror", tensors, ward=ward, step=step, skeleton=Plain(skeleton))

    def send_ward_state(self, ward: int, step: int, tensors: dict[str, torch.Tensor], skeleton: Any,
                        index_keys: list[str], fitted: str) -> None:
        """Give the agent a ward's whole state of ``step`` (replicas on peers, under sharding), which
        it keeps as a replica of that rank and advances with the ward's steps; ``fitted``: the
        signature the ward gave it, compared with the ward's own at a restart. The optimizer class is
        this rank's (a job's ranks train with one), never a name a peer sent."""
        self._to_agent("ward_init", tensors, ward=ward, step=step, skeleton=Plain(skeleton), index_keys=index_keys,
                       optimizer_class=optimizer_class_path(self.components.optimizer), signature=fitted)

    def send_ward_step(self, ward: int, step: int, slot: dict[str, torch.Tensor], *, groups: list[dict[str, Any]],
                       skipped: bool, has_grad: list[int], skeleton: Any) -> None:
        """Give the agent a ward's step (its slot: the gradients its optimizer consumed, and what they
        cannot rebuild), to apply to its replica of that rank."""
        self._to_agent("ward_step", slot, ward=ward, step=step, groups=groups, skipped=skipped, has_grad=has_grad,
                       skeleton=Plain(skeleton))

    def _to_agent(self, kind: str, tensors: dict[str, torch.Tensor], **fields: Any) -> None:
        if self.link is None or self.lost is not None:
            return
        region, buffer = SharedRegion.holding(TensorLayout.of(tensors))
        try:
            snapshot_into(buffer, tensors)
            self.link.send(kind, fds=[region.fd], layout=buffer.layout, **fields)
        except AgentLostError as e:
            self.lose(str(e))
        finally:
            region.close()

    def fetch(self, step: int) -> tuple[int, dict[str, Any]]:
        """The agent's replica of ``step``: its step and its state tree, for the live objects to load
        (the optimizer's state stays in the region the agent hands over: see :meth:`take_over`)."""
        assert self.link is not None
        reply = self.link.call("fetch", reply="replica", timeout=self.timeout, step=step)
        (fd,) = self.link.receive_fds(1)
        region, buffer = SharedRegion.holding(reply["layout"], fd=fd)
        # The model copies into its parameters. The optimizer keeps the tensors it is given: its
        # state stays in the region, which the agent hands over (it moves its replica out and says
        # ``released``; the first update waits for that, :meth:`take_over`). Anything else is cloned.
        self._handover = threading.Event()
        tensors = {k: v if k.startswith(("/model/", "/optimizer/state/")) else v.clone() for k, v in buffer.views.items()}
        live = self.shards.live_shards()
        for key, t in tensors.items():
            like = live.get(key)
            if like is not None and tuple(local_shard(like).shape) == tuple(t.shape):
                tensors[key] = shard_like(t, like)  # (the agent holds this rank's shards: placed as the live ones)
        region.close()  # (the mapping stays while the tensors over it do)
        self._fetched = True
        return int(reply["step"]), unflatten(reply["skeleton"], tensors)

    def take_over(self) -> None:
        """Before the first update after recovery from memory: the optimizer state lives in the
        region the agent handed over, and the agent must be out of it before it changes."""
        handover = self._handover
        if handover is None:
            return
        assert self.link is not None
        t0 = time.perf_counter()
        if not handover.wait(self.timeout):  # set by 'released' or by the agent's loss
            self.lose(f"it did not release the recovered state within {self.timeout:.0f} s")
        self._handover = None  # only now: a 'released' arriving during the wait must find the event
        self.progress.waited(time.perf_counter() - t0)
        if not self._released:
            self.link.kill()  # lost before it was out of the region: it must not touch it again

    # -- starting ------------------------------------------------------------------------------

    def start(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, config: AgentConfig) -> None:
        """Spawn the agent unless one was found, give it S_step (unless it holds it) and the slots."""
        self._index_keys = self._keys_of_params(tensors)
        if self.link is None:
            self.link = AgentLink.spawn(config)
        if self.shared:
            self.last_persist = step
            self.commits = PartCommits(self.directory, rank=self.ranks.rank, keep=self.keep, timeout=self.timeout + 600,
                                       errors=self.errors, lost=lambda: self.lost, lose=self.lose,
                                       committed=lambda s, seconds: self.progress.record_durable(s, count=False, seconds=seconds))
        lost = None
        try:
            if not self._fetched:
                self.send_state(step, tensors, skeleton, persist=step == 0)
            crash_point("lowdiff_plus.start.slots")
            self._make_slots(tensors)
        except AgentLostError as e:  # it has exited: what it said last (why) is read first, by the reader
            lost = str(e)
        self.link.start_reader({"done": self._on_done, "persisted": self._on_persisted, "part": self._on_part,
                                "diverged": self._on_diverged, "error": self._on_error, "released": self._on_released},
                               self.lose)
        if lost is not None:
            self.link.wait_reader(10.0)
            self.lose(lost)

    def _keys_of_params(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        where = {storage_key(t): k for k, t in tensors.items() if t.numel()}
        keys = []
        for i, p in enumerate(self.params):
            key = where.get(storage_key(local_shard(p.detach())))
            if key is None:
                raise ConfigError(f"optimizer parameter {i} is not in the model's state_dict; lowdiff_plus replicates "
                                  "the parameters the model holds")
            keys.append(key)
        return keys

    # -- the agent's messages (reader thread) --------------------------------------------------

    def _on_done(self, msg: dict[str, Any]) -> None:
        self.progress.in_memory(msg["step"])
        self.pool.give_back(msg["slot"])
        seconds = msg.get("seconds")
        if isinstance(seconds, (int, float)):
            self.apply_seconds.append(float(seconds))

    def _on_persisted(self, msg: dict[str, Any]) -> None:
        self.persisted = (self.persisted + [msg["step"]])[-2:]
        self.progress.record_durable(msg["step"], count=False)
        self.directory.catalog.count_written_elsewhere(msg["nbytes"])

    def _on_released(self, msg: dict[str, Any]) -> None:
        self._released = True
        if self._handover is not None:
            self._handover.set()

    def _on_diverged(self, msg: dict[str, Any]) -> None:
        self._diverged.append(f"step {msg['step']}: {msg['detail']}")

    def _on_error(self, msg: dict[str, Any]) -> None:
        if msg["fatal"]:
            self.lose(f"{msg['what']} failed: {msg['detail']}")
        else:
            self.errors.record(msg["what"], RuntimeError(msg["detail"]))

    def _on_part(self, msg: dict[str, Any]) -> None:
        self.write_seconds = msg["seconds"] if msg["error"] is None else self.write_seconds
        assert self.commits is not None
        self.commits.deliver(msg)

    def lose(self, reason: str) -> None:
        """The agent is lost (any thread): stop waiting for it anywhere."""
        if self.lost is None:
            self.lost = reason
        if self._handover is not None:
            self._handover.set()
        self.pool.wake()  # wakes a waiting step
        if self.commits is not None:
            self.commits.wake()  # and a commit waiting for a part

    # -- the training path ---------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """The agent takes steps: found or started, given its slots, not lost."""
        return self.link is not None and self.lost is None and bool(self.pool)

    def slot(self) -> HostBuffer | None:
        """The slot this step fills, taking a free one if needed (the wait is reported); None when inactive."""
        if not self.active:
            return None
        if self.pool.current is None and not self._take():
            return None
        return self.pool.buffer()

    def _take(self) -> bool:
        if self.lost is not None:
            return False  # (the one wake-up lose() gives may have gone to an earlier wait)
        t0 = time.perf_counter()
        try:
            return self.pool.take(self.timeout)
        except queue.Empty:
            self.lose(f"it freed no slot within {self.timeout:.0f} s")
            return False
        finally:
            self.progress.waited(time.perf_counter() - t0)

    def split(self, tensors: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The keys the agent's optimizer updates (parameters and their state), and everything else."""
        replayed = replayed_keys(self._index_keys, tensors)
        return sorted(replayed), {k: t for k, t in tensors.items() if k not in replayed}

    def fits(self, volatile: dict[str, torch.Tensor]) -> bool:
        """Whether the slots have room for exactly these volatile tensors."""
        return TensorLayout.of(volatile) == self._volatile

    def diverged(self) -> list[str]:
        """What verification found since the last call (and forget it)."""
        found, self._diverged = self._diverged, []
        return found

    def send_step(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, replayed: list[str],
                  volatile: dict[str, torch.Tensor], *, groups: list[dict[str, Any]], skipped: bool,
                  has_grad: list[int], persist: bool, verify: bool,
                  after_copies: Callable[[str, Callable[[], None]], None] | None = None) -> HostBuffer | None:
        """The step's slot, finished with its volatile state, goes to the agent (``verify``: with a
        digest of the live parameters and optimizer state to compare its replica with); the message
        is sent by ``after_copies`` once the gradients' copies are in (None: here). Returns the slot,
        unchanged until the agent has applied the step, or None if the agent was lost."""
        assert self.link is not None
        if self.slot() is None:
            return None  # lost while waiting; the strategy falls back at its next step
        sent = self.pool.buffer()
        event = snapshot_into(sent, {f"v{k}": t for k, t in volatile.items()})
        if event is not None:
            event.synchronize()
        check = None
        if verify:
            check = {"keys": replayed, "sample": self.verify_sample,
                     "value": digest(tensors, replayed, self.verify_sample)}
        self.expect_part(step, persist)
        message = dict(step=step, slot=self.pool.current, groups=groups, skipped=skipped,
                       has_grad=[] if skipped else has_grad, skeleton=Plain(skeleton), digest=check, persist=persist)
        self.pool.hand_over()
        if after_copies is None:
            self._send_step(message)
        else:
            after_copies("handing the step's slot to the agent", functools.partial(self._send_step, message))
        return sent

    def _send_step(self, message: dict[str, Any]) -> None:
        crash_point("lowdiff_plus.step.before_send")  # the slot filled, the agent not told
        try:
            if self.link is not None and self.lost is None:
                self.link.send("step", **message)
        except AgentLostError as e:
            self.lose(str(e))
        crash_point("lowdiff_plus.step.sent")  # the agent told

    def expect_part(self, step: int, persist: bool) -> None:
        """Several ranks: the agent will write its part of ``step``; the committer commits it."""
        if persist:
            self.last_persist = step
            self.persisted = (self.persisted + [step])[-2:]
            assert self.commits is not None
            self.commits.expect(step)

    # -- the whole state -----------------------------------------------------------------------

    def send_state(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, *, persist: bool | None) -> None:
        """Give the agent S_step whole, in a region it adopts as its replica; it persists it if
        ``persist``, or with None if a write is due (one process only)."""
        assert self.link is not None
        region, buffer = SharedRegion.holding(TensorLayout.of(tensors))
        event = snapshot_into(buffer, tensors)
        if event is not None:
            event.synchronize()
        if self.shared:
            self.expect_part(step, bool(persist))
        try:
            sharded = self.shards.sharded  # (the DTensors of the flattening that gave ``tensors``)
            self.link.send("init", fds=[region.fd], step=step, layout=buffer.layout, skeleton=skeleton,
                           index_keys=self._index_keys, optimizer_class=optimizer_class_path(self.components.optimizer),
                           persist=persist, boxes={k: shard_box(dt) for k, dt in sharded.items()},
                           signature=signature(tensors, sharded))
        finally:
            region.close()

    def _make_slots(self, tensors: dict[str, torch.Tensor]) -> None:
        assert self.link is not None
        _, volatile = self.split(tensors)
        layout = slot_layout({i: local_shard(p) for i, p in enumerate(self.params)}, volatile)
        count = self.slots + self.shared
        regions = self.pool.make(layout, count, pin=any(p.is_cuda for p in self.params))
        try:
            self.link.send("slots", fds=[r.fd for r in regions], count=count, layout=layout)
        finally:
            for r in regions:
                r.close()
        self._volatile = TensorLayout.of(volatile)

    def resync(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, *, persist: bool | None) -> bool:
        """Wait for every step in flight, then give the agent S_step whole, and new slots if the
        step's volatile state no longer fits the old ones (the agent keeps its slots across a new
        state). False if the agent was lost on the way."""
        self.quiesce()
        if self.shared:
            self.sync(persist=False)  # the step an agent holds back frees its slot
        held = [self.pool.current] if self.pool.current is not None else []
        while len(held) < len(self.pool):
            if not self._take():
                return False
            held.append(self.pool.hand_over())
        self.pool.current = None
        try:
            self.send_state(step, tensors, skeleton, persist=persist)
            if not self.fits(self.split(tensors)[1]):
                self._make_slots(tensors)
            else:
                for slot in held:
                    self.pool.give_back(slot)
        except AgentLostError as e:
            self.lose(str(e))
            return False
        return True

    def sync(self, *, persist: bool) -> None:
        """Wait until the agent has applied every step sent (``persist``: and persisted the newest)."""
        assert self.link is not None
        self.quiesce()
        try:
            self.link.call("sync", reply="synced", timeout=self.timeout + 600, persist=persist)
        except AgentLostError as e:
            self.lose(str(e))

    # -- ending --------------------------------------------------------------------------------

    def drain(self) -> None:
        """Wait for the commits of the steps marked so far (several ranks)."""
        if self.commits is not None:
            self.commits.drain()

    def close(self, *, clean: bool) -> None:
        """``clean``: the agent persists what it holds and exits; else, as after a crash, the link
        is dropped without a word and the agent keeps its replica for a restarted process."""
        self.quiesce()
        self.pool.release()
        if self.commits is not None:
            self.commits.close(wait=clean)
        link, self.link = self.link, None
        if link is not None and not clean:
            link.hang_up()
        elif link is not None and self.lost is None:
            link.close(timeout=self.timeout + 600)
        elif link is not None:
            link.kill()

    def kill(self) -> None:
        """End the agent now (it is lost, or the training process gives up on it)."""
        if self.link is not None:
            self.link.kill()
