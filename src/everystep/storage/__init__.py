"""Where checkpoints live. The core is here: the records stores and readers exchange (``base``), the
catalog of checkpoints over a store, the checkpoint directory above it and its lock, retention, the
node-local directories of several hosts, and the writing and reading of full checkpoints. Around it,
each with a face of its own: the stores (``stores``: a local filesystem, S3, and the one place that
tells a URL from a path), the formats (``formats``: tensor files, sharded parts, DCP), the region
(``region``: two slots in a mapped file, their hashing process, lending, paths) and the remote tier
(``remote``: the tier, its lock, its upload process).

Code outside ``storage`` imports this face and the sub-packages' faces, never a module inside;
names are imported at their first use, so that a light process (the upload process) imports none
of PyTorch."""

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from .base import MALFORMED, Manifest, ManifestRecord, ObjectInfo, Reader, Store, checksum, malformed, \
        manifest_name, refuse_constant
    from .catalog import Catalog
    from .directory import MARKER, CheckpointDirectory
    from .full import persist_full, read_state, read_state_together, write_full
    from .hosts import elsewhere, gather_from_hosts
    from .retention import SPREAD_KIND, plan_retention
    from .stores.local import LocalStore, StoreWriteError

__all__ = ["Manifest", "ManifestRecord", "ObjectInfo", "Reader", "Store", "MALFORMED", "checksum", "malformed",
           "manifest_name", "refuse_constant", "Catalog", "CheckpointDirectory", "MARKER", "persist_full", "read_state",
           "read_state_together", "write_full", "elsewhere", "gather_from_hosts", "plan_retention", "SPREAD_KIND",
           "LocalStore", "StoreWriteError"]

__getattr__, __dir__ = exports(__name__, {
    **dict.fromkeys(["Manifest", "ManifestRecord", "ObjectInfo", "Reader", "Store", "MALFORMED", "checksum", "malformed",
                     "manifest_name", "refuse_constant"], ".base"),
    "Catalog": ".catalog", "CheckpointDirectory": ".directory", "MARKER": ".directory",
    **dict.fromkeys(["persist_full", "read_state", "read_state_together", "write_full"], ".full"),
    **dict.fromkeys(["elsewhere", "gather_from_hosts"], ".hosts"),
    "plan_retention": ".retention", "SPREAD_KIND": ".retention",
    "LocalStore": ".stores.local", "StoreWriteError": ".stores.local",
})
