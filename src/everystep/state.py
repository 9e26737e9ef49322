"""The complete training state: capture, restore, and the checks that a stored state fits the live one.

A training state is a tree of dicts, lists and tuples whose leaves are tensors or JSON scalars
(:mod:`everystep.tree` flattens it to tensors and a JSON skeleton, and hashes it).
"""

from __future__ import annotations

import array
import copy
import random
import sys
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import StateMismatchError
from .tree import flatten

__all__ = [
    "Stateful",
    "TrainingComponents",
    "capture_rng",
    "restore_rng",
    "group_scalars",
    "owned",
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


def capture_rng() -> dict[str, Any]:
    """Every random generator the training may draw from: torch CPU and CUDA, Python, NumPy."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python": {"version": version, "internal": torch.frombuffer(array.array("q", internal), dtype=torch.int64),
                   "gauss": gauss},  # (by way of an array: a third of torch.tensor's time on a 625-int tuple)
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`.

    Generator states are cloned first: ``set_rng_state`` reads a state tensor from the start of its
    storage, so a view into a larger buffer (a replica in shared memory) would be misread.
    """
    torch.set_rng_state(state["torch_cpu"].clone())
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss"]))
    if "torch_cuda" in state:
        if not torch.cuda.is_available():
            raise StateMismatchError(
                "the checkpoint holds CUDA random state but CUDA is not available here; "
                "restore it on a machine with the same GPUs"
            )
        torch.cuda.set_rng_state_all([t.clone() for t in state["torch_cuda"]])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        keys = n["keys"].numpy().astype("uint32")
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))


def _scalar(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_scalar(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def group_scalars(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyperparameters that are plain values (lr, betas, weight decay, …)."""
    return [{k: v for k, v in g.items() if k != "params" and _scalar(v)} for g in optimizer.param_groups]


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

    def restore(self, tree: dict[str, Any]) -> None:
        """Load a captured state into the live objects.

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
        before = self._saved()
        try:
            self._load(tree)
        except Exception as e:
            self._load(before)
            raise StateMismatchError(f"the checkpoint's state could not be loaded ({type(e).__name__}: {e}); the model, "
                                     "optimizer and other components are as they were") from e

    def _saved(self) -> dict[str, Any]:
        """Copies of every live object's state in host memory, to put back (:meth:`restore`)."""
        saved: dict[str, Any] = {"model": _host_copy(self.module.state_dict()),
                                 "optimizer": _host_copy(optimizer_state(self.optimizer)), "rng": capture_rng()}
        for name in self.OPTIONAL:
            component = getattr(self, name)
            if component is not None:
                saved[name] = _host_copy(component.state_dict())
        return saved

    def _load(self, tree: dict[str, Any]) -> None:
        self.module.load_state_dict(tree["model"])
        # (a shallow copy: ZeroRedundancyOptimizer's load_state_dict blanks the entries of other ranks' parameters)
        self.optimizer.load_state_dict({**tree["optimizer"], "state": dict(tree["optimizer"]["state"])})
        for name in self.OPTIONAL:
            component = getattr(self, name)
            if component is not None:
                component.load_state_dict(owned(tree[name]))
        restore_rng(tree["rng"])

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
            if key not in live or not isinstance(value, torch.Tensor) or _shape(value) != _shape(live[key]):
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


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_model(model: torch.nn.Module, stored: Any) -> None:
    """Raise :class:`StateMismatchError` naming the first key or shape that differs."""
    if not isinstance(stored, dict):
        raise StateMismatchError(f"the checkpoint's model state is a {type(stored).__name__}, not a dict of tensors")
    live = model.state_dict()
    missing = sorted(set(live) - set(stored))
    unexpected = sorted(set(stored) - set(live))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"the model has {_names(missing)} which the checkpoint lacks")
        if unexpected:
            parts.append(f"the checkpoint has {_names(unexpected)} which the model lacks")
        raise StateMismatchError(
            "; ".join(parts) + " — was it written by another model (or with/without a DDP 'module.' prefix)?"
        )
    for key, tensor in live.items():
        other = stored[key]
        if isinstance(tensor, torch.Tensor) and not isinstance(other, torch.Tensor):
            raise StateMismatchError(f"model entry {key!r} is a tensor; the checkpoint has a {type(other).__name__}")
        if isinstance(tensor, torch.Tensor) and _shape(tensor) != _shape(other):
            raise StateMismatchError(
                f"model parameter {key!r} has shape {_shape(tensor)}; the checkpoint has {_shape(other)} "
                "— was it written by another model configuration?"
            )


def _kind(value: Any) -> str:
    """What a setting or state value is, for comparing one stored with one live."""
    if isinstance(value, torch.Tensor):
        return "a 0-d tensor" if value.dim() == 0 else "a tensor"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return f"a sequence of ({', '.join(_kind(v) for v in value)})"
    return type(value).__name__


def check_optimizer(optimizer: torch.optim.Optimizer, stored: Any) -> None:
    """Check the optimizer's kind by its settings, the parameter counts per group, and per-parameter
    state: the same names for every parameter that has state, each a tensor of its parameter's
    shape, a 0-d tensor, a number or None, alike across parameters."""
    if not isinstance(stored, dict) or not isinstance(stored.get("param_groups"), list) \
            or not isinstance(stored.get("state"), dict):
        raise StateMismatchError("the checkpoint's optimizer state is not a dict of state and param_groups")
    groups = optimizer.param_groups
    stored_groups = stored["param_groups"]
    if len(groups) != len(stored_groups):
        raise StateMismatchError(
            f"the optimizer has {len(groups)} parameter groups; the checkpoint has {len(stored_groups)}"
        )
    check_group_settings(optimizer, stored_groups)
    known = set()
    for gi, (group, sgroup) in enumerate(zip(groups, stored_groups)):
        indexes = sgroup.get("params")
        if not isinstance(indexes, list) or not all(type(i) is int for i in indexes) or len(set(indexes)) != len(indexes):
            raise StateMismatchError(f"the checkpoint's optimizer parameter group {gi} has no list of parameter indexes")
        if len(group["params"]) != len(sgroup["params"]):
            raise StateMismatchError(
                f"optimizer parameter group {gi} has {len(group['params'])} parameters; "
                f"the checkpoint has {len(sgroup['params'])} — was it written by another model or optimizer?"
            )
        for param, index in zip(group["params"], sgroup["params"]):
            known.add(index)
            _check_param_state(stored["state"].get(index, {}), param, index)
        kinds: dict[str, set[str]] = {}  # an entry is of one kind in a group (entries may differ by shape: Adafactor)
        for index in sgroup["params"]:
            for name, value in stored["state"].get(index, {}).items():
                kinds.setdefault(name, set()).add(_state_kind(value))
        mixed = sorted(name for name, found in kinds.items() if len(found) > 1)
        if mixed:
            raise StateMismatchError(f"optimizer state {mixed[0]!r} is of several kinds in parameter group {gi} "
                                     f"({', '.join(sorted(kinds[mixed[0]]))})")
    for index in stored["state"]:
        if index not in known:
            raise StateMismatchError(f"the checkpoint holds optimizer state for parameter {index!r}, which no group has")


def _state_kind(value: Any) -> str:
    return "a tensor" if isinstance(value, torch.Tensor) else _kind(value)


def check_group_settings(optimizer: torch.optim.Optimizer, stored: Any, *, partial: bool = False) -> None:
    """Raise :class:`StateMismatchError` unless ``stored`` holds, for each param group, every setting
    this optimizer class defines (``partial``: those of plain values, as :func:`group_scalars`
    gives them), each of the kind the live group's is: another optimizer's settings are named as
    such. Settings others add (a scheduler's ``initial_lr``) may be there or not."""
    groups = optimizer.param_groups
    if not isinstance(stored, list) or len(stored) != len(groups):
        raise StateMismatchError(f"the optimizer has {len(groups)} parameter groups; the checkpoint's settings "
                                 f"are not a list of {len(groups)}")
    for gi, (group, sgroup) in enumerate(zip(groups, stored)):
        if not isinstance(sgroup, dict):
            raise StateMismatchError(f"the checkpoint's settings of optimizer parameter group {gi} are not a dict")
        live = group_scalars(optimizer)[gi] if partial else {k: v for k, v in group.items() if k != "params"}
        defined = {k for k in optimizer.defaults if k in live}
        missing = sorted(defined - set(sgroup))
        if missing:
            raise StateMismatchError(
                f"the optimizer ({type(optimizer).__name__}) has the settings {_names(sorted(defined), 99)}; the "
                f"checkpoint's lack {_names(missing, 99)} and are {_names(sorted(set(sgroup) - {'params'}), 99)} — "
                "was it written with another optimizer?")
        for name in sorted(set(live) & set(sgroup)):
            if _kind(live[name]) != _kind(sgroup[name]) and live[name] is not None and sgroup[name] is not None:
                raise StateMismatchError(f"optimizer setting {name!r} of group {gi} is {_kind(live[name])}; the "
                                         f"checkpoint's is {_kind(sgroup[name])}")


def _check_param_state(state: Any, param: torch.Tensor, index: Any) -> None:
    if not isinstance(state, dict):
        raise StateMismatchError(f"the optimizer state of parameter {index} is not a dict")
    for name, value in state.items():
        if _kind(value) not in ("a tensor", "a 0-d tensor", "a number", "NoneType"):
            raise StateMismatchError(f"optimizer state {name!r} of parameter {index} is {_kind(value)}")
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not _fits(_shape(value), _shape(param)):
            raise StateMismatchError(
                f"optimizer state {name!r} of parameter {index} has shape {_shape(value)}; "
                f"the parameter has {_shape(param)} — was it written by another model configuration?"
            )


def _fits(state: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """Whether a state tensor of shape ``state`` belongs to a parameter of shape ``param``: the same
    shape, or a factored one (Adafactor's row and column statistics: 1 where it averages)."""
    return state == param or (len(state) == len(param) and all(s in (p, 1) for s, p in zip(state, param)))


def check_rng(stored: Any) -> None:
    """Raise :class:`StateMismatchError` unless ``stored`` has the structure :func:`capture_rng` gives."""
    live = capture_rng()
    problem = _differs(live, stored, "rng")
    if problem:
        raise StateMismatchError(f"the checkpoint's random generator state is malformed: {problem}")


def _differs(live: Any, stored: Any, path: str) -> str | None:
    if isinstance(live, dict):
        if not isinstance(stored, dict):
            return f"{path} is {_kind(stored)}, not a dict"
        for key in live:
            if key not in stored:
                if key == "torch_cuda":
                    continue  # written without CUDA
                return f"{path}/{key} is missing"
            problem = _differs(live[key], stored[key], f"{path}/{key}")
            if problem:
                return problem
        return None
    if isinstance(live, torch.Tensor):
        if not isinstance(stored, torch.Tensor) or stored.dtype != live.dtype or stored.shape != live.shape:
            return f"{path} is not a {live.dtype} tensor of shape {tuple(live.shape)}"
        return None
    if isinstance(live, list):
        return None if isinstance(stored, list) and all(isinstance(t, torch.Tensor) for t in stored) else \
            f"{path} is not a list of tensors"
    if _kind(live) != _kind(stored) and not (live is None or stored is None):
        return f"{path} is {_kind(stored)}, not {_kind(live)}"
    return None


def _names(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return shown + more
