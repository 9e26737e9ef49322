"""The store in S3-compatible object storage (:mod:`everystep.storage.stores.s3`), against a real server:
moto's standalone server, started as a process of its own on loopback and reached over HTTP by boto3,
as any S3 endpoint is (``AWS_ENDPOINT_URL``). Nothing of the client is patched."""

from __future__ import annotations

import os
import signal

import pytest

from everystep.distributed import free_port
from everystep.errors import CorruptCheckpointError, RemoteStoreError
from everystep.storage.base import Manifest
from everystep.storage.catalog import Catalog

from .conftest import TamperedClient, ROOT
from .forked import run_script

from everystep.storage.stores.s3 import PART_BYTES, S3Store, parse_url

from .conftest import S3_SECRET as SECRET


def test_urls_are_parsed_and_bad_ones_named():
    assert parse_url("s3://my-bucket/runs/job-1") == ("my-bucket", "runs/job-1/")
    assert parse_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("s3:/b/p", "http://b/p", "s3://B/p", "s3://bucket/a/../b"):
        with pytest.raises(ValueError, match="s3://"):
            parse_url(bad)


def test_values_are_put_whole_listed_with_versions_read_and_deleted(bucket):
    store = S3Store(f"s3://{bucket}/job")
    big = os.urandom(2 * PART_BYTES + 12345)  # three parts of a multipart upload
    assert store.put("objects/big", [big[:100], memoryview(big)[100:]]) == len(big)
    assert store.put("manifests/a.json", [b"{}"]) == 2
    listed = store.list("")
    assert set(listed) == {"objects/big", "manifests/a.json"} and all(listed.values())
    assert store.get("objects/big") == big
    first = listed["manifests/a.json"]
    store.put("manifests/a.json", [b'{"x": 1}'])
    assert store.list("manifests/")["manifests/a.json"] != first  # its version changed with its value
    store.delete("objects/big")
    assert "objects/big" not in store.list("objects/")
    with pytest.raises(FileNotFoundError):
        store.get("objects/big")
    for bad in ("../x", "/abs", "objects//x", "objects/.."):
        with pytest.raises(ValueError, match="is not a key"):
            store.get(bad)


def test_a_directory_value_is_uploaded_file_by_file_fetched_and_deleted_whole(bucket):
    store = S3Store(f"s3://{bucket}/d")

    def fill(folder):
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"zero")
        (folder / ".metadata").write_bytes(b"meta")
        return "filled"

    assert store.put_directory("objects/full-1.dcp", fill) == "filled"
    assert set(store.list("objects/")) == {"objects/full-1.dcp/__0_0.distcp", "objects/full-1.dcp/.metadata"}
    local = store.fetch("objects/full-1.dcp")
    assert (local / "__0_0.distcp").read_bytes() == b"zero"
    store.delete("objects/full-1.dcp")
    assert store.list("objects/") == {}
    store.close()
    assert not local.exists()


def test_of_two_writers_creating_one_key_exactly_one_succeeds(bucket):
    a, b = S3Store(f"s3://{bucket}/p"), S3Store(f"s3://{bucket}/p")
    version = a.create("writer.lock", b"a")
    assert version and b.create("writer.lock", b"b") is None
    assert a.get("writer.lock") == b"a"
    # a conditional replace: whoever holds the version it read, once
    newer = b.replace("writer.lock", b"b", version)
    assert newer and a.replace("writer.lock", b"a", version) is None and a.get("writer.lock") == b"b"


_KILLED_MID_UPLOAD = """
import os, signal, sys
from everystep.storage.stores.s3 import PART_BYTES, S3Store

def chunks():
    yield os.urandom(PART_BYTES + 1)  # the first part goes up with the next chunk
    yield b"x"
    os.kill(os.getpid(), signal.SIGKILL)  # killed between parts, the upload in progress
    yield b"never"

S3Store(sys.argv[1]).put("objects/full-000000000007.safetensors", chunks())
"""


def test_a_writer_killed_mid_upload_leaves_nothing_visible_and_its_upload_is_aborted(bucket):
    url = f"s3://{bucket}/k"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = run_script(_KILLED_MID_UPLOAD, url, env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stdout[-2000:]
    store = S3Store(url)
    assert store.list("") == {}  # nothing of it is an object
    (token, key), = store.leftovers()
    assert key == "objects/full-000000000007.safetensors"
    store.delete(token)
    assert store.leftovers() == []


def test_a_catalog_in_s3_commits_reads_and_refuses_a_tampered_object(bucket):
    import boto3

    catalog = Catalog(S3Store(f"s3://{bucket}/c"))
    info = catalog.write_object("full-000000000003.safetensors", [b"tensor bytes"])
    catalog.commit(Manifest(kind="full", step=3, objects={"tensors": info}))
    (record,) = catalog.manifests()
    assert record.manifest.step == 3 and catalog.read_object(info) == b"tensor bytes"
    # re-uploaded with other bytes by someone else: its checksum no longer matches
    boto3.client("s3").put_object(Bucket=bucket, Key="c/objects/full-000000000003.safetensors", Body=b"tensor bytez")
    with pytest.raises(CorruptCheckpointError):
        Catalog(S3Store(f"s3://{bucket}/c", access="read")).read_object(info)


def test_a_missing_bucket_is_one_error_naming_the_url_and_never_the_secret(server):
    with pytest.raises(RemoteStoreError) as failed:
        S3Store("s3://no-such-bucket/x").put("objects/a", [b"1"])
    message = str(failed.value)
    assert "s3://no-such-bucket/x/objects/a" in message and "NoSuchBucket" in message and "bucket does not exist" in message
    assert SECRET not in message and "testing" not in message


@pytest.mark.parametrize("url", ["s3://", "s3://b", "s3://Upper/x", "s3://b/../x", "s3://b/./x", "s3://b/a b", "s3://b/a?x",
                                 "s3://user:pass@b/x"])
def test_a_malformed_url_is_one_line_naming_it_from_every_command(capsys, url):
    """``verify``, ``inspect`` and ``recover`` as ``train --remote``: one line and status 2, never a
    traceback, and a URL's credentials never printed."""
    from .conftest import call_cli

    for args in (("verify", url), ("inspect", url), ("recover", "--dir", url)):
        code, out, err = call_cli(capsys, *args)
        assert code == 2 and "is not an s3://bucket/prefix URL" in err and len(err.strip().splitlines()) == 1, (args, err)
        assert "pass" not in err and "Traceback" not in err


def test_credentials_in_the_endpoint_url_are_never_printed(server, capsys, monkeypatch):
    from .conftest import call_cli

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://KEYID:{SECRET}@127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    code, out, err = call_cli(capsys, "verify", "s3://bucket/x")
    assert code == 2 and "Could not connect to the endpoint URL" in err and "127.0.0.1" in err, err
    assert SECRET not in err and "KEYID" not in err


def test_a_remote_object_longer_than_its_manifest_says_is_refused_without_downloading_it(bucket):
    """An object replaced in the bucket by one of 8 MiB where its manifest says 100 bytes: reading it
    takes 101 bytes, and refuses it naming both sizes."""
    import boto3

    url = f"s3://{bucket}/job"
    catalog = Catalog(S3Store(url))
    info = catalog.write_object("full-000000000001.safetensors", [b"x" * 100])
    boto3.client("s3").put_object(Bucket=bucket, Key="job/objects/full-000000000001.safetensors", Body=b"y" * (8 << 20))
    received = []

    class Counting(TamperedClient):
        def get_object(self, **kwargs):
            answer = self._client.get_object(**kwargs)
            body = answer["Body"]

            class Body:
                def read(self, n=None):
                    data = body.read(n)
                    received.append(len(data))
                    return data

            return {**answer, "Body": Body()}

    reader = Catalog(S3Store(url, s3=Counting(boto3.client("s3"), lambda head: None)))
    with pytest.raises(CorruptCheckpointError, match=f"holds {(8 << 20)} bytes, more than the 100 expected"):
        reader.read_object(info)
    assert sum(received) == 101
