"""Helpers for the processes everystep starts beside a training process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from multiprocessing import connection

__all__ = ["die_with", "start_helper", "stop_helper", "run_helper"]


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


def run_helper(argv: list[str], serve: Callable[..., None]) -> int:
    """The body of a helper :func:`start_helper` started, given its arguments: ``serve(conn, *rest)``
    on the connection to its parent, which it dies with (and a crash point that fires here kills the
    parent first: the helper is part of the training process it serves). Its exit status."""
    from . import _faults

    parent = os.getppid()
    die_with(parent)
    _faults.crash_with(parent)
    conn = connection.Connection(int(argv[0]))
    try:
        serve(conn, *argv[1:])
    except (EOFError, ConnectionError):
        return 0  # the training process is gone: nothing to answer
    except BaseException:
        traceback.print_exc()
        return 1
    return 0
