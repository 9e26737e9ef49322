"""Where checkpoints live: the Store protocol, a local-filesystem store, the directory manager above
it, tensor files, retention."""

from .base import Manifest, ManifestRecord, ObjectInfo, Store
from .directory import CheckpointDirectory
from .local import LocalStore, StoreWriteError
from .retention import plan_retention

__all__ = ["Manifest", "ManifestRecord", "ObjectInfo", "Store", "CheckpointDirectory", "LocalStore", "StoreWriteError",
           "plan_retention"]
