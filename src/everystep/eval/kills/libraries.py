"""The kill-and-resume harness run over the checkpointing libraries (:mod:`everystep.eval.bench.libraries`):
does a library recover at all after a SIGKILL that lands while its write is in flight, how many
finished steps it loses, and does training then go on bitwise as the uninterrupted run does.

Each library trains the workload in a process of its own, checkpointing every step (and writing to
disk every ``disk_every`` steps where it keeps checkpoints in memory), and that process kills itself
(SIGKILL, as a crash or the out-of-memory killer would) right after the save call of step
``kill_at`` returns, with that save's write under way in the background. A second process restores
what the library finds, as a restarted job would, and trains on to ``steps``; its losses and final
state are compared with a run that never stopped. everystep's own strategies go through the same
trial in ``everystep train --fail-at`` (``tests/test_strategies.py``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from ...tree import state_hash

__all__ = ["kill_and_resume", "Trial"]

Trial = dict[str, Any]
"""What one trial found: ``recovered`` (the step restored, or None), ``lost`` (finished steps lost),
``bitwise`` (losses and final state as the uninterrupted run's), ``error`` (why it did not recover)."""


def _final(w: Any, step: int) -> str:
    return state_hash({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict(),
                       "scheduler": w.scheduler.state_dict(), "step": step})


def _train(w: Any, start: int, stop: int, after: Any = None, before: Any = None) -> list[float]:
    losses = []
    for step in range(start + 1, stop + 1):
        loss = w.loss(w.data.next())
        loss.backward()
        w.update(before=before)
        losses.append(loss.item())
        if after is not None:
            after(step)
    return losses


def _reference(workload: str, steps: int, out: str) -> None:
    """The uninterrupted run, in a process set up as the trial's are."""
    from ..workloads import build

    w = build(workload, seed=0)
    losses = _train(w, 0, steps)
    Path(out).write_text(json.dumps({"losses": losses, "final": _final(w, steps)}))


def _first_life(name: str, workload: str, directory: str, kill_at: int, disk_every: int) -> None:
    """Train to ``kill_at`` with the library, then die by SIGKILL right after its save."""
    from ..bench import libraries
    from ..workloads import build

    libraries.DISK_EVERY = disk_every
    w = build(workload, seed=0)
    adapter = libraries.LIBRARIES[name](Path(directory), w, 1)

    def after(step: int) -> None:
        adapter.after_step(step)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    _train(w, 0, kill_at, after, adapter.before_update)


def _second_life(name: str, workload: str, directory: str, steps: int, disk_every: int, out: str) -> None:
    """Restore what the library finds, train on to ``steps``; write what happened to ``out``."""
    from ..bench import libraries
    from ..workloads import build

    libraries.DISK_EVERY = disk_every
    w = build(workload, seed=0)
    found: dict[str, Any] = {"recovered": None, "error": None}
    try:
        adapter = libraries.LIBRARIES[name](Path(directory), w, 1)
        found["recovered"] = adapter.resume(w)
    except Exception as e:  # the library's own error: what a restarted job would see
        found["error"] = f"{type(e).__name__}: {e}"
    else:
        start = found["recovered"] or 0
        found["losses"] = _train(w, start, steps, adapter.after_step, adapter.before_update)
        found["final"] = _final(w, steps)
        adapter.close()
    Path(out).write_text(json.dumps(found))


def kill_and_resume(name: str, *, workload: str = "mlp", steps: int = 12, kill_at: int = 7,
                    disk_every: int = 2) -> Trial:
    """One trial of library ``name`` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix=f"everystep-kill-{name}-") as tmp:
        directory, out, ref = os.path.join(tmp, "ckpt"), os.path.join(tmp, "second.json"), os.path.join(tmp, "ref.json")
        if _run(["reference", workload, str(steps), ref], tmp)[0] != 0:
            raise RuntimeError(f"{name}: the uninterrupted run failed")
        reference = json.loads(Path(ref).read_text())
        losses, final = reference["losses"], reference["final"]
        # (what the killed process started, DLRover's saver among them, lives on through the restart,
        # as it would after a crash; it is ended with the trial)
        first, group = _run(["first", name, workload, directory, str(kill_at), str(disk_every)], tmp, keep=True)
        try:
            if first != -signal.SIGKILL:
                raise RuntimeError(f"{name}: the first life ended with {first}, not SIGKILL")
            second, _ = _run(["second", name, workload, directory, str(steps), str(disk_every), out], tmp)
            if second != 0 or not os.path.exists(out):
                raise RuntimeError(f"{name}: the restarted process ended with {second}")
        finally:
            _end(group)
        found = json.loads(Path(out).read_text())
    recovered = found["recovered"]
    trial: Trial = {"library": name, "kill_at": kill_at, "disk_every": disk_every, "recovered": recovered,
                    "lost": None if found["error"] else kill_at - (recovered or 0), "error": found["error"],
                    "bitwise": None}
    if found["error"] is None:
        start = recovered or 0
        trial["bitwise"] = found["losses"] == losses[start:] and found["final"] == final
    return trial


def _run(argv: list[str], tmp: str, *, keep: bool = False) -> tuple[int, int]:
    """Run one role in a process group of its own, its output to a file (a process it leaves behind
    would hold a pipe open); its exit status and its group, which is ended here unless ``keep``."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                                     os.environ.get("PYTHONPATH")]))}
    log = os.path.join(tmp, f"{argv[0]}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "everystep.eval.kills.libraries", *argv], env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=600)
    finally:
        if not keep:
            _end(proc.pid)
    if code not in (0, -signal.SIGKILL):
        sys.stderr.write(Path(log).read_text(errors="replace")[-4000:])
    return code, proc.pid


def _end(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    import torch

    from ...errors import quiet_imports

    quiet_imports()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    role, *rest = sys.argv[1:]
    if role == "reference":
        _reference(rest[0], int(rest[1]), rest[2])
    elif role == "first":
        _first_life(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]))
    else:
        _second_life(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]), rest[5])
