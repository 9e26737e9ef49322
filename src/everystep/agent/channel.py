"""How a training process finds and talks to its checkpoint agent.

The agent listens on a Unix socket (an abstract name on Linux, so nothing is left on disk) and
records where, with a random key, in ``agent.json`` in the checkpoint directory (mode 0600). A
connection is authenticated with that key (HMAC challenge and response) before anything else is
read. Messages are Python objects of plain types; tensors never travel in messages: they live in
shared memory whose descriptors are passed alongside (``SCM_RIGHTS``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import tempfile
from dataclasses import asdict, dataclass
from multiprocessing import connection, reduction
from pathlib import Path
from typing import Any

import torch
import xxhash

from ..transport.host import tensor_bytes

__all__ = ["AgentAddress", "rank_file", "listen", "connect", "shut_down", "send_fds", "recv_fds", "digest", "DISCOVERY_FILE"]

DISCOVERY_FILE = "agent.json"


def rank_file(name: str, rank: int, world: int) -> str:
    """The file ``name`` (``agent.json``, ``agent.log``) of a training process's agent: as it is in
    a single process, with the rank added (``agent-r1.json``) for each rank of a job of several."""
    stem, dot, ext = name.partition(".")
    return name if world == 1 else f"{stem}-r{rank}{dot}{ext}"


@dataclass(frozen=True, kw_only=True)
class AgentAddress:
    address: str
    authkey: str
    pid: int = 0

    @classmethod
    def new(cls) -> "AgentAddress":
        name = f"everystep-agent-{secrets.token_hex(8)}"
        address = "\0" + name if sys.platform.startswith("linux") else os.path.join(tempfile.gettempdir(), name)
        return cls(address=address, authkey=secrets.token_hex(16))

    def publish(self, directory: Path, name: str = DISCOVERY_FILE) -> None:
        """Write ``directory/name`` atomically, readable by its owner only."""
        tmp = directory / f".{name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, directory / name)

    @classmethod
    def find(cls, directory: Path, name: str = DISCOVERY_FILE) -> "AgentAddress | None":
        try:
            return cls(**json.loads((directory / name).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def withdraw(self, directory: Path, name: str = DISCOVERY_FILE) -> None:
        """Remove ``directory/name`` if it still names this agent."""
        if AgentAddress.find(directory, name) == self:
            (directory / name).unlink(missing_ok=True)


def listen(address: AgentAddress) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address.address)
    sock.listen(4)
    return sock


def accept(listener: socket.socket, authkey: str, timeout: float | None) -> connection.Connection | None:
    """The next authenticated connection, or None when ``timeout`` seconds pass without one."""
    listener.settimeout(timeout)
    try:
        sock, _ = listener.accept()
    except TimeoutError:
        return None
    sock.settimeout(None)
    conn = connection.Connection(sock.detach())
    try:
        connection.deliver_challenge(conn, authkey.encode())  # type: ignore[attr-defined]
        connection.answer_challenge(conn, authkey.encode())  # type: ignore[attr-defined]
    except (OSError, EOFError, connection.AuthenticationError):
        conn.close()
        return None
    return conn


def connect(address: AgentAddress, *, timeout: float = 30.0) -> connection.Connection:
    """Connect and authenticate; raises OSError when no agent listens there or none answers
    within ``timeout`` seconds (one that is serving another training process)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address.address)
    except OSError:
        sock.close()
        raise
    conn = connection.Connection(sock.detach())
    if not conn.poll(timeout):
        conn.close()
        raise TimeoutError(f"the agent at {address.address!r} did not answer within {timeout:.0f} s")
    try:
        connection.answer_challenge(conn, address.authkey.encode())  # type: ignore[attr-defined]
        connection.deliver_challenge(conn, address.authkey.encode())  # type: ignore[attr-defined]
    except (EOFError, connection.AuthenticationError) as e:
        conn.close()
        raise ConnectionRefusedError(f"the agent at {address.address!r} did not authenticate: {e}") from e
    return conn


def shut_down(conn: connection.Connection) -> None:
    """End the connection in both directions, so that the other end sees it at once and a thread of
    this process reading it gets end-of-file (a plain close would wait for that read). The
    descriptor stays open: close it once no thread can read it any more."""
    if conn.closed:
        return
    try:
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def send_fds(conn: connection.Connection, fds: list[int]) -> None:
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        reduction.sendfds(s, fds)


def recv_fds(conn: connection.Connection, n: int) -> list[int]:
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        return list(reduction.recvfds(s, n))


def digest(tensors: dict[str, torch.Tensor], keys: list[str], sample: int) -> str:
    """XXH3 of the named tensors, or of ``sample`` evenly spaced elements of each (0: all)."""
    h = xxhash.xxh3_64()
    for key in sorted(keys):
        t = tensors[key].detach().reshape(-1)
        if sample and t.numel() > sample:
            t = t[:: t.numel() // sample][:sample]
        h.update(key.encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def message(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, **fields}
