"""The Store protocol and the records it exchanges.

A store holds immutable *objects* (byte blobs with a checksum) and *manifests* (JSON records
that name a checkpoint's objects). Call order for one checkpoint:

1. ``write_object`` once per object; each is durable when it returns, but invisible.
2. ``commit(manifest)``; the checkpoint is visible to recovery exactly when this returns.

Readers call ``manifests()`` and then ``read_object`` for the objects of the manifest they want.
``discard(manifest)`` removes a checkpoint: the manifest first, then its objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

__all__ = ["ObjectInfo", "Manifest", "ManifestRecord", "Store", "new_hasher", "CHECKSUM_ALGORITHM"]

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
        return cls(name=str(d["name"]), nbytes=int(d["nbytes"]), checksum=str(d["checksum"]))


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
        body = self.body()
        body["checksum"] = checksum(_canonical(body))
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        """Parse and verify a manifest; raises ValueError naming what is wrong."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"manifest is not valid JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != "everystep-manifest":
            raise ValueError("not an everystep manifest")
        stored = body.pop("checksum", None)
        if stored != checksum(_canonical(body)):
            raise ValueError("manifest checksum mismatch")
        return cls(
            kind=body["kind"],
            step=int(body["step"]),
            rank=int(body.get("rank", 0)),
            objects={k: ObjectInfo.from_json(v) for k, v in body["objects"].items()},
            meta=body["meta"],
            requires=tuple(body["requires"]),
        )


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

    @property
    def bytes_written(self) -> int: ...

    def write_object(self, name: str, chunks: Iterable[bytes | memoryview]) -> ObjectInfo: ...

    def read_object(self, info: ObjectInfo) -> bytearray: ...

    def commit(self, manifest: Manifest) -> None: ...

    def manifests(self) -> list[ManifestRecord]: ...

    def discard(self, manifest_name: str) -> None: ...
