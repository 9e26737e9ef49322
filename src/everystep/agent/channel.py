"""How a training process finds and talks to its checkpoint agent, and how each checks the other.

The agent listens on a Unix socket (an abstract name on Linux, so nothing is left on disk) and
records where, with a random key, in ``agent.json`` in the checkpoint directory, created with
``O_EXCL|O_NOFOLLOW`` and mode 0600. Before it sends anything, a training process checks who it
is talking to: ``agent.json`` must be a regular file owned by its own user and readable by no
one else, and the process at the other end of the socket (``SO_PEERCRED``) must run as that user
with the pid ``agent.json`` names (or, for an agent it started, the pid it started). The agent
accepts only peers of its own user. Then each side proves it knows the key (HMAC challenge and
response) before any message is read.

Messages are JSON (tuples and tensor layouts tagged), never pickle: nothing received on the socket
can run code. Tensors never travel in messages: they live in shared memory whose descriptors are
passed alongside (``SCM_RIGHTS``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing import connection, reduction
from pathlib import Path
from typing import Any

import torch
import xxhash

from ..layout import LayoutEntry, TensorLayout, tensor_bytes

__all__ = ["AgentAddress", "AgentIdentityError", "rank_file", "listen", "accept", "connect", "shut_down", "send_fds",
           "recv_fds", "send", "recv", "digest", "open_log", "DISCOVERY_FILE", "HANDSHAKE_SECONDS"]

DISCOVERY_FILE = "agent.json"
HANDSHAKE_SECONDS = 10.0
"""How long either side waits for the other's part of the handshake before dropping the connection."""
MAX_MESSAGE = 64 << 20


class AgentIdentityError(ConnectionRefusedError):
    """The process or file that claims to be the checkpoint agent is not this user's agent."""


def rank_file(name: str, rank: int, world: int) -> str:
    """The file ``name`` (``agent.json``, ``agent.log``) of a training process's agent: as it is in
    a single process, with the rank added (``agent-r1.json``) for each rank of a job of several."""
    stem, dot, ext = name.partition(".")
    return name if world == 1 else f"{stem}-r{rank}{dot}{ext}"


def open_log(path: str | os.PathLike[str]) -> int:
    """A descriptor that appends to an agent's log at ``path``: created private to this user, never
    opened through a symbolic link."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def create_private(path: Path, mode: str = "w") -> Any:
    """Open a new file for writing, readable by its owner only: never an existing file or a
    symbolic link planted at ``path`` (``O_EXCL|O_NOFOLLOW``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, mode)


@dataclass(frozen=True, kw_only=True)
class AgentAddress:
    address: str
    authkey: str
    pid: int = 0
    host: str = ""
    """The host the agent runs on, where the job names its hosts (replicas on peers); else empty."""

    @classmethod
    def new(cls) -> "AgentAddress":
        name = f"everystep-agent-{secrets.token_hex(8)}"
        address = "\0" + name if sys.platform.startswith("linux") else os.path.join(tempfile.gettempdir(), name)
        return cls(address=address, authkey=secrets.token_hex(16))

    def publish(self, directory: Path, name: str = DISCOVERY_FILE) -> None:
        """Write ``directory/name`` atomically, readable by its owner only."""
        tmp = directory / f".{name}.{secrets.token_hex(8)}"
        with create_private(tmp) as f:
            json.dump(asdict(self), f)
        os.replace(tmp, directory / name)

    @classmethod
    def find(cls, directory: Path, name: str = DISCOVERY_FILE) -> "AgentAddress | None":
        """The address ``directory/name`` records; None when there is none. Raises
        :class:`AgentIdentityError` when the file is not this user's own private file."""
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise AgentIdentityError(f"{path} cannot be trusted: {e.strerror or e} (a symbolic link?)") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise AgentIdentityError(
                    f"{path} cannot be trusted: it is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; "
                    f"an agent of this user (uid {os.getuid()}) writes it as a regular file of mode -rw-------")
            try:
                found = json.loads(f.read(1 << 16))
                return cls(address=str(found["address"]), authkey=str(found["authkey"]), pid=int(found["pid"]),
                           host=str(found.get("host", "")))
            except (ValueError, KeyError, TypeError):
                return None

    def withdraw(self, directory: Path, name: str = DISCOVERY_FILE) -> None:
        """Remove ``directory/name`` if it still names this agent."""
        try:
            if AgentAddress.find(directory, name) == self:
                (directory / name).unlink(missing_ok=True)
        except AgentIdentityError:
            pass


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket; None where the platform cannot say."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return pid, uid


def _handshake_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each read of the handshake (``SO_RCVTIMEO``; 0: unbounded) on the blocking descriptor
    that :class:`multiprocessing.connection.Connection` reads with ``os.read``."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def _end_handshake(conn: connection.Connection) -> None:
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        _handshake_timeout(s, 0)


def listen(address: AgentAddress) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address.address)
    sock.listen(4)
    return sock


def accept(listener: socket.socket, authkey: str, timeout: float, *, handshake: float = HANDSHAKE_SECONDS,
           log: Any = None) -> connection.Connection | None:
    """The next connection from a process of this user that proves it knows ``authkey``; None when
    ``timeout`` seconds pass without one. A connection that fails (another user, a wrong key,
    silence for ``handshake`` seconds) is dropped, said in ``log``, and does not end the wait."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            return None
        sock.settimeout(None)
        why = _check_peer(sock, pid=None)
        if why is None:
            _handshake_timeout(sock, handshake)
            conn = connection.Connection(sock.detach())
            try:
                connection.deliver_challenge(conn, authkey.encode())  # type: ignore[attr-defined]
                connection.answer_challenge(conn, authkey.encode())  # type: ignore[attr-defined]
            except (OSError, EOFError, connection.AuthenticationError) as e:
                conn.close()
                why = f"it failed the handshake ({type(e).__name__}: {e})"
            else:
                _end_handshake(conn)
                return conn
        else:
            sock.close()
        if log is not None:
            print(f"everystep agent: dropped a connection: {why}", file=log, flush=True)
    return None


def _check_peer(sock: socket.socket, pid: int | None) -> str | None:
    """Why the peer of ``sock`` is not this user's process (with ``pid``, not that process); None if it is."""
    creds = peer_credentials(sock)
    if creds is None:
        return None
    peer_pid, peer_uid = creds
    if peer_uid != os.getuid():
        return f"the peer runs as uid {peer_uid}, not uid {os.getuid()}"
    if pid is not None and peer_pid != pid:
        return f"the peer is process {peer_pid}, not process {pid}"
    return None


def connect(address: AgentAddress, *, pid: int, timeout: float = 30.0) -> connection.Connection:
    """Connect to the agent that should be process ``pid`` and authenticate; raises
    :class:`AgentIdentityError` when the listener is another process or user (before anything is
    sent), OSError when no agent listens there or none answers within ``timeout`` seconds (one
    that is serving another training process)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address.address)
        why = _check_peer(sock, pid)
    except OSError:
        sock.close()
        raise
    if why is not None:
        sock.close()
        raise AgentIdentityError(f"the process listening at the agent's address is not the agent: {why}")
    _handshake_timeout(sock, max(timeout, HANDSHAKE_SECONDS))
    conn = connection.Connection(sock.detach())
    if not conn.poll(timeout):
        conn.close()
        raise TimeoutError(f"the agent at {address.address!r} did not answer within {timeout:.0f} s")
    try:
        connection.answer_challenge(conn, address.authkey.encode())  # type: ignore[attr-defined]
        connection.deliver_challenge(conn, address.authkey.encode())  # type: ignore[attr-defined]
    except (EOFError, OSError, connection.AuthenticationError) as e:
        conn.close()
        raise ConnectionRefusedError(f"the agent at {address.address!r} did not authenticate: {e}") from e
    _end_handshake(conn)
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


def send(conn: connection.Connection, msg: dict[str, Any]) -> None:
    """Send one message as JSON."""
    conn.send_bytes(json.dumps(_encode(msg), allow_nan=True).encode())


def recv(conn: connection.Connection) -> dict[str, Any]:
    """Receive one message; raises EOFError or OSError when the connection ends, ValueError when
    what arrived is not a message (nothing in it is run, whatever it holds)."""
    msg = _decode(json.loads(conn.recv_bytes(MAX_MESSAGE)))
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise ValueError("a message must be a JSON object with a string 'kind'")
    return msg


@dataclass(frozen=True)
class Plain:
    """A message field that is plain JSON already — dicts with string keys, lists, scalars, no
    tuples or layouts, as a state's skeleton is — sent as it is, without the walk that tags tuples
    and checks keys (a skeleton goes with every checkpoint, from a thread of the training process),
    and read back as it is, without the walk that untags them: whatever keys it holds, none of it
    is taken for a tag."""

    value: Any


def _encode(value: Any) -> Any:
    if isinstance(value, Plain):
        return {"$plain": value.value}
    if isinstance(value, TensorLayout):
        return {"$layout": [[e.key, str(e.dtype).removeprefix("torch."), list(e.shape), e.offset, e.nbytes]
                            for e in value.entries], "nbytes": value.nbytes}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or any(k.startswith("$") for k in value):
            raise TypeError(f"a message's dict keys must be plain strings, got {list(value)[:3]}")
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a message cannot carry a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "$plain" in value:
        return value["$plain"]
    if "$tuple" in value:
        return tuple(_decode(v) for v in value["$tuple"])
    if "$layout" in value:
        entries = []
        for key, dtype, shape, offset, nbytes in value["$layout"]:
            found = getattr(torch, str(dtype), None)
            if not isinstance(found, torch.dtype):
                raise ValueError(f"a tensor layout names an unknown dtype {dtype!r}")
            entries.append(LayoutEntry(str(key), found, tuple(int(n) for n in shape), int(offset), int(nbytes)))
        return TensorLayout(tuple(entries), int(value["nbytes"]))
    return {k: _decode(v) for k, v in value.items()}
