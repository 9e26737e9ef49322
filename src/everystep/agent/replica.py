"""The CPU-resident replica of the training state, kept in shared memory by the agent.

The replica is S_t as a full checkpoint holds it — ``{key: tensor}`` plus a skeleton — laid out in
one :class:`SharedRegion`. The parameters and the optimizer state are views of that region, and a
private optimizer of the training optimizer's class updates them in place. A step applies the
gradients the training optimizer consumed (from a slot of shared memory) with that step's group
settings, unless the step was skipped, then takes over everything a gradient cannot rebuild (RNG,
data position, scheduler, buffers, compression residuals) from the same slot, and the skeleton.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

from ..replay import replay_step
from ..tree import unflatten
from ..transport.host import HostBuffer, TensorLayout
from ..transport.shared import SharedRegion

__all__ = ["Replica", "WardReplica", "FUSED_CPU", "fusable", "optimizer_class_path", "replayed_keys", "slot_layout"]

_NOT_ON_CPU = ("capturable",)


def optimizer_class_path(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def _import(path: str) -> type:
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise TypeError(
            f"the checkpoint agent cannot import the optimizer class {path!r}: lowdiff_plus needs an optimizer "
            "class defined in an importable module"
        ) from e
    return obj


FUSED_CPU = ("torch.optim.adam:Adam", "torch.optim.adamw:AdamW")
"""The optimizer classes with a fused CPU kernel (torch ≥ 2.4)."""


def fusable(cls: type, params: list[torch.Tensor]) -> bool:
    """Whether an optimizer of ``cls`` over ``params`` (on the CPU) can run its fused kernel."""
    return f"{cls.__module__}:{cls.__qualname__}" in FUSED_CPU and \
        all(p.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) for p in params)


def replayed_keys(index_keys: list[str], keys: Iterable[str]) -> set[str]:
    """The keys of the state the agent's optimizer updates — the parameters and their optimizer
    state, what DDP keeps the same on every rank; the rest is taken over from each step's slot."""
    return set(index_keys) | {k for k in keys if k.startswith("/optimizer/state/")}


def slot_layout(grads: dict[int, torch.Tensor], volatile: dict[str, torch.Tensor]) -> TensorLayout:
    """One step's slot: the gradient of each optimizer parameter and the volatile tensors."""
    return TensorLayout.of({**{f"g/{i}": g for i, g in grads.items()}, **{f"v{k}": t for k, t in volatile.items()}})


class Replica:
    """S_t in shared memory, advanced one step at a time by a CPU optimizer."""

    def __init__(self, *, step: int, region: SharedRegion, layout: TensorLayout, skeleton: Any, index_keys: list[str],
                 optimizer_class: str, fused: bool = False) -> None:
        self.step = step
        self.skeleton = skeleton
        self.index_keys = index_keys
        self._adopt(region, HostBuffer(layout, data=region.data))
        tree = unflatten(skeleton, self.tensors)
        saved = tree["optimizer"]
        self.params = [torch.nn.Parameter(self.tensors[k], requires_grad=False) for k in index_keys]
        cls = _import(optimizer_class)
        self.fused = fused and fusable(cls, self.params)
        """Whether the replica's optimizer runs torch's fused CPU kernel (``fused``, where its class
        has one for these tensors): the same update as training's, in another order of arithmetic,
        several times faster than the for-loop one. For training on a GPU, whose arithmetic the
        CPU does not reproduce bitwise either way; on the CPU the training optimizer's own path."""
        self._ignore = _NOT_ON_CPU + (("fused", "foreach") if self.fused else ())
        groups = []
        for g in saved["param_groups"]:
            options = {k: v for k, v in g.items() if k != "params" and k not in self._ignore}
            if self.fused:
                options.update(fused=True, foreach=None)
            groups.append({**options, "params": [self.params[i] for i in g["params"]]})
        self.optimizer: torch.optim.Optimizer = cls(groups)
        for index, state in saved["state"].items():
            self.optimizer.state[self.params[index]] = dict(state)

    def _adopt(self, region: SharedRegion, buffer: HostBuffer) -> None:
        self.region, self.layout, self.tensors = region, buffer.layout, buffer.views

    def apply(self, step: int, slot: HostBuffer, *, groups: list[dict[str, Any]], skipped: bool,
              has_grad: list[int], skeleton: Any) -> None:
        """S_{step-1} → S_step."""
        if step != self.step + 1:
            raise ValueError(f"the replica is at step {self.step} and cannot apply step {step}")
        if not skipped:
            grads = [(self.params[i], slot.views[f"g/{i}"]) for i in has_grad]
            replay_step(self.optimizer, groups, grads, ignore=self._ignore)
        for key in slot.views:
            if key.startswith("v/"):
                self.tensors[key[1:]].copy_(slot.views[key])
        self.skeleton, self.step = skeleton, step
        self._keep_in_region()

    def _keep_in_region(self) -> None:
        """Optimizer state created or replaced by ``step()`` moves into the region."""
        moved = False
        for i, p in enumerate(self.params):
            state = self.optimizer.state.get(p, {})
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                key = f"/optimizer/state/{i}/{name}"
                home = self.tensors.get(key)
                if home is None or home.shape != value.shape or home.dtype != value.dtype:
                    moved = True
                elif value is not home:
                    home.copy_(value)
                    state[name] = home
        if moved:
            self.rehome()

    def rehome(self) -> None:
        """Move the replica into a region of its own, a copy: the one it leaves now belongs to
        whoever else maps it (the training process the replica was handed to), and is never read
        or written here again. Also lays optimizer state that ``step()`` created or reshaped out."""
        tensors = dict(self.tensors)
        for i, p in enumerate(self.params):
            for name, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"/optimizer/state/{i}/{name}"] = value
        region, buffer = SharedRegion.holding(TensorLayout.of(tensors))
        for key, t in tensors.items():
            buffer.views[key].copy_(t)
        for i, p in enumerate(self.params):
            p.data = buffer.views[self.index_keys[i]]
            state = self.optimizer.state.get(p, {})
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[name] = buffer.views[f"/optimizer/state/{i}/{name}"]
        old = self.region
        self._adopt(region, buffer)
        old.close()

    def servable(self) -> bool:
        """Whether every tensor the skeleton names is in the replica (it can be handed out whole)."""
        try:
            unflatten(self.skeleton, self.tensors)
        except KeyError:
            return False
        return True


class WardReplica:
    """The replica of a ward's whole state and the ward's newest step, held back as the agent's own
    newest step is under several ranks: it serves both the step applied and the one pending."""

    def __init__(self, replica: Replica, signature: str) -> None:
        self.replica, self.signature = replica, signature
        self.pending: tuple[dict[str, Any], SharedRegion] | None = None

    def served(self) -> list[int]:
        if not self.replica.servable():
            return []
        return [self.replica.step] + ([self.pending[0]["step"]] if self.pending is not None else [])

    def arrive(self, msg: dict[str, Any], region: SharedRegion) -> None:
        self._apply_pending()
        self.pending = msg, region

    def at(self, step: int) -> Replica:
        """The replica at ``step`` (applying the pending step if that is the one asked for)."""
        if self.pending is not None and self.pending[0]["step"] == step:
            self._apply_pending()
        if self.replica.step != step:
            raise ValueError(f"the ward's replica is at step {self.replica.step} and cannot serve step {step}")
        return self.replica

    def _apply_pending(self) -> None:
        if self.pending is None:
            return
        (msg, region), self.pending = self.pending, None
        try:
            self.replica.apply(msg["step"], HostBuffer(msg["layout"], data=region.data), groups=msg["groups"],
                               skipped=msg["skipped"], has_grad=msg["has_grad"], skeleton=msg["skeleton"])
        finally:
            region.close()

    def close(self) -> None:
        if self.pending is not None:
            self.pending[1].close()
            self.pending = None
        self.replica.region.close()
