"""The checkpoint agent: a separate process that holds the replica and persists it.

It is started with ``python -m everystep.agent`` (a fresh interpreter, never a fork of a process
that may hold a CUDA context) and serves one training process at a time. When that process
disappears without saying goodbye — a software failure — the agent persists its newest step,
then waits ``grace`` seconds for a restarted training process to take the replica from memory,
and exits if none comes. A training process that closes cleanly tells the agent to persist what
it has and exit. So the agent never outlives its job by more than ``grace`` seconds.

Messages (training → agent): ``hello``, ``fetch``, ``init`` (+ state descriptor), ``slots``
(+ slot descriptors), ``step``, ``sync``, ``close``. Agent → training: ``hello``, ``replica``
(+ descriptor), ``done`` (a slot is free), ``persisted``, ``synced``, ``diverged``, ``error``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Any

import torch

from ..storage.local import LocalStore
from ..storage.tensorfile import buffer_chunks
from ..strategies._full import write_full
from ..transport.host import HostBuffer
from ..transport.shared import SharedRegion
from .channel import AgentAddress, accept, digest, listen, message, recv_fds, send_fds
from .replica import Replica

__all__ = ["AgentConfig", "Agent", "main"]


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


class Agent:
    def __init__(self, config: AgentConfig, address: AgentAddress) -> None:
        self.config = config
        self.address = address
        self.directory = Path(config.directory)
        self.store = LocalStore.open(self.directory, strategy=config.strategy, create=False)
        self.replica: Replica | None = None
        self.slots: list[HostBuffer] = []
        self._regions: list[SharedRegion] = []
        self._conn: connection.Connection | None = None
        self._send_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="everystep-agent-persist")
        self._persist: Future[Any] | None = None
        self._persist_buffer: HostBuffer | None = None
        self._persisted = -1  # newest step written or being written
        self._write_seconds: float | None = None
        self._arrivals: list[float] = []

    # -- serving -------------------------------------------------------------------------------

    def serve(self) -> None:
        listener = listen(self.address)
        AgentAddress(address=self.address.address, authkey=self.address.authkey, pid=os.getpid()).publish(self.directory)
        try:
            wait = max(self.config.grace, 60.0)  # the first training process is starting up
            while (conn := accept(listener, self.address.authkey, wait)) is not None:
                self._conn = conn
                if self._session(conn) == "close":
                    break
                self._conn = None
                self._persist_newest()  # the training process is gone: make the newest step durable
                wait = self.config.grace
        finally:
            listener.close()
            self._finish_persist()
            self._writer.shutdown(wait=True)
            AgentAddress(address=self.address.address, authkey=self.address.authkey, pid=os.getpid()).withdraw(self.directory)

    def _session(self, conn: connection.Connection) -> str:
        try:
            while True:
                msg = conn.recv()
                kind = msg["kind"]
                if kind == "close":
                    self._persist_newest()
                    self._finish_persist()
                    self._send("closed", step=self.replica.step if self.replica else None)
                    return "close"
                self._handle(conn, msg)
        except (EOFError, OSError):
            return "lost"
        finally:
            conn.close()
            self._drop_slots()

    def _handle(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        """Serve one request. Anything but a broken connection is fatal: the training process is
        told what failed, and falls back to its own checkpoints, before the agent exits."""
        kind = msg["kind"]
        try:
            getattr(self, f"_on_{kind}")(conn, msg)
        except (EOFError, OSError):
            raise
        except BaseException as e:
            what = {"step": f"applying step {msg.get('step')} to the replica",
                    "init": f"taking over the training state of step {msg.get('step')}"}.get(kind, f"the agent's {kind!r}")
            self._send("error", fatal=True, what=what, detail="".join(traceback.format_exception_only(e)).strip())
            raise SystemExit(1) from e

    def _send(self, kind: str, *, fds: list[int] | None = None, **fields: Any) -> None:
        """Send a message (and descriptors right after it: nothing may come between)."""
        conn = self._conn
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send(message(kind, **fields))
                if fds:
                    send_fds(conn, fds)
        except OSError:
            pass  # the training process is gone; the session loop notices

    # -- requests ------------------------------------------------------------------------------

    def _on_hello(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        r = self.replica
        servable = r is not None and r.servable()
        self._send("hello", pid=os.getpid(), step=r.step if servable and r else None, persisted=self._persisted)

    def _on_fetch(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        r = self.replica
        assert r is not None
        self._send("replica", fds=[r.region.fd], step=r.step, layout=r.layout, skeleton=r.skeleton)

    def _on_init(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        (fd,) = recv_fds(conn, 1)
        if self.replica is not None:
            self.replica.region.close()
        self.replica = Replica(step=msg["step"], region=SharedRegion(msg["layout"].nbytes, fd=fd), layout=msg["layout"],
                               skeleton=msg["skeleton"], index_keys=msg["index_keys"], optimizer_class=msg["optimizer_class"])
        if msg["persist"]:
            self._start_persist()
        else:
            self._persisted = max(self._persisted, msg["step"])

    def _on_slots(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        self._drop_slots()
        fds = recv_fds(conn, msg["count"])
        self._regions = [SharedRegion(msg["layout"].nbytes, fd=fd) for fd in fds]
        self.slots = [HostBuffer(msg["layout"], data=r.data) for r in self._regions]

    def _on_step(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        r = self.replica
        assert r is not None, "a step arrived before the replica was initialised"
        self._arrivals = (self._arrivals + [time.perf_counter()])[-21:]
        r.apply(msg["step"], self.slots[msg["slot"]], groups=msg["groups"], skipped=msg["skipped"],
                has_grad=msg["has_grad"], skeleton=msg["skeleton"])
        self._send("done", slot=msg["slot"], step=r.step)
        check = msg.get("digest")
        if check is not None:
            lacking = [k for k in check["keys"] if k not in r.tensors]
            if lacking:
                self._send("diverged", step=r.step, detail=f"the replica lacks {', '.join(lacking[:3])}")
            else:
                mine = digest(r.tensors, check["keys"], check["sample"])
                if mine != check["value"]:
                    self._send("diverged", step=r.step, detail=f"digest {mine} of the replica, {check['value']} of the live state")
        if self._due(r.step):
            self._start_persist()

    def _on_sync(self, conn: connection.Connection, msg: dict[str, Any]) -> None:
        if msg.get("persist") and self.replica is not None and self._persisted < self.replica.step:
            self._finish_persist()
            self._start_persist()
        self._finish_persist()
        r = self.replica
        if r is not None and r.servable() and self._due(r.step):  # fell due while the writer was busy
            self._start_persist()
            self._finish_persist()
        self._send("synced", step=self.replica.step if self.replica else None, persisted=self._persisted)

    def _drop_slots(self) -> None:
        for region in self._regions:
            region.close()
        self._regions, self.slots = [], []

    # -- persistence ---------------------------------------------------------------------------

    def interval(self) -> int:
        """P: the configured interval, or the one that keeps the writer busy ``busy`` of the time."""
        if self.config.every is not None:
            return self.config.every
        if self._write_seconds is None or len(self._arrivals) < 3:
            return 1 << 30
        step_seconds = statistics.median(b - a for a, b in zip(self._arrivals, self._arrivals[1:]))
        return max(1, math.ceil(self._write_seconds / (self.config.busy * max(step_seconds, 1e-9))))

    def _due(self, step: int) -> bool:
        if self._persist is not None and not self._persist.done():
            return False  # one write at a time; a due write happens at the first step after it
        P = self.interval()
        if self.config.every is not None:  # the first step at or after each multiple of P
            return step // P > max(self._persisted, 0) // P
        return step - self._persisted >= P

    def _persist_newest(self) -> None:
        if self.replica is not None and self._persisted < self.replica.step and self.replica.servable():
            self._finish_persist()
            self._start_persist()

    def _start_persist(self) -> None:
        r = self.replica
        assert r is not None
        self._finish_persist()
        if self._persist_buffer is None or self._persist_buffer.layout != r.layout:
            self._persist_buffer = HostBuffer(r.layout)
        self._persist_buffer.data.copy_(r.region.data)
        self._persisted = r.step
        self._persist = self._writer.submit(self._write, r.step, self._persist_buffer, r.skeleton)

    def _write(self, step: int, buffer: HostBuffer, skeleton: Any) -> None:
        try:
            t0 = time.perf_counter()
            manifest = write_full(self.store, step, buffer_chunks(buffer.layout, buffer.memoryview()), skeleton,
                                  meta={"writer": "agent"})
            self._write_seconds = time.perf_counter() - t0
            self.store.retain(self.config.keep)
            self._send("persisted", step=step, nbytes=manifest.nbytes, seconds=self._write_seconds)
        except BaseException as e:
            self._send("error", fatal=False, what=f"the agent's write of the checkpoint at step {step}",
                       detail="".join(traceback.format_exception_only(e)).strip())

    def _finish_persist(self) -> None:
        if self._persist is not None:
            self._persist.result()
            self._persist = None


def main(argv: list[str]) -> int:
    """``python -m everystep.agent CONFIG_JSON``, with the address in ``EVERYSTEP_AGENT``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process, which closes us
    config = AgentConfig(**json.loads(argv[0]))
    address = AgentAddress(**json.loads(os.environ.pop("EVERYSTEP_AGENT")))
    torch.set_num_threads(config.threads)
    try:
        Agent(config, address).serve()
    except Exception as e:
        print(f"everystep agent: {e}", file=sys.stderr)
        return 1
    return 0
