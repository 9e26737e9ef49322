"""A :class:`~everystep.storage.base.Store` in S3-compatible object storage: ``s3://bucket/prefix``.

The client is boto3 (botocore): S3's own client, which every S3-compatible server (MinIO, Ceph's
RADOS Gateway, the clouds' own) is tested against; it brings multipart uploads, the standard retry
mode and the whole AWS credential chain, and nothing compiled. Credentials and the endpoint come
from that chain — ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE`` and the shared
config files, an instance's role; ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for a server other
than AWS's — and are never written into a checkpoint, a log or a message: errors name the URL.

What the store protocol asks, and what in S3 gives it:

- :meth:`put` is atomic and durable. A value of up to :data:`PART_BYTES` is one ``PutObject``; a
  larger one a multipart upload (:data:`PARALLEL_PARTS` parts in flight), which becomes an object only when ``CompleteMultipartUpload``
  succeeds. S3 makes an object visible whole or not at all, and durable once the request returns.
  An upload that fails is aborted; one whose process was killed stays in progress, invisible — no
  listing or read shows it — until :meth:`leftovers` lists it and :meth:`delete` aborts it.
- :meth:`list` is ``ListObjectsV2``, strongly consistent since December 2020 (a value put is
  listed by the next listing); the version of a value is its ETag.
- :meth:`create` is ``PutObject`` with ``If-None-Match: *`` (conditional writes, August 2024): of
  two writers creating one key, exactly one succeeds. A server that ignores the header (some older
  S3-compatible ones) cannot give one writer per prefix.
- There is no rename and no directory: :meth:`put_directory` uploads the files a format wrote into a
  local folder one by one under the directory's key; a catalog commits the manifest that names them
  after, so a checkpoint is still visible whole.
- :meth:`fetch` downloads a value into a folder of the store's own, removed at :meth:`close`.
"""

from __future__ import annotations

import email.utils
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..._faults import crash_point
from ...errors import CheckpointDirectoryError, ReadOnlyStoreError, RemoteStoreError
from ..base import Access

__all__ = ["S3Store", "parse_url", "redact", "client", "PART_BYTES"]

T = TypeVar("T")

PART_BYTES = 8 << 20
"""A value larger than this is uploaded in parts of this size (S3's minimum is 5 MiB)."""
PARALLEL_PARTS = 8
"""Parts of one value in flight at once (boto3's clients are thread-safe)."""

_URL = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>[^?#]*))?")
_PART = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.][A-Za-z0-9_.\-]*")
"""A name in a key, as in a local store: letters, digits, ``_.-``, never ``.`` or ``..``."""
_UPLOAD = "..upload/"
"""The key :meth:`S3Store.leftovers` gives an upload in progress: ``..upload/<upload id>/<key>``."""


_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def _own_key(key: str) -> bool:
    """Whether ``key`` (under the prefix) is one everystep writes uploads to: a plain name in one of
    its folders."""
    parts = key.split("/")
    return len(parts) >= 2 and parts[0] in ("objects", "manifests") and all(_PART.fullmatch(p) for p in parts)


def redact(text: str) -> str:
    """``text`` with the user information of any URL in it (``//KEY:SECRET@host``) replaced by
    ``…@``: an endpoint given with credentials in it (``AWS_ENDPOINT_URL``), or a URL typed so,
    is never printed whole."""
    return _USERINFO.sub("…@", text)


def parse_url(url: str) -> tuple[str, str]:
    """The bucket and the key prefix (``""`` or ending in ``/``) of ``s3://bucket/prefix``; ValueError
    naming the URL (its credentials, if it holds any, left out) when it is not one."""
    found = _URL.fullmatch(url)
    if found is None:
        raise ValueError(f"{redact(url)!r} is not an s3://bucket/prefix URL")
    prefix = (found["prefix"] or "").strip("/")
    if prefix and not all(_PART.fullmatch(p) for p in prefix.split("/")):
        raise ValueError(f"the prefix of {redact(url)!r} must be plain names separated by /")
    return found["bucket"], f"{prefix}/" if prefix else ""


def client() -> Any:
    """A boto3 S3 client from the AWS chain (credentials, endpoint, region), with standard retries."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise CheckpointDirectoryError("s3:// needs boto3: pip install 'everystep[s3]'") from e
    # botocore's standard retries: throttling and transient errors retried with backoff, 3 attempts
    # unless AWS_MAX_ATTEMPTS (or the profile's max_attempts) says otherwise
    return boto3.client("s3", config=Config(retries={"mode": "standard"}))


class S3Store:
    """Values as the objects under ``s3://bucket/prefix/`` (see the module docstring)."""

    def __init__(self, url: str, *, access: Access = "write", s3: Any = None) -> None:
        """``s3``: a boto3 S3 client to use (default: :func:`client`'s)."""
        self.bucket, self.prefix = parse_url(url)
        self.root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        """The URL, named in messages."""
        self.access: Access = access
        self._s3 = s3 if s3 is not None else client()
        self._cache: Path | None = None
        self._said_unlisted = False

    # -- keys and errors -----------------------------------------------------------------------

    def _key(self, key: str, *, folder: bool = False) -> str:
        """The object key of ``key``; ValueError for a key that is not plain names separated by /."""
        parts = key.split("/") if isinstance(key, str) else []
        if folder and parts and parts[-1] == "":
            parts = parts[:-1]
        if not parts or not all(_PART.fullmatch(p) for p in parts):
            raise ValueError(f"{key!r} is not a key of the store at {self.root}")
        return self.prefix + "/".join(parts) + ("/" if folder else "")

    def _check_writable(self) -> None:
        if self.access == "read":
            raise ReadOnlyStoreError(f"{self.root} was opened for reading; nothing may be written or deleted there")

    def _failed(self, what: str, key: str, error: BaseException) -> RemoteStoreError:
        """A failed request as the store's error, naming the object's URL and S3's code (never a credential)."""
        code = _code(error) or redact(f"{type(error).__name__}: {error}")  # (a client error: its code alone)
        return RemoteStoreError(f"{what} s3://{self.bucket}/{self.prefix}{key} failed: {code}{_hint(code)}")

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        """One ``PutObject``, or above :data:`PART_BYTES` a multipart upload whose parts go up
        :data:`PARALLEL_PARTS` at a time (memory: that many parts, and the one being filled)."""
        self._check_writable()
        name = self._key(key)
        pending, total, upload = bytearray(), 0, None
        sent: list[Future[dict[str, Any]]] = []
        pool: ThreadPoolExecutor | None = None

        def send(part: bytes) -> None:  # a part's worth: the value is uploaded in parts
            nonlocal upload, pool
            if upload is None:
                # CRC32 declared for the whole upload, each part's checked by the server and named
                # at completion, as boto3's own transfer does (a server then stores the parts with
                # less work: on moto, a third less time per upload)
                upload = self._s3.create_multipart_upload(Bucket=self.bucket, Key=name,
                                                          ChecksumAlgorithm="CRC32")["UploadId"]
                pool = ThreadPoolExecutor(PARALLEL_PARTS, thread_name_prefix="everystep-s3-part")
            assert pool is not None
            in_flight = [f for f in sent if not f.done()]
            if len(in_flight) >= PARALLEL_PARTS:
                in_flight[0].result()  # (raises the part's failure)
            sent.append(pool.submit(self._part, name, upload, len(sent) + 1, part))
            crash_point("store.remote.part")  # a part on its way, the value not complete

        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                total += len(view)
                at = 0
                if pending:  # the part begun by earlier chunks first
                    at = min(PART_BYTES - len(pending), len(view))
                    pending += view[:at]
                    if len(pending) == PART_BYTES:
                        send(bytes(pending))
                        pending.clear()
                while len(view) - at >= PART_BYTES:  # (one copy per part, straight from the chunk)
                    send(bytes(view[at:at + PART_BYTES]))
                    at += PART_BYTES
                pending += view[at:]
            if upload is None:
                self._s3.put_object(Bucket=self.bucket, Key=name, Body=bytes(pending))
                return total
            assert pool is not None
            if pending or not sent:
                sent.append(pool.submit(self._part, name, upload, len(sent) + 1, bytes(pending)))
            parts = [f.result() for f in sent]
            self._s3.complete_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload,
                                               MultipartUpload={"Parts": parts})
        except Exception as e:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            if upload is not None:
                self._abort(name, upload)
            raise self._failed("writing", key, e) from None
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        return total

    def _part(self, name: str, upload: str, number: int, data: bytes) -> dict[str, Any]:
        done = self._s3.upload_part(Bucket=self.bucket, Key=name, UploadId=upload, PartNumber=number, Body=data,
                                    ChecksumAlgorithm="CRC32")
        return {"PartNumber": number, "ETag": done["ETag"],
                **({"ChecksumCRC32": done["ChecksumCRC32"]} if done.get("ChecksumCRC32") else {})}

    def _abort(self, name: str, upload: str) -> None:
        try:
            self._s3.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
        except Exception:
            pass  # (then it is a leftover, which garbage collection aborts)

    def create(self, key: str, data: bytes) -> str | None:
        """Write ``key`` only if no value has it (``If-None-Match: *``): its version (ETag) when this
        call created it, None when one was there. Of several writers at once, exactly one succeeds."""
        return self._conditional("creating", key, data, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, version: str) -> str | None:
        """Write ``key`` only if its value is still the one of ``version`` (``If-Match``): the new
        version, or None when it changed meanwhile. Of several writers at once, at most one succeeds."""
        return self._conditional("replacing", key, data, IfMatch=version)

    def _conditional(self, what: str, key: str, data: bytes, **condition: str) -> str | None:
        self._check_writable()
        name = self._key(key)
        try:
            return str(self._s3.put_object(Bucket=self.bucket, Key=name, Body=data, **condition)["ETag"])
        except Exception as e:
            if _code(e) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "NoSuchKey", "404"):
                return None
            raise self._failed(what, key, e) from None

    def age(self, key: str) -> tuple[str, float] | None:
        """The version of ``key`` and the seconds since it was written, by the server's clock (its
        ``Date`` against the value's ``Last-Modified``: no clock of this machine enters; 0 when the
        server sends no ``Date``); None when there is no value."""
        name = self._key(key)
        try:
            head = self._s3.head_object(Bucket=self.bucket, Key=name)
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._failed("reading", key, e) from None
        date = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        if date is None:  # a server that sends no Date: the value counts as just written (a lease's wait, at most)
            return str(head["ETag"]), 0.0
        now = email.utils.parsedate_to_datetime(date)
        return str(head["ETag"]), (now - head["LastModified"]).total_seconds()

    def put_directory(self, key: str, fill: Callable[[Path], T], *, lead: bool = True) -> T:
        """``fill`` writes into a local temporary folder; its files are then uploaded under ``key/``
        (by every caller: each uploads the files of its own folder, a rank its own)."""
        self._check_writable()
        self._key(key)
        with tempfile.TemporaryDirectory(prefix="everystep-s3-") as tmp:
            folder = Path(tmp) / "value"
            result = fill(folder)
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    with open(path, "rb") as f:
                        self.put(f"{key}/{path.relative_to(folder).as_posix()}", iter(lambda: f.read(PART_BYTES), b""))
        return result

    # -- reading -------------------------------------------------------------------------------

    def get(self, key: str, *, limit: int | None = None) -> bytearray:
        """With ``limit``, a ranged GET of ``limit`` + 1 bytes: a longer object is refused (a
        ValueError) without downloading it."""
        name = self._key(key)
        ranged = {} if limit is None else {"Range": f"bytes=0-{limit}"}
        try:
            answer = self._s3.get_object(Bucket=self.bucket, Key=name, **ranged)
            data = bytearray(answer["Body"].read(None if limit is None else limit + 1))
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"no value {key!r} in {self.root}") from None
            if _code(e) in ("InvalidRange", "416"):  # (an empty object has no byte 0)
                return bytearray()
            raise self._failed("reading", key, e) from None
        if limit is not None and len(data) > limit:
            total = str(answer.get("ContentRange", "")).rpartition("/")[2] or f"more than {limit}"
            raise ValueError(f"{self.root}/{key} holds {total} bytes, more than the {limit} expected")
        return data

    def list(self, prefix: str) -> dict[str, str]:
        folder, _, start = prefix.rpartition("/")
        if folder:
            self._key(folder)
        if start and not _PART.fullmatch(start):
            raise ValueError(f"{prefix!r} is not a prefix of keys of the store at {self.root}")
        found: dict[str, str] = {}
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    key = item["Key"][len(self.prefix):]
                    if all(_PART.fullmatch(p) for p in key.split("/")):  # (what everystep could have written)
                        found[key] = item["ETag"]
        except Exception as e:
            raise self._failed("listing", prefix, e) from None
        return dict(sorted(found.items()))

    def leftovers(self) -> list[tuple[str, str]]:
        """The multipart uploads in progress under the prefix's folders of everystep's (a writer killed
        mid-upload): for each, ``("..upload/<id>/<key>", key)`` (a key no value can have). Uploads
        under keys everystep never writes (another folder, a name with a space) are not its: left.
        A server that cannot list uploads (``NotImplemented``) has none listed, with one warning."""
        found = []
        try:
            for page in self._s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.prefix):
                for upload in page.get("Uploads", []):
                    key = upload["Key"][len(self.prefix):]
                    if _own_key(key):
                        found.append((f"{_UPLOAD}{upload['UploadId']}/{key}", key))
        except Exception as e:
            if _code(e) not in ("NotImplemented", "501"):
                raise self._failed("listing the uploads under", "", e) from None
            if not self._said_unlisted:
                self._said_unlisted = True
                warnings.warn(f"{self.root}: the server cannot list multipart uploads ({_code(e)}), so the uploads a "
                              "killed writer left are not aborted here (they stay invisible; the server's own "
                              "lifecycle rules may remove them)", RuntimeWarning, stacklevel=2)
        return sorted(found)

    def fetch(self, key: str) -> Path:
        """The value ``key`` downloaded (a directory value: each of its files) into the store's folder."""
        self._key(key)
        if self._cache is None:
            self._cache = Path(tempfile.mkdtemp(prefix="everystep-s3-cache-"))
        target = self._cache.joinpath(*key.split("/"))
        inside = self.list(f"{key}/")
        if not inside:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.get(key))
            return target
        for name in inside:
            path = self._cache.joinpath(*name.split("/"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.get(name))
        return target

    # -- removing ------------------------------------------------------------------------------

    def delete(self, key: str, *, durable: bool = True) -> None:
        """A value, every value under a directory value's key, or (a key :meth:`leftovers` gave) an
        upload in progress, aborted. S3's deletes are durable once they return."""
        self._check_writable()
        if key.startswith(_UPLOAD):
            upload, _, name = key[len(_UPLOAD):].partition("/")
            self._abort(self._key(name), upload)
            return
        keys = [self._key(key), *(self.prefix + k for k in self.list(f"{key}/"))]
        try:
            for start in range(0, len(keys), 1000):  # (DeleteObjects takes up to 1000 keys)
                self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]],
                                                                     "Quiet": True})
        except Exception as e:
            raise self._failed("deleting", key, e) from None

    def close(self) -> None:
        """Remove the folder :meth:`fetch` downloads into."""
        cache, self._cache = self._cache, None
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


def _code(error: BaseException) -> str | None:
    """S3's error code (``NoSuchKey``, ``AccessDenied``, …) of a botocore error, or None."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code") or "") or None
    return None


def _hint(code: str) -> str:
    return {
        "NoSuchBucket": " (the bucket does not exist: create it, or correct the URL)",
        "InvalidAccessKeyId": " (the credentials are not known to the server: check AWS_ACCESS_KEY_ID or AWS_PROFILE)",
        "SignatureDoesNotMatch": " (the secret key is wrong: check AWS_SECRET_ACCESS_KEY or AWS_PROFILE)",
        "AccessDenied": " (the credentials may not do this here)",
        "NoCredentialsError": " (no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
        "EndpointConnectionError": " (the server cannot be reached: check AWS_ENDPOINT_URL)",
    }.get(code, "")
