"""Scripts that tests run in a process of their own (to SIGKILL it), forked from one warm process.

A new interpreter spends seconds of CPU importing torch before its first step (and its first optimizer
imports ``torch._dynamo``); a test that kills a training run pays that for every run. :func:`run_script`
instead forks the run from a zygote (:mod:`everystep.eval.zygote`, as the training driver forks its
ranks) that imported torch, everystep and this package once: a new process in all but the imports,
with the environment, the working directory and the arguments a fresh ``python -c`` would have.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Imported once, in the zygote, for every run forked from it: the scripts' own imports (the
# Checkpointer, every strategy and storage room, the training driver) would cost each run a fifth of
# a second of CPU.
import torch  # noqa: F401

import everystep.checkpointer  # noqa: F401
import everystep.eval.kills.train  # noqa: F401
import everystep.eval.workloads  # noqa: F401
import everystep.inventory  # noqa: F401
import everystep.storage.formats.dcp  # noqa: F401
from everystep.eval.zygote import Zygote, start_ranks

ROOT = Path(__file__).resolve().parents[1]
_ZYGOTE: list[Zygote] = []


def _zygote() -> Zygote | None:
    """This test process's zygote, started at the first call (None where one cannot run)."""
    if _ZYGOTE and _ZYGOTE[0].process.poll() is None:
        return _ZYGOTE[0]
    _close()  # (one that ended)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join((str(ROOT / "src"), str(ROOT)))  # (what it imports: tests.forked)
    try:
        found = start_ranks("tests.forked:main")
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    if found is not None:
        _ZYGOTE.append(found)
    return found


def _close() -> None:
    """End the zygote (at exit: it would end with this process, unwaited for)."""
    while _ZYGOTE:
        _ZYGOTE.pop().close()


atexit.register(_close)


def run_script(source: str, *args: str, env: dict[str, str] | None = None, cwd: Path | str | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -c SOURCE ARGS`` in ``env`` (default: this process's) and ``cwd``, forked from the
    zygote where one runs; its return code (``-9`` for SIGKILL) and its output (stdout and stderr
    together, in ``stdout``)."""
    return start_script(source, *args, env=env, cwd=cwd).wait(timeout)


class Started:
    """A script :func:`start_script` started, running."""

    def __init__(self, child: Any, output: Any, args: tuple[str, ...]) -> None:
        self.child, self.output, self.args = child, output, ["python", "-c", "…", *args]

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Its return code and its output, once it ends (TimeoutExpired, and killed, after ``timeout``)."""
        with self.output:
            code = _wait(self.child, timeout)
            if code is None:
                self.child.kill()
                self.child.wait()
                raise subprocess.TimeoutExpired(self.args, timeout, self.output.read())
            return subprocess.CompletedProcess(self.args, code, self.output.read(), None)


def wait_all(started: list[Started], timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Each script's :meth:`Started.wait`; once one ends in failure the others are killed (ranks of
    one job: they would wait for it in a collective until ``timeout``)."""
    deadline = time.monotonic() + timeout
    running = list(started)
    while running:
        if _wait(running[0].child, min(1.0, max(0.0, deadline - time.monotonic()))) is None:
            if time.monotonic() >= deadline:
                break  # (each one's wait says so)
            running.append(running.pop(0))  # (the next one's turn)
            continue
        if running.pop(0).child.poll() != 0:
            for other in running:
                other.child.kill()
    return [s.wait(max(0.0, deadline - time.monotonic())) for s in started]


def _wait(child: Any, timeout: float) -> int | None:
    """A forked or started child's exit status once it ends, None if it still runs after ``timeout`` s."""
    if hasattr(child, "wait_for"):
        return child.wait_for(timeout)
    try:
        return child.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def start_script(source: str, *args: str, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None) -> Started:
    """:func:`run_script`'s script, started and not waited for (the ranks of a job, each one)."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    output = tempfile.NamedTemporaryFile("r", suffix=".out")
    zygote = _zygote()
    if zygote is None:  # (not Linux: a fresh interpreter)
        with open(output.name, "w") as out:
            child = subprocess.Popen([sys.executable, "-c", source, *args], env=env, cwd=cwd, stdout=out,
                                     stderr=subprocess.STDOUT)
    else:
        child = zygote.fork(env, [output.name, cwd, source, *args])
    return Started(child, output, args)


def main(argv: list[str]) -> int:
    """In the forked child: output to the file named, into the working directory, run the script."""
    output, cwd, source, *args = argv
    fd = os.open(output, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.pop("EVERYSTEP_SUPERVISOR", None)  # (the zygote's pid, for the training driver's ranks)
    if os.environ.get("OMP_NUM_THREADS"):  # (read at torch's import, which the zygote did)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [*path, *(p for p in sys.path if p not in path)]
    sys.argv = ["-c", *args]
    exec(compile(source, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    return 0
