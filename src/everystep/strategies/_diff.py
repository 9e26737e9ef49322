"""What differential strategies share: the part of S_t that gradients or deltas cannot rebuild."""

from __future__ import annotations

from typing import Any

import torch

from ..recovery import latest_full
from ..replay import group_scalars
from ..state import TrainingComponents, flatten, restore_rng, unflatten
from ..storage.base import Manifest
from ..storage.local import LocalStore
from ..storage.sharded import read_parts

__all__ = ["end_state", "apply_end_state", "restore_base", "read_differential"]


def end_state(components: TrainingComponents, boundary: dict[str, Any], step: int, *,
              residuals: bool = True) -> tuple[dict[str, torch.Tensor], Any]:
    """Model buffers (BatchNorm statistics), param-group settings as the scheduler left them,
    scheduler, scaler, compression residuals (unless ``residuals`` is False), RNG and data
    position, as of the end of ``step``."""
    c = components
    buffers = {n for n, _ in c.module.named_buffers()}
    tree: dict[str, Any] = {
        "step": step,
        "buffers": {k: v.detach().clone() for k, v in c.module.state_dict().items() if k in buffers},
        "groups": group_scalars(c.optimizer),
        **boundary,
    }
    for name in ("scheduler", "scaler", "compression"):
        component = getattr(c, name)
        if component is not None and (residuals or name != "compression"):
            tree[name] = component.state_dict()
    return flatten(tree)


def apply_end_state(components: TrainingComponents, end: dict[str, Any]) -> None:
    c = components
    c.module.load_state_dict(end["buffers"], strict=False)
    for group, saved in zip(c.optimizer.param_groups, end["groups"]):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    for name in ("scheduler", "scaler", "data", "compression"):
        component = getattr(c, name)
        if component is not None and name in end:
            component.load_state_dict(end[name])
    restore_rng(end["rng"])


def restore_base(store: LocalStore, components: TrainingComponents) -> Manifest | None:
    """Load the newest verified full checkpoint into the live objects: the base of a chain."""
    found = latest_full(store)
    if found is None:
        return None
    full, tree = found
    components.restore(tree)
    return full


def read_differential(store: LocalStore, manifest: Manifest) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A differential's tensors and its end state; raises CorruptCheckpointError if it fails to verify."""
    tensors, meta = read_parts(store, manifest)
    end = unflatten(meta["end"], {k[len("end"):]: v for k, v in tensors.items() if k.startswith("end/")})
    return tensors, end
