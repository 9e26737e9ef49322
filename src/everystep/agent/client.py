"""The training process's end of the link to its checkpoint agent."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict
from multiprocessing import connection
from pathlib import Path
from typing import Any, ClassVar

import torch

from .._forking import AGENT_ENTRY, inherited
from ..errors import EverystepError
from ..parallelism import shard_box
from .channel import (
    DISCOVERY_FILE,
    AgentAddress,
    AgentIdentityError,
    connect,
    message,
    open_log,
    rank_file,
    recv,
    recv_fds,
    send,
    send_fds,
    shut_down,
)
from .config import AgentConfig

__all__ = ["AgentLink", "AgentLostError", "signature", "fits", "served"]


def signature(tensors: dict[str, torch.Tensor], sharded: Mapping[str, torch.Tensor]) -> str:
    """What a replica of ``tensors`` (a flat state; ``sharded``: the DTensors of the keys that hold
    this rank's shards) fits: the model's keys, each tensor's shape, and where a shard lies in the
    whole. A replica made under another layout or model is not taken."""
    model = [(k, list(t.shape), shard_box(sharded[k]).offsets if k in sharded else None)
             for k, t in sorted(tensors.items()) if k.startswith("/model/")]
    return hashlib.sha256(json.dumps(model).encode()).hexdigest()[:32]


def fits(hello: dict[str, Any], expect: str) -> bool:
    """Whether the replica an agent's answer to ``hello`` describes fits the :func:`signature`
    ``expect`` (warned about where it does not)."""
    if hello["step"] is None or hello.get("signature") == expect:
        return True
    warnings.warn(f"the checkpoint agent (pid {hello.get('pid')}) holds the state of another layout (another sharding, "
                  "or another model); recovering from storage", RuntimeWarning, stacklevel=6)
    return False


def served(hello: dict[str, Any]) -> list[int] | None:
    """The steps an agent's answer to ``hello`` says its replica can serve; None when it holds none."""
    if hello["step"] is None:
        return None
    return [hello["step"]] + ([hello["pending"]] if hello.get("pending") is not None else [])


LOG_FILE = "agent.log"


class AgentLostError(EverystepError):
    """The agent did not answer, or its connection broke."""


def _alive(pid: int) -> bool:
    try:  # an agent this process started and that has exited: reap it
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AgentLink:
    """A connection to an agent, with a reader thread once :meth:`start_reader` is called.

    Before the reader starts, :meth:`call` reads the reply itself; after, replies come through
    the reader, which also dispatches the agent's unsolicited messages to ``handlers``.
    """

    launcher: ClassVar[Any] = None
    """Where :meth:`spawn` starts agents, besides the zygote a process was forked from (which forks
    its agents, :func:`everystep._forking.inherited`): None, a fresh interpreter each (seconds of CPU
    importing torch and the compiler its optimizer imports); or, for a process that starts many (the
    test suite), a zygote (:class:`everystep.eval.zygote.Zygote`) — a process that imported them
    once, started by this one and running no torch operation (nothing of a CUDA context is forked) —
    that forks each agent."""

    def __init__(self, conn: connection.Connection, pid: int, process: Any) -> None:
        """``process``: the agent's :class:`subprocess.Popen` (or the zygote's handle on it), where
        this process started it."""
        self.conn, self.pid, self.process = conn, pid, process
        self.lost: str | None = None
        self._send_lock = threading.Lock()
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._early: list[dict[str, Any]] = []

    # -- finding or starting an agent ----------------------------------------------------------

    @classmethod
    def find(cls, directory: Path, name: str = DISCOVERY_FILE, *, host: str | None = None) -> "AgentLink | None":
        """The live agent that ``directory/name`` (``agent.json``) names, or None (with a warning
        that says why, when a file names one that cannot be used: not this user's, or silent).
        ``host``: only an agent that runs there (another host's is not this process's to reach)."""
        try:
            address = AgentAddress.find(directory, name)
            if address is None or (host is not None and address.host != host) or not _alive(address.pid):
                return None
            conn = connect(address, pid=address.pid)
        except AgentIdentityError as e:
            warnings.warn(f"not using the checkpoint agent that {directory / name} names: {e}; recovering from "
                          "storage", RuntimeWarning, stacklevel=3)
            return None
        except OSError as e:
            warnings.warn(f"the checkpoint agent (pid {address.pid}) that {directory / name} names did not answer "
                          f"({e}); recovering from storage", RuntimeWarning, stacklevel=3)
            return None
        return cls(conn, address.pid, None)

    @classmethod
    def spawn(cls, config: AgentConfig, *, timeout: float = 120.0) -> "AgentLink":
        """Start ``python -m everystep.agent`` and connect to it: forked from the zygote this process
        was forked from (in this process's group), else from :attr:`launcher`, else a fresh interpreter."""
        address = AgentAddress.new()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "EVERYSTEP_AGENT": json.dumps(asdict(address)),
               "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        log_path = Path(config.directory) / rank_file(LOG_FILE, config.rank, config.world)
        process: Any
        launcher = inherited() or cls.launcher
        if launcher is not None:
            process = launcher.fork(env, [os.getcwd(), str(log_path), json.dumps(asdict(config))], entry=AGENT_ENTRY)
        else:
            log = os.fdopen(open_log(log_path), "ab")
            try:
                process = subprocess.Popen([sys.executable, "-m", "everystep.agent", json.dumps(asdict(config))],
                                           env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            finally:
                log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls(connect(address, pid=process.pid), process.pid, process)
            except AgentIdentityError:
                process.kill()
                process.wait()
                raise
            except OSError:
                if process.poll() is not None:
                    raise AgentLostError(f"the checkpoint agent exited with status {process.returncode} before it "
                                         f"listened; see {log_path}") from None
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    raise AgentLostError(f"the checkpoint agent did not listen within {timeout:.0f} s") from None
                time.sleep(0.05)

    # -- messages ------------------------------------------------------------------------------

    def send(self, kind: str, *, fds: list[int] | None = None, **fields: Any) -> None:
        try:
            with self._send_lock:
                send(self.conn, message(kind, **fields))
                if fds:
                    send_fds(self.conn, fds)
        except OSError as e:
            self.wait_reader(10.0)  # what it said before it went (why) is handled first
            self._mark_lost(f"sending to it failed ({e})")
            raise AgentLostError(self.lost) from e

    def call(self, kind: str, *, reply: str, timeout: float, fds: list[int] | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and return its reply, of kind ``reply``."""
        self.send(kind, fds=fds, **fields)
        if self._reader is None:
            while True:  # the agent's own news (a write that finished) may come first: kept for the reader
                if not self.conn.poll(timeout):
                    raise AgentLostError(f"no answer to {kind!r} within {timeout:.0f} s")
                try:
                    msg = recv(self.conn)
                except (EOFError, OSError, ValueError) as e:
                    self._mark_lost(f"its connection closed ({e})" if isinstance(e, ValueError) else "its connection closed")
                    raise AgentLostError(self.lost) from e
                if msg["kind"] == reply:
                    return msg
                self._early.append(msg)
        try:
            answer = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AgentLostError(f"no answer to {kind!r} within {timeout:.0f} s") from None
        if answer is None:
            raise AgentLostError(self.lost or "its connection closed")
        return answer

    def receive_fds(self, n: int) -> list[int]:
        assert self._reader is None, "descriptors are received before the reader starts"
        return recv_fds(self.conn, n)

    def start_reader(self, handlers: dict[str, Callable[[dict[str, Any]], None]], on_lost: Callable[[str], None]) -> None:
        for msg in self._early:
            handlers[msg["kind"]](msg)
        self._early.clear()

        def read() -> None:
            while True:
                try:
                    msg = recv(self.conn)
                except (EOFError, OSError, ValueError) as e:
                    self._mark_lost(f"it sent something that is not a message ({e})" if isinstance(e, ValueError)
                                    else "its connection closed")
                    self._replies.put(None)
                    on_lost(self.lost or "")
                    return
                handler = handlers.get(msg["kind"])
                if handler is None:
                    self._replies.put(msg)
                else:
                    handler(msg)

        self._reader = threading.Thread(target=read, name="everystep-agent-reader", daemon=True)
        self._reader.start()

    def wait_reader(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the reader to end: an agent that is gone has its last
        messages (why it went) handled, and its end of the connection seen."""
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=timeout)

    def _mark_lost(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason

    # -- ending --------------------------------------------------------------------------------

    def hang_up(self) -> None:
        """Leave without a word, as a crashed training process would.

        The reader thread, woken by the shutdown, ends before the descriptor is closed: closed
        under it, the descriptor's number could go to the next connection this process opens (a
        restarted Checkpointer's), and a read already under way would take that connection's
        messages.
        """
        shut_down(self.conn)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=10.0)
        self.conn.close()

    def close(self, *, timeout: float) -> None:
        """Ask the agent to persist what it holds and exit; wait for it to be gone."""
        if self.lost is None:
            try:
                self.call("close", reply="closed", timeout=timeout)
            except AgentLostError:
                pass
        self.hang_up()
        self._wait_gone(timeout)

    def kill(self) -> None:
        """End an agent that stopped answering (it would otherwise outlive the job)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.hang_up()
        self._wait_gone(10.0)

    def _wait_gone(self, timeout: float) -> None:
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            return
        deadline = time.monotonic() + timeout
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
