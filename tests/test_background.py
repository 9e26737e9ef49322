"""Background work: jobs run in order, a failure is raised once, a bounded worker holds the caller back."""

from __future__ import annotations

import threading

import pytest

from everystep.background import BackgroundErrors, Worker, settled
from everystep.errors import BackgroundWriteError


def test_jobs_run_in_order_and_futures_carry_results():
    errors, done = BackgroundErrors(), []
    worker = Worker("test-worker", errors)
    for i in range(5):
        worker.post("job", done.append, i)
    future = worker.submit("last", lambda: sum(done))
    assert future.result(timeout=10) == 10 and done == [0, 1, 2, 3, 4]
    worker.close()
    errors.raise_pending()  # nothing failed


def test_a_failure_is_raised_once_in_the_callers_thread_and_none_is_dropped():
    errors = BackgroundErrors()
    worker = Worker("test-worker", errors)

    def fail(message: str) -> None:
        raise OSError(message)

    first = worker.submit("writing step 3", fail, "disk full")
    worker.post("writing step 4", fail, "still full")
    worker.drain()
    settled(first)  # waiting on a failed future does not raise
    assert isinstance(first.exception(), OSError)
    with pytest.raises(BackgroundWriteError, match=r"writing step 3 failed: disk full \(and 1 more failed since: "
                                                   r"writing step 4\)") as raised:
        errors.raise_pending()
    assert isinstance(raised.value.__cause__, OSError)
    errors.raise_pending()  # raised once: quiet now
    worker.close()


def test_a_bounded_worker_holds_the_caller_back_while_it_is_behind():
    """The third post returns only once the worker has taken the second from its queue, which it does
    only once the first is done: the order of what each thread records says so, whatever the timing."""
    errors, release, taken = BackgroundErrors(), threading.Event(), threading.Event()
    order: list[str] = []
    worker = Worker("test-worker", errors, bound=1)
    worker.post("blocked", lambda: (taken.set(), release.wait(), order.append("first done")))
    assert taken.wait(10)  # the worker holds the first; the second fills the queue
    worker.submit("second", lambda: order.append("second done"))

    def post_third() -> None:
        release.set()  # the first may finish now; the third must wait for the second to be taken
        worker.post("third", lambda: order.append("third done"))
        order.append("third posted")

    posting = threading.Thread(target=post_third)
    posting.start()
    posting.join(timeout=10)
    worker.drain()
    assert not posting.is_alive()
    assert order.index("first done") < order.index("third posted")
    assert order.index("second done") < order.index("third done")
    worker.close()
