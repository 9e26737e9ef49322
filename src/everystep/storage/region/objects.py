"""A region's complete slots as stored objects: the :class:`~everystep.storage.base.Reader`
protocol (``manifests``, ``read_object``, ``committed``, ``discard``, ``stored_files``) over them,
each complete slot a manifest of kind ``full`` whose objects are its tensors, named
``slot<N>/<key>``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...errors import CorruptCheckpointError
from ...layout import LayoutEntry
from ..base import Access, Manifest, ManifestRecord, ObjectInfo, checksum
from .mapping import RegionSlot, SlotMeta

if TYPE_CHECKING:
    from ...distributed import Ranks

__all__ = ["SlotObjects", "Slots"]


class Slots(Protocol):
    """What the objects are read from: a region's slots (:class:`~everystep.storage.region.slots.Region`)."""

    root: Path
    path: Path
    ranks: "Ranks"
    access: Access

    def parse_slot(self, slot: int) -> tuple[RegionSlot | None, str | None]: ...
    def slots(self, *, warn: bool = True) -> list[RegionSlot]: ...
    def slot_metadata(self, slot: RegionSlot) -> SlotMeta: ...
    def invalidate(self, s: RegionSlot) -> None: ...
    def check_writable(self) -> None: ...


class SlotObjects:
    """The Reader protocol over a region's complete slots (:attr:`Region.objects
    <everystep.storage.region.slots.Region.objects>`)."""

    def __init__(self, region: Slots) -> None:
        self.region = region
        self.root, self.path, self.ranks, self.access = region.root, region.path, region.ranks, region.access

    def check_writable(self) -> None:
        self.region.check_writable()

    def manifests(self) -> list[ManifestRecord]:
        records = []
        for slot in (0, 1):
            parsed, problem = self.region.parse_slot(slot)
            if problem:
                records.append(ManifestRecord(f"slot{slot}", None, problem))
            elif parsed is not None:
                try:
                    records.append(ManifestRecord(self._name(parsed), self._manifest(parsed)))
                except CorruptCheckpointError as e:
                    records.append(ManifestRecord(self._name(parsed), None, str(e)))
        return records

    def _name(self, slot: RegionSlot) -> str:
        """The name of the manifest the slot is listed as (a :class:`Manifest`'s own name)."""
        return Manifest(kind="full", step=slot.step, objects={}, rank=self.ranks.rank).name

    def _manifest(self, slot: RegionSlot) -> Manifest:
        m = self.region.slot_metadata(slot)
        objects = {e.key: ObjectInfo(f"slot{slot.slot}/{e.key}", e.nbytes, m.sums[e.key]) for e in m.layout.entries}
        return Manifest(kind="full", step=slot.step, objects=objects,
                        meta={"skeleton": m.meta["skeleton"], "slot": slot.slot, "generation": slot.generation,
                              **m.meta["meta"]},
                        rank=self.ranks.rank)

    def _entry(self, info: ObjectInfo) -> tuple[SlotMeta, LayoutEntry]:
        """The verified metadata of the complete slot that holds the object, and the object's entry."""
        number, _, key = info.name.partition("/")
        for slot in self.region.slots(warn=False):
            if f"slot{slot.slot}" == number:
                m = self.region.slot_metadata(slot)
                entry = next((e for e in m.layout.entries if e.key == key), None)
                if entry is not None:
                    return m, entry
        raise CorruptCheckpointError(f"{info.name} is not in a complete slot of {self.path}")

    def read_object(self, info: ObjectInfo) -> bytearray:
        """The object's bytes (one tensor of a slot), its checksum verified."""
        m, e = self._entry(info)
        data = bytearray(m.area.mm[m.base + e.offset:m.base + e.offset + e.nbytes])
        if checksum(memoryview(data)) != m.sums[e.key]:
            raise CorruptCheckpointError(f"{m.where}: tensor {e.key!r} fails its checksum")
        return data

    def object_location(self, info: ObjectInfo) -> tuple[int, int]:
        """Where an object of a complete slot lies in the file: its offset and size."""
        m, e = self._entry(info)
        return m.area.offset + m.base + e.offset, e.nbytes

    def committed(self, manifest_name: str) -> bool:
        return any(self._name(s) == manifest_name for s in self.region.slots(warn=False))

    def discard(self, manifest_name: str) -> None:
        for s in self.region.slots(warn=False):
            if self._name(s) == manifest_name:
                self.region.invalidate(s)

    def stored_files(self) -> list[str]:
        return [self.path.name]

