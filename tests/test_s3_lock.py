"""One writer per prefix of an object store (:mod:`everystep.storage.remote.lock`), against a real
server (moto's, as in ``test_s3_store.py``): a server that ignores conditional writes, a second
writer, a stale or forged lock."""

from __future__ import annotations

import json
import os
import time

import pytest

from .conftest import TamperedClient

from everystep.storage.stores.s3 import S3Store


def test_a_server_that_ignores_conditional_writes_is_refused_naming_them_never_two_writers(tmp_path, bucket):
    """A server that drops If-None-Match and If-Match (as older S3-compatible servers do; here moto,
    sent the writes without their conditions) would let a second writer take the lock at once: the
    tier refuses it, naming conditional writes, and nothing of the probe stays behind."""
    import boto3

    from everystep.errors import RemoteStoreError
    from everystep.storage import CheckpointDirectory
    from everystep.storage.remote.tier import RemoteConfig, RemoteTier

    class Unconditional(S3Store):
        def _conditional(self, what, key, data, **condition):
            return super()._conditional(what, key, data)  # the server never sees the condition

    url = f"s3://{bucket}/job"
    directory = CheckpointDirectory.open(tmp_path / "c", strategy="checkfreq")
    try:
        with pytest.raises(RemoteStoreError, match="does not honour conditional writes .*If-None-Match, If-Match"):
            RemoteTier(RemoteConfig(url, every=2, mtbf=3600.0), directory, keep=2, store=Unconditional(url))
    finally:
        directory.close()
    left = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="job/").get("Contents", [])
    assert [o["Key"] for o in left] == ["job/everystep.json"]  # (the prefix's marker, written first)


def test_a_second_writer_on_a_live_writers_prefix_is_refused(bucket, tmp_path):
    from everystep import Checkpointer, RemoteConfig
    from everystep.errors import DirectoryInUseError
    from everystep.eval.workloads import build

    url = f"s3://{bucket}/one"
    a, b = build("mlp", seed=0), build("mlp", seed=0)
    with Checkpointer(tmp_path / "a", a.model, a.optimizer, strategy="full_sync", remote=RemoteConfig(url, lease=1.5)) as first:
        first.restore()
        with pytest.warns(RuntimeWarning, match=r"waiting \d+ s for the lock to expire"):
            with pytest.raises(DirectoryInUseError, match=f"{url} is being written by another job .host .*, pid {os.getpid()}"):
                Checkpointer(tmp_path / "b", b.model, b.optimizer, strategy="full_sync", remote=RemoteConfig(url, lease=1.5))



@pytest.mark.parametrize("edit", ["no Date header", "written in 2099"])
def test_a_stale_lock_whose_age_cannot_be_read_is_taken_over_after_one_lease_at_most(bucket, edit):
    """A lock left by a lost writer, read from a server that sends no ``Date`` or says the lock was
    written in 2099: the next writer waits one lease at most, then takes it over; no traceback."""
    import datetime
    import warnings

    from everystep.storage.remote.lock import LOCK_KEY, RemoteLock

    url = f"s3://{bucket}/job"
    store = S3Store(url)
    store.create(LOCK_KEY, json.dumps({"holder": "gone", "host": "lost-host", "pid": 7}).encode())

    def change(head):
        if edit == "no Date header":
            del head["ResponseMetadata"]["HTTPHeaders"]["date"]
        else:
            head["LastModified"] = datetime.datetime(2099, 1, 1, tzinfo=datetime.timezone.utc)

    store._s3 = TamperedClient(store._s3, change)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lock = RemoteLock(store, url, lease=1.0)
    try:
        assert time.monotonic() - t0 < 1.0 + 0.5 + 5  # one lease, the half second after it, the requests
        assert [str(w.message) for w in caught] == [f"{url} is locked by host lost-host, pid 7; waiting 1 s for the lock "
                                                    "to expire (a live writer renews it before then)"]
        assert json.loads(bytes(store.get(LOCK_KEY)))["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_forged_lock_prints_no_control_characters(bucket):
    """A ``writer.lock`` whose host holds terminal escapes and a line of its own: the warning shows
    them escaped, on one line."""
    import warnings

    from everystep.storage.remote.lock import LOCK_KEY, RemoteLock

    url = f"s3://{bucket}/job"
    store = S3Store(url)
    store.create(LOCK_KEY, json.dumps({"host": "\x1b[2J\x1b[Hok\neverystep: all clear", "pid": "1\r"}).encode())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # (a lease long enough that the forged lock is still live when the writer looks at it, on a loaded machine)
        lock = RemoteLock(store, url, lease=2.0)
    lock.release()
    (said,) = [str(w.message) for w in caught]
    assert "\x1b" not in said and "\n" not in said and "\r" not in said and "\\x1b[2J" in said, said
