"""Writing full checkpoints, shared by every strategy that makes them and by the checkpoint agent,
and reading a checkpoint that holds a whole state back, verified, as recovery and a pull from the
remote tier do."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CorruptCheckpointError
from ..tree import unflatten
from .base import Manifest, Reader, malformed
from .hosts import gather_from_hosts, read_together
from .catalog import Catalog

from .formats.sharded import RankShare, commit_parts, read_parts

if TYPE_CHECKING:
    from .directory import CheckpointDirectory

__all__ = ["write_full", "persist_full", "read_state", "read_state_together"]

_WHOLE = RankShare({}, {})


def write_full(
    catalog: Catalog,
    step: int,
    chunks: Iterable[memoryview] | None,
    skeleton: Any,
    *,
    share: RankShare = _WHOLE,
    meta: dict[str, Any] | None = None,
    error: BaseException | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    format: str = "safetensors",
) -> Manifest:
    """Write this rank's part of one full checkpoint (all of it in a single process) and commit it.

    ``format`` "dcp" writes ``tensors`` (the whole share, replicated tensors included) through
    torch.distributed.checkpoint instead of ``chunks``.

    IMPORTANT: the manifest is committed only after every part is durable. Under several ranks,
    every rank calls this for the same steps in the same order, from its ``full`` channel thread.
    """
    if format == "dcp":
        if error is not None:
            raise error
        assert tensors is not None
        from .formats.dcp import write_dcp  # torch.distributed.checkpoint takes a second to import
        return write_dcp(catalog, "full", step, tensors, set(share.replicated), skeleton, meta, sharded=share.sharded)
    return commit_parts(catalog, "full", kind="full", step=step, chunks=chunks, share=share, meta=meta or {},
                        rank_meta={"skeleton": skeleton}, error=error)


def persist_full(directory: "CheckpointDirectory", step: int, chunks: Iterable[memoryview] | None, skeleton: Any, *,
                 keep: int, committed: Callable[[float], None] | None = None, **options: Any) -> tuple[Manifest, float]:
    """Persist one full checkpoint: :func:`write_full` (``options`` are its), then ``committed``
    with the seconds the write took — the checkpoint is durable and visible —, then retention of
    the newest ``keep`` full checkpoints. Returns the manifest and those seconds."""
    t0 = time.perf_counter()
    manifest = write_full(directory.catalog, step, chunks, skeleton, **options)
    seconds = time.perf_counter() - t0
    if committed is not None:
        committed(seconds)  # before retention: what is durable is known at once
    directory.retain(keep)
    return manifest, seconds


def read_state(directory: "CheckpointDirectory", manifest: Manifest, *, shards: Mapping[str, torch.Tensor] | None = None,
               reader: Reader | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify a checkpoint that holds a whole state (a full one, or GoCkpt's spread one):
    its state tree, all its tensors (the tree's and any others) and its meta. ``shards``: a sharded
    job's live DTensors by key (:func:`~everystep.storage.formats.sharded.read_parts`); None: a replicated job's.
    ``reader``: where its objects are read (default: the directory's catalog)."""
    tensors, meta = read_parts(reader or directory.catalog, manifest, full_format=directory.full_format, shards=shards)
    if "skeleton" not in meta:
        raise CorruptCheckpointError(f"manifest {manifest.name} lacks the skeleton of its state tree")
    with malformed(f"checkpoint {manifest.name}"):
        tree = unflatten(meta["skeleton"], tensors)
        if not isinstance(tree, dict) or tree.get("step") != manifest.step:
            raise ValueError(f"it holds step {tree.get('step') if isinstance(tree, dict) else None}, not {manifest.step}")
    return tree, tensors, meta


def read_state_together(directory: "CheckpointDirectory", manifest: Manifest, shards: Mapping[str, torch.Tensor] | None = None
                        ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`read_state`, and under node-local directories on every rank at once: each part a rank
    reads from the host that holds it (:func:`~everystep.storage.hosts.gather_from_hosts`); raises
    :class:`CorruptCheckpointError` on every rank where it fails on any."""
    if directory.catalog.hosts is None:
        return read_state(directory, manifest, shards=shards)
    reader = gather_from_hosts(directory.catalog, [manifest], shards)
    error, found = None, None
    try:
        found = read_state(directory, manifest, shards=shards, reader=reader)
    except CorruptCheckpointError as e:
        error = e
    read_together(directory.catalog, error)
    assert found is not None
    return found
