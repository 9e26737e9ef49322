"""Asking a zygote (:mod:`everystep.eval.zygote`) for a child, and the handle on the child it forks.

A zygote and each process that asks it for children hold the two ends of a ``SOCK_SEQPACKET`` socket
pair, one message per request or report. A request is JSON ``{"env": {...}, "argv": [...]}`` (with
``"entry": AGENT_ENTRY`` where the child is a checkpoint agent, not the zygote's own entry point), the
asker's standard output and error attached (``SCM_RIGHTS``): the child writes where its asker writes
when it asks, not where the zygote's first asker wrote when it started. The zygote answers
``{"pid": N}`` for each request, in order, and ``{"exit": N, "code": C}`` as each child it forked for
this asker ends (``C`` as :attr:`subprocess.Popen.returncode`: ``-9`` for SIGKILL).

The zygote's own parent is its first asker (:class:`~everystep.eval.zygote.Zygote`). Each child
forked for that parent is handed an end of a pair of its own, named in its environment
(:data:`ENV`, with its pid: a fork of the child finds it is not its own), through which
:func:`inherited` asks for children of its own — a checkpoint agent, forked in a fraction of a second
where a fresh interpreter spends seconds importing torch. The zygote puts such a child in its asker's
process group, as a child the asker started itself would be, so that what kills the group (a lost
machine, simulated) kills it too, and what kills the asker alone (a crash) leaves it running.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import stat
import subprocess
import threading
import time

from .errors import EverystepError

__all__ = ["ENV", "AGENT_ENTRY", "Channel", "Forked", "inherited", "MAX_MESSAGE"]

ENV = "EVERYSTEP_ZYGOTE"
"""``FD:PID``: the descriptor of a forked child's end of its pair to the zygote, and that child's pid."""

AGENT_ENTRY = "everystep.agent.entry:forked"
"""The one entry point a request may name besides the zygote's own (:func:`everystep.agent.entry.forked`):
what is read from the socket chooses no other code to run."""

MAX_MESSAGE = 1 << 20
"""The largest request (an environment and arguments) or report read."""


class Channel:
    """The asker's end: :meth:`fork` asks for a child; children may be forked and waited for from
    several threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._started: list[int] = []
        self._pids: set[int] = set()
        self.codes: dict[int, int] = {}
        """Exit status of each child that ended, by pid."""
        self._lock = threading.Lock()
        """Held to send a request and to read the reports."""

    def fork(self, env: dict[str, str], argv: list[str], *, entry: str | None = None) -> "Forked":
        """A child that runs the zygote's entry point (or ``entry``) with ``argv``, in ``env``."""
        request = {"env": env, "argv": argv, **({"entry": entry} if entry else {})}
        streams, opened = [], []
        for fd in (1, 2):  # (one closed here: the child's is /dev/null)
            try:
                os.fstat(fd)
                streams.append(fd)
            except OSError:
                opened.append(os.open(os.devnull, os.O_WRONLY))
                streams.append(opened[-1])
        try:
            with self._lock:
                try:
                    socket.send_fds(self.sock, [json.dumps(request).encode()], streams)
                except OSError:
                    raise self.gone() from None
                while not self._started:
                    if not self._read():
                        raise self.gone()
                return Forked(self, self._started.pop(0))
        finally:
            for fd in opened:
                os.close(fd)

    def gone(self) -> EverystepError:
        return EverystepError("the process that forks the training processes is gone")

    def collect(self) -> None:
        """Take in the zygote's reports of children that ended, without waiting for more."""
        with self._lock, selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            while sel.select(0) and self._read():
                pass

    def _read(self) -> bool:
        """Read one report (waiting for it); False when the zygote is gone. Its children are then taken
        as killed with it: a job's ranks die with it; a child forked for a rank (its agent) may live
        on, but its status is no longer this process's to learn."""
        try:
            message = self.sock.recv(MAX_MESSAGE)
        except OSError:
            message = b""
        if not message:
            self.codes.update((pid, -signal.SIGKILL) for pid in self._pids if pid not in self.codes)
            return False
        report = json.loads(message)
        if "pid" in report:
            self._started.append(report["pid"])
            self._pids.add(report["pid"])
        else:
            self.codes[report["exit"]] = report["code"]
        return True


class Forked:
    """A child of the zygote, with the part of :class:`subprocess.Popen`'s interface its asker uses."""

    def __init__(self, channel: Channel, pid: int) -> None:
        self.channel = channel
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self.channel.codes.get(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.channel.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, as :meth:`subprocess.Popen.wait` (``TimeoutExpired`` after ``timeout`` s)."""
        code = self.wait_for(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not yet reaped by the zygote: the pid is still this child's
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait_for(self, timeout: float | None) -> int | None:
        """Its exit status once it ends, or None if it is still running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.returncode) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            with selectors.DefaultSelector() as sel:
                sel.register(self.channel.sock, selectors.EVENT_READ)
                if sel.select(left):
                    self.channel.collect()  # (what another thread has not read meanwhile)
        return code


_INHERITED: list[tuple[int, Channel]] = []


def inherited() -> Channel | None:
    """The channel to the zygote that forked this process (:data:`ENV`), or None: not forked from
    one, or a fork of the process it was handed to."""
    value = os.environ.get(ENV, "")
    fd, _, pid = value.partition(":")
    if not (fd.isdigit() and pid.isdigit()) or int(pid) != os.getpid():
        return None
    if _INHERITED and _INHERITED[0][0] == os.getpid():
        return _INHERITED[0][1]
    try:
        if not stat.S_ISSOCK(os.fstat(int(fd)).st_mode):
            return None
        sock = socket.socket(fileno=int(fd))
    except OSError:
        return None
    if sock.type != socket.SOCK_SEQPACKET or sock.family != socket.AF_UNIX:
        sock.detach()
        return None
    _INHERITED[:] = [(os.getpid(), Channel(sock))]
    return _INHERITED[0][1]
