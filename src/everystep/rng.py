"""Every random generator the training may draw from — torch's on the CPU and CUDA, Python's,
NumPy's —: captured at a step's end, and restored (:func:`~everystep.state_checks.check_rng` checks a
stored state first)."""

from __future__ import annotations

import array
import random
from typing import Any

import torch

from .errors import StateMismatchError

__all__ = ["capture_rng", "restore_rng"]


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
