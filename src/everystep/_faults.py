"""Named crash points for fault injection.

``crash_point("store.object.mid_write")`` does nothing unless that point is armed, either by the
environment (``EVERYSTEP_CRASH=name`` or ``name:N`` to fire at the N-th arrival, ``name:N+`` at it and
every one after) or by :func:`arm`.
An armed point kills the process with SIGKILL: no handler, no flush, exactly like an external kill.
``EVERYSTEP_FAIL`` arms points the same way to raise ``OSError(ENOSPC)`` instead, as a full disk
would; ``EVERYSTEP_DELAY=name=SECONDS`` to sleep there (a slow disk or a slow rank);
``EVERYSTEP_HOLD=name=PATH`` to wait there until the file ``PATH`` exists (a test opens the gate
when it has seen what it must see while the point is held). Any item may
end in ``@R`` to apply only to the process of rank R (environment variable ``RANK``). Child
processes (the checkpoint agent) inherit all of them.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["arm", "arm_from_environment", "disarm", "crash_point", "kill_self", "crash_with"]

_lock = threading.Lock()
_armed: dict[str, tuple[int, Callable[[], None], bool]] = {}
_with: int | None = None


def kill_self() -> None:
    if _with is not None:
        os.kill(_with, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def crash_with(pid: int) -> None:
    """A crash in this process kills process ``pid`` first: a helper process (the checkpoint
    writer) is part of the training process it serves, and a fault injected in it crashes both."""
    global _with
    _with = pid


def arm(name: str, *, after: int = 1, action: Callable[[], None] = kill_self, repeat: bool = False) -> None:
    """Fire ``action`` at the ``after``-th arrival at crash point ``name`` (``repeat``: and at
    every arrival after it)."""
    if after < 1:
        raise ValueError(f"after must be >= 1, got {after}")
    with _lock:
        _armed[name] = (after, action, repeat)


def disarm(name: str) -> None:
    with _lock:
        _armed.pop(name, None)


def crash_point(name: str) -> None:
    if not _armed:
        return
    with _lock:
        entry = _armed.get(name)
        if entry is None:
            return
        remaining, action, repeat = entry
        if remaining > 1:
            _armed[name] = (remaining - 1, action, repeat)
            return
        if not repeat:
            del _armed[name]
    action()


def disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def hold_until(path: str, poll: float = 0.01) -> None:
    """Wait until the file ``path`` exists."""
    while not os.path.exists(path):
        time.sleep(poll)


def arm_from_environment() -> None:
    """Arm the points the environment names (done at import; again in a process forked after its
    environment changed, as a rank forked from the supervisor's zygote)."""
    with _lock:
        _armed.clear()
    rank = os.environ.get("RANK", "0")
    for variable in ("EVERYSTEP_CRASH", "EVERYSTEP_FAIL", "EVERYSTEP_DELAY", "EVERYSTEP_HOLD"):
        for item in filter(None, (s.strip() for s in os.environ.get(variable, "").split(","))):
            item, _, only = item.partition("@")
            if only and only != rank:
                continue
            item, _, value = item.partition("=")
            name, _, count = item.partition(":")
            repeat = count.endswith("+")
            count = count.removesuffix("+")
            action = {"EVERYSTEP_CRASH": kill_self, "EVERYSTEP_FAIL": disk_full}.get(variable)
            if variable == "EVERYSTEP_HOLD":
                action = functools.partial(hold_until, value)
            elif action is None:
                action = functools.partial(time.sleep, float(value))
            arm(name, after=int(count) if count else 1, action=action, repeat=repeat)


arm_from_environment()
