"""The Strategy protocol, its configuration and the context a strategy works in.

Call order (enforced by :class:`~everystep.Checkpointer`):

1. ``attach(ctx)`` once, before anything else. Optional, at restore: ``agree_restore()`` on
   every rank at once (it may use collectives), then ``restore()`` (ranks may be staggered),
   then ``on_start(step)``.
2. ``load_state_dict(state)`` when recovery found strategy-owned state.
3. For each training step t = 1, 2, …:
   a. ``on_step_end(t)`` right after the update of step t;
   b. ``on_state_ready(t)`` once S_t is complete and before step t+1 changes it;
   c. ``before_update(t + 1)`` right before the update of step t+1.
4. ``wait()`` whenever the user asks: block until work in flight is done, raise any failure.
5. ``on_state_ready(t, final=True)`` at a clean close, where t is the last step.
6. ``close()`` once: ``wait()``, then release threads and buffers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..distributed import Ranks
from ..errors import BackgroundWriteError, ConfigError
from ..state import TrainingComponents, flatten
from ..storage.sharded import ShardPlan

if TYPE_CHECKING:
    from ..storage.local import LocalStore

__all__ = ["Strategy", "StrategyConfig", "StrategyContext", "CheckpointStats"]


@dataclass(kw_only=True, slots=True)
class StrategyConfig:
    """Options every strategy shares."""

    every: int = 1
    """Checkpoint every this many steps (1: every step)."""
    keep: int = 2
    """Full checkpoints to keep; older ones, and what only they need, are deleted."""

    def __post_init__(self) -> None:
        self._check_every()
        if self.keep < 1:
            raise ConfigError(f"keep must be at least 1 so that a checkpoint survives, got {self.keep}")

    def _check_every(self) -> None:
        if self.every < 1:
            raise ConfigError(f"every must be a positive number of steps, got {self.every}")


@dataclass
class CheckpointStats:
    """What checkpointing cost, as observed by the training process."""

    steps: int = 0
    checkpoints: int = 0
    stall_seconds: float = 0.0
    snapshot_wait_seconds: float = 0.0
    last_durable_step: int = 0
    """The newest step recoverable after a hardware failure (on storage)."""
    last_memory_step: int = 0
    """The newest step recoverable after a software failure from memory that outlives the process."""
    max_checkpoint_seconds: float = 0.0
    """The longest time one full checkpoint took to become durable (write and commit)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "checkpoints": self.checkpoints,
            "stall_seconds": self.stall_seconds,
            "snapshot_wait_seconds": self.snapshot_wait_seconds,
            "stall_per_checkpoint_seconds": self.stall_seconds / self.checkpoints if self.checkpoints else 0.0,
            "last_durable_step": self.last_durable_step,
        }


class StrategyContext:
    """What a strategy may use: the live components, the store, the boundary capture, stats."""

    def __init__(self, components: TrainingComponents, store: "LocalStore | None", stats: CheckpointStats) -> None:
        self.components = components
        self.store = store
        self.stats = stats
        self.boundary: dict[str, Any] = {}
        self.full_format = "safetensors"
        """How full checkpoints are stored: ``safetensors`` (everystep's own) or ``dcp``."""
        self._lock = threading.Lock()
        self.strategy_state: dict[str, Any] | None = None

    def state_tree(self, step: int) -> dict[str, Any]:
        """S_step as a tree referencing live tensors (valid until the next update)."""
        tree = {"step": step, **self.components.capture(), **self.boundary}
        if self.strategy_state is not None:
            tree["strategy"] = self.strategy_state
        return tree

    def flatten_state(self, step: int) -> tuple[dict[str, torch.Tensor], Any]:
        return flatten(self.state_tree(step))

    @property
    def ranks(self) -> Ranks:
        return self.store.ranks if self.store is not None else Ranks()

    def _optimizer_storages(self) -> set[int]:
        opt = self.components.optimizer
        ptrs = {p.untyped_storage().data_ptr() for g in opt.param_groups for p in g["params"]}
        for st in opt.state.values():
            ptrs |= {v.untyped_storage().data_ptr() for v in st.values() if isinstance(v, torch.Tensor) and v.numel()}
        return ptrs

    @staticmethod
    def _keys_in(tensors: dict[str, torch.Tensor], ptrs: set[int]) -> set[str]:
        return {k for k, t in tensors.items() if t.numel() and t.untyped_storage().data_ptr() in ptrs}

    def stable_keys(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Keys of tensors that only ``optimizer.step()`` modifies: parameters and optimizer state.

        Everything else (BatchNorm statistics, RNG, counters) may change in the next forward and
        must be copied before it starts.
        """
        ptrs = self._optimizer_storages()
        compression = self.components.compression
        if compression is not None and getattr(compression, "immutable_tensors", False):
            tensors_, _ = flatten(compression.state_dict())
            ptrs |= {t.untyped_storage().data_ptr() for t in tensors_.values() if t.numel()}
        return self._keys_in(tensors, ptrs)

    def replicated_keys(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Keys of the state data parallelism keeps identical on every rank: parameters and
        optimizer state. The rest (buffers, RNG, residuals) is treated as each rank's own."""
        return self._keys_in(tensors, self._optimizer_storages()) if self.ranks.distributed else set()

    def full_plan(self, step: int) -> tuple[ShardPlan, Any]:
        """The tensors of S_step this rank writes (all of them in a single process), and the skeleton."""
        tensors, skeleton = self.flatten_state(step)
        split = self.full_format != "dcp"  # DCP spreads whole replicated tensors over the ranks itself
        return ShardPlan.of(tensors, self.replicated_keys(tensors), self.ranks, split=split), skeleton

    def committed(self, step: int, *, count: bool = True, seconds: float = 0.0) -> None:
        """Record that the checkpoint of ``step`` is durable and visible (``count``: as a checkpoint),
        a full one written in ``seconds``."""
        with self._lock:
            self.stats.max_checkpoint_seconds = max(self.stats.max_checkpoint_seconds, seconds)
            self.stats.checkpoints += count
            self.stats.last_durable_step = max(self.stats.last_durable_step, step)

    def in_memory(self, step: int) -> None:
        """Record a checkpoint of ``step`` held in memory that outlives the training process."""
        with self._lock:
            self.stats.checkpoints += 1
            self.stats.last_memory_step = max(self.stats.last_memory_step, step)


class BackgroundErrors:
    """Keeps every failure of background work and raises them, once, in the training thread.

    The first failure is raised as the cause; any others that happened before the raise are
    named in the same message, so no failure is ever dropped.
    """

    def __init__(self) -> None:
        self._errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()

    def record(self, what: str, error: BaseException) -> None:
        with self._lock:
            self._errors.append((what, error))

    def raise_pending(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if not errors:
            return
        (what, first), rest = errors[0], errors[1:]
        message = f"{what} failed: {first}"
        if rest:
            message += f" (and {len(rest)} more failed since: " + "; ".join(w for w, _ in rest) + ")"
        raise BackgroundWriteError(message) from first


class Strategy(Protocol):
    """A checkpointing strategy; see the module docstring for the call order."""

    name: ClassVar[str]
    needs_store: ClassVar[bool]

    def attach(self, ctx: StrategyContext) -> None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def on_step_end(self, step: int) -> None: ...

    def on_state_ready(self, step: int, *, final: bool = False) -> None: ...

    def before_update(self, step: int) -> None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...

