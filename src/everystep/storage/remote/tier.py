"""The remote tier: full checkpoints copied to an object store in the background, and brought back
to a local directory that has nothing as new (a new machine, a lost disk).

Every strategy keeps checkpointing to its fast tier (the local directory, its region, its agent) as
without a remote. At a step end on which an upload is due and none is running, the newest committed
full checkpoint of the local directory is uploaded by a thread of its own: each object read back and
verified against its checksum, put in the remote store under the same name — that work in a process
of the rank's own (:class:`~everystep.storage.remote.uploader.UploadProcess`), not sharing the training
process's interpreter lock — and the manifest put last, by the thread — the commit, as locally
(:class:`~everystep.storage.catalog.Catalog` over an :class:`~everystep.storage.stores.s3.S3Store`). Then the
remote keeps its newest ``keep`` full checkpoints. The checkpoint going up is pinned in the local
directory (:meth:`~everystep.storage.directory.CheckpointDirectory.pin`): retention keeps it until it
is up, however many checkpoints are committed meanwhile.
Training never waits for an upload; a failed one is reported once (a warning), checkpoints stay
local, and the next due upload tries again; a success after failures says uploads resumed.

When an upload is due: every ``every`` steps, or — ``every=None`` — at the Young/Daly interval for
the measured upload time and step time and the given MTBF of a machine (the failure the remote tier is
for), the first one at once.

At restore, :meth:`RemoteTier.pull` takes the newest remote full checkpoint that verifies, if it is
newer than the local directory's newest, into the local directory (objects, then the manifest), and
returns what it read (:class:`Pulled`), which the restore offers to the strategy's recovery: it
recovers as from its own directory, the pulled state taken as read, and names it as from the remote.
On a new machine, training resumes where the remote left it.

The remote holds a copy of the local directory's marker (``everystep.json``): a prefix holding
another job's checkpoints (another strategy, format or world size) is refused, naming the URL.

Under several ranks the job is one writer, rank 0 leading: it holds the lock, checks the marker,
collects garbage and decides when an upload is due; for each upload it sends the manifest to the
other ranks (the ``remote`` channel, a gloo group of its own), every rank uploads its share of the
objects (by size, :meth:`~everystep.distributed.Ranks.owners`), and rank 0 puts the manifest once
every rank's share is durable. A pull is shared the same way: rank 0 names the candidates, each rank
downloads and verifies its share, and rank 0 commits locally once every share verified and what
they make reads as a state.

One writer per prefix: :class:`~everystep.storage.remote.lock.RemoteLock`, taken once the server is
seen to honour the conditional writes it rests on. Once the lock is held, what interrupted writers
left (uploads in progress, objects no manifest names) is collected.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._faults import crash_point
from ...background import BackgroundErrors, Worker
from ...errors import CheckpointDirectoryError, ConfigError, CorruptCheckpointError, EverystepError
from ...policy.interval import median_gap
from ...policy.young_daly import young_daly_interval
from ...distributed import Ranks
from ..base import ConditionalStore, Manifest, ObjectInfo
from ..catalog import Catalog, Supplemented
from ..retention import plan_retention
from ..full import read_state, read_state_together
from ..formats.sharded import part_rank
from ..directory import MARKER, collect_garbage, marker_bytes, parse_marker
from ..stores.location import is_remote, open_remote
from .lock import LOCK_KEY, RemoteLock, check_conditional_writes
from .uploader import UploadProcess

if TYPE_CHECKING:
    from ..directory import CheckpointDirectory  # noqa: F811

__all__ = ["RemoteTier", "RemoteConfig", "Pulled", "RemoteLock", "LOCK_KEY"]

_SAME_JOB = ("strategy", "full_format", "world_size")
"""What of the markers must agree for a prefix to hold this job's checkpoints."""
FOLLOW_TIMEOUT = 7 * 86400.0
"""Seconds a rank following rank 0's uploads waits for the next one (the ``remote`` channel's timeout):
uploads can be an hour apart (Young/Daly's interval), and rank 0 says when the job closes."""


@dataclass(frozen=True)
class RemoteConfig:
    """Where and how often the remote tier copies a job's full checkpoints (``Checkpointer(remote=...)``
    takes one, or its URL alone for these defaults).

    Args:
        url: ``s3://bucket/prefix``.
        every: upload every this many steps; ``None``: Young/Daly's interval for the measured upload
            time and step time and ``mtbf``.
        mtbf: seconds between losses of a machine, the failure the remote tier is for.
        lease: seconds without renewal after which the remote's writer lock is taken over.
    """

    url: str
    every: int | None = None
    mtbf: float = 86400.0
    lease: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not is_remote(self.url):
            raise ConfigError(f"remote must be an s3://bucket/prefix URL, got {self.url!r}")
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise ConfigError(f"RemoteConfig.every must be a positive number of steps or None, got {self.every!r}")
        for name, value in (("mtbf", self.mtbf), ("lease", self.lease)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"RemoteConfig.{name} must be a positive number of seconds, got {value!r}")
        from ..stores.s3 import parse_url

        try:
            parse_url(self.url)
        except ValueError as e:
            raise ConfigError(f"remote: {e}") from None


@dataclass(frozen=True)
class Pulled:
    """The checkpoint :meth:`RemoteTier.pull` brought back, committed in the local directory: its
    manifest, and the state it read to check it — ``(tree, tensors, meta)`` as
    :func:`~everystep.storage.full.read_state` returns it, or None where the pull did not read it
    (DCP's format, read by every rank at restore; a rank that did not lead the check). A restore offers
    it to the strategy's recovery, which takes the state from here rather than read it again, and
    names its source ``remote``."""

    manifest: Manifest
    state: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None


class RemoteTier:
    """Uploads ``directory``'s full checkpoints to ``url`` and brings them back (see the module docstring)."""

    def __init__(self, config: RemoteConfig, directory: "CheckpointDirectory", *, keep: int,
                 store: ConditionalStore | None = None, uploaded: Callable[[int], None] | None = None) -> None:
        url, lease = config.url, config.lease
        self.url, self.directory, self.every, self.mtbf, self.keep = url, directory, config.every, float(config.mtbf), keep
        self.store = store if store is not None else open_remote(url)
        self.catalog = Catalog(self.store)
        self.uploaded_step = -1
        """The newest step committed remotely (by this run, or found there at :meth:`pull`)."""
        self._uploaded = uploaded or (lambda step: None)
        self.upload_seconds: float | None = None
        """How long the newest upload took."""
        self.bytes_up = self.bytes_down = 0
        """Bytes this rank uploaded (each object once, retries not counted), and downloaded at :meth:`pull`."""
        self._started_at = -math.inf
        self._marks: list[float] = []
        self._failed: str | None = None
        self._upload: Future[Any] | None = None
        self._lock = threading.Lock()
        self.ranks: Ranks = directory.ranks
        self.lead = self.ranks.rank == 0
        """Whether this rank leads (rank 0, or the only process): it decides, locks and commits."""
        self._follows = self.ranks.distributed and directory.access == "write"
        self._worker = Worker("everystep-remote-upload", BackgroundErrors())
        self.lock: RemoteLock | None = None
        self._uploader: UploadProcess | None = None
        error: BaseException | None = None
        if self.lead:
            try:
                self._check_marker()
                if directory.access == "write":
                    check_conditional_writes(self.store, url)
                    self.lock = RemoteLock(self.store, url, lease=float(lease))
                    collect_garbage(self.catalog)
            except BaseException as e:
                error = e
        if error is None and directory.access == "write":
            try:
                self._uploader = UploadProcess(url, directory.root)  # (each rank uploads its share from there)
            except BaseException as e:  # (said to every rank by the exchange below)
                error = e
        try:
            self.ranks.exchange("control", {}, error, f"opening the remote {url}")
            if self._follows:
                self.ranks.add_channel("remote", timeout=FOLLOW_TIMEOUT)
                if not self.lead:
                    self._worker.post(f"the uploads to {url} that rank 0 leads", self._follow)
        except BaseException:
            self._release(wait=True)
            raise

    def _check_marker(self) -> None:
        """Refuse a prefix of another job's; give a new one this directory's marker."""
        ours = self.directory.marker
        try:
            theirs = parse_marker(bytes(self.store.get(MARKER)), f"{self.url}/{MARKER}")
        except FileNotFoundError:
            if self.directory.access != "read":
                self.store.create(MARKER, marker_bytes(ours))
            return
        except CheckpointDirectoryError as e:
            raise CheckpointDirectoryError(f"{e}: the prefix holds something else; choose another") from None
        differ = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in _SAME_JOB if theirs.get(k) != ours.get(k)]
        if differ:
            raise CheckpointDirectoryError(f"{self.url} holds another job's checkpoints ({'; '.join(differ)}); choose "
                                           "another remote prefix")

    # -- bringing back ---------------------------------------------------------------------------

    def pull(self) -> Pulled | None:
        """Take the newest remote full checkpoint that verifies into the local directory, if it is newer
        than the local newest: what it read (:class:`Pulled`), or None. Under several ranks every rank
        calls it at once (the training thread's ``control`` channel): each downloads its share."""
        found: dict[str, Any] = {"candidates": [], "held": -1}
        error: BaseException | None = None
        if self.lead:
            try:
                local = self.directory.newest_full_step()
                records = sorted(self._fulls(), key=lambda r: -r.manifest.step)
                # IMPORTANT: what the remote holds, for the uploads that follow, is what verifies: a
                # newer manifest counts only once its checkpoint is pulled whole (one that does not
                # verify, or names a step no run reached, must not stop every upload after it)
                found = {"held": max((r.manifest.step for r in records if r.manifest.step <= local), default=-1),
                         "candidates": [r.manifest.to_bytes() for r in records if r.manifest.step > local]}
            except BaseException as e:
                error = e
        found = self.ranks.exchange("control", found, error, f"the listing of {self.url}")[0]
        self._holds(found["held"])
        for body in found["candidates"]:
            manifest = Manifest.from_bytes(body)
            step, data, bad = manifest.step, {}, None
            try:
                data = {info.name: (info, self._new_object(info)) for info in self._share(manifest)}
                self.bytes_down += sum(len(v) for _, v in data.values())
            except (CorruptCheckpointError, FileNotFoundError) as e:
                bad = str(e)
            except BaseException as e:
                error = e
            bads = [r["bad"] for r in self.ranks.exchange("control", {"bad": bad}, error,
                                                          f"the download of step {step} from {self.url}") if r["bad"]]
            if bads:
                if self.lead:
                    warnings.warn(f"the remote checkpoint of step {step} at {self.url} does not verify ({bads[0]}); "
                                  "trying the one before", RuntimeWarning, stacklevel=2)
                continue
            what = f"the download of step {step} from {self.url}"
            catalog, written = self.directory.catalog, []
            try:
                for info, value in data.values():
                    if not catalog.has_object(info.name):  # (else the same object, verified: _new_object)
                        catalog.put_object(info, value)
                        written.append(info.name)
            except BaseException as e:
                error = e
            self.ranks.exchange("control", {}, error, what)  # every rank's share in the local directory
            bad, state = self._check_pulled(manifest, data, what)
            if bad is None:
                self._holds(step)
                return Pulled(manifest, state)
            for name in written:  # each rank its own share: nothing of it stays in the local directory
                catalog.delete_object(name)
            if self.lead:
                warnings.warn(f"the remote checkpoint of step {step} at {self.url} verifies but does not read as a "
                              f"state ({bad}); trying the one before", RuntimeWarning, stacklevel=2)
        return None

    def _holds(self, step: int) -> None:
        """The remote holds the checkpoint of ``step``, whole: uploads take only newer ones."""
        if step > self.uploaded_step:
            self.uploaded_step = step
            self._uploaded(step)

    def _check_pulled(self, manifest: Manifest, data: dict[str, tuple[ObjectInfo, bytearray]], what: str
                      ) -> tuple[str | None, Any]:
        """Why the pulled checkpoint does not read as a state (:meth:`_read_pulled`), or None, once it is
        committed locally (every rank learns which), and the state this rank read of it, or None.
        Under node-local disks every rank reads it, its parts from the hosts that hold them, and each
        host's leader commits it in its own directory."""
        node_local, error, bad, state = self.directory.catalog.hosts is not None, None, None, None
        if self.lead or node_local:
            try:
                bad, state = self._read_pulled(manifest, data)
            except BaseException as e:
                error = e
        if node_local:
            bad = next((r["bad"] for r in self.ranks.exchange("control", {"bad": bad}, error, what) if r["bad"]), None)
        try:
            if bad is None and self.directory.catalog.leads:
                self.directory.catalog.commit(manifest)
        except BaseException as e:
            error = e
        bad = self.ranks.exchange("control", {"bad": bad}, error, what)[0]["bad"]  # (before any rank restores)
        return bad, state if bad is None else None

    def _read_pulled(self, manifest: Manifest, data: dict[str, tuple[ObjectInfo, bytearray]]) -> tuple[str | None, Any]:
        """Why the pulled checkpoint, its objects in the local directory and not yet committed there,
        does not read as a state (its checksums prove only that its bytes are the ones it names), or
        None, with the state read. It is read from ``data``, what this rank downloaded (the other
        ranks' shares from the directory). A checkpoint in DCP's format is read by every rank together
        at restore, not here: no state."""
        if manifest.meta.get("format") == "dcp":
            return None, None
        try:
            if self.directory.catalog.hosts is not None:  # (collective: every rank reads its state)
                return None, read_state_together(self.directory, manifest)
            return None, read_state(self.directory, manifest, reader=Supplemented(self.directory.catalog, data))
        except CorruptCheckpointError as e:
            return str(e), None

    def _new_object(self, info: ObjectInfo) -> bytearray:
        """The verified bytes of a remote object the local directory does not hold.

        IMPORTANT: a pull never writes over a local object: one of that name is another checkpoint's
        (garbage collection removed what no manifest names before the pull) — unless it is this one,
        verified against ``info`` (a checkpoint that not every host's directory holds, under
        node-local disks), which is read from there and not downloaded."""
        if self.directory.catalog.has_object(info.name):
            try:
                return self.directory.catalog.read_object(info)
            except CorruptCheckpointError:
                raise CorruptCheckpointError(f"its object {info.name} exists in the local directory {self.directory.root} "
                                             "with other bytes, which a pull never writes over") from None
        return self.catalog.read_object(info)

    def _share(self, manifest: Manifest, held: list[list[str]] | None = None) -> list[ObjectInfo]:
        """The objects of ``manifest`` this rank moves: all of them in a job of one process. Under
        node-local disks a rank uploads only what its host holds (``held``: the names each rank's
        host holds), and downloads its own part (rank r's ``tensors-rr``), which its host keeps."""
        infos = list(manifest.objects.values())
        if not self.ranks.distributed:
            return infos
        able: dict[str, list[int]] = {}
        if held is not None:
            able = {info.name: [r for r, names in enumerate(held) if info.name in names] for info in infos}
            if lost := sorted(name for name, ranks in able.items() if not ranks):
                raise CorruptCheckpointError(f"its objects {', '.join(lost)} are on no host's disk")
        elif self.directory.catalog.hosts is not None:
            able = {info.name: [rank] for key, info in manifest.objects.items()
                    if (rank := part_rank(key)) is not None and rank < self.ranks.world}
        owners = self.ranks.owners({info.name: info.nbytes for info in infos}, able)
        return [info for info in infos if owners[info.name] == self.ranks.rank]

    def _fulls(self) -> list[Any]:
        """The remote's full checkpoints (a rank's part of one is not one)."""
        return [r for r in self.catalog.manifests()
                if r.manifest is not None and r.manifest.kind == "full" and r.manifest.rank == 0]

    # -- uploading -------------------------------------------------------------------------------

    def step_end(self, step: int) -> None:
        """After each step (training thread): start an upload if one is due and none is running (rank
        0 decides for the job)."""
        if not self.lead:
            return
        self._marks = (self._marks + [time.perf_counter()])[-21:]
        with self._lock:
            if self._upload is not None and not self._upload.done():
                return
            if step - self._started_at < self.interval():
                return
            self._started_at = step
            self._upload = self._worker.submit(f"the upload to {self.url}", self._upload_newest)

    def interval(self) -> float:
        """Steps between uploads: ``every``, or Young/Daly's for the measured upload and step times."""
        if self.every is not None:
            return self.every
        step_seconds = median_gap(self._marks)
        if self.upload_seconds is None or not step_seconds:
            return 1  # nothing measured yet: the first upload measures it
        return max(1.0, young_daly_interval(step_seconds=step_seconds, ckpt_seconds=self.upload_seconds,
                                            mtbf_seconds=self.mtbf))

    def _upload_newest(self) -> None:
        if self.lock is not None and self.lock.lost is not None:
            if self._failed != self.lock.lost:
                warnings.warn(f"no more uploads to {self.url}: {self.lock.lost}", RuntimeWarning, stacklevel=1)
                self._failed = self.lock.lost
            return
        manifest = self.directory.pin_newest(newer_than=self.uploaded_step)  # kept until every share is read and up
        if manifest is None:
            return
        t0 = time.perf_counter()
        try:
            if not self._copy(manifest):
                return  # retired by another process's retention planned just before the pin: the next upload takes a newer one
        except (EverystepError, OSError) as e:
            if self._failed is None:
                warnings.warn(f"uploading the checkpoint of step {manifest.step} to {self.url} failed ({e}); training goes "
                              "on with checkpoints kept locally, and later uploads try again", RuntimeWarning, stacklevel=1)
            self._failed = str(e)
            return
        self.upload_seconds = time.perf_counter() - t0
        self.uploaded_step = manifest.step
        self._uploaded(manifest.step)
        if self._failed is not None:
            warnings.warn(f"uploads to {self.url} resumed with step {manifest.step}", RuntimeWarning, stacklevel=1)
            self._failed = None

    def _copy(self, manifest: Manifest) -> bool:
        """Upload ``manifest``, pinned by the caller; unpinned at the end, up or not. False where it
        failed because the checkpoint was retired locally meanwhile (by a retention planned before the
        pin); asked while it is still pinned, so that a retention after the unpin does not pass a
        failure of the upload itself off as that."""
        try:
            if self._follows:
                self.ranks.broadcast("remote", manifest.to_bytes())  # the followers upload their shares with it
            self._round(manifest)
        except (EverystepError, OSError):
            if not self.directory.catalog.committed(manifest.name):
                return False
            raise
        finally:
            self.directory.pin([])
            crash_point("remote.unpinned")
        return True

    def _round(self, manifest: Manifest) -> None:
        """One upload, on every rank: its share of the objects, each verified on the way out; rank 0
        puts the manifest once every share is durable (raised on every rank if any failed)."""
        error: BaseException | None = None
        held = None
        if self.directory.catalog.hosts is not None:  # each rank uploads what its host's disk holds
            catalog = self.directory.catalog
            held = self.ranks.all_gather("remote", [o.name for o in manifest.objects.values() if catalog.has_object(o.name)])
        try:
            assert self._uploader is not None
            if share := self._share(manifest, held):
                self.bytes_up += self._uploader.put(share)  # each object verified on the way out
        except (EverystepError, OSError) as e:
            error = e
        what = f"the upload of step {manifest.step} to {self.url}"
        self.ranks.exchange("remote", {}, error, what)
        crash_point("remote.before_manifest")
        if self.lead:
            try:
                self.catalog.commit(manifest)  # last: the checkpoint is visible remotely from here on
                for name in plan_retention([r.manifest for r in self._fulls()], keep=self.keep):
                    self.catalog.discard(name)
            except (EverystepError, OSError) as e:
                error = e
        self.ranks.exchange("remote", {}, error, what)

    def _follow(self) -> None:
        """A rank other than 0: take part in each upload rank 0 starts, until it says the job closes."""
        while (command := self.ranks.broadcast("remote", None)) is not None:
            manifest = Manifest.from_bytes(command)
            try:
                self._round(manifest)
            except (EverystepError, OSError):
                continue  # rank 0 reports it
            self.uploaded_step = manifest.step
            self._uploaded(manifest.step)

    def wait(self) -> None:
        """Wait for the upload in flight, if any (its failure is reported, never raised)."""
        with self._lock:
            running = self._upload
        if running is not None:
            running.result()

    def flush(self) -> None:
        """Wait for the upload in flight, then upload the newest checkpoint if it is not there yet
        (rank 0; under several ranks every rank calls it, the others taking part in its upload)."""
        self.wait()
        if self.lead:
            self._worker.submit(f"the upload to {self.url}", self._upload_newest).result()

    def close(self, *, upload: bool = True) -> None:
        """Wait for the upload in flight; with ``upload``, then upload the newest checkpoint (the final
        one) if it is not there yet. Under several ranks, rank 0 then tells the others the job is
        closing, and each waits for that (``upload=False``, a failed rank's close: it does not)."""
        try:
            if upload:
                self.flush()
            else:
                self.wait()
        finally:
            try:
                if self._follows and self.lead:  # (after a failure a peer may be gone: not waited for)
                    said = self._worker.submit("closing the uploads", self.ranks.broadcast, "remote", None)
                    if upload:
                        said.result()
            finally:
                self._release(wait=upload)

    def _release(self, *, wait: bool) -> None:
        """End the upload thread (``wait``: for it to end), release the lock, close the store."""
        self._worker.close(wait=wait)
        if self._uploader is not None:
            self._uploader.close(wait=wait)
        if self.lock is not None:
            self.lock.release()
        self.store.close()
