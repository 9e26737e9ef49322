"""A process that writes a training process's full checkpoints from shared memory.

A strategy that persists in a thread of the training process (``checkfreq``, ``async``) runs the
Python of every write there — building the object's header, hashing, the manifest, the retention
of older checkpoints. With ``persist="process"`` those strategies hand each snapshot to a
:class:`WriterProcess` instead: a child process (:func:`main`, in a fresh interpreter, never a fork
of a process that may hold a CUDA context) that maps the host buffers — shared memory,
:class:`~everystep.transport.shared.SharedRegion` — and writes, commits and retains there, exactly
as the thread would (:func:`~everystep.storage.full.write_full`, ``retain``). The training
process's persist thread only sends the request and waits for the answer, without the GIL. (On a
2-core machine this measured no faster than the thread: docs/measurements.md says why.)

The two talk over a socket pair made before the child starts: nothing else can reach it, so there
is no one to authenticate. Messages are JSON (:mod:`.channel`'s encoding, never
pickle); buffer descriptors pass alongside (``SCM_RIGHTS``). The child dies with its parent
(``PR_SET_PDEATHSIG``), so a killed training process leaves no write behind it — as a killed
thread would — and a crash point that fires in the child kills the training process too, so a
fault injected mid-write means what it means with a thread.

Messages: training → writer ``buffer`` (+ descriptor), ``drop``, ``write``, ``close``; writer →
training ``written`` or ``failed``, in the order of the writes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Any

from .. import tracing
from .._process import run_helper, start_helper, stop_helper
from ..errors import BackgroundWriteError
from ..layout import TensorLayout
from ..transport.host import HostBuffer
from ..transport.shared import SharedRegion

__all__ = ["WriterProcess", "Written"]

_MAIN = "import sys; from everystep.agent.writer import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class Written:
    """A checkpoint the writer committed."""

    step: int
    nbytes: int
    seconds: float


class WriterProcess:
    """The training side: starts the writer, allocates the buffers it maps, and has it write them.

    :meth:`buffer` and :meth:`drop` (the training thread's, through a host buffer pool) touch no
    socket; a new buffer is shared, and a dropped one forgotten, with the next :meth:`write` (the
    persist thread's), which alone talks to the writer."""

    def __init__(self, directory: Path, *, keep: int, timeout: float = 600.0) -> None:
        from .channel import Plain, recv, send, send_fds  # (the channel imports torch: not at module import)

        self._send, self._recv, self._send_fds, self._plain = send, recv, send_fds, Plain
        self.process, self._conn = start_helper(_MAIN, str(directory), str(keep))
        self.timeout = timeout
        """Seconds a write may go unanswered before :meth:`write` gives up on the writer."""
        self._hung = False
        self._regions: dict[int, SharedRegion] = {}
        """Each buffer allocated and not dropped (by ``id``), with the memory behind it."""
        self._shared: set[int] = set()
        """The buffers the writer maps."""
        self._forget: list[int] = []
        """Buffers dropped that the writer still maps."""
        self._state = threading.Lock()
        self._talk = threading.Lock()

    def buffer(self, layout: TensorLayout) -> HostBuffer:
        """A host buffer for ``layout`` in memory the writer can map (pinned for DMA from a GPU where
        the driver allows)."""
        region, buffer = SharedRegion.holding(layout)
        region.register()
        with self._state:
            self._regions[id(buffer)] = region
        return buffer

    def drop(self, buffer: HostBuffer) -> None:
        """Give up ``buffer``; the writer forgets it at the next write."""
        with self._state:
            region = self._regions.pop(id(buffer))
            if id(buffer) in self._shared:
                self._shared.remove(id(buffer))
                self._forget.append(id(buffer))
        region.close()

    def write(self, step: int, buffer: HostBuffer, skeleton: Any) -> Written:
        """Have the writer write ``buffer`` as the full checkpoint of ``step``, commit it and apply
        retention; returns once it is committed. Raises :class:`BackgroundWriteError` with the
        writer's reason when the write failed, or when the writer is gone."""
        with self._talk:
            with self._state:
                forget, self._forget = self._forget, []
                region = None if id(buffer) in self._shared else self._regions[id(buffer)]
                self._shared.add(id(buffer))
            for key in forget:
                self._call(lambda: self._send(self._conn, {"kind": "drop", "id": key}))
            if region is not None:
                self._call(lambda: (self._send(self._conn, {"kind": "buffer", "id": id(buffer), "layout": buffer.layout}),
                                    self._send_fds(self._conn, [region.fd])))
            self._call(lambda: self._send(self._conn, {"kind": "write", "id": id(buffer), "step": step,
                                                       "skeleton": self._plain(skeleton)}))
            self._await_answer(step)
            answer = self._call(lambda: self._recv(self._conn))
        if answer["kind"] == "failed":
            raise BackgroundWriteError(f"{answer['error']} (in the checkpoint writer process, pid {self.process.pid})")
        return Written(answer["step"], answer["nbytes"], answer["seconds"])

    def close(self) -> None:
        """Ask the writer to exit and wait for it (every write asked for has been answered), then
        give up the buffers' memory."""
        with self._talk:
            try:
                self._send(self._conn, {"kind": "close"})
            except OSError:
                pass
            stop_helper(self.process, self._conn, wait=0 if self._hung else 60)  # (hung: it answered nothing in time)
        with self._state:
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.close()

    def _await_answer(self, step: int) -> None:
        """Block until the writer answers (the socket is readable), it exits, or :attr:`timeout`
        passes with no answer: a stopped or hung writer ends in an error, not a training that waits."""
        deadline = time.monotonic() + self.timeout
        while not self._conn.poll(max(0.0, min(1.0, deadline - time.monotonic()))):
            if self.process.poll() is not None:
                return  # the read that follows reports how it exited
            if time.monotonic() >= deadline:
                self._hung = True
                raise BackgroundWriteError(
                    f"the checkpoint writer process (pid {self.process.pid}) has not answered the write of step {step} "
                    f"in {self.timeout:g} s (stopped, or hung on storage?); raise writer_timeout if its writes take "
                    "that long")

    def _call(self, fn: Any) -> Any:
        try:
            return fn()
        except (EOFError, OSError) as e:
            status = self.process.poll()
            how = f"exited with status {status}" if status is not None else f"cannot be reached ({e})"
            raise BackgroundWriteError(f"the checkpoint writer process (pid {self.process.pid}) {how}") from None


def _serve(conn: connection.Connection, directory: Path, keep: int) -> None:
    from .channel import recv, recv_fds, send
    from ..storage import CheckpointDirectory, persist_full
    from ..storage.formats import buffer_chunks

    checkpoints = CheckpointDirectory.open(directory, strategy=None, create=False, access="shared")
    buffers: dict[int, tuple[SharedRegion, HostBuffer]] = {}
    try:
        while True:
            msg = recv(conn)
            kind = msg["kind"]
            if kind == "buffer":
                (fd,) = recv_fds(conn, 1)
                layout: TensorLayout = msg["layout"]
                buffers[msg["id"]] = SharedRegion.holding(layout, fd=fd)
            elif kind == "drop":
                region, _ = buffers.pop(msg["id"])
                region.close()
            elif kind == "write":
                _, buffer = buffers[msg["id"]]
                t0 = time.perf_counter()
                try:
                    with tracing.span("write", step=msg["step"]):
                        manifest, _ = persist_full(checkpoints, msg["step"],
                                                   buffer_chunks(buffer.layout, buffer.memoryview()), msg["skeleton"],
                                                   keep=keep)
                except Exception as e:
                    send(conn, {"kind": "failed", "step": msg["step"], "error": f"{type(e).__name__}: {e}"})
                    continue
                send(conn, {"kind": "written", "step": msg["step"], "nbytes": manifest.nbytes,
                            "seconds": time.perf_counter() - t0})
            elif kind == "close":
                return
    finally:
        for region, _ in buffers.values():
            region.close()
        checkpoints.close()


def main(argv: list[str]) -> int:
    return run_helper(argv, lambda conn, directory, keep: _serve(conn, Path(directory), int(keep)),
                      "checkfreq's writer process")
