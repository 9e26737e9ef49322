"""Gradient compression as training uses it, in one process: compress → decompress → optimizer.

:class:`GradientCompression` registers an optimizer step pre-hook that replaces every gradient
the optimizer is about to consume (after the user's clipping and a GradScaler's unscaling) by
the decompression of its compressed form. The compressed forms of the last update are kept for
a checkpointing strategy to reuse (:meth:`take`); the error-feedback residuals are training
state (:meth:`state_dict`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..capture.hooks import register_before_update
from ..errors import ConfigError
from ..state import bare_module
from .base import Compressed, Compressor
from .quant import Quant8
from .topk import TopK

__all__ = ["GradientCompression", "make_compressor", "parameter_names", "parse_spec"]

SPECS = "topk:RATIO, quant8 or powersgd:rank=R (topk and quant8 may add ,ef=off)"


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``topk[:RATIO]`` (default 0.01), ``quant8``, ``powersgd[:rank=R]`` (default 4), each optionally
    followed by ``,ef=off`` (topk and quant8: no error feedback; ``error_feedback`` in the arguments
    only when given) → kind and arguments."""
    head, *extra = spec.split(",")
    kind, args = _parse_kind(head, spec)
    for option in extra:
        if option not in ("ef=on", "ef=off"):
            raise ConfigError(f"compression option {option!r} in {spec!r} is unknown; the one option is ef=on or ef=off")
        args["error_feedback"] = option == "ef=on"
    if kind == "powersgd" and not args.get("error_feedback", True):
        raise ConfigError(f"{spec!r}: PowerSGD keeps its own error feedback; ef=off applies to topk and quant8")
    return kind, args


def _parse_kind(head: str, spec: str) -> tuple[str, dict[str, Any]]:
    kind, _, arg = head.partition(":")
    if kind == "topk":
        try:
            return kind, {"ratio": float(arg) if arg else 0.01}
        except ValueError:
            raise ConfigError(f"--compress topk takes a ratio like topk:0.01; got {spec!r}") from None
    if kind == "quant8" and not arg:
        return kind, {}
    if kind == "powersgd":
        key, _, value = arg.partition("=")
        if arg and (key != "rank" or not value.isdigit() or int(value) < 1):
            raise ConfigError(f"--compress powersgd takes a rank like powersgd:rank=4; got {spec!r}")
        return kind, {"rank": int(value) if arg else 4}
    raise ConfigError(f"unknown compression {spec!r}; use {SPECS}")


def make_compressor(spec: str) -> Compressor:
    """The per-parameter compressor of ``topk[:RATIO]`` or ``quant8`` (``,ef=off``: no error feedback)."""
    kind, args = parse_spec(spec)
    if kind == "topk":
        return TopK(args["ratio"], error_feedback=args.get("error_feedback", True))
    if kind == "quant8":
        return Quant8(error_feedback=args.get("error_feedback", True))
    raise ConfigError(f"{spec} compresses DistributedDataParallel's gradient communication: it needs a DDP model "
                      "and everystep.compress.ddp_compression (everystep train sets this up, in one process too)")


def parameter_names(model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """Each parameter's name as ``named_parameters`` of the bare model (no DDP or compile wrapper)
    first yields it (tied weights: the first name), so that names agree in one process and many."""
    return {p: n for n, p in bare_module(model).named_parameters()}


class StepRecords:
    """What every gradient compression shares: the optimizer's parameters by name, a step pre-hook
    (:meth:`_pre_step`) that makes the records of the update about to happen, and :meth:`take`."""

    immutable_tensors = True  # state_dict returns tensors that are replaced, never modified in place

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: str) -> None:
        self.spec = spec
        self.names = parameter_names(model)
        self.params: list[tuple[str, torch.nn.Parameter]] = [
            (self.names[p], p) for group in optimizer.param_groups for p in group["params"]
        ]
        self._last: dict[str, Compressed] | None = None
        self.compressed_bytes = 0
        """Bytes of the compressed gradients this process produced (what it sends), over all steps."""
        self._handle = register_before_update(optimizer, self._pre_step)

    def _pre_step(self) -> None:
        raise NotImplementedError

    def devices(self) -> dict[str, torch.device]:
        """Each parameter's device, by name."""
        return {name: p.device for name, p in self.params}

    def take(self) -> dict[str, Compressed] | None:
        """The records of the last update, once; ``None`` if no update happened."""
        last, self._last = self._last, None
        return last

    def remove(self) -> None:
        self._handle.remove()


def residual_state(compressor: Any) -> dict[str, Any]:
    """A per-parameter compressor's training state: its kind and its error-feedback residuals."""
    return {"kind": compressor.name, "residuals": dict(compressor.residuals)}


def load_residual_state(compressor: Any, state: dict[str, Any], devices: dict[str, torch.device]) -> None:
    """Take the residuals of ``state``, each onto its parameter's device (``devices`` by name):
    they are stored on the CPU, and the gradients they are added to may live on a GPU."""
    check_kind(state, compressor.name)
    if state["residuals"] and not getattr(compressor, "error_feedback", True):
        raise ConfigError(f"the checkpoint was trained with {compressor.name} error feedback (it holds residuals); this "
                          "run compresses without it (ef=off): use the same compression as the run that wrote it")
    compressor.residuals = {k: v.to(devices.get(k, v.device), copy=True) for k, v in state["residuals"].items()}


def check_kind(state: dict[str, Any], spec: str) -> None:
    """Refuse compression state saved by another kind of compression."""
    if state.get("kind") != spec:
        raise ConfigError(f"the checkpoint was trained with {state.get('kind')!r} compression; this run uses {spec!r}")


class GradientCompression(StepRecords):
    """Compresses the gradients an optimizer consumes. Use :meth:`remove` to detach it."""

    def __init__(self, compressor: Compressor, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.compressor = compressor
        super().__init__(model, optimizer, compressor.name)

    def _pre_step(self) -> None:
        record: dict[str, Compressed] = {}
        with torch.no_grad():
            for name, p in self.params:
                if p.grad is None:
                    continue
                compressed = self.compressor.compress(name, p.grad)
                p.grad.copy_(self.compressor.decompress(compressed, p.grad))
                record[name] = compressed
                self.compressed_bytes += self.compressor.nbytes(compressed)
        self._last = record

    def state_dict(self) -> dict[str, Any]:
        return residual_state(self.compressor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_residual_state(self.compressor, state, self.devices())
