"""The stores a checkpoint directory lies in (:class:`~everystep.storage.base.Store`): a local (or
network-mounted POSIX) filesystem, S3-compatible object storage, and the one place that tells a
URL from a path and opens a prefix's store (``location``)."""

from typing import TYPE_CHECKING

from ..._lazy import exports

if TYPE_CHECKING:
    from .local import LocalStore, StoreWriteError, check_own_folder, fsync_dir
    from .location import is_remote, open_remote
    from .s3 import S3Store, client, parse_url, redact

__all__ = ["LocalStore", "StoreWriteError", "check_own_folder", "fsync_dir", "is_remote", "open_remote", "S3Store",
           "client", "parse_url", "redact"]

__getattr__, __dir__ = exports(__name__, {
    **dict.fromkeys(["LocalStore", "StoreWriteError", "check_own_folder", "fsync_dir"], ".local"),
    **dict.fromkeys(["is_remote", "open_remote"], ".location"),
    **dict.fromkeys(["S3Store", "client", "parse_url", "redact"], ".s3"),
})
