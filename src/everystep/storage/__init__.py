"""Where checkpoints live: the Store protocol, a local-filesystem store, tensor files, retention."""

from .base import Manifest, ManifestRecord, ObjectInfo, Store
from .local import LocalStore, StoreWriteError
from .retention import plan_retention

__all__ = ["Manifest", "ManifestRecord", "ObjectInfo", "Store", "LocalStore", "StoreWriteError", "plan_retention"]
