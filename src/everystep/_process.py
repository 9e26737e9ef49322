"""Helpers for the processes everystep starts beside a training process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing import connection
from typing import Any, NoReturn

__all__ = ["die_with", "exit_after", "start_helper", "stop_helper", "run_helper", "HelperClient"]


def start_helper(code: str, *args: str, pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen[bytes], connection.Connection]:
    """Start ``python -c code <fd> *args`` — a fresh interpreter, never a fork of a process that may
    hold a CUDA context — and the connection to it: one end of a socket pair made before it starts,
    whose other end it finds as descriptor ``<fd>`` (nothing else can reach it). ``pass_fds``: more
    descriptors it inherits, under the same numbers."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), *args],
                                   pass_fds=(theirs.fileno(), *pass_fds), stdin=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, connection.Connection(ours.detach())


class HelperClient:
    """The training process's side of a helper :func:`start_helper` starts: asked one JSON message at a
    time and answered with one (:meth:`ask`, from any thread), started again at the next question
    when it died. A helper that exits or cannot be reached is ``failure(f"{name} exited with status
    N")`` (or ``… cannot be reached``); what the answer says is the caller's to read."""

    def __init__(self, code: str, *args: str, pass_fds: tuple[int, ...] = (), name: str,
                 failure: type[Exception], stop_wait: float = 60.0) -> None:
        self._code, self._args, self._pass_fds = code, args, pass_fds
        self._name, self._failure, self._stop_wait = name, failure, stop_wait
        self._talk = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: connection.Connection | None = None

    def start(self) -> None:
        """Start the helper if it is not running (its failure to start is raised here)."""
        with self._talk:
            self._running()

    def _running(self) -> None:
        if self._process is None or self._process.poll() is not None:
            self._stop()
            self._process, self._conn = start_helper(self._code, *self._args, pass_fds=self._pass_fds)
            self._started()

    def _started(self) -> None:
        """A new helper started (under the lock): what the one before was told is gone with it."""

    def ask(self, message: dict[str, Any] | Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Send ``message`` (or what it makes, once the helper is known to run) and return the answer."""
        with self._talk:
            self._running()
            assert self._process is not None and self._conn is not None
            try:
                self._conn.send_bytes(json.dumps(message() if callable(message) else message).encode())
                while not self._conn.poll(1.0):  # (a watch on the child, not a synchronisation)
                    if self._process.poll() is not None:
                        break  # the read that follows reports how it exited
                    if _stopped(self._process.pid):  # (SIGSTOP: it would never answer, and nothing would say so)
                        self._stop(wait=0)
                        raise self._failure(f"{self._name} was stopped (SIGSTOP?) while asked: ended, and started "
                                            "again at the next question")
                answer: dict[str, Any] = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                status = self._process.poll()
                how = f"exited with status {status}" if status is not None else "cannot be reached"
                self._stop()
                raise self._failure(f"{self._name} {how}") from None
        return answer

    def close(self, *, wait: bool = True) -> None:
        """Ask the helper to exit once the question in flight (if any) is answered, and wait for it
        (``wait=False``: end it now)."""
        if not wait:
            self._stop(wait=0)
            return
        with self._talk:
            if self._conn is not None:
                try:
                    self._conn.send_bytes(b'{"close": true}')
                except OSError:
                    pass
            self._stop()

    def _stop(self, *, wait: float | None = None) -> None:
        if self._process is not None and self._conn is not None:
            stop_helper(self._process, self._conn, wait=self._stop_wait if wait is None else wait)
        self._process = self._conn = None


def stop_helper(process: subprocess.Popen[bytes], conn: connection.Connection, *, wait: float = 60.0) -> None:
    """Close the connection to a helper :func:`start_helper` started (which it reads as its end) and
    wait up to ``wait`` seconds for it to exit, then kill it (``wait=0``: kill it now)."""
    conn.close()
    try:
        if not wait:
            raise subprocess.TimeoutExpired(process.args, 0)
        process.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def die_with(parent: int) -> None:
    """Have the kernel kill this process when ``parent`` dies (Linux: ``PR_SET_PDEATHSIG``); a parent
    already gone (this process reparented) ends it now."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def exit_after(work: Callable[[], int]) -> NoReturn:
    """``work()``, then end the process with its return code (a ``SystemExit``'s code; 1, its
    traceback printed, for any other exception), the output flushed, without the interpreter's
    teardown or exit handlers: for a forked child (its parent's handlers are not its own), and for a
    process that closed what it wrote itself."""
    code = 1
    try:
        code = work()
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_helper(argv: list[str], serve: Callable[..., None], role: str) -> int:
    """The body of a helper :func:`start_helper` started, given its arguments: ``serve(conn, *rest)``
    on the connection to its parent, which it dies with (and a crash point that fires here kills the
    parent first: the helper is part of the training process it serves). Its spans are traced as
    ``role`` where its parent's are (:func:`everystep.tracing.start_from_env`). Its exit status."""
    from . import _faults, tracing

    parent = os.getppid()
    die_with(parent)
    _faults.crash_with(parent)
    conn = connection.Connection(int(argv[0]))
    tracing.start_from_env(role)
    try:
        serve(conn, *argv[1:])
    except (EOFError, ConnectionError):
        return 0  # the training process is gone: nothing to answer
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        tracing.stop()
    return 0


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (by SIGSTOP, or traced), as the kernel says."""
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False

