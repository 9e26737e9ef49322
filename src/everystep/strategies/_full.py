"""Writing and reading full checkpoints, shared by every strategy that makes them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..storage.base import Manifest
from ..storage.local import LocalStore
from ..transport.host import TensorLayout

__all__ = ["write_full"]


def write_full(
    store: LocalStore,
    step: int,
    layout: TensorLayout,
    chunks: Iterable[memoryview],
    skeleton: Any,
    *,
    meta: dict[str, Any] | None = None,
) -> Manifest:
    """Write one full checkpoint and commit it.

    IMPORTANT: the manifest is committed only after the tensor object is durable.
    """
    info = store.write_object(f"full-{step:012d}.safetensors", chunks)
    manifest = Manifest(kind="full", step=step, objects={"tensors": info}, meta={"skeleton": skeleton, **(meta or {})})
    store.commit(manifest)
    return manifest
