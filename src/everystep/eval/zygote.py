"""The ranks of a supervised job, forked from one process that imported torch and everystep once.

A new interpreter per rank and per lifetime spends seconds importing torch before it trains a step
(more when the ranks of a job start together on a machine of a few cores). The supervisor instead
starts one *zygote* per job: a process that imports the module of the entry point it is given
(``module:function``; the training driver's ``worker_main``), and torch's compiler, which a
rank's first optimizer would import, and then only forks. Each
rank's lifetime is a child forked from it — a new process in all but the imports: its own session
(as ``start_new_session``), its own environment, stdin on ``/dev/null``. The zygote runs no torch
operation, so no thread pool is lost in the fork, and it dies with the supervisor (``PR_SET_PDEATHSIG``
and the end of its request pipe), its children with it (the worker's own ``PR_SET_PDEATHSIG``).

It needs Linux's ``pidfd_open`` (to wait on children and requests together); elsewhere
:func:`start_ranks` returns ``None`` and the supervisor starts a new interpreter per rank.

Protocol: one JSON line per request on the zygote's stdin (``{"env": {...}, "argv": [...]}``); on
the reply pipe, ``{"pid": N}`` for each request in order and ``{"exit": N, "code": C}`` as each
child ends (``C`` as :attr:`subprocess.Popen.returncode`: ``-9`` for SIGKILL).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._process import die_with, exit_after
from ..errors import EverystepError

__all__ = ["Zygote", "Forked", "start_ranks", "shared", "report_entry"]


class Forked:
    """A child of the zygote, with the part of :class:`subprocess.Popen`'s interface the supervisor uses."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.codes.get(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.collect()
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
                sel.register(self.zygote._replies, selectors.EVENT_READ)
                if sel.select(left):
                    self.zygote.collect()  # (what another thread has not read meanwhile)
        return code


class Zygote:
    """The supervisor's end: :meth:`fork` starts a child; :meth:`close` ends the zygote. Its children
    may be started and waited for from several threads."""

    def __init__(self, entry: str) -> None:
        """``entry``: ``module:function``, what each child runs with its ``argv``."""
        reply_r, reply_w = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "everystep.eval.zygote", str(reply_w), str(os.getpid()), entry],
                stdin=subprocess.PIPE, pass_fds=(reply_w,), start_new_session=True)
        finally:
            os.close(reply_w)
        self._replies = reply_r
        self._pending = b""
        self._started: list[int] = []
        self._pids: set[int] = set()
        self.codes: dict[int, int] = {}
        """Exit status of each child that ended, by pid."""
        self._lock = threading.Lock()
        """Held to write a request and read the replies."""

    def fork(self, env: dict[str, str], argv: list[str]) -> Forked:
        """A child that runs the entry point with ``argv``, in ``env``."""
        assert self.process.stdin is not None
        with self._lock:
            try:
                self.process.stdin.write(json.dumps({"env": env, "argv": argv}).encode() + b"\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                raise self._gone() from None
            while not self._started:
                if not self._read():
                    raise self._gone()
            return Forked(self, self._started.pop(0))

    def _gone(self) -> EverystepError:
        return EverystepError(f"the process that starts the training processes ended (exit status {self.process.wait()})")

    def collect(self) -> None:
        """Take in the zygote's reports of children that ended, without waiting for more."""
        with self._lock, selectors.DefaultSelector() as sel:
            sel.register(self._replies, selectors.EVENT_READ)
            while sel.select(0) and self._read():
                pass

    def _read(self) -> bool:
        """Read what the zygote sent (waiting for something); False when it is gone (its children
        were killed with it)."""
        chunk = os.read(self._replies, 1 << 16)
        if not chunk:
            self.codes.update((pid, -signal.SIGKILL) for pid in self._pids if pid not in self.codes)
            return False
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        for line in lines:
            report = json.loads(line)
            if "pid" in report:
                self._started.append(report["pid"])
                self._pids.add(report["pid"])
            else:
                self.codes[report["exit"]] = report["code"]
        return True

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """End the zygote (its children, if any are left, die with it)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()
        os.close(self._replies)


def start_ranks(entry: str) -> Zygote | None:
    """A zygote for a job's ranks running ``entry``, or None where one cannot run (not Linux)."""
    if not hasattr(os, "pidfd_open") or not hasattr(selectors, "EpollSelector"):
        return None
    return Zygote(entry)


_SHARED: dict[str, tuple[tuple[Any, ...], Zygote]] = {}


_READ_AT_IMPORT = ("TORCH", "OMP_", "MKL_", "CUDA", "NCCL_", "GLOO_", "PYTHON", "LD_")
"""The environment variables a zygote's interpreter and imports may read once, at their start (by
name prefix): torch's and its libraries'. everystep reads its own where it uses them, and a forked
child arms the crash points its environment names (:func:`_child`)."""

_SET_BY_TORCH = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
"""Set in this process by torch itself (the first time its compiler's cache is named), read where used."""


def _context() -> tuple[Any, ...]:
    """What a zygote started now would inherit: this process's standard output and error (its
    children write there) and the environment its imports read (:data:`_READ_AT_IMPORT`)."""
    found: list[Any] = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            found.append((st.st_dev, st.st_ino))
        except OSError:
            found.append(None)
    return (*found, tuple(sorted((k, v) for k, v in os.environ.items()
                                 if k.startswith(_READ_AT_IMPORT) and k not in _SET_BY_TORCH)))


def shared(entry: str) -> Zygote | None:
    """The zygote this process forks every run of ``entry`` from, started at the first call and ended
    at exit (a run's children are new processes in all but their imports: nothing of one run is left
    in the zygote for the next). A new one replaces it when this process's standard output, error or
    environment changed since it started (:func:`_context`): a run forks from a zygote as if it had
    started it itself. None where one cannot run."""
    context = _context()
    held = _SHARED.get(entry)
    if held is not None and (held[0] != context or held[1].process.poll() is not None):
        del _SHARED[entry]
        held[1].close()
        held = None
    if held is None:
        found = start_ranks(entry)
        if found is None:
            return None
        if not _SHARED:
            atexit.register(_close_shared)
        held = _SHARED[entry] = (context, found)
    return held[1]


def _close_shared() -> None:
    """At exit: end the zygotes (they would end with this process, unwaited for)."""
    while _SHARED:
        _SHARED.popitem()[1][1].close()


def report_entry(measure: Callable[[dict[str, Any]], dict[str, Any]], argv: list[str]) -> int:
    """A child that measures: ``argv`` is the spec (JSON), where its report goes and where its output
    goes (stdout and stderr both); the report is written whole or not at all."""
    spec, report, output = json.loads(argv[0]), argv[1], argv[2]
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    result = json.dumps(measure(spec))
    with open(report + ".tmp", "w") as f:
        f.write(result)
    os.replace(report + ".tmp", report)
    return 0


def _child(request: dict[str, Any], inherited: list[int], entry: Callable[[list[str]], int]) -> None:
    """In the forked child: become a rank's process and run it; never returns."""
    def become() -> int:
        os.setsid()
        for fd in inherited:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        from .._faults import arm_from_environment

        arm_from_environment()  # read at import, in the zygote's environment: this rank's is another
        return entry(request["argv"])

    exit_after(become)


def main(argv: list[str]) -> None:
    reply_fd, supervisor, (module, _, function) = int(argv[0]), int(argv[1]), argv[2].partition(":")
    die_with(supervisor)
    entry = getattr(importlib.import_module(module), function)  # the imports every rank needs, done once
    if "torch" in sys.modules:
        # Imported by the first optimizer a process builds (torch.optim's constructor is wrapped to
        # keep torch.compile out, and the wrapper imports the compiler at its first call): a second
        # or more of each rank's start. It starts no thread.
        importlib.import_module("torch._dynamo")

    replies = os.fdopen(reply_fd, "wb", buffering=0)
    sel = selectors.EpollSelector()
    sel.register(0, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd != 0:  # a child's pidfd: it ended
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(key.data, 0)
                replies.write(json.dumps({"exit": key.data, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the supervisor is done (or gone): children still running die with this process
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                request["env"]["EVERYSTEP_SUPERVISOR"] = str(os.getpid())
                inherited = [reply_fd, sel.fileno(), *(k.fd for k in sel.get_map().values() if k.fd != 0)]
                pid = os.fork()
                if pid == 0:
                    _child(request, inherited, entry)
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
                replies.write(json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    main(sys.argv[1:])
