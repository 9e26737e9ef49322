"""A slot's tensors lent to the live objects: state recovered from a region kept where the slot's
private mapping holds it, instead of copied out of it.

A restore from a region reads the slot through a mapping of its own, copy-on-write
(``MAP_PRIVATE``), and verifies every byte where it lies. The optimizer's state of a fresh
optimizer whose load keeps the tensors it is given (torch's own) can then stay in the file's pages:
each entry becomes a tensor of its own storage (``torch.frombuffer``, so that ``torch.save`` of it
writes its bytes alone) over a second private mapping of the slot (:meth:`Lending.lend` says why
a second), and the restore copies none of it. Copying it would
take as many bytes of new memory, zeroed by the kernel, then filled: on a virtual machine where new
memory costs about as much as a copy, most of a restore.

Until a page of such a mapping is written it is the file's page, and a later write into the file
(the writer's next checkpoint into that slot) would show through. So the pages are made the
process's own (``madvise(MADV_POPULATE_WRITE)``: each page copied as a write would copy it, the
data untouched, atomically against the training thread's own writes) on a thread of their own,
started once the restore is done, while training goes on; the region waits for it before it
writes any slot (:meth:`Lending.settle`) and when it closes. The call goes through ctypes, which
releases the interpreter's lock, a few MiB at a time (the kernel holds the process's memory map
for reading during each call).

Where the kernel cannot (before Linux 5.14: ``EINVAL``), nothing is lent and the restore copies as
before.

Made its own is not yet out of the file's reach: Linux drops a private mapping's pages past the new
end of its file, copied or not, so a file cut short (``truncate``, another writer making the region
anew, a user's hand) would take the lent state with it, and the live optimizer would train on the
new file's bytes, or die of a bus error. So the same thread then moves the lent pages out of the
file's mapping into memory of the process's own (:func:`detached`: each few MiB copied into
anonymous memory, which ``mremap`` puts at the same addresses). A write into a range while it is
copied would be lost, so the thread moves a range only while no update runs: the optimizers that
write the lent state (:meth:`Lending.start`'s ``writers``) hold it off for their step, and wait at
most for the one range being moved. What is left when the region closes (the Checkpointer's close,
when training does not step) is moved there (:meth:`Lending.detach`). Until the thread is done (a
second or so after a restore of gpt2-small's state) a file cut short by hand still takes the lent
pages; once it is done, nothing done to the file reaches them, and the region's writer refuses the
changed file at its next slot (:meth:`~everystep.storage.region.slots.Region.begin`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import EverystepError
from ...layout import LayoutEntry

__all__ = ["Lending", "lending_supported", "detached"]

MADV_POPULATE_WRITE = 23
"""Linux's ``madvise`` advice (from 5.14) that faults pages in writable, breaking copy-on-write."""

_CHUNK = 8 << 20
"""Bytes made the process's own per call."""

_PAGE = mmap.PAGESIZE


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def _populate(address: int, nbytes: int) -> None:
    """Make ``nbytes`` of a private mapping from ``address`` (page-aligned) this process's own;
    OSError where the kernel refuses."""
    call = _madvise()
    if call is None:
        raise OSError(errno.ENOSYS, "madvise is not available")
    while call(address, nbytes, MADV_POPULATE_WRITE) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINTR, errno.EAGAIN):
            raise OSError(code, os.strerror(code))


_MAP_PRIVATE, _MAP_ANONYMOUS, _MREMAP_MAYMOVE, _MREMAP_FIXED = 0x02, 0x20, 1, 2
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.mremap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def detached(address: int, nbytes: int) -> None:
    """Put memory of the process's own (anonymous) at ``nbytes`` from ``address`` (page-aligned, in a
    private mapping of a file), holding what is there: copied into fresh anonymous pages, which
    ``mremap`` moves onto those addresses in one call. Nothing may write there meanwhile. OSError
    where the kernel refuses (the range is then as it was)."""
    libc = _libc()
    fresh = libc.mmap(None, nbytes, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if fresh in (None, _FAILED):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    ctypes.memmove(fresh, address, nbytes)
    moved = libc.mremap(fresh, nbytes, nbytes, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved != address:
        code = ctypes.get_errno()
        libc.munmap(fresh, nbytes)
        raise OSError(code, os.strerror(code))


@functools.cache
def lending_supported() -> bool:
    """Whether this kernel makes a private mapping's pages the process's own without writing them
    (``MADV_POPULATE_WRITE``): tried once, on a page of this process's."""
    probe = mmap.mmap(-1, _PAGE, mmap.MAP_PRIVATE)
    page = ctypes.c_char.from_buffer(probe)
    try:
        _populate(ctypes.addressof(page), _PAGE)
    except OSError:
        return False
    finally:
        del page
        probe.close()
    return True


class _Lent:
    """One mapping's lent pages: the mapping (weakly: it lives while a lent tensor does), the
    page-aligned ranges of its addresses, and what to drop once they are the process's own."""

    def __init__(self, mapping: mmap.mmap, ranges: list[tuple[int, int]], then_drop: object) -> None:
        self.mapping = weakref.ref(mapping)
        self.then_drop = then_drop
        self.ranges = ranges


class Lending:
    """The mappings a region lent tensors of (:meth:`lend`) and the making of their pages the
    process's own (:meth:`start`, :meth:`settle`). ``where``: the region, for messages."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._lent: list[_Lent] = []
        self._moved: list[_Lent] = []
        """Those made the process's own, still in the file's mapping until :meth:`detach`."""
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None
        self._populated = threading.Event()
        """Set once :meth:`start`'s thread has made every lent page the process's own (or failed)."""
        self._quiet = threading.Condition()
        self._writing = 0
        """Updates under way that may write lent state (their ranges are not moved meanwhile)."""
        self._moving = False
        self._stop = False
        self._hooks: list[Any] = []
        self.detached_bytes = 0
        """Bytes moved out of the file's mapping so far."""
        self.bytes = 0
        """Bytes lent so far (the pages they lie in)."""
        self.seconds = 0.0
        """How long making them the process's own took, on its thread or the caller's."""

    def lend(self, fd: int, offset: int, nbytes: int, start: int, entries: Sequence[LayoutEntry], *,
             then_drop: object = None) -> dict[str, torch.Tensor]:
        """A tensor of its own over each entry of a private mapping, made here, of the ``nbytes`` of
        the file open as ``fd`` from ``offset`` (a slot's area, its data section ``start`` bytes in);
        their pages are to be made the process's own, and ``then_drop`` (the mapping the slot was
        verified through) is held until then: unmapping gpt2-small's 265 MiB took some 17 ms,
        which the restore need not wait for.

        A mapping of its own, not the one the slot was verified through: none of its pages is mapped
        yet, so each is copied as a first write would copy it. A page already mapped (read) would
        be unmapped first, and with the training thread on another core each such page costs an
        interrupt there to drop it from that core's TLB: the first step after a restore of
        gpt2-small took 0.3 s longer so."""
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        page = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(page)
        del page
        tensors: dict[str, torch.Tensor] = {}
        spans: list[tuple[int, int]] = []
        for e in entries:
            if not e.nbytes:
                tensors[e.key] = torch.empty(e.shape, dtype=e.dtype)
                continue
            at = start + e.offset
            tensors[e.key] = torch.frombuffer(mapping, dtype=e.dtype, count=e.nbytes // e.dtype.itemsize,
                                              offset=at).view(e.shape)
            first, stop = at // _PAGE * _PAGE, -(-(at + e.nbytes) // _PAGE) * _PAGE
            if spans and first <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
            else:
                spans.append((first, stop))
        if spans:
            lent = _Lent(mapping, [(address + a, b - a) for a, b in spans], then_drop)
            with self._lock:
                self._lent.append(lent)
                self.bytes += sum(n for _, n in lent.ranges)
        return tensors

    def start(self, writers: Sequence[Any] = ()) -> None:
        """Make the lent pages the process's own, then move them out of the file, on a thread of
        their own (once the restore is done: those of a slot it did not take are gone with its
        tensors). ``writers``: the optimizers whose steps write the lent state (each ``step`` holds
        the moving off while it runs); none: the pages are moved at :meth:`detach`."""
        with self._lock:
            if not self._lent or self._thread is not None:
                return
            for optimizer in writers:
                self._hooks += [optimizer.register_step_pre_hook(self._enter),
                                optimizer.register_step_post_hook(self._leave)]
            self._thread = threading.Thread(target=self._background, name="everystep-region-lent", daemon=True)
            self._thread.start()

    def _enter(self, *_: Any) -> None:
        with self._quiet:
            while self._moving:
                self._quiet.wait()
            self._writing += 1

    def _leave(self, *_: Any) -> None:
        with self._quiet:
            self._writing = max(0, self._writing - 1)
            self._quiet.notify_all()

    def _background(self) -> None:
        try:
            self._run()
        finally:
            self._populated.set()
        if self._error is None and self._hooks:
            self._move_out(between_updates=True)

    def settle(self) -> None:
        """Return once every lent page still in use is the process's own (waiting for :meth:`start`'s
        thread, or doing it here); raises :class:`~everystep.errors.EverystepError` where the
        kernel refused, before anything the pages lie over is written."""
        with self._lock:
            started = self._thread is not None
        if started:
            self._populated.wait()
        self._run()
        if self._error is not None:
            raise EverystepError(f"the state recovered from {self.where} could not be made this process's own "
                                 f"(madvise: {self._error.strerror}); the region writes no slot while it lies there")

    @property
    def moved_out(self) -> bool:
        """Whether every lent page still in use lies out of the file's mapping."""
        with self._lock:
            return not self._lent and not self._moved

    def detach(self) -> None:
        """Move every lent page still in use out of the file's mapping into memory of the process's
        own (:func:`detached`), once made its own (:meth:`settle`): called as the region closes,
        when nothing writes the lent tensors. A range the kernel refuses to move stays in the
        file's private mapping, said in the error raised after the others are moved."""
        self.settle()
        with self._quiet:
            self._stop = True
            self._quiet.notify_all()
        with self._lock:
            thread, self._thread = self._thread, None
            hooks, self._hooks = self._hooks, []
        if thread is not None:
            thread.join()
        for hook in hooks:
            hook.remove()
        failed = self._move_out(between_updates=False)
        if failed is not None:
            raise EverystepError(f"the state recovered from {self.where} could not be moved out of its file "
                                 f"(mremap: {failed.strerror}): a change to that file while this process trains "
                                 "would show in its optimizer's state")

    def _move_out(self, *, between_updates: bool) -> OSError | None:
        """Move the lent ranges made the process's own out of the file's mapping, a few MiB at a
        time (``between_updates``: each while no update runs, until :meth:`detach` stops it)."""
        failed: OSError | None = None
        while True:
            with self._lock:
                if not self._moved:
                    return failed
                item = self._moved[0]
            mapping = item.mapping()
            try:
                for address, nbytes in item.ranges if mapping is not None else ():
                    for at in range(0, nbytes, _CHUNK):
                        if between_updates and not self._hold_updates():
                            return failed
                        try:
                            detached(address + at, min(_CHUNK, nbytes - at))
                            self.detached_bytes += min(_CHUNK, nbytes - at)
                        except OSError as e:
                            failed = failed or e
                            if between_updates:
                                return failed  # (left for detach, which says so)
                        finally:
                            if between_updates:
                                with self._quiet:
                                    self._moving = False
                                    self._quiet.notify_all()
            finally:
                del mapping
            with self._lock:
                if item in self._moved:
                    self._moved.remove(item)

    def _hold_updates(self) -> bool:
        """Wait until no update runs and keep the next from starting; False once told to stop."""
        with self._quiet:
            while self._writing and not self._stop:
                self._quiet.wait()
            self._moving = not self._stop
            return not self._stop

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._lent or self._error is not None:
                    return
                lent = self._lent[0]
            t0 = time.perf_counter()
            mapping = lent.mapping()  # (held while its pages are worked on: it stays mapped)
            try:
                if mapping is not None:
                    for address, nbytes in lent.ranges:
                        for at in range(0, nbytes, _CHUNK):
                            _populate(address + at, min(_CHUNK, nbytes - at))
            except OSError as e:
                self._error = e
                return
            finally:
                del mapping
                self.seconds += time.perf_counter() - t0
            with self._lock:
                if lent in self._lent:  # (not when a settle beside this thread took it first)
                    self._lent.remove(lent)
                    self._moved.append(lent)
            lent.then_drop = None
