"""A process that computes the checksums of a region's slot, beside the training process.

A commit hashes every byte of the slot (278 MB a step on gpt2-small with AdamW). The hash itself
releases the interpreter's lock, but handing a few hundred tensors to a pool of threads and
collecting their digests took about 2,600 Python calls a step on the training process's threads,
each one the lock taken from the training thread. So a writer's :class:`~everystep.storage.region.slots.Region`
has a :class:`RegionHasher`: a child process in a fresh interpreter (never a fork of a process that
may hold a CUDA context) that imports neither PyTorch nor the region, is given a read-only descriptor
of the region's file at its start — an open file of its own (:func:`reopened`), not the writer's,
which holds the writer's ``flock``: a child sharing it would keep the region locked after its writer
was killed, until its own death a moment later, and refuse the restarted writer — maps the slot's
data section read-only and hashes it, large tensors on threads of its own. The commit thread sends
one message and waits for one answer; the metadata and the header stay the region's, written in the
training process, in the same order as before.

The two talk over a socket pair made before the child starts, so nothing else can reach it.
Messages are JSON (never pickle): training → hasher ``{"layout": id, "at": offset, "nbytes": n}``
with ``"ranges": [[offset, nbytes], ...]`` the first time a layout is used (offsets in the data
section, which starts ``at`` bytes into the file) and ``"part": [first, stop]`` where only those
ranges are to be hashed (a slot hashed part by part as its copies land), or ``{"close": true}``;
hasher → training ``{"sums": [checksum, ...]}`` in the order of the ranges, or ``{"error": message}``. The child dies
with its parent (``PR_SET_PDEATHSIG``); one that died is started again at the next commit.
"""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import connection

from ... import tracing
from ..._process import HelperClient, run_helper
from ...background import in_shares
from ...errors import EverystepError
from ..base import checksum

__all__ = ["RegionHasher", "HASH_THREADS", "hash_ranges", "reopened"]

_MAIN = "import sys; from everystep.storage.region.hashing import main; sys.exit(main(sys.argv[1:]))"
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
HASH_THREADS = max(1, min(12, _CORES * 3 // 4))
"""The threads of a pool that hashes a slot (:func:`hash_ranges`), beside the thread that asks: three
quarters of the cores this process may run on, up to 12 (one on two cores; on a GPU's host, whose
cores the step leaves idle, a slot of 4 GB is hashed at the memory's speed, not one core's: on an
H200's host one thread hashed 8.3 GB/s, twelve 71)."""


def reopened(fd: int, path: str) -> int:
    """A read-only descriptor of the file open as ``fd``, an open file of its own (through
    ``/proc/self/fd``, else ``path``, checked to be the same file): it holds none of ``fd``'s locks."""
    want = os.fstat(fd)
    for name in (f"/proc/self/fd/{fd}", path):
        try:
            mine = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        got = os.fstat(mine)
        if (got.st_dev, got.st_ino) == (want.st_dev, want.st_ino):
            return mine
        os.close(mine)
    raise EverystepError(f"{path} cannot be opened again, read-only, for its hashing process")


class RegionHasher(HelperClient):
    """The training side: the hasher for the region file open as ``fd`` (:meth:`sums`; :meth:`close`
    at the end), started at its first question. It is given a descriptor of its own (:func:`reopened`),
    closed with it."""

    def __init__(self, fd: int, where: str) -> None:
        fd = reopened(fd, where)
        self.fd, self.where = fd, where
        super().__init__(_MAIN, str(fd), pass_fds=(fd,), name=f"hashing a slot of {where}: the hashing process",
                         failure=EverystepError, stop_wait=10.0)
        self._layout: object | None = None
        """The layout whose ranges the hasher holds (kept so that its id is not another's)."""
        self._layouts = 0

    def _started(self) -> None:
        self._layout = None  # (a new hasher has been given no ranges)

    def close(self, *, wait: bool = True) -> None:
        try:
            super().close(wait=wait)
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def sums(self, layout: object, ranges: list[tuple[int, int]], at: int, nbytes: int,
             part: tuple[int, int] | None = None) -> list[str]:
        """The checksum of each of ``ranges`` (``ranges[first:stop]`` for ``part``) of the data
        section that starts ``at`` bytes into the file and holds ``nbytes``: ``layout`` names the
        ranges (the same object, the same ranges). Raises :class:`EverystepError` when the hasher
        failed or is gone (started again next time)."""

        def message() -> dict[str, object]:  # (made once the hasher runs: a new one is sent the ranges)
            said: dict[str, object] = {"at": at, "nbytes": nbytes}
            if part is not None:
                said["part"] = list(part)
            if layout is not self._layout:
                self._layouts += 1
                said["ranges"] = ranges
                self._layout = layout
            said["layout"] = self._layouts
            return said

        answer = self.ask(message)
        if "error" in answer:
            raise EverystepError(f"hashing a slot of {self.where}: {answer['error']}")
        return list(answer["sums"])


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _serve(conn: connection.Connection, fd: int) -> None:
    layouts: dict[int, list[tuple[int, int]]] = {}
    # The data sections asked about, mapped: the two slots' alternate, and a section mapped again at
    # each commit had its page tables filled again (on a GPU's host, a tenth of a second a step for 4 GB)
    mapped: dict[tuple[int, int], mmap.mmap] = {}
    pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="everystep-region-hash")
    try:
        while True:
            message = json.loads(conn.recv_bytes())
            if not isinstance(message, dict) or "layout" not in message:
                return  # close
            try:
                if "ranges" in message:
                    layouts = {message["layout"]: [(int(o), int(n)) for o, n in message["ranges"]]}
                ranges, at, nbytes = layouts[message["layout"]], int(message["at"]), int(message["nbytes"])
                if "part" in message:
                    first, stop = map(int, message["part"])
                    ranges = ranges[first:stop]
                if nbytes and (at, nbytes) not in mapped:
                    while len(mapped) >= 2:  # (a slot's area moved or grew: its old mapping goes)
                        mapped.pop(next(iter(mapped))).close()
                    mapped[at, nbytes] = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ, offset=at)
                with memoryview(mapped[at, nbytes]) if nbytes else memoryview(b"") as data, \
                        tracing.span("hash", bytes=sum(n for _, n in ranges)):
                    sums = hash_ranges(pool, data, ranges)
            except Exception as e:  # (sent whole to the commit, which raises it)
                conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                continue
            conn.send_bytes(json.dumps({"sums": sums}).encode())
    finally:
        pool.shutdown(wait=True)
        for m in mapped.values():
            m.close()


def hash_ranges(pool: ThreadPoolExecutor, data: memoryview, ranges: list[tuple[int, int]]) -> list[str]:
    """The checksum of each ``(offset, nbytes)`` range of ``data``, in order: the ranges shared out
    by size between the threads of ``pool`` (:data:`HASH_THREADS` of them) and this one (the hash
    releases the interpreter's lock)."""
    if any(o < 0 or n < 0 or o + n > len(data) for o, n in ranges):
        raise ValueError(f"a range lies outside the data section ({len(data)} bytes)")

    return in_shares(pool, [n for _, n in ranges], lambda i: checksum(data[ranges[i][0]:ranges[i][0] + ranges[i][1]]),
                     HASH_THREADS + 1)


def main(argv: list[str]) -> int:
    return run_helper(argv, lambda conn, fd: _serve(conn, int(fd)), "region hashing process")
