"""One writer per prefix of an object store (:class:`RemoteLock`): ``writer.lock`` is created only
where none is (``If-None-Match``), renewed by its holder every third of ``lease`` seconds (``If-Match`` its own
version), and taken over by a successor only once its holder has not renewed it for ``lease``
seconds by the server's clock (``If-Match`` the stale version: of several successors, one wins). A
holder that finds its lock taken stops uploading. What this rests on: S3's conditional writes, and a
holder that renews within the lease — a writer stalled for longer than ``lease`` (a frozen
machine) can have one upload in flight when a successor takes over; its manifest is then an older
step's, which retention and recovery order by step, so nothing newer is lost.
Before the lock is taken, :func:`check_conditional_writes` refuses a server that does not honour
the conditions (an older S3-compatible server drops them and writes anyway, and two writers would
each hold the lock).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
import warnings
from typing import Any

from ...errors import DirectoryInUseError, EverystepError, RemoteStoreError
from ..base import ConditionalStore

__all__ = ["LOCK_KEY", "RemoteLock", "check_conditional_writes"]

LOCK_KEY = "writer.lock"


def check_conditional_writes(store: ConditionalStore, url: str) -> None:
    """Refuse a server that does not honour conditional writes, on which two writers could each
    believe they hold the lock (an older S3-compatible server drops ``If-None-Match`` and
    ``If-Match`` and writes anyway): a value is created, then created again and replaced with a
    version it does not have — both must be refused — and deleted."""
    key = f"{LOCK_KEY}.probe-{uuid.uuid4().hex}"
    try:
        created = store.create(key, b"probe")
        ignored = [what for what, version in (("If-None-Match", store.create(key, b"again")),
                                              ("If-Match", store.replace(key, b"again", '"0"')))
                   if version is not None]
    finally:
        store.delete(key)
    if created is None or ignored:
        raise RemoteStoreError(
            f"{url}: the server does not honour conditional writes ({', '.join(ignored) or 'If-None-Match'} ignored), "
            "which the lock that keeps one writer on a prefix needs; use a server that honours them (AWS S3 does)")


_PLAIN = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")


def _shown(value: Any) -> str:
    """A field of a lock anyone who can write the bucket may have written, fit to print: a plain
    host name or number as it is, anything else quoted with its control characters escaped."""
    text = str(value)
    return text if _PLAIN.fullmatch(text) else ascii(text[:64])


class RemoteLock:
    """One writer per prefix of an object store (see the module docstring); raises
    :class:`DirectoryInUseError` naming the holder when a live one holds it."""

    def __init__(self, store: ConditionalStore, url: str, *, lease: float) -> None:
        self.store, self.url, self.lease = store, url, lease
        self.lost: str | None = None
        """Why this writer no longer holds the lock (another took it over), or None."""
        self._holder_id = {"holder": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        self._renewals = 0
        self._version = self._take()
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="everystep-remote-lock", daemon=True)
        self._renewer.start()

    def _body(self) -> bytes:
        """The lock's value: who holds it, and how many times it renewed it (each renewal a new
        version, so that a successor's takeover of a version it saw fails once the holder renewed)."""
        return json.dumps({**self._holder_id, "renewals": self._renewals}).encode()

    def _take(self) -> str:
        version = self.store.create(LOCK_KEY, self._body())
        if version is not None:
            return str(version)
        seen = self.store.age(LOCK_KEY)
        if seen is not None and seen[1] < self.lease:
            # Held, and renewed within the lease: a job restarted after its host was lost finds its own
            # predecessor's lock so; it expires unless its holder renews it within the lease.
            holder = self._holder()
            left = min(self.lease, self.lease - seen[1])  # (a value written "in the future": one lease at most)
            warnings.warn(f"{self.url} is locked by {holder}; waiting {left:.0f} s for the lock to expire (a live writer "
                          "renews it before then)", RuntimeWarning, stacklevel=4)
            time.sleep(left + 0.5)  # (a lease's expiry is a matter of time: there is nothing to wait on)
            again = self.store.age(LOCK_KEY)
            if again is not None and again[0] != seen[0]:
                raise DirectoryInUseError(f"{self.url} is being written by another job ({self._holder()}), which renewed "
                                          "its lock: choose another remote prefix", None)
        version = self.store.replace(LOCK_KEY, self._body(), seen[0]) if seen is not None else \
            self.store.create(LOCK_KEY, self._body())
        if version is None:
            raise DirectoryInUseError(f"{self.url}: another job took over its stale lock at the same moment "
                                      f"({self._holder()})", None)
        return str(version)

    def _holder(self) -> str:
        try:
            found = json.loads(self.store.get(LOCK_KEY))
            return f"host {_shown(found.get('host'))}, pid {_shown(found.get('pid'))}"
        except (FileNotFoundError, ValueError, EverystepError, OSError, AttributeError):
            return "holder unknown"

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):  # (a period, not a synchronisation)
            self._renewals += 1
            try:
                version = self.store.replace(LOCK_KEY, self._body(), self._version)
            except (EverystepError, OSError):
                continue  # the server away: try again; a successor can take the lock only after the lease
            if version is None:
                self.lost = f"another job took over the lock of {self.url} ({self._holder()})"
                return
            self._version = version

    def release(self) -> None:
        """Stop renewing, and delete the lock if this writer still holds it."""
        self._stop.set()
        self._renewer.join()
        if self.lost is None:
            try:
                if (found := self.store.age(LOCK_KEY)) is not None and found[0] == self._version:
                    self.store.delete(LOCK_KEY)
            except (EverystepError, OSError):
                pass  # (the server away: the lock expires after its lease)
