"""The ranks of a supervised job, forked from one process that imported torch and everystep once.

A new interpreter per rank and per lifetime spends seconds importing torch before it trains a step
(more when the ranks of a job start together on a machine of a few cores). The supervisor instead
starts one *zygote* per job: a process that imports the module of the entry point it is given
(``module:function``; the training driver's ``worker_main``), and torch's compiler, which a
rank's first optimizer would import, and then only forks. Each rank's lifetime is a child forked
from it — a new process in all but the imports: its own process group (in the zygote's session, as
``start_new_session`` gives the zygote), its own environment, stdin on ``/dev/null``, standard output
and error where the supervisor's are when it asks. The zygote runs no torch operation, so no thread
pool is lost in the fork, and it dies with the supervisor (``PR_SET_PDEATHSIG`` and the end of its
socket), its ranks with it (the worker's own ``PR_SET_PDEATHSIG``).

A rank may ask the zygote for a child of its own (:func:`everystep._forking.inherited`): its
checkpoint agent, forked into the rank's process group instead of a fresh interpreter's seconds of
imports. Such a child does not die with the zygote: like an agent the rank started itself, it
outlives a crashed rank and dies with a lost machine's group.

It needs Linux's ``pidfd_open`` (to wait on children and requests together); elsewhere
:func:`start_ranks` returns ``None`` and the supervisor starts a new interpreter per rank.

The protocol, messages on a socket pair per asker, is :mod:`everystep._forking`'s.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import selectors
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .._forking import AGENT_ENTRY, ENV, MAX_MESSAGE, Channel, Forked
from .._process import die_with, exit_after
from ..errors import EverystepError, quiet_imports

__all__ = ["Zygote", "Forked", "start_ranks", "shared", "report_entry"]


class Zygote(Channel):
    """The supervisor's end: :meth:`fork` starts a child; :meth:`close` ends the zygote."""

    def __init__(self, entry: str) -> None:
        """``entry``: ``module:function``, what each child runs with its ``argv``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "everystep.eval.zygote", str(theirs.fileno()), str(os.getpid()), entry],
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        super().__init__(ours)

    def gone(self) -> EverystepError:
        return EverystepError(f"the process that starts the training processes ended "
                              f"(exit status {self.process.wait()})")

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """End the zygote (its children, if any are left, die with it)."""
        if self.sock.fileno() != -1:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self.process.wait()
        self.sock.close()


def start_ranks(entry: str) -> Zygote | None:
    """A zygote for a job's ranks running ``entry``, or None where one cannot run (not Linux)."""
    if not hasattr(os, "pidfd_open") or not hasattr(selectors, "EpollSelector"):
        return None
    return Zygote(entry)


_SHARED: dict[str, tuple[tuple[tuple[str, str], ...], Zygote]] = {}


_READ_AT_IMPORT = ("TORCH", "OMP_", "MKL_", "CUDA", "NCCL_", "GLOO_", "PYTHON", "LD_")
"""The environment variables a zygote's interpreter and imports may read once, at their start (by
name prefix): torch's and its libraries'. everystep reads its own where it uses them, and a forked
child arms the crash points its environment names (:func:`_child`)."""

_SET_BY_TORCH = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
"""Set in this process by torch itself (the first time its compiler's cache is named), read where used."""


def _context() -> tuple[tuple[str, str], ...]:
    """What a zygote started now would inherit that its children do not take anew: the environment
    its imports read (:data:`_READ_AT_IMPORT`). (Each child writes where its asker writes at the time.)"""
    return tuple(sorted((k, v) for k, v in os.environ.items()
                        if k.startswith(_READ_AT_IMPORT) and k not in _SET_BY_TORCH))


def shared(entry: str) -> Zygote | None:
    """The zygote this process forks every run of ``entry`` from, started at the first call and ended
    at exit (a run's children are new processes in all but their imports: nothing of one run is left
    in the zygote for the next). A new one replaces it when what its imports read of this process's
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


class _Asker:
    """One that asks the zygote for children: its end of their pair, and its pid (None: the zygote's
    parent, whose children each get a process group and a pair of their own)."""

    def __init__(self, sock: socket.socket, pid: int | None) -> None:
        self.sock, self.pid, self.open = sock, pid, True

    def report(self, report: dict[str, Any]) -> None:
        """Send ``report``; to a child that asked, only what its socket takes now (it may not be
        reading), nothing once it is gone."""
        if self.open:
            try:
                self.sock.send(json.dumps(report).encode(), 0 if self.pid is None else socket.MSG_DONTWAIT)
            except OSError:
                pass


def _entry(name: str) -> Callable[[list[str]], int]:
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _group_of(pid: int) -> int:
    """The process group a child asked for by ``pid`` joins: ``pid``'s (0, a group of its own, once
    ``pid`` is gone)."""
    try:
        return os.getpgid(pid)
    except OSError:
        return 0


def _child(env: dict[str, str], argv: list[str], streams: list[int], group: int, inherited: list[int],
           entry: str) -> None:
    """In the forked child: become the process asked for and run it; never returns."""
    def become() -> int:
        try:
            os.setpgid(0, group)
        except OSError:  # (the asker's group ended meanwhile)
            os.setpgid(0, 0)
        for fd in inherited:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for target, fd in zip((1, 2), streams):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        from .._faults import arm_from_environment

        arm_from_environment()  # read at import, in the zygote's environment: this child's is another
        return _entry(entry)(argv)

    exit_after(become)


def _serve(asker: _Asker, sel: selectors.BaseSelector, default: str) -> bool:
    """Fork the child ``asker`` asks for; False when it is gone (its socket closed, or what it sent
    is not a request, or names an entry point other than the zygote's or an agent's: it is then no
    longer listened to)."""
    try:
        message, streams, _, _ = socket.recv_fds(asker.sock, MAX_MESSAGE, 2)
    except OSError:
        message, streams = b"", []
    try:
        request = json.loads(message)
        entry, env, argv = request.get("entry", default), dict(request["env"]), list(request["argv"])
        if entry not in (default, AGENT_ENTRY):
            raise ValueError(entry)
    except (ValueError, KeyError, TypeError, AttributeError):  # (gone, or not a request: it is not answered)
        for fd in streams:
            os.close(fd)
        sel.unregister(asker.sock)
        asker.sock.close()
        asker.open = False
        return False
    env.pop(ENV, None)
    try:
        _entry(entry)  # (imported here once for every child that runs it; a failure is the child's to report)
    except Exception:
        pass
    pair = None
    if asker.pid is None:  # a rank: a group of its own, and a pair to ask for its own children on
        pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env["EVERYSTEP_SUPERVISOR"] = str(os.getpid())
        group = 0
    else:  # a rank's agent: in the rank's group, as a child the rank started would be
        group = _group_of(asker.pid)
    inherited = [sel.fileno(), *(k.fd for k in sel.get_map().values()), *([pair[0].fileno()] if pair else [])]
    pid = os.fork()
    if pid == 0:
        if pair is not None:
            env[ENV] = f"{pair[1].fileno()}:{os.getpid()}"
        _child(env, argv, streams, group, inherited, entry)
    for fd in streams:
        os.close(fd)
    try:
        os.setpgid(pid, group or pid)  # (here as well as in the child: a signal to the group right after finds it)
    except OSError:
        pass
    sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, asker))
    if pair is not None:
        pair[1].close()
        sel.register(pair[0], selectors.EVENT_READ, _Asker(pair[0], pid))
    asker.report({"pid": pid})
    return True


def main(argv: list[str]) -> None:
    fd, supervisor, default = int(argv[0]), int(argv[1]), argv[2]
    die_with(supervisor)
    quiet_imports()  # (before torch is imported: it may warn as it imports)
    _entry(default)  # the imports every rank needs, done once
    if "torch" in sys.modules:
        # Imported by the first optimizer a process builds (torch.optim's constructor is wrapped to
        # keep torch.compile out, and the wrapper imports the compiler at its first call): a second
        # or more of each rank's start. It starts no thread.
        importlib.import_module("torch._dynamo")

    sel = selectors.EpollSelector()
    parent = _Asker(socket.socket(fileno=fd), None)
    sel.register(parent.sock, selectors.EVENT_READ, parent)
    while True:
        for key, _ in sel.select():
            if isinstance(key.data, _Asker):
                if not _serve(key.data, sel, default) and key.data is parent:
                    return  # the supervisor is done (or gone): ranks still running die with this process
                continue
            pid, asker = key.data  # a child's pidfd: it ended
            sel.unregister(key.fd)
            os.close(key.fd)
            _, status = os.waitpid(pid, 0)
            asker.report({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main(sys.argv[1:])
