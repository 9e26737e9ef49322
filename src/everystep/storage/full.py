"""Writing full checkpoints, shared by every strategy that makes them and by the checkpoint agent."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .base import Manifest, Store

from .sharded import ShardPlan, commit_parts

__all__ = ["write_full"]

_WHOLE = ShardPlan({}, {})


def write_full(
    store: Store,
    step: int,
    chunks: Iterable[memoryview] | None,
    skeleton: Any,
    *,
    plan: ShardPlan = _WHOLE,
    meta: dict[str, Any] | None = None,
    error: BaseException | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    format: str = "safetensors",
) -> Manifest:
    """Write this rank's part of one full checkpoint (all of it in a single process) and commit it.

    ``format`` "dcp" writes ``tensors`` (the whole plan, replicated tensors included) through
    torch.distributed.checkpoint instead of ``chunks``.

    IMPORTANT: the manifest is committed only after every part is durable. Under several ranks,
    every rank calls this for the same steps in the same order, from its ``full`` channel thread.
    """
    if format == "dcp":
        if error is not None:
            raise error
        assert tensors is not None
        from .dcp import write_dcp  # torch.distributed.checkpoint takes a second to import
        return write_dcp(store, "full", step, tensors, set(plan.replicated), skeleton, meta)
    return commit_parts(store, "full", kind="full", step=step, chunks=chunks, plan=plan, meta=meta or {},
                        rank_meta={"skeleton": skeleton}, error=error)
