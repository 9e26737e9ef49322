"""Memory two processes share, passed as a file descriptor: nothing to clean up after a crash.

A :class:`SharedRegion` is an anonymous file (``memfd`` on Linux, an unlinked temporary file
elsewhere) mapped into this process. Another process receives the descriptor over a Unix socket
(``SCM_RIGHTS``) and maps the same pages. The memory lives while any process holds the descriptor
or a mapping, and the kernel reclaims it when the last one goes — however the processes end.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import torch

from .._memory import register_host, unregister_host
from .host import HostBuffer, TensorLayout

__all__ = ["SharedRegion"]


class SharedRegion:
    """``nbytes`` of shared memory; ``data`` is a uint8 tensor over them."""

    def __init__(self, nbytes: int, *, fd: int | None = None) -> None:
        if fd is None:
            fd = _anonymous_file()
            os.ftruncate(fd, max(nbytes, 1))
        self.fd, self.nbytes = fd, nbytes
        self.registered = False
        self._map = mmap.mmap(fd, max(nbytes, 1))
        self.data = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def holding(cls, layout: TensorLayout, *, fd: int | None = None) -> tuple["SharedRegion", HostBuffer]:
        """A region the size of ``layout`` (new, or the one behind ``fd``) and typed views over it."""
        region = cls(layout.nbytes, fd=fd)
        return region, HostBuffer(layout, data=region.data)

    def register(self) -> bool:
        """Pin the mapping for DMA from a GPU (False where there is none, or the driver refuses)."""
        if not self.registered:
            self.registered = register_host(self.data)
        return self.registered

    def close(self) -> None:
        """Give up the descriptor (and the pinning); the mapping goes when the last tensor over it does."""
        if self.registered:
            unregister_host(self.data)
            self.registered = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _anonymous_file() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("everystep", os.MFD_CLOEXEC)
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="everystep-", dir=directory)
    os.unlink(path)
    return fd
