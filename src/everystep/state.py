"""The complete training state: capture and restore (the checks that a stored state fits the live
one before anything is loaded: :mod:`everystep.state_checks`; the random generators: :mod:`everystep.rng`).

A training state is a tree of dicts, lists and tuples whose leaves are tensors or JSON scalars
(:mod:`everystep.tree` flattens it to tensors and a JSON skeleton, and hashes it).
"""

from __future__ import annotations

import copy
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .background import in_shares
from .errors import StateMismatchError
from .optim import OptimizerInBackward
from .rng import capture_rng, restore_rng
from .state_checks import check_group_settings, check_model, check_optimizer, check_rng, group_scalars, shape_of
from .tree import flatten

__all__ = [
    "Stateful",
    "TrainingComponents",
    "capture_rng",
    "restore_rng",
    "group_scalars",
    "owned",
    "replaces_state",
]



def zero_redundancy(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ZeroRedundancyOptimizer (ZeRO-1: each rank holds the state of its
    partition of the parameters, in its local optimizer ``optimizer.optim``)."""
    # Not imported here: importing torch.distributed.optim compiles TorchScript (deprecation warnings in
    # every process); where it is not imported, no optimizer is one of its classes.
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that updates this rank's parameters: ``optimizer``, or a ZeroRedundancyOptimizer's
    local one (over its partition; its param groups are the global ones, in order)."""
    return optimizer.optim if zero_redundancy(optimizer) else optimizer


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()``, referencing the live tensors. Of a ZeroRedundancyOptimizer, whose
    ``state_dict()`` needs every rank's state gathered to one rank first, this rank's part of it
    without communication: the param groups over every parameter, as ZeRO numbers them, and the state
    of the parameters this rank updates (its local optimizer's), under those numbers. ZeRO's
    ``load_state_dict`` takes it as it takes the gathered one (each rank loads its own partition's)."""
    if not zero_redundancy(optimizer):
        return optimizer.state_dict()
    number = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    local = [p for g in optimizer.optim.param_groups for p in g["params"]]
    state = optimizer.optim.state_dict()["state"]
    return {
        "state": {number[id(local[i])]: v for i, v in state.items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [number[id(p)] for p in g["params"]]}
                         for g in optimizer.param_groups],
    }


def bare_module(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without DistributedDataParallel or ``torch.compile`` wrappers."""
    while True:
        inner = getattr(model, "module", None) if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
            else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: a data position, a sampler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class TrainingComponents:
    """The live objects whose state makes up S_t. Only model and optimizer are required."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any | None = None
    scaler: Any | None = None
    data: Stateful | None = None
    compression: Stateful | None = None
    """Gradient compression whose error-feedback residuals are training state."""

    OPTIONAL = ("scheduler", "scaler", "data", "compression")

    @property
    def module(self) -> torch.nn.Module:
        """The model without a DistributedDataParallel (or ``torch.compile``) wrapper, so that its
        state has the same keys in a single process and under data parallelism."""
        return bare_module(self.model)

    def capture(self) -> dict[str, Any]:
        """The heavy, slowly-changing part of the state, referencing live tensors (no copy)."""
        tree: dict[str, Any] = {
            "model": self.module.state_dict(),
            "optimizer": optimizer_state(self.optimizer),
        }
        if self.scheduler is not None:
            tree["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            tree["scaler"] = self.scaler.state_dict()
        if self.compression is not None:
            tree["compression"] = self.compression.state_dict()
        return tree

    def capture_boundary(self) -> dict[str, Any]:
        """The part that must be read at the instant a step ends: RNG and data position, as copies
        that do not change with the live objects (the RNG states are new objects; the data
        position, which a loader may return by reference, is copied)."""
        tree: dict[str, Any] = {"rng": capture_rng()}
        if self.data is not None:
            tree["data"] = copy.deepcopy(self.data.state_dict())
        return tree

    def restore(self, tree: dict[str, Any], *, borrowed: frozenset[str] = frozenset()) -> None:
        """Load a captured state into the live objects (``borrowed``: see :meth:`_optimizer_tree`).

        IMPORTANT: everything is checked before anything is loaded — each shape, the optimizer's
        settings and state, the random generators' — and should a component's own
        ``load_state_dict`` still fail, every live object is put back as it was before the error
        is raised: a failed restore leaves the live objects untouched.
        """
        check_model(self.module, tree.get("model"))
        check_optimizer(self.optimizer, tree.get("optimizer"))
        check_rng(tree.get("rng"))
        for name in self.OPTIONAL:
            component = getattr(self, name)
            if (component is None) != (name not in tree):
                have = "has" if name in tree else "has no"
                given = "was given one" if component is not None else "was not given one"
                raise StateMismatchError(
                    f"the checkpoint {have} {name} state but the Checkpointer {given}; "
                    f"attach the same components that wrote it"
                )
        plain = loads_plainly(self.module)
        before = self._saved(model=not plain)
        try:
            self._load(tree, plain=plain, borrowed=borrowed)
        except Exception as e:
            self._load(before)
            raise StateMismatchError(f"the checkpoint's state could not be loaded ({type(e).__name__}: {e}); the model, "
                                     "optimizer and other components are as they were") from e

    def _saved(self, *, model: bool = True) -> dict[str, Any]:
        """Every live object's state, to put back (:meth:`restore`): copies in host memory of what
        loading overwrites in place — the model's tensors (unless ``model`` is False: :meth:`_load`
        loads the model last, and where it :func:`loads_plainly` nothing after the checks can make
        its load fail), any optimizer's but torch's own —, and references to the tensors of an
        optimizer whose ``load_state_dict`` is torch's, which replaces its state and groups without
        writing into the tensors they held."""
        state = optimizer_state(self.optimizer)
        saved: dict[str, Any] = {"optimizer": state if replaces_state(self.optimizer) else _host_copy(state),
                                 "rng": capture_rng()}
        if model:
            saved["model"] = _host_copy(self.module.state_dict())
        for name in self.OPTIONAL:
            component = getattr(self, name)
            if component is not None:
                saved[name] = _host_copy(component.state_dict())
        return saved

    def _load(self, tree: dict[str, Any], *, plain: bool = False, borrowed: frozenset[str] = frozenset()) -> None:
        """Load ``tree`` into the live objects, the model last (if ``tree`` holds it; ``plain``: a
        model that :func:`loads_plainly`, whose load is only copies), then what goes into the
        optimizer's live tensors (:meth:`_optimizer_tree`)."""
        stored, into = self._optimizer_tree(tree["optimizer"], borrowed)
        self.optimizer.load_state_dict(stored)
        for name in self.OPTIONAL:
            component = getattr(self, name)
            if component is not None:
                component.load_state_dict(owned(tree[name]))
        restore_rng(tree["rng"])
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        if "model" in tree:
            live = self.module.state_dict()
            if plain and all(t.device.type == "cpu" for t in live.values()):
                copies = _model_copies(live, tree["model"])
            else:
                self.module.load_state_dict(tree["model"])
        held = self.optimizer.state
        copies += [(held[param][name], value) for param, name, value in into]  # (what the load holds: the live tensor, or its cast)
        _copy_all(copies)

    def _optimizer_tree(self, stored: dict[str, Any], borrowed: frozenset[str]
                        ) -> tuple[dict[str, Any], list[tuple[torch.Tensor, str, torch.Tensor]]]:
        """The optimizer state to hand to its load, and ``(parameter, name, tensor)`` for each entry
        loaded into the live optimizer's own tensor instead.

        Where the optimizer holds its state already (recovery within the process, or a job that
        makes the state before loading, as ``torch.distributed.checkpoint.state_dict`` does) and its
        load is torch's own (:func:`loads_into_own_tensors`), a stored entry goes into the live
        tensor of its parameter and name that is like it (the same type, shape and dtype) when

        - it is borrowed (its flat key ``/optimizer/state/<i>/<name>`` in ``borrowed``: a view of a
          region's slot, which the live objects must not keep) and the live tensor is on its device;
        - or it lies on the host and the live tensor on a GPU (where torch's load would copy it
          into a new tensor on the device, and drop the live one).

        The load is handed the live tensor, which it keeps as it is (so putting the live objects
        back needs no copy of it), and the stored one is copied in last, once nothing can fail: the
        optimizer keeps its tensors (and what holds their addresses, a captured graph, stays valid),
        and the restore takes no new memory. A borrowed entry loaded otherwise is copied out.
        Anything else is handed on as it is (the optimizer's state a checkpoint agent hands over is
        kept where it lies)."""
        # (shallow copies: ZeroRedundancyOptimizer's load_state_dict blanks the entries of other ranks' parameters)
        state = dict(stored["state"])
        into: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        in_place = loads_into_own_tensors(self.optimizer) and bool(self.optimizer.state)
        if not (borrowed or in_place):
            return {**stored, "state": state}, into
        params = {index: param for group, sgroup in zip(self.optimizer.param_groups, stored["param_groups"])
                  for param, index in zip(group["params"], sgroup["params"])}
        for index, entry in state.items():
            live = self.optimizer.state.get(params[index], {}) if in_place and index in params else {}
            changed = dict(entry)
            for name, t in entry.items():
                if not isinstance(t, torch.Tensor):
                    continue
                view = f"/optimizer/state/{index}/{name}" in borrowed and not owns_memory(t)
                like = live.get(name)
                if type(like) is torch.Tensor and type(t) is torch.Tensor and (like.shape, like.dtype) == (t.shape, t.dtype) \
                        and (view and like.device == t.device or like.device.type != "cpu" and t.device.type == "cpu"):
                    changed[name] = like
                    into.append((params[index], name, t))
                elif view:
                    changed[name] = t.clone(memory_format=torch.contiguous_format)
            if any(changed[name] is not t for name, t in entry.items()):
                state[index] = changed
        return {**stored, "state": state}, into

    def end_state(self, boundary: dict[str, Any], step: int, *,
                  residuals: bool = True) -> tuple[dict[str, torch.Tensor], Any]:
        """What gradients cannot rebuild, as of the end of ``step``, flattened: model buffers
        (BatchNorm statistics), param-group settings as the scheduler left them, scheduler, scaler,
        compression residuals (unless ``residuals`` is False), and ``boundary`` (RNG, data position).
        A differential checkpoint stores it next to its gradients or deltas."""
        buffers = {n for n, _ in self.module.named_buffers()}
        tree: dict[str, Any] = {
            "step": step,
            "buffers": {k: v.detach().clone() for k, v in self.module.state_dict().items() if k in buffers},
            "groups": group_scalars(self.optimizer),
            **boundary,
        }
        for name in ("scheduler", "scaler", "compression"):
            component = getattr(self, name)
            if component is not None and (residuals or name != "compression"):
                tree[name] = component.state_dict()
        return flatten(tree)

    def check_end_state(self, end: Any) -> None:
        """Raise :class:`StateMismatchError` unless ``end`` is an :meth:`end_state` these objects
        could have made: the model's buffers by name and shape, each group's settings, the random
        generators', and the optional components this Checkpointer has."""
        if not isinstance(end, dict) or not isinstance(end.get("buffers"), dict):
            raise StateMismatchError("the end state is not a dict with the model's buffers")
        live = dict(self.module.named_buffers())
        for key, value in end["buffers"].items():
            if key not in live or not isinstance(value, torch.Tensor) or shape_of(value) != shape_of(live[key]):
                raise StateMismatchError(f"the end state's buffer {key!r} is not one of the model's, of its shape")
        check_group_settings(self.optimizer, end.get("groups"), partial=True)
        check_rng(end.get("rng"))
        for name in ("scheduler", "scaler", "data"):
            if name in end and getattr(self, name) is None:
                raise StateMismatchError(f"the end state has {name} state but the Checkpointer was not given one")

    def apply_end_state(self, end: dict[str, Any]) -> None:
        """Load an :meth:`end_state` (as a tree) into the live objects, checked first
        (:meth:`check_end_state`); should a component's ``load_state_dict`` fail, every live object
        is put back as it was before the error is raised."""
        self.check_end_state(end)
        before = self._saved()
        try:
            self.module.load_state_dict(end["buffers"], strict=False)
            for group, saved in zip(self.optimizer.param_groups, end["groups"]):
                group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
            for name in self.OPTIONAL:
                component = getattr(self, name)
                if component is not None and name in end:
                    component.load_state_dict(owned(end[name]))
            restore_rng(end["rng"])
        except Exception as e:
            self._load(before)
            raise StateMismatchError(f"the end state could not be loaded ({type(e).__name__}: {e}); the model, "
                                     "optimizer and other components are as they were") from e


def loads_plainly(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` of a state that :func:`~everystep.state_checks.check_model`
    passed cannot fail: torch's own load throughout (no override of ``load_state_dict``, of
    ``_load_from_state_dict`` outside ``torch.nn``'s layers, or of the extra state; no load hook)
    and plain tensors only (no DTensor or other subclass): it then copies each tensor into the one
    of the same key and shape, which casts and never raises."""
    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    for m in module.modules():
        kind = type(m)
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks \
                or not kind._load_from_state_dict.__module__.startswith("torch.nn.modules.") \
                or kind.get_extra_state is not torch.nn.Module.get_extra_state:
            return False
        if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in (*m._parameters.values(), *m._buffers.values())
               if t is not None):
            return False
    return True


def _model_copies(live: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Torch's load of a model that :func:`loads_plainly`, on the host, as copies: each stored
    tensor into the live one of its key (the tensor of two tied keys once)."""
    return list({(t.data_ptr(), t.dtype, t.shape, t.stride()): (t, stored[k]) for k, t in live.items()}.values())


def _copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``into.copy_(source)`` for each pair: into host memory shared out by size between a thread of
    their own and this one (a copy releases the interpreter's lock); onto a device on this thread,
    on its current stream, after the work queued there that may still use the tensor."""
    host = [pair for pair in copies if pair[0].device.type == "cpu"]
    for into, source in copies:
        if into.device.type != "cpu":
            into.copy_(source)
    if not host:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="everystep-load") as helper:
        in_shares(helper, [t.numel() * t.element_size() for t, _ in host], lambda i: host[i][0].copy_(host[i][1]), 2)


def replaces_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.load_state_dict`` is torch's own (or :class:`~everystep.OptimizerInBackward`'s,
    which calls it), with no hook of the user's around it: it puts new state and groups in place and
    never writes into the tensors the old ones held."""
    hooks = [getattr(optimizer, name, None) for name in ("_optimizer_load_state_dict_pre_hooks",
                                                         "_optimizer_load_state_dict_post_hooks")]
    return type(optimizer).load_state_dict in (torch.optim.Optimizer.load_state_dict, OptimizerInBackward.load_state_dict) \
        and not any(hooks)


def loads_into_own_tensors(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a restore may load stored optimizer state (borrowed views; host state for tensors on
    a GPU) into the tensors ``optimizer`` holds (:meth:`TrainingComponents._optimizer_tree`): its
    load is torch's own (:func:`replaces_state`), which keeps a tensor it is given as it is, and it
    holds its state itself (not ZeRO's partition)."""
    return replaces_state(optimizer) and not zero_redundancy(optimizer)


def _host_copy(tree: Any) -> Any:
    """A copy of ``tree`` whose tensors are copies in host memory (the device's stays free)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _host_copy(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(_host_copy(v) for v in tree)
    return copy.deepcopy(tree)


def owns_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and alone in its storage, from its start."""
    return t.storage_offset() == 0 and t.is_contiguous() and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()


def owned(tree: Any) -> Any:
    """``tree`` with every tensor that is not alone in its memory (a view into a buffer read from a
    region, shared memory or a mapped file) replaced by a contiguous copy of its own.

    What a user's ``load_state_dict`` receives goes through it: some consumers read a state tensor
    from the start of its storage (``Generator.set_state``), and a view would keep the whole buffer
    alive in the user's object.
    """
    if isinstance(tree, torch.Tensor):
        return tree if owns_memory(tree) else tree.clone(memory_format=torch.contiguous_format)
    if isinstance(tree, dict):
        return {k: owned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(owned(v) for v in tree) if type(tree) in (list, tuple) else tree
    return tree
