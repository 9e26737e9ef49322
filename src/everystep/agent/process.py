"""The checkpoint agent: a separate process that holds the replica and persists it.

It is started with ``python -m everystep.agent`` (a fresh interpreter, never a fork of a process
that may hold a CUDA context), or forked from a zygote that runs no torch operation
(:mod:`everystep.agent.entry`), and serves one training process at a time. When that process
disappears without saying goodbye — a software failure — the agent persists its newest step,
then waits ``grace`` seconds for a restarted training process to take the replica from memory,
and exits if none comes. A training process that closes cleanly tells the agent to persist what
it has and exit. So the agent never outlives its job by more than ``grace`` seconds.

In a job of several ranks (``world`` > 1) each rank has an agent of its own, and two things
change, because the agents' replicas and checkpoints must agree across ranks:

- The agent persists exactly the steps its training process marks (``persist`` in the step
  message; every rank marks the same steps), and only writes its part of the checkpoint (its
  share of the replicated tensors and its own per-rank state); the training process commits it
  with the other ranks' parts. It never persists on its own, so not after its training process
  is gone either: the newest committed checkpoint stays the newest on storage.
- It applies step t only once step t+1 arrives (or at ``sync``): a rank sends step t+1 only after
  its backward pass of t+1, whose gradient all-reduce needed every rank to have sent step t. So
  after a failure every agent holds the step all ranks completed, applied or pending, and
  ``fetch`` brings each to the one step the restarted ranks agreed on.

Replicas on peers (:mod:`everystep.peers`) add, for the ranks of another host this agent's rank
mirrors (its *wards*): under data parallelism, ``mirror`` (+ descriptor: a ward's own state of a
step, the newest :data:`_MIRRORED_STEPS` kept) and ``mirror_get``; under sharding, where a ward's
own state is its shards, a replica of the ward's whole state, advanced as the agent's own is —
``ward_init`` (+ descriptor: the ward's state whole), ``ward_step`` (+ descriptor: that step's slot,
applied when the ward's next step arrives) and ``ward_fetch`` (a copy of it, at a step it serves).

Messages (training → agent): ``hello``, ``fetch``, ``init`` (+ state descriptor), ``slots``
(+ slot descriptors), ``step``, ``sync``, ``close``. Agent → training: ``hello``, ``replica``
(+ descriptor; the region then belongs to the training process), ``released`` (the replica has
moved out of it), ``done`` (a slot is free), ``persisted`` (or, under several ranks, ``part``: this
rank's part is written), ``synced``, ``diverged``, ``error``; for the wards, ``mirrored`` and
``ward`` (+ descriptor).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from multiprocessing import connection
from pathlib import Path
from typing import Any

from .. import tracing
from .._faults import crash_point
from ..background import BackgroundErrors, Worker, settled
from ..distributed import Ranks
from ..policy.interval import busy_interval, median_gap, persist_due
from ..storage import persist_full, CheckpointDirectory
from ..parallelism import ShardBox, state_boxes
from ..storage.formats import RankShare, write_part, buffer_chunks, tensor_chunks
from ..transport.host import HostBuffer, TensorLayout
from ..transport.shared import SharedRegion
from .channel import (
    AgentAddress,
    Plain,
    accept,
    digest,
    listen,
    message,
    recv,
    recv_fds,
    send,
    send_fds,
)
from .config import AgentConfig
from .replica import Replica, WardReplica, replayed_keys

__all__ = ["AgentConfig", "Agent"]

_REQUESTS = frozenset({"hello", "fetch", "init", "slots", "step", "sync", "mirror", "mirror_get", "ward_init",
                       "ward_step", "ward_fetch"})
_MIRRORED_STEPS = 8
"""The most steps of a ward's own state an agent keeps (replicas on peers)."""


class Agent:
    def __init__(self, config: AgentConfig, address: AgentAddress) -> None:
        self.config = config
        self.address = address
        self.directory = Path(config.directory)
        # The training process opened and checked the directory (strategy, world size), and owns it,
        # before it started the agent, which writes on its behalf; a rank's agent is not in the
        # job's process groups, so it checks nothing.
        self.checkpoints = CheckpointDirectory.open(self.directory, strategy=None, create=False, access="shared")
        self.replica: Replica | None = None
        self._boxes: dict[str, ShardBox] = {}
        """The keys of the replica that are this rank's shards of DTensors, and where each lies in the whole."""
        self._signature: str | None = None
        """What the replica fits (:func:`~everystep.agent.session.signature`), told by the training process."""
        self.slots: list[HostBuffer] = []
        self._regions: list[SharedRegion] = []
        self._conn: connection.Connection | None = None
        self._send_lock = threading.Lock()
        self._errors = BackgroundErrors()  # a write reports its own failure to the training process
        self._writer = Worker("everystep-agent-persist", self._errors)
        self._persist: Future[Any] | None = None
        self._persist_buffer: HostBuffer | None = None
        self._copied: threading.Event | None = None
        """Set once the persist in progress has copied the replica (which no step may change before)."""
        self._persisted = -1  # newest step written or being written
        self._write_seconds: float | None = None
        self._arrivals: list[float] = []
        self.shared = config.world > 1
        self._pending: dict[str, Any] | None = None
        """Under several ranks: the newest step message, applied when the next arrives."""
        self._mirrors: dict[int, dict[int, tuple[SharedRegion, TensorLayout, Any]]] = {}
        """Replicas on peers: by ward (a rank on another host) and step, that rank's own state (its
        RNG, data position, buffers: what its replica would hold beyond the replicated state)."""
        self._wards: dict[int, WardReplica] = {}
        """Replicas on peers under sharding: by ward, a replica of that rank's whole state."""

    # -- serving -------------------------------------------------------------------------------

    def serve(self) -> None:
        # Published before it listens: the training process connects as soon as it can, and may die
        # right after; its successor must find this agent.
        me = AgentAddress(address=self.address.address, authkey=self.address.authkey, pid=os.getpid(),
                          host=self.config.host)
        me.publish(self.directory, self.config.discovery)
        listener = None
        try:
            listener = listen(self.address)
            wait = max(self.config.grace, 60.0)  # the first training process is starting up
            while (conn := accept(listener, self.address.authkey, wait, handshake=self.config.handshake,
                                  log=sys.stderr)) is not None:
                self._conn = conn
                if self._session(conn) == "close":
                    break
                if not self.shared:
                    self._persist_newest()  # the training process is gone: make the newest step durable
                wait = self.config.grace
        finally:
            if listener is not None:
                listener.close()
            self._finish_persist()
            self._writer.close()
            self.checkpoints.close()  # the file it kept to write over goes too
            me.withdraw(self.directory, self.config.discovery)

    def _session(self, conn: connection.Connection) -> str:
        try:
            while True:
                msg = recv(conn)
                kind = msg["kind"]
                if kind == "close":
                    self._apply_pending()
                    if not self.shared:
                        self._persist_newest()
                    self._finish_persist()
                    self._send("closed", step=self.replica.step if self.replica else None)
                    return "close"
                self._handle(conn, msg)
        except (EOFError, OSError, ValueError):
            return "lost"
        finally:
            with self._send_lock:  # no other thread is sending on the descriptor closed here
                self._conn = None
                conn.close()
            if self._pending is None:  # a pending step's gradients are in a slot
                self._drop_slots()

    def _handle(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        """Serve one request. Anything but a broken connection is fatal: the training process is
        told what failed, and falls back to its own checkpoints, before the agent exits."""
        kind = msg["kind"]
        try:
            if kind not in _REQUESTS:
                raise ValueError(f"unknown request {kind!r}")
            getattr(self, f"_on_{kind}")(conn, msg)
        except (EOFError, OSError):
            raise
        except BaseException as e:
            what = {"step": f"applying step {msg.get('step')} to the replica",
                    "init": f"taking over the training state of step {msg.get('step')}"}.get(kind, f"the agent's {kind!r}")
            self._send("error", fatal=True, what=what, detail=_describe(e))
            print(f"everystep agent: {what} failed", file=sys.stderr)
            traceback.print_exc()
            raise SystemExit(1) from e

    def _send(self, kind: str, *, fds: list[int] | None = None, **fields: Any) -> None:
        """Send a message (and descriptors right after it: nothing may come between)."""
        try:
            with self._send_lock:
                conn = self._conn
                if conn is None:
                    return
                send(conn, message(kind, **fields))
                if fds:
                    send_fds(conn, fds)
        except OSError:
            pass  # the training process is gone; the session loop notices

    # -- requests ------------------------------------------------------------------------------

    def _on_hello(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        if self.shared:  # a new job: no part of the old one is written after this (its restart collects garbage)
            self._finish_persist()
        r = self.replica
        servable = r is not None and r.servable()
        pending = self._pending["step"] if servable and self._pending is not None else None
        self._send("hello", pid=os.getpid(), step=r.step if servable and r else None, pending=pending,
                   persisted=self._persisted, signature=self._signature, rank=self.config.rank,
                   mirrors={str(ward): sorted(held) for ward, held in self._mirrors.items() if held},
                   wards={str(ward): {"steps": w.served(), "signature": w.signature}
                          for ward, w in self._wards.items() if w.served()})

    def _on_fetch(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        r = self.replica
        assert r is not None
        self._settle_copy()  # (the replica moves out below)
        target = msg.get("step")
        if target is not None and self._pending is not None:
            if self._pending["step"] == target:
                # Its commit, and its slot, went with the old training process.
                self._apply(self._pending, persist=False, notify=False)
            self._pending = None
        if target is not None and r.step != target:
            raise ValueError(f"the replica is at step {r.step} and cannot serve step {target}")
        self._send("replica", fds=[r.region.fd], step=r.step, layout=r.layout, skeleton=r.skeleton)
        # The training process keeps the optimizer state where it is, in that region, without a copy:
        # the replica moves out (while the training process loads the rest and runs its first
        # forward and backward), and says so; the training process writes no state before that.
        r.rehome()
        self._send("released", step=r.step)

    def _on_init(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        (fd,) = recv_fds(conn, 1)
        self._settle_copy()
        if self.replica is not None:
            self.replica.region.close()
        self.replica = Replica(step=msg["step"], region=SharedRegion(msg["layout"].nbytes, fd=fd), layout=msg["layout"],
                               skeleton=msg["skeleton"], index_keys=msg["index_keys"], optimizer_class=msg["optimizer_class"],
                               fused=self.config.fused)
        self._boxes = {k: ShardBox(*box) for k, box in msg["boxes"].items()}
        self._signature = msg["signature"]
        self._pending = None
        for held in self._mirrors.values():  # what a ward sent after this step belongs to a run that is gone
            for step in [s for s in held if s > msg["step"]]:
                held.pop(step)[0].close()
        for ward in [w for w, kept in self._wards.items() if max(kept.served(), default=-1) > msg["step"]]:
            self._drop_ward(ward)
        if msg["persist"] or (msg["persist"] is None and self._due(msg["step"])):
            self._start_persist()
        elif msg["persist"] is False:  # the state came from storage
            self._persisted = max(self._persisted, msg["step"])

    def _on_slots(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        self._drop_slots()
        fds = recv_fds(conn, msg["count"])
        self._regions = [SharedRegion(msg["layout"].nbytes, fd=fd) for fd in fds]
        self.slots = [HostBuffer(msg["layout"], data=r.data) for r in self._regions]

    def _on_step(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        assert self.replica is not None, "a step arrived before the replica was initialised"
        crash_point("agent.step")
        self._arrivals = (self._arrivals + [time.perf_counter()])[-21:]
        if not self.shared:
            self._apply(msg, persist=None)
            return
        self._apply_pending()
        self._pending = msg

    def _apply_pending(self) -> None:
        if self._pending is not None:
            msg, self._pending = self._pending, None
            self._apply(msg, persist=msg["persist"])

    def _apply(self, msg: dict[str, Any], *, persist: bool | None, notify: bool = True) -> None:
        """Apply one step, free its slot (``notify``), then persist it if ``persist``, or, with None,
        if it is due."""
        r = self.replica
        assert r is not None
        t0 = time.perf_counter()
        self._settle_copy()
        with tracing.span("agent apply", step=msg["step"]):
            r.apply(msg["step"], self.slots[msg["slot"]], groups=msg["groups"], skipped=msg["skipped"],
                    has_grad=msg["has_grad"], skeleton=msg["skeleton"])
        if notify:
            self._send("done", slot=msg["slot"], step=r.step, seconds=time.perf_counter() - t0)
        check = msg.get("digest")
        if check is not None:
            lacking = [k for k in check["keys"] if k not in r.tensors]
            if lacking:
                self._send("diverged", step=r.step, detail=f"the replica lacks {', '.join(lacking[:3])}")
            else:
                mine = digest(r.tensors, check["keys"], check["sample"])
                if mine != check["value"]:
                    self._send("diverged", step=r.step, detail=f"digest {mine} of the replica, {check['value']} of the live state")
        if persist or (persist is None and self._due(r.step)):
            self._start_persist()

    def _on_sync(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        self._apply_pending()
        if self.shared:
            self._finish_persist()
            self._send("synced", step=self.replica.step if self.replica else None, persisted=self._persisted)
            return
        if msg.get("persist") and self.replica is not None and self._persisted < self.replica.step:
            self._finish_persist()
            self._start_persist()
        self._finish_persist()
        r = self.replica
        if r is not None and r.servable() and self._due(r.step):  # fell due while the writer was busy
            self._start_persist()
            self._finish_persist()
        self._send("synced", step=self.replica.step if self.replica else None, persisted=self._persisted)

    def _on_mirror(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        """Keep a ward's own state of a step (replicas on peers), and the newest few only."""
        (fd,) = recv_fds(conn, 1)
        held = self._mirrors.setdefault(int(msg["ward"]), {})
        if msg["step"] in held:
            held.pop(msg["step"])[0].close()
        held[int(msg["step"])] = (SharedRegion(msg["layout"].nbytes, fd=fd), msg["layout"], msg["skeleton"])
        for step in sorted(held)[:-_MIRRORED_STEPS]:
            held.pop(step)[0].close()

    def _on_mirror_get(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        found = self._mirrors.get(int(msg["ward"]), {}).get(msg["step"])
        if found is None:
            raise ValueError(f"no state of rank {msg['ward']} at step {msg['step']} is kept here")
        region, layout, skeleton = found
        self._send("mirrored", fds=[region.fd], ward=msg["ward"], step=msg["step"], layout=layout,
                   skeleton=Plain(skeleton))

    def _on_ward_init(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        """A ward's whole state (replicas on peers, under sharding): the replica of it kept here,
        in place of any before."""
        (fd,) = recv_fds(conn, 1)
        region = SharedRegion(msg["layout"].nbytes, fd=fd)
        self._drop_ward(int(msg["ward"]))
        with self._ward_failure(msg, region, "state"):
            replica = Replica(step=msg["step"], region=region, layout=msg["layout"], skeleton=msg["skeleton"],
                              index_keys=msg["index_keys"], optimizer_class=msg["optimizer_class"],
                               fused=self.config.fused)
            self._wards[int(msg["ward"])] = WardReplica(replica, msg["signature"])

    def _on_ward_step(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        (fd,) = recv_fds(conn, 1)
        region = SharedRegion(msg["layout"].nbytes, fd=fd)
        kept = self._wards.get(int(msg["ward"]))
        if kept is None:  # (dropped, below: the ward's later steps have nothing to apply to)
            region.close()
            return
        with self._ward_failure(msg, region, f"step {msg['step']}"):
            kept.arrive(msg, region)

    @contextlib.contextmanager
    def _ward_failure(self, msg: dict[str, Any], region: SharedRegion, what: str) -> Iterator[None]:
        """What a ward sent that its replica cannot take drops that replica — recovery then finds
        none of the ward's state here, and reads storage — not this agent, which serves its own rank."""
        try:
            yield
        except Exception:
            region.close()
            self._drop_ward(int(msg["ward"]))
            print(f"everystep agent: the replica of rank {msg['ward']} could not take its {what}, and is dropped",
                  file=sys.stderr)
            traceback.print_exc()

    def _drop_ward(self, ward: int) -> None:
        kept = self._wards.pop(ward, None)
        if kept is not None:
            kept.close()

    def _on_ward_fetch(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        kept = self._wards.get(int(msg["ward"]))
        if kept is None:
            raise ValueError(f"no replica of rank {msg['ward']} is kept here")
        r = kept.at(msg["step"])
        self._send("ward", fds=[r.region.fd], ward=msg["ward"], step=r.step, layout=r.layout, skeleton=Plain(r.skeleton))

    def _drop_slots(self) -> None:
        for region in self._regions:
            region.close()
        self._regions, self.slots = [], []

    # -- persistence ---------------------------------------------------------------------------

    def interval(self) -> int:
        """P: the configured interval, or the one that keeps the writer busy ``busy`` of the time."""
        if self.config.every is not None:
            return self.config.every
        if self._write_seconds is None:
            return 1  # nothing written yet (a start from storage): the next write measures it
        step_seconds = median_gap(self._arrivals)
        if step_seconds is None:
            return 1 << 30
        return busy_interval(self._write_seconds, step_seconds, self.config.busy)

    def _due(self, step: int) -> bool:
        writing = self._persist is not None and not self._persist.done()
        return persist_due(step, self._persisted, self.interval(), fixed=self.config.every is not None, writing=writing)

    def _persist_newest(self) -> None:
        if self.replica is not None and self._persisted < self.replica.step and self.replica.servable():
            self._finish_persist()
            self._start_persist()

    def _start_persist(self) -> None:
        """Persist the replica's step: its copy and its write on the writer's thread, so that the
        thread applying steps goes on answering; the next step's apply waits for the copy only."""
        r = self.replica
        assert r is not None
        self._finish_persist()
        self._persisted = r.step
        self._copied = copied = threading.Event()
        self._persist = self._writer.submit(f"the agent's write of step {r.step}", self._copy_and_write, r, r.step,
                                            r.skeleton, copied)

    def _copy_and_write(self, r: Replica, step: int, skeleton: Any, copied: threading.Event) -> None:
        try:
            crash_point("agent.persist.copy")
            if self._persist_buffer is None or self._persist_buffer.layout != r.layout:
                self._persist_buffer = HostBuffer(r.layout)
            self._persist_buffer.data.copy_(r.region.data)
        finally:
            copied.set()
        self._write(step, self._persist_buffer, skeleton)

    def _settle_copy(self) -> None:
        """Wait until the persist in progress has copied the replica: then it may change."""
        if self._copied is not None:
            self._copied.wait()
            self._copied = None

    def _write(self, step: int, buffer: HostBuffer, skeleton: Any) -> None:
        if self.shared:
            self._write_part(step, buffer, skeleton)
            return
        try:
            manifest, self._write_seconds = persist_full(self.checkpoints, step, buffer_chunks(buffer.layout,
                                                         buffer.memoryview()), skeleton, keep=self.config.keep,
                                                         meta={"writer": "agent"})
            self._send("persisted", step=step, nbytes=manifest.nbytes, seconds=self._write_seconds)
        except BaseException as e:
            self._send("error", fatal=False, what=f"the agent's write of the checkpoint at step {step}",
                       detail=_describe(e))

    def _write_part(self, step: int, buffer: HostBuffer, skeleton: Any) -> None:
        """This rank's part of the checkpoint of ``step``; its training process commits it with the others."""
        t0 = time.perf_counter()
        info, error, pieces, boxes = None, None, {}, {}
        try:
            assert self.replica is not None
            ranks = Ranks(rank=self.config.rank, world=self.config.world)
            # (the optimizer state that step() made since the training process sent the boxes: its parameter's)
            boxes = state_boxes(self._boxes, self.replica.index_keys, buffer.views)
            replicated = replayed_keys(self.replica.index_keys, buffer.views) - boxes.keys()
            share = RankShare.of(buffer.views, replicated, ranks, boxes=boxes)
            pieces, boxes = share.pieces, share.boxes
            info = write_part(self.checkpoints.catalog, "full", step, tensor_chunks(TensorLayout.of(share.local), share.local), ranks)
            self._write_seconds = time.perf_counter() - t0
        except BaseException as e:
            error = _describe(e)
        self._send("part", step=step, info=info.to_json() if info else None, pieces=pieces, boxes=boxes,
                   meta={"skeleton": skeleton}, error=error, seconds=time.perf_counter() - t0)

    def _finish_persist(self) -> None:
        if self._persist is not None:
            settled(self._persist)
            self._persist = None
            self._errors.raise_pending()


def _describe(error: BaseException) -> str:
    """``Type: message`` of an exception, as the training process is told it."""
    return "".join(traceback.format_exception_only(error)).strip()
