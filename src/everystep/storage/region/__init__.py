"""A region of two slots, each a complete checkpoint, in a memory-mapped file (``slots``): how a
slot is laid out and mapped (``mapping``), the process that hashes it (``hashing``), the tensors it
lends a restarted writer (``lending``), its complete slots as stored objects (``objects``), and where
a directory's region lies and how it is opened (``paths``)."""

from typing import TYPE_CHECKING

from ..._lazy import exports

if TYPE_CHECKING:
    from .mapping import RegionLayout, SlotWriter, on_volatile_memory
    from .paths import memory_path, memory_place, open_region, own_memory_folder, readable_region, record_memory, \
        region_path, region_places
    from .slots import Region, RegionSlot, UnreadableRegionError, UntrustedRegionError

__all__ = ["Region", "RegionSlot", "UnreadableRegionError", "UntrustedRegionError", "RegionLayout", "SlotWriter",
           "on_volatile_memory", "memory_path", "memory_place", "open_region", "own_memory_folder", "readable_region",
           "record_memory", "region_path", "region_places"]

__getattr__, __dir__ = exports(__name__, {
    **dict.fromkeys(["Region", "RegionSlot", "UnreadableRegionError", "UntrustedRegionError"], ".slots"),
    **dict.fromkeys(["RegionLayout", "SlotWriter", "on_volatile_memory"], ".mapping"),
    **dict.fromkeys(["memory_path", "memory_place", "open_region", "own_memory_folder", "readable_region",
                     "record_memory", "region_path", "region_places"], ".paths"),
})
