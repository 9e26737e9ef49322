"""The Store protocol and the records it exchanges.

A store holds immutable *objects* (byte blobs with a checksum, or directories of files written by
another format's writer) and *manifests* (JSON records that name a checkpoint's objects). Call
order for one checkpoint:

1. ``write_object`` (or ``write_directory``) once per object; each is durable when it returns,
   but invisible.
2. ``commit(manifest)``; the checkpoint is visible to recovery exactly when this returns.

Readers call ``manifests()`` and then ``read_object`` for the objects of the manifest they want.
``discard(manifest)`` removes a checkpoint: the manifest first, then the objects only it used.
A store opened with ``access="read"`` refuses every change (``check_writable`` says so).

The directory as a whole — its identity, its one writer, retention and garbage collection — is
managed above the store, by :class:`~everystep.storage.directory.CheckpointDirectory`, through
the listing and deletion calls at the end of the protocol.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import xxhash

from ..errors import CorruptCheckpointError

if TYPE_CHECKING:
    from ..distributed import Ranks

__all__ = ["malformed", "MALFORMED", "refuse_constant", "ObjectInfo", "Manifest", "check_object_name", "check_manifest_name", "MAX_STEP", "ManifestRecord", "Store", "Access", "new_hasher", "CHECKSUM_ALGORITHM"]

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
        suffix = f"-r{self.rank}" if self.rank else ""
        return f"{self.kind}-{self.step:012d}{suffix}"

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
        return manifest


MAX_STEP = 10**12 - 1
"""The largest step a manifest may name (its name holds twelve digits)."""
MAX_RANK = 1 << 20
_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}|\.metadata")
_MANIFEST_NAME = re.compile(r"(?P<kind>[a-z][a-z0-9_]{0,31})-(?P<step>[0-9]{12})(?:-r(?P<rank>[1-9][0-9]{0,6}))?")


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
    """Where checkpoints live. See the module docstring for the call order."""

    root: Path
    """Where the store is (named in messages)."""
    ranks: "Ranks"
    """The job writing here: each rank writes its part of a checkpoint; rank 0 commits."""
    access: Access

    @property
    def bytes_written(self) -> int: ...

    def count_written_elsewhere(self, n: int) -> None:
        """Add ``n`` bytes written for this directory elsewhere than through this store: by a checkpoint
        agent (another process), or into lightcheck's region."""

    def check_writable(self) -> None:
        """Raise :class:`~everystep.errors.ReadOnlyStoreError` if the store was opened for reading."""

    def write_object(self, name: str, chunks: Iterable[bytes | memoryview]) -> ObjectInfo: ...

    def write_directory(self, name: str, fill: Callable[[Path], T]) -> T:
        """An object that is a directory of files, which ``fill`` writes into the path it is given."""
        ...

    def object_path(self, name: str) -> Path:
        """Where an object lies, for formats that read by path."""
        ...

    def read_object(self, info: ObjectInfo) -> bytearray:
        """The object's bytes, after its size and checksum are verified."""
        ...

    def commit(self, manifest: Manifest) -> None: ...

    def manifests(self) -> list[ManifestRecord]: ...

    def committed(self, manifest_name: str) -> bool:
        """Whether the checkpoint is still committed (a writer may discard it while a reader reads it)."""
        ...

    def discard(self, manifest_name: str) -> None: ...

    def close(self) -> None:
        """Delete what the store keeps to write over (the store may still be read)."""
        ...

    def stored_files(self) -> list[str]:
        """Every file of every object, as an object name (``verify`` compares it with the manifests)."""
        ...

    # For the manager above the store: its directory's identity and garbage.

    def prepare(self) -> None: ...

    def unprepare(self) -> None: ...

    def put_file(self, name: str, data: bytes) -> None: ...

    def object_names(self) -> list[str]: ...

    def delete_object(self, name: str) -> str: ...

    def interrupted_writes(self) -> list[tuple[str, str]]: ...

    def delete_leftover(self, token: str) -> str: ...
