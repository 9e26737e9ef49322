"""Where checkpoints lie: a local path, or a prefix in object storage (``s3://bucket/prefix``). The
one place that tells the two apart and opens a prefix's store; everything else asks here."""

from __future__ import annotations

from ..base import Access, ConditionalStore

__all__ = ["is_remote", "open_remote"]


def is_remote(location: object) -> bool:
    """Whether ``location`` names a prefix in object storage (``s3://…``), not a local path: the one
    test of it (a :class:`~pathlib.Path` is always local)."""
    return isinstance(location, str) and location.startswith("s3://")


def open_remote(url: str, *, access: Access = "write") -> ConditionalStore:
    """The store of the prefix ``url``; ValueError naming it where it is not an ``s3://bucket/prefix``
    URL, :class:`~everystep.errors.CheckpointDirectoryError` where boto3 is not installed."""
    from .s3 import S3Store  # (boto3 only where a remote is used)

    return S3Store(url, access=access)
