"""Helpers for the processes everystep starts beside a training process."""

from __future__ import annotations

import os
import signal

__all__ = ["die_with"]


def die_with(parent: int) -> None:
    """Have the kernel kill this process when ``parent`` dies (Linux: ``PR_SET_PDEATHSIG``); a parent
    already gone (this process reparented) ends it now."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
