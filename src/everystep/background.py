"""Background work, one idiom: a worker thread per job kind, failures kept and raised once.

A :class:`Worker` runs the jobs given to it in order on one thread. ``post`` hands over a job
that nobody waits for (a gradient copy, a record for the writer); ``submit`` returns a
:class:`~concurrent.futures.Future` for a job that another one depends on (a snapshot the persist
waits for). A worker may be bounded: ``post`` and ``submit`` then block while ``bound`` jobs are
waiting, which is how memory stays bounded and training feels backpressure.

Every job's failure goes to the :class:`BackgroundErrors` the worker was made with, which raises
it in the training thread once (the strategy's next call). A future also carries its job's
failure, so that a job that depends on it can tell; waiting on it with :meth:`Worker.drain` or
:func:`settled` does not raise it a second time.

Work that several threads share at once — copies and hashes, which release the interpreter's lock —
is dealt out to them by size (:func:`in_shares`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any, TypeVar

from . import tracing
from .errors import BackgroundWriteError

__all__ = ["BackgroundErrors", "Worker", "settled", "in_shares"]


class BackgroundErrors:
    """Keeps every failure of background work and raises them, once, in the training thread.

    The first failure is raised as the cause; any others that happened before the raise are
    named in the same message, so no failure is ever dropped.
    """

    def __init__(self) -> None:
        self._errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()

    def record(self, what: str, error: BaseException) -> None:
        with self._lock:
            self._errors.append((what, error))

    def raise_pending(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if not errors:
            return
        (what, first), rest = errors[0], errors[1:]
        message = f"{what} failed: {first}"
        if rest:
            message += f" (and {len(rest)} more failed since: " + "; ".join(w for w, _ in rest) + ")"
        raise BackgroundWriteError(message) from first


def settled(*futures: Future[Any] | None) -> None:
    """Wait until every given future is done, without raising what it failed with."""
    pending = [f for f in futures if f is not None]
    if pending:
        wait(pending)


_STOP = object()


class Worker:
    """One thread that runs jobs in the order they are given (see the module docstring)."""

    def __init__(self, name: str, errors: BackgroundErrors, *, bound: int = 0) -> None:
        self.name = name
        self.errors = errors
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=bound)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def post(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in turn; a failure is recorded as ``what`` failed."""
        self._jobs.put((what, fn, args, None))

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """:meth:`post`, with a future that holds the result or the failure."""
        future: Future[Any] = Future()
        self._jobs.put((what, fn, args, future))
        return future

    def drain(self) -> None:
        """Block until every job given so far has run."""
        self._jobs.join()

    def close(self, *, wait: bool = True) -> None:
        """Run what was given, then end the thread (``wait=False``: do not wait for it to end)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_STOP)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            what, fn, args, future = job
            try:
                if future is None or future.set_running_or_notify_cancel():
                    with tracing.job(what):
                        result = fn(*args)
                    if future is not None:
                        future.set_result(result)
            except BaseException as e:
                self.errors.record(what, e)
                if future is not None:
                    future.set_exception(e)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()


T = TypeVar("T")


def in_shares(pool: Executor, sizes: Sequence[int], work: Callable[[int], T], shares: int) -> list[T]:
    """``work(i)`` for each index ``i`` of ``sizes``, the indices dealt into ``shares`` groups of about
    the same total size (largest first, each to the group that holds least so far), one group on this
    thread and each other on one of ``pool``'s; the results in the order of ``sizes``."""
    groups: list[list[int]] = [[] for _ in range(shares)]
    loads = [0] * shares
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        least = loads.index(min(loads))
        groups[least].append(i)
        loads[least] += sizes[i]

    def run(group: list[int]) -> list[tuple[int, T]]:
        return [(i, work(i)) for i in group]

    futures = [pool.submit(run, g) for g in groups[1:] if g]
    done = dict(run(groups[0]))
    for f in futures:
        done.update(f.result())
    return [done[i] for i in range(len(sizes))]
