"""The Store protocol (where bytes live), the Reader protocol (what reads checkpoints) and the
records they exchange: objects, manifests, checksums.

Three layers keep a checkpoint directory: a :class:`Store` keeps values whole under keys (a local
folder: :class:`~everystep.storage.stores.local.LocalStore`); a
:class:`~everystep.storage.catalog.Catalog` makes checkpoints of them (objects checksummed, a
manifest committed last, discarded manifest first); a
:class:`~everystep.storage.directory.CheckpointDirectory` manages the directory as a whole (its
identity, its one writer, retention, garbage collection).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Protocol, TypeVar

import xxhash

from ..errors import CorruptCheckpointError

if TYPE_CHECKING:
    from ..distributed import Ranks

__all__ = ["malformed", "MALFORMED", "refuse_constant", "ObjectFile", "ObjectInfo", "Manifest", "check_object_name", "check_manifest_name",
           "manifest_name", "MAX_STEP", "ManifestRecord", "Store", "Reader", "Access", "new_hasher", "checksum", "CHECKSUM_ALGORITHM",
           "read_verified", "fetch_object", "check_object", "check_bytes", "check_digest"]

Access = Literal["write", "shared", "read"]
"""``write``: the directory's one writer; ``shared``: a process writing on the writer's behalf (its
checkpoint agent); ``read``: changes nothing."""
T = TypeVar("T")

CHECKSUM_ALGORITHM = "xxh3_128"


def new_hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


def checksum(data: bytes | bytearray | memoryview) -> str:
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


@dataclass(frozen=True, slots=True)
class ObjectFile:
    """An object opened as a file to read once (:meth:`~everystep.storage.catalog.Catalog.open_object`):
    its size is checked; its bytes are not — whoever reads them hashes what it reads against the
    object's checksum before it uses any of it."""

    file: BinaryIO
    size: int
    where: str
    """The object as messages name it."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A stored object: its name in the store, its size and its checksum."""

    name: str
    nbytes: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "nbytes": self.nbytes, "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ObjectInfo":
        """Raises ValueError when a field is missing, of another type, or a name everystep does not write."""
        return cls(name=check_object_name(_field(d, "name", str)), nbytes=_count(_field(d, "nbytes", int), "nbytes", 1 << 62),
                   checksum=_field(d, "checksum", str))


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A committed checkpoint.

    ``kind`` is ``"full"`` or a differential kind; ``requires`` names the manifests this one
    cannot be recovered without (a differential's base), which retention keeps alive.
    """

    kind: str
    step: int
    objects: dict[str, ObjectInfo]
    meta: dict[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    rank: int = 0

    @property
    def name(self) -> str:
        return manifest_name(self.kind, self.step, self.rank)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.objects.values())

    def body(self) -> dict[str, Any]:
        return {
            "format": "everystep-manifest",
            "version": 1,
            "kind": self.kind,
            "step": self.step,
            "rank": self.rank,
            "objects": {k: o.to_json() for k, o in self.objects.items()},
            "requires": list(self.requires),
            "meta": self.meta,
        }

    def to_bytes(self) -> bytes:
        """The manifest's file: compact JSON, which the C encoder writes (a manifest holds the state's
        whole skeleton; indented JSON goes through the pure-Python encoder, milliseconds per
        checkpoint of the writer thread's time, under the GIL)."""
        canonical = _canonical(self.body())
        # the checksum goes in as one more key: the file is the canonical body with it added
        return canonical[:-1] + b',"checksum":' + json.dumps(checksum(canonical)).encode() + b"}\n"

    @classmethod
    def from_bytes(cls, data: bytes, *, name: str | None = None) -> "Manifest":
        """Parse and verify a manifest; raises ValueError naming what is wrong.

        IMPORTANT: everything a manifest names becomes a path (its objects, its kind in its own
        name, what it requires), and a checksum proves nothing about who wrote it: each is checked
        against what everystep writes before anything uses it. ``name``: the name the manifest is
        stored under, which must be its own.
        """
        try:
            body = json.loads(data, parse_constant=refuse_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"manifest is not valid JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != "everystep-manifest":
            raise ValueError("not an everystep manifest")
        stored = body.pop("checksum", None)
        if stored != checksum(_canonical(body)):
            raise ValueError("manifest checksum mismatch")
        objects, requires = _field(body, "objects", dict), _field(body, "requires", list)
        manifest = cls(
            kind=_kind(_field(body, "kind", str)),
            step=_count(_field(body, "step", int), "step", MAX_STEP),
            rank=_count(body.get("rank", 0), "rank", MAX_RANK),
            objects={_typed(k, "object key", str): ObjectInfo.from_json(_typed(v, "object", dict)) for k, v in objects.items()},
            meta=_field(body, "meta", dict),
            requires=tuple(check_manifest_name(r) for r in requires),
        )
        if name is not None and manifest.name != name:
            raise ValueError(f"it is stored as {name} but names itself {manifest.name}")
        own = f"{manifest.kind}-{manifest.step:012d}"
        for info in manifest.objects.values():  # a manifest cannot claim another checkpoint's objects
            if not info.name.startswith(own) or info.name[len(own):len(own) + 1].isdigit():
                raise ValueError(f"its object {info.name} is not named for its checkpoint ({own}…)")
        return manifest


MAX_STEP = 10**12 - 1
"""The largest step a manifest may name (its name holds twelve digits)."""
MAX_RANK = 1 << 20
_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}|\.metadata")
_MANIFEST_NAME = re.compile(r"(?P<kind>[a-z][a-z0-9_]{0,31})-(?P<step>[0-9]{12})(?:-r(?P<rank>[1-9][0-9]{0,6}))?")


def fetch_object(open_value: Callable[[], T], info: ObjectInfo, where: str) -> T:
    """``open_value()`` — the store's ``get`` or ``open_value`` of the object ``info`` describes —,
    with what makes it :class:`CorruptCheckpointError` naming ``where``: a name everystep does not
    write, a missing object, a value that is not one (a link, a folder), one longer than ``info`` says."""
    try:
        check_object_name(info.name)
        return open_value()
    except ValueError as e:
        raise CorruptCheckpointError(str(e)) from None
    except (FileNotFoundError, IsADirectoryError):
        raise CorruptCheckpointError(f"object {where} is missing") from None


def check_object(info: ObjectInfo, where: str, size: int) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``where`` unless the object is ``info``'s size and
    its checksum one everystep computes."""
    if size != info.nbytes:
        raise CorruptCheckpointError(f"object {where} has {size} bytes; its manifest says {info.nbytes} (truncated?)")
    algorithm, _, _ = info.checksum.partition(":")
    if algorithm != CHECKSUM_ALGORITHM:
        raise CorruptCheckpointError(f"object {where} has checksum algorithm {algorithm!r}; expected {CHECKSUM_ALGORITHM}")


def read_verified(store: "Store", key: str, info: ObjectInfo, where: str) -> bytearray:
    """The bytes of the object ``info`` describes, ``key`` in ``store``, once their size and checksum
    are verified; :class:`CorruptCheckpointError` naming ``where`` when it is missing or they differ."""
    data = fetch_object(lambda: store.get(key, limit=info.nbytes), info, where)
    check_bytes(info, data, where)
    return data


def check_bytes(info: ObjectInfo, data: bytes | bytearray | memoryview, where: str, *, what: str | None = None) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``where`` (the checksum's failure: ``what``, by
    default ``object {where}``) unless ``data`` is the object ``info`` describes, its size and checksum."""
    check_object(info, where, len(data))
    hasher = new_hasher()
    hasher.update(data)
    check_digest(hasher, info.checksum, what or f"object {where}")


def check_digest(hasher: "xxhash.xxh3_128", expected: str, what: str) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``what`` unless the bytes ``hasher`` took are
    those the checksum ``expected`` names: the one check every object read passes."""
    if f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}" != expected:
        raise CorruptCheckpointError(f"{what} fails its checksum (corrupted on storage?)")


def manifest_name(kind: str, step: int, rank: int = 0) -> str:
    """The name of the manifest of ``kind`` for ``step`` (a rank's part of it: ``rank``), as stored."""
    return f"{kind}-{step:012d}" + (f"-r{rank}" if rank else "")


def check_object_name(name: str) -> str:
    """``name`` if it is an object name everystep writes — a file, or a file in one folder
    (``full-….dcp/__0_0.distcp``), never absolute, never ``..`` — else ValueError."""
    parts = name.split("/")
    if len(parts) > 2 or not all(_PART.fullmatch(p) and p not in (".", "..") for p in parts) \
            or parts[0].startswith("."):
        raise ValueError(f"object name {name!r} is not one everystep writes")
    return name


def check_manifest_name(name: Any) -> str:
    """``name`` if it is a manifest name everystep writes (``full-000000000012``, ``diff-…-r3``), else ValueError."""
    if not isinstance(name, str) or not _MANIFEST_NAME.fullmatch(name):
        raise ValueError(f"manifest name {name!r} is not one everystep writes")
    return name


def refuse_constant(text: str) -> Any:
    """``json.loads``'s ``parse_constant``: NaN and Infinity are not JSON, and nothing everystep writes."""
    raise ValueError(f"{text} is not a number JSON allows")


def _field(body: dict[str, Any], key: str, kind: type) -> Any:
    if key not in body:
        raise ValueError(f"its field {key!r} is missing")
    return _typed(body[key], f"field {key!r}", kind)


def _typed(value: Any, what: str, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"its {what} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _count(value: Any, what: str, most: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ValueError(f"its {what} {value!r} is not an integer from 0 to {most}")
    return value


def _kind(kind: str) -> str:
    if not _KIND.fullmatch(kind):
        raise ValueError(f"its kind {kind!r} is not one everystep writes")
    return kind


MALFORMED = (KeyError, ValueError, TypeError, IndexError, AttributeError, RecursionError, OverflowError)
"""What reading a malformed value raises: of something read from storage, it means corrupt."""


@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn what a malformed value read from storage raises into :class:`CorruptCheckpointError`
    naming ``what``, so that the reader skips it and falls back, as for a failed checksum."""
    try:
        yield
    except CorruptCheckpointError:
        raise
    except MALFORMED as e:
        raise CorruptCheckpointError(f"{what} is malformed ({type(e).__name__}: {e})") from None


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class ManifestRecord:
    """One entry of :meth:`Store.manifests`: a manifest that parsed, or why it did not."""

    name: str
    manifest: Manifest | None
    error: str | None = None


class Store(Protocol):
    """Where the bytes of a checkpoint directory live: whole values under keys such as
    ``objects/full-000000000012.safetensors``, ``manifests/full-000000000012.json`` or
    ``everystep.json``. What makes them checkpoints — checksums, the manifest written last, what a
    discard removes and in which order — is written once, above every store, by
    :class:`~everystep.storage.catalog.Catalog`; a store has only to keep each value whole.

    IMPORTANT: :meth:`put` is atomic and durable. A value becomes visible only whole, once durable, and
    a crash at any instant leaves the old value, or none, or the new one. A catalog commits a
    checkpoint by putting its manifest after its objects; that is a commit only if this holds.
    """

    root: Path
    """Where the store is (named in messages)."""
    access: Access
    """``read``: :meth:`put`, :meth:`put_directory` and :meth:`delete` raise
    :class:`~everystep.errors.ReadOnlyStoreError`, and nothing is created, renamed or deleted."""

    def put(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Write the value ``key`` from ``chunks``, atomically and durably, over any value it had; the
        bytes written. Each chunk is consumed before the next is asked for (a caller hashes them on
        the way)."""
        ...

    def get(self, key: str, *, limit: int | None = None) -> bytearray:
        """The value ``key``; :class:`FileNotFoundError` when there is none. With ``limit``, no more
        than that many bytes (and one) are read: a longer value is a ValueError naming it."""
        ...

    def list(self, prefix: str) -> dict[str, str]:
        """The keys under ``prefix`` (``"manifests/"``), each with a version that changes when its value
        is written again; values inside a directory value count as keys of their own
        (``objects/full-….dcp/__0_0.distcp``). What interrupted writes left is not listed."""
        ...

    def delete(self, key: str, *, durable: bool = True) -> None:
        """Delete the value ``key``, or the directory value ``key``; nothing when there is none.
        ``durable``: a crash after it returns cannot bring the value back (a catalog asks this of a
        manifest's deletion; an object's may come back, as garbage that collection removes)."""
        ...

    def leftovers(self) -> list[tuple[str, str]]:
        """What interrupted writes left: (its key, which :meth:`delete` takes; the key it was being
        written under) for each."""
        ...

    def put_directory(self, key: str, fill: Callable[[Path], T]) -> T:
        """Write a value that is a directory of files (a DCP checkpoint): ``fill`` writes them into the
        local folder it is given; the directory becomes visible whole, once durable, after ``fill``
        returns. Returns what ``fill`` returned. Under several ranks every rank calls it at once with
        one folder, ``fill`` returning only once every rank's files are written (a collective), and
        rank 0 installs the directory."""
        ...

    def fetch(self, key: str) -> Path:
        """A local path holding the value ``key`` (a file, or a directory value's folder), for a format
        that reads by path; ValueError for a key that would lie outside the store."""
        ...

    def close(self) -> None:
        """Release what the store keeps for the writes to come (it may still be read)."""
        ...


class ConditionalStore(Store, Protocol):
    """A store whose writes can be made conditional on a value's version, as object storage's are
    (``If-None-Match``, ``If-Match``): what the lock that keeps one writer on a remote prefix rests
    on (:class:`~everystep.storage.remote.lock.RemoteLock`)."""

    def create(self, key: str, data: bytes) -> str | None:
        """Write ``key`` only if no value has it: its version when this call created it, None when one
        was there. Of several writers at once, exactly one succeeds."""
        ...

    def replace(self, key: str, data: bytes, version: str) -> str | None:
        """Write ``key`` only if its value is still the one of ``version``: the new version, or None
        when it changed meanwhile. Of several writers at once, at most one succeeds."""
        ...

    def age(self, key: str) -> tuple[str, float] | None:
        """The version of ``key`` and the seconds since it was written, by the store's clock; None when
        there is no value."""
        ...


class Reader(Protocol):
    """What reads checkpoints: the manifests committed, and their objects verified. A
    :class:`~everystep.storage.catalog.Catalog` over a store is one; lightcheck's region is another."""

    root: Path
    ranks: "Ranks"
    access: Access

    def manifests(self) -> list[ManifestRecord]:
        """Every manifest, parsed and verified, or why it is not."""
        ...

    def read_object(self, info: ObjectInfo) -> bytearray:
        """The object's bytes, after its size and checksum are verified."""
        ...

    def committed(self, manifest_name: str) -> bool:
        """Whether the checkpoint is still committed (a writer may discard it while a reader reads it)."""
        ...

    def discard(self, manifest_name: str) -> None:
        """Uncommit a checkpoint and delete what only it used."""
        ...

    def check_writable(self) -> None:
        """Raise :class:`~everystep.errors.ReadOnlyStoreError` if opened for reading."""
        ...

    def stored_files(self) -> list[str]:
        """Every file holding objects, as an object name (``verify`` compares it with the manifests)."""
        ...
