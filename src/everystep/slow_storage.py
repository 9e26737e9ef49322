"""Storage that is slow, or hangs, never takes training with it without a word: the training
thread's waits for checkpointing are said (:class:`WaitReport`), and ``close()`` waits for storage at
most its ``close_timeout`` (:func:`bounded`)."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from .errors import StorageTimeoutError

__all__ = ["WaitReport", "bounded", "status", "gave_up", "SAID_WAIT", "SAY_EVERY"]

SAID_WAIT = 1.0
"""Seconds of one call into everystep on the training thread from which it is said that training waited."""
SAY_EVERY = 60.0
"""After the first, at most one such warning a minute, with what training waited since the one before."""


class WaitReport:
    """Says that training waited for checkpointing: while a call into everystep on the training
    thread has lasted :data:`SAID_WAIT` seconds or more (a watching thread, which wakes at that pace
    and takes no part in the calls themselves), and when such a call ends — at once the first time,
    then at most every :data:`SAY_EVERY` seconds, each time with what training waited since the one
    before."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._said_at: float | None = None
        self._unsaid = 0.0
        self._count = 0
        self._call: tuple[float, int, Any] | None = None
        """The call in progress: when it began, its step, the stats."""
        self._watcher: threading.Thread | None = None
        self._closed = False

    def enter(self, step: int, stats: Any) -> None:
        """A call into everystep on the training thread begins."""
        self._call = (time.monotonic(), step, stats)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="everystep-wait-watch", daemon=True)
            self._watcher.start()

    def took(self, seconds: float, step: int, stats: Any) -> None:
        """The call at ``step`` ended, after ``seconds``; ``stats``: the Checkpointer's
        (:class:`~everystep.strategies.context.CheckpointStats`)."""
        self._call = None
        if seconds < SAID_WAIT:
            return
        with self._lock:
            self._unsaid += seconds
            self._count += 1
            self._say(f"training waited {self._unsaid:.1f} s for checkpointing, {seconds:.1f} s at step {step}", stats)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._watcher is not None:
            self._watcher.join()

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                self._lock.wait(SAID_WAIT)
                call = self._call
                if call is not None and (waited := time.monotonic() - call[0]) >= SAID_WAIT:
                    self._say(f"training has been waiting {waited:.0f} s for checkpointing at step {call[1]}", call[2],
                              latest=True)

    def _say(self, what: str, stats: Any, latest: bool = False) -> None:
        """Warn, unless one was said less than :data:`SAY_EVERY` seconds ago (under the lock)."""
        now = time.monotonic()
        if self._said_at is not None and now - self._said_at < SAY_EVERY:
            return
        since = f" ({self._count} wait(s) in the last {now - self._said_at:.0f} s)" \
            if self._said_at is not None and not latest else ""
        warnings.warn(f"{what}{since}: {status(stats)}; storage is slower than the steps — give memory=True (every "
                      "checkpoint in memory, storage as often as it takes) or a larger every", RuntimeWarning,
                      stacklevel=4)
        self._said_at, self._unsaid, self._count = now, 0.0, 0


def status(stats: Any) -> str:
    """What is durable and what only in memory, as the waits for storage say it."""
    durable, memory = stats.last_durable_step, stats.last_memory_step
    return f"the newest checkpoint on storage is of step {durable}" + (
        f", the newest in memory of step {memory}" if memory > durable else "")


def gave_up(stats: Any, strategy: Any, seconds: float) -> str:
    """Why ``close()`` gave up after ``seconds``: what is durable, what only in memory and where (the
    memory tier's region, or LightCheck's)."""
    durable, memory = stats.last_durable_step, stats.last_memory_step
    tier = strategy.tier.path if strategy.tier is not None else getattr(getattr(strategy, "region", None), "path", None)
    kept = (f"; step {memory} is only in memory{f', in {tier}' if tier else ''}: it outlives this process, not "
            "the host — restore() reads it once storage answers") if memory > durable else ""
    return (f"close() waited {seconds:.0f} s (close_timeout) for storage, which has not answered: the newest "
            f"checkpoint on storage is of step {durable}{kept}; a lost host would lose the steps after {durable}")


def bounded(work: Callable[[], None], seconds: float | None, why: Callable[[float], str]) -> None:
    """Run ``work()`` (the close's waits for storage) on a thread of its own, and wait for it at most
    ``seconds`` (None: for as long as it takes): its failure is raised here; past the bound,
    :class:`StorageTimeoutError` with ``why(seconds)``, the work left to finish, or not, on its own
    (a daemon thread: it does not keep the process alive). The thread works as the calling one would:
    with its grad mode, and on CUDA on its current device and stream (each thread has its own)."""
    import torch

    stream, grad = _current_stream(), torch.is_grad_enabled()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad):
                if stream is None:
                    work()
                else:
                    torch.cuda.set_device(stream.device)
                    with torch.cuda.stream(stream):
                        work()
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run, name="everystep-close", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise StorageTimeoutError(why(seconds or 0.0))
    if failed:
        raise failed[0]


def _current_stream() -> Any:
    import torch

    return torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
