"""The checks that a stored state fits the live objects, made before anything of it is loaded
(:meth:`~everystep.state.TrainingComponents.restore`): the model's entries and shapes, the
optimizer's settings and per-parameter state, the random generators'; and the settings of each
optimizer group as scalars, which the checks and the differential strategies compare."""

from __future__ import annotations

from typing import Any

import torch

from .errors import StateMismatchError
from .rng import capture_rng

__all__ = ["check_model", "check_optimizer", "check_group_settings", "check_rng", "group_scalars", "shape_of"]


def _scalar(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_scalar(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def group_scalars(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyperparameters that are plain values (lr, betas, weight decay, …)."""
    return [{k: v for k, v in g.items() if k != "params" and _scalar(v)} for g in optimizer.param_groups]


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
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
        if isinstance(tensor, torch.Tensor) and shape_of(tensor) != shape_of(other):
            raise StateMismatchError(
                f"model parameter {key!r} has shape {shape_of(tensor)}; the checkpoint has {shape_of(other)} "
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
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not _fits(shape_of(value), shape_of(param)):
            raise StateMismatchError(
                f"optimizer state {name!r} of parameter {index} has shape {shape_of(value)}; "
                f"the parameter has {shape_of(param)} — was it written by another model configuration?"
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
