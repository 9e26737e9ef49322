"""Where checkpoints live: the Store protocol and a local-filesystem store, the catalog of checkpoints
over a store, the directory manager above it, tensor files, retention."""

from .base import Manifest, ManifestRecord, ObjectInfo, Reader, Store
from .catalog import Catalog
from .directory import CheckpointDirectory
from .local import LocalStore, StoreWriteError
from .retention import plan_retention

__all__ = ["Manifest", "ManifestRecord", "ObjectInfo", "Reader", "Store", "Catalog", "CheckpointDirectory", "LocalStore",
           "StoreWriteError", "plan_retention"]
