"""Several ranks: committing the checkpoints whose parts the ranks' agents write.

Each rank's agent writes its rank's part of a marked step's full checkpoint and reports it
(``part``); the training process commits it with the other ranks' parts (a collective on the
``full`` channel, :func:`~everystep.storage.formats.sharded.commit_written`). Every rank's committer
commits the same steps in the same order, on a worker of its own, so that training never waits
for a commit. A part that does not come within the timeout, or an agent lost meanwhile, makes
the commit fail on every rank; the checkpoint is then not committed, and a warning says so.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..background import BackgroundErrors, Worker
from ..errors import BackgroundWriteError, PeerFailedError
from ..storage import ObjectInfo, CheckpointDirectory
from ..storage.formats import commit_written
from .client import AgentLostError

__all__ = ["PartCommits"]


class PartCommits:
    """Commits, in order, the steps :meth:`expect` names, once :meth:`deliver` brought this rank's part.

    ``lost()`` says why the agent is lost (``None``: it is not); ``lose(reason)`` marks it lost;
    ``committed(step, seconds)`` is told of each checkpoint committed.
    """

    def __init__(self, directory: CheckpointDirectory, *, rank: int, keep: int, timeout: float, errors: BackgroundErrors,
                 lost: Callable[[], str | None], lose: Callable[[str], None],
                 committed: Callable[[int, float], None]) -> None:
        self.directory, self.rank, self.keep, self.timeout = directory, rank, keep, timeout
        self._lost, self._lose, self._committed = lost, lose, committed
        self._parts: dict[int, dict[str, Any]] = {}
        self._ready = threading.Condition()
        self._worker = Worker("everystep-agent-commit", errors)

    def expect(self, step: int) -> None:
        """The agent will write its part of ``step``: commit it when it comes."""
        self._worker.post(f"the commit of the agents' checkpoint of step {step}", self._commit, step)

    def deliver(self, msg: dict[str, Any]) -> None:
        """The agent's ``part`` message (its reader thread)."""
        with self._ready:
            self._parts[msg["step"]] = msg
            self._ready.notify_all()

    def wake(self) -> None:
        """The agent is lost: a commit waiting for its part stops waiting."""
        with self._ready:
            self._ready.notify_all()

    def drain(self) -> None:
        self._worker.drain()

    def close(self, *, wait: bool = True) -> None:
        """``wait=False``: a commit in progress, whose peers may be gone, ends with its collective's timeout."""
        self._worker.close(wait=wait)

    def _commit(self, step: int) -> None:
        deadline = time.monotonic() + self.timeout
        with self._ready:
            while step not in self._parts and self._lost() is None and time.monotonic() < deadline:
                self._ready.wait(deadline - time.monotonic())
            part = self._parts.pop(step, None)
        if part is None and self._lost() is None:
            self._lose(f"its part of the checkpoint of step {step} did not come within {self.timeout:.0f} s")
        error: BaseException | None = None
        if part is None:
            error = AgentLostError(f"the checkpoint agent of rank {self.rank} is lost: {self._lost()}")
        elif part["error"]:
            error = BackgroundWriteError(f"the checkpoint agent's write of its part failed: {part['error']}")
        info = ObjectInfo.from_json(part["info"]) if part is not None and part["info"] else None
        try:
            commit_written(self.directory.catalog, "full", kind="full", step=step, info=info, pieces=part["pieces"] if part else {},
                           boxes=part["boxes"] if part else {},
                           meta={"writer": "agent"}, rank_meta=part["meta"] if part else {}, error=error)
        except (AgentLostError, PeerFailedError) as e:
            if isinstance(e, PeerFailedError) and set(e.failed.values()) != {AgentLostError.__name__}:
                raise
            warnings.warn(f"the checkpoint of step {step} is not committed: {e}", RuntimeWarning, stacklevel=1)
            return
        assert part is not None and info is not None
        self.directory.retain(self.keep)
        self._committed(step, part["seconds"])
        self.directory.catalog.count_written_elsewhere(info.nbytes)
