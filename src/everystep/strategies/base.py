"""The Strategy base class, its configuration and the context a strategy works in.

A strategy is a :class:`Strategy` subclass: its public lifecycle methods check the call order and
raise failures of background work, then call ``_``-hooks that do nothing unless overridden. What a
strategy can do is declared on its class (``needs_store``, ``needs_restore``, ``other_world_size``,
``shares_store``), never probed. Call order (the :class:`~everystep.Checkpointer` keeps it):

1. ``attach(ctx)`` once, before anything else.
2. At restore (``needs_restore``: required before the first step): ``agree_restore()`` —
   a **collective**: every rank calls it at once — then ``recover()`` (ranks may be staggered),
   which returns the state to recover as a :class:`~everystep.recovery.Candidate` that the
   Checkpointer loads into the live objects (:func:`~everystep.recovery.load`: no strategy loads),
   then ``on_start(step)`` with the step restored (0: none). Without restore, ``on_start(0)``
   comes at the first step.
3. For each training step t = 1, 2, …:
   a. ``on_step_end(t)`` right after the update of step t;
   b. ``on_state_ready(t)`` once S_t is complete and before step t+1 changes it;
   c. ``before_update(t + 1)`` right before the update of step t+1.
   With per-layer updates (:class:`~everystep.OptimizerInBackward`, ``layer_updates``), the update
   of step t+1 runs during its backward pass, one layer at a time: ``before_update(t + 1)`` comes
   before the first layer's, ``before_layer_update(t + 1, params)`` before each layer's, and
   ``on_step_end(t + 1)`` once the backward pass (every layer's update) is done.
   Under several ranks ``on_state_ready`` may be a collective (every rank calls it for the
   same steps); the others never are.
4. ``wait()`` whenever the user asks: block until work in flight is done, raise any failure.
5. ``on_state_ready(t, final=True)`` at a clean close, where t is the last step.
6. ``close()`` once: ``wait()``, then release threads and buffers. After an error in training,
   ``abandon()`` instead: like ``close()``, except that what outlives the training process (a
   checkpoint agent's replica) is left as a crash would leave it.

Background work uses :mod:`everystep.background`: workers whose failures go to ``self.errors``,
raised once by the next lifecycle call.
"""

from __future__ import annotations

import math
import threading
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..background import BackgroundErrors
from ..distributed import Ranks
from ..errors import ConfigError, EverystepError
from ..policy.interval import due
from ..recovery import Candidate, recover
from ..state import TrainingComponents, zero_redundancy
from ..parallelism import shard_like, sharded_layout
from ..tree import OPTIMIZER_STATE_ENTRY, flatten, local_shard
from ..layout import TensorLayout
from ..storage.full import persist_full
from ..storage.sharded import RankShare
from ..storage.tensorfile import buffer_chunks, tensor_chunks
from ..transport.host import HostBuffer

if TYPE_CHECKING:
    from ..storage.base import Manifest
    from ..storage.catalog import Catalog
    from ..storage.directory import CheckpointDirectory

__all__ = ["Strategy", "StrategyConfig", "StrategyContext", "CheckpointStats", "ParamKeys", "LiveShards", "as_shards"]


RATE_PLAUSIBLE = 1e5
"""A rate below 100 kB/s was given without its unit (16 meaning 16 GB/s)."""

_PLAIN = {int: "a whole number", float: "a finite number", bool: "True or False", str: "a string",
          type(None): "None"}


@dataclass(kw_only=True, slots=True)
class StrategyConfig:
    """Options every strategy shares."""

    every: int = 1
    """Checkpoint every this many steps (1: every step)."""
    keep: int = 2
    """Full checkpoints to keep; older ones, and what only they need, are deleted."""

    quantities: ClassVar[dict[str, str]] = {}
    """Options that are sizes (``"size"``, bytes) or rates (``"rate"``, bytes/s): each may be given
    with a unit, ``"16GB/s"`` or ``"4MiB"`` (:mod:`everystep.units`)."""

    def __post_init__(self) -> None:
        self._read_quantities()
        self._check_types()
        self._check_every()

    def _read_quantities(self) -> None:
        from ..units import UnitError, parse_bytes

        for name, kind in self.quantities.items():
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    got = parse_bytes(value, rate=kind == "rate", plausible=RATE_PLAUSIBLE if kind == "rate" else 1)
                except UnitError as e:
                    raise ConfigError(f"{name}: {e}") from None
                setattr(self, name, got if kind == "rate" else int(got))
            elif kind == "rate" and type(value) in (int, float) and 0 < value < RATE_PLAUSIBLE:
                raise ConfigError(f"{name}={value!r} is {value:g} bytes/s, implausibly small; give a unit, e.g. "
                                  f"{name}='{value:g}GB/s'")
        if self.keep < 1:
            raise ConfigError(f"keep must be at least 1 so that a checkpoint survives, got {self.keep}")

    def _check_types(self) -> None:
        """Each option of a plain type (int, float, bool, str, or None where allowed) has that type:
        a bool is not an int, an int is a float, a float is finite."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
            if not all(a in _PLAIN for a in allowed):
                continue
            value = getattr(self, f.name)
            ok = (value is None and type(None) in allowed) or (type(value) is bool and bool in allowed) or \
                (type(value) is int and (int in allowed or float in allowed)) or \
                (type(value) is float and float in allowed and math.isfinite(value)) or \
                (type(value) is str and str in allowed)
            if not ok:
                names = " or ".join(_PLAIN[a] for a in allowed)
                raise ConfigError(f"{f.name} must be {names}, got {value!r}")

    def check_job(self, world: int, full_format: str) -> None:
        """Refuse (:class:`ConfigError`) a job of ``world`` processes writing full checkpoints in
        ``full_format`` that these options cannot serve; every job, unless a strategy says otherwise."""

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
    last_remote_step: int = -1
    """The newest step committed in the remote tier (``remote=``); -1: none."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "checkpoints": self.checkpoints,
            "stall_seconds": self.stall_seconds,
            "snapshot_wait_seconds": self.snapshot_wait_seconds,
            "stall_per_checkpoint_seconds": self.stall_seconds / self.checkpoints if self.checkpoints else 0.0,
            "last_durable_step": self.last_durable_step,
            "last_remote_step": self.last_remote_step,
        }


@dataclass(frozen=True)
class ParamKeys:
    """A parameter the optimizer updates and where its tensors lie in the flat state."""

    index: int
    param: torch.Tensor
    group: int
    key: str | None
    state: dict[str, str]


_COMPRESSION = "/compression/"
"""Where a gradient compression's state lies in the flat state (:meth:`TrainingComponents.capture`)."""


class LiveShards(Mapping[str, torch.Tensor]):
    """The live DTensors of a state by key; an optimizer's state entry that is not there (optimizers
    make their state at the first step, after a restore) is placed as its parameter is, where the
    parameter is a DTensor: ``/optimizer/state/<i>/<name>`` as the i-th parameter over the groups, the
    index ``optimizer.state_dict()`` gives it. A reader places an entry so only where its shape is
    the parameter's (``exp_avg``, not a step counter). :attr:`shapes`: the shape of each tensor of
    the live flat state (of a DTensor, its local shard's)."""

    def __init__(self, live: dict[str, torch.Tensor], params: list[torch.Tensor],
                 shapes: dict[str, tuple[int, ...]]) -> None:
        self._live, self._params, self.shapes = live, params, shapes

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._live:
            return self._live[key]
        found = OPTIMIZER_STATE_ENTRY.fullmatch(key)
        if found is not None and int(found[1]) < len(self._params):
            param = self._params[int(found[1])]
            if local_shard(param) is not param:
                return param
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def holds(self, key: str) -> bool:
        """Whether ``key`` is a DTensor of the live state now (not one placed as its parameter)."""
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)


def as_shards(tensors: dict[str, torch.Tensor], live: LiveShards) -> None:
    """Make each tensor of a state read back (a region's slot, a replica on a peer; its shapes are
    the live state's) that is this rank's shard of a live DTensor a DTensor placed as the live one,
    in place. An optimizer state the live optimizer has not made yet is a
    shard where it has its parameter's local shape (``exp_avg``; not a step counter)."""
    for key, t in list(tensors.items()):
        like = live.get(key)
        if like is not None and tuple(t.shape) == tuple(local_shard(like).shape) and (t.dim() or live.holds(key)):
            tensors[key] = shard_like(t, like)


class StrategyContext:
    """What a strategy may use: the live components, the checkpoint directory and its catalog, the
    boundary capture, stats."""

    def __init__(self, components: TrainingComponents, directory: "CheckpointDirectory | None",
                 stats: CheckpointStats) -> None:
        self.components = components
        self.directory = directory
        """Retention and garbage collection (``None``: a strategy that stores nothing)."""
        self.catalog: Catalog | None = directory.catalog if directory is not None else None
        """Where objects and manifests are written and read."""
        self.stats = stats
        self.layout = sharded_layout(components.model, components.optimizer)
        """The job's sharded layout (:func:`~everystep.parallelism.sharded_layout`); None: replicated. A
        sharded state is read on the training thread only: FSDP2's ``state_dict()`` reshards the
        parameters that a forward running meanwhile has gathered."""
        self.boundary: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stable: tuple[Any, frozenset[str]] | None = None
        self._sharded: dict[str, torch.Tensor] = {}

    def state_tree(self, step: int) -> dict[str, Any]:
        """S_step as a tree referencing live tensors (valid until the next update)."""
        return {"step": step, **self.components.capture(), **self.boundary}

    def flatten_state(self, step: int) -> tuple[dict[str, torch.Tensor], Any]:
        """S_step flattened (:func:`~everystep.tree.flatten`): a DTensor as its local shard; the DTensors
        themselves are kept by key (what :meth:`full_share` and :meth:`replicated_keys` read)."""
        sharded: dict[str, torch.Tensor] = {}
        flat = flatten(self.state_tree(step), sharded=sharded)
        self._sharded = sharded
        return flat

    @property
    def sharded(self) -> dict[str, torch.Tensor]:
        """The DTensors of the last :meth:`flatten_state` by key (empty where the state is replicated):
        the flat state holds their local shards under the same keys."""
        return self._sharded

    def live_shards(self) -> "LiveShards":
        """The live DTensors of the state by key (a sharded job's checkpoint is read as their shards),
        including the optimizer state that does not exist yet (:class:`LiveShards`)."""
        tensors, _ = self.flatten_state(0)
        params = [p for group in self.components.optimizer.param_groups for p in group["params"]]
        return LiveShards(dict(self._sharded), params, {k: tuple(t.shape) for k, t in tensors.items()})

    @property
    def full_format(self) -> str:
        """How full checkpoints are stored: ``safetensors`` (everystep's own) or ``dcp``; the
        directory's marker says (the Checkpointer refuses a directory of the other format)."""
        return self.directory.full_format if self.directory is not None else "safetensors"

    @property
    def splits_replicated(self) -> bool:
        """Whether this rank writes its share of the replicated tensors' elements (everystep's own
        format); DCP spreads whole replicated tensors over the ranks itself."""
        return self.full_format != "dcp"

    @property
    def device(self) -> torch.device:
        """Where training runs: the device of the optimizer's first parameter (the CPU without one)."""
        for group in self.components.optimizer.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def copy_stream(self) -> "torch.cuda.Stream | None":
        """A new side stream for copies off the training device (None where training is not on CUDA)."""
        return torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def ranks(self) -> Ranks:
        return self.directory.ranks if self.directory is not None else Ranks()

    def _optimizer_storages(self) -> set[int]:
        """Where the parameters and the optimizer state that ``optimizer.step()`` alone changes lie (of
        ZeRO-1's state, none: each rank's is its own, held by its local optimizer)."""
        opt = self.components.optimizer
        ptrs = {local_shard(p).untyped_storage().data_ptr() for g in opt.param_groups for p in g["params"]}
        for st in () if zero_redundancy(opt) else opt.state.values():
            ptrs |= {local_shard(v).untyped_storage().data_ptr() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.numel()}
        return ptrs

    @staticmethod
    def _keys_in(tensors: dict[str, torch.Tensor], ptrs: set[int]) -> set[str]:
        return {k for k, t in tensors.items() if t.numel() and t.untyped_storage().data_ptr() in ptrs}

    def stable_keys(self, tensors: dict[str, torch.Tensor]) -> frozenset[str]:
        """Keys of tensors that only ``optimizer.step()`` modifies: parameters and optimizer state,
        and the state of a gradient compression that replaces its tensors rather than modifying them
        (``immutable_tensors``: its residuals, new objects at every step).

        Everything else (BatchNorm statistics, RNG, counters) may change in the next forward and
        must be copied before it starts. A state checkpointed every step asks with the same tensors
        each time: the answer for the model's and the optimizer's part of it is kept while the same
        keys name the same memory (each tensor's data pointer). What could change beneath that (a parameter group
        added, whose tensors get optimizer state, so new keys, only at their first update) leaves a
        tensor counted volatile, copied at once, which is always correct.
        """
        compression = self.components.compression
        replaced = compression is not None and getattr(compression, "immutable_tensors", False)
        fresh = tuple(f"/{name}/" for name in self.boundary)  # copies taken at the step's end: volatile
        rest = [k for k in tensors if not k.startswith(fresh) and not (replaced and k.startswith(_COMPRESSION))]
        signature = (rest, [tensors[k].data_ptr() for k in rest])
        if self._stable is None or self._stable[0] != signature:
            self._stable = (signature, frozenset(self._keys_in({k: tensors[k] for k in rest},
                                                               self._optimizer_storages())))
        if not replaced:
            return self._stable[1]
        return self._stable[1] | {k for k in tensors if k.startswith(_COMPRESSION) and tensors[k].numel()}

    def optimizer_keys(self, tensors: dict[str, torch.Tensor]) -> list[ParamKeys]:
        """Each parameter the optimizer updates, in its groups' order, with its key in ``tensors``
        (the flat state: ``None`` when the model does not hold it) and its state's keys by name."""
        by_ptr = {t.data_ptr(): k for k, t in tensors.items() if t.numel() and k.startswith("/model/")}
        found = []
        for gi, group in enumerate(self.components.optimizer.param_groups):
            for p in group["params"]:
                prefix = f"/optimizer/state/{len(found)}/"
                found.append(ParamKeys(len(found), p, gi, by_ptr.get(local_shard(p).data_ptr()),
                                       {k[len(prefix):]: k for k in tensors if k.startswith(prefix)}))
        return found

    def replicated_keys(self, tensors: dict[str, torch.Tensor], *, alone: bool = False,
                        sharded: Mapping[str, torch.Tensor] | None = None) -> set[str]:
        """Keys of the state data parallelism keeps identical on every rank: parameters and
        optimizer state that are not shards of DTensors (each rank holds its own). The rest
        (buffers, RNG, residuals) is treated as each rank's own. In a single process none, unless
        ``alone``: a format that loads at another world size stores them under the keys every rank reads.
        ``sharded``: the DTensors of the flattening that made ``tensors`` (default: the last
        :meth:`flatten_state`'s)."""
        if not self.ranks.distributed and not alone:
            return set()
        return self._keys_in(tensors, self._optimizer_storages()) - (self._sharded if sharded is None else sharded).keys()

    def full_share(self, step: int) -> tuple[RankShare, Any]:
        """The tensors of S_step this rank writes (all of them in a single process), and the skeleton."""
        tensors, skeleton = self.flatten_state(step)
        split = self.splits_replicated
        return RankShare.of(tensors, self.replicated_keys(tensors, alone=not split), self.ranks, split=split,
                            sharded=self._sharded), skeleton

    def persist(self, step: int, source: "HostBuffer | dict[str, torch.Tensor]", skeleton: Any, *, share: RankShare,
                keep: int, count: bool = True) -> tuple[Manifest, float]:
        """Write this rank's part of the full checkpoint of ``step`` from ``source`` (a host buffer,
        or tensors), commit it, record it (:meth:`record_durable`; ``count``: as a checkpoint), and keep the
        newest ``keep``; the manifest and the seconds the write took. The caller releases ``source``."""
        assert self.directory is not None
        if isinstance(source, HostBuffer):
            chunks, tensors = buffer_chunks(source.layout, source.memoryview()), source.views
        else:
            chunks, tensors = tensor_chunks(TensorLayout.of(source), source), source
        return persist_full(self.directory, step, chunks, skeleton, keep=keep, share=share, tensors=tensors,
                            format=self.full_format, committed=lambda s: self.record_durable(step, count=count, seconds=s))

    def record_durable(self, step: int, *, count: bool = True, seconds: float = 0.0) -> None:
        """Record that the checkpoint of ``step`` is durable and visible (``count``: as a checkpoint),
        a full one written in ``seconds``."""
        with self._lock:
            self.stats.max_checkpoint_seconds = max(self.stats.max_checkpoint_seconds, seconds)
            self.stats.checkpoints += count
            self.stats.last_durable_step = max(self.stats.last_durable_step, step)

    def waited(self, seconds: float) -> None:
        """Record that the training thread waited ``seconds`` for checkpointing to free memory."""
        with self._lock:
            self.stats.snapshot_wait_seconds += seconds

    def in_memory(self, step: int) -> None:
        """Record a checkpoint of ``step`` held in memory that outlives the training process."""
        with self._lock:
            self.stats.checkpoints += 1
            self.stats.last_memory_step = max(self.stats.last_memory_step, step)


class Strategy:
    """A checkpointing strategy; see the module docstring for the call order and the hooks."""

    name: ClassVar[str]
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig
    needs_store: ClassVar[bool] = True
    """It writes checkpoints: the Checkpointer opens a directory for it."""
    needs_restore: ClassVar[bool] = False
    """It records the state training starts from: ``recover()`` must come before the first step."""
    other_world_size: ClassVar[bool] = False
    """What it stores is the full state alone: a job of another size can resume from it."""
    layer_updates: ClassVar[bool] = False
    """It works with an optimizer that updates layer by layer during backward
    (:class:`~everystep.OptimizerInBackward`): it needs no gradient after the update."""
    shares_store: ClassVar[bool] = False
    """Another process (a checkpoint agent) writes to its store: only the strategy may collect
    the directory's garbage, when it knows that process writes nothing."""
    needs_compression: ClassVar[bool] = False
    """It reuses the compressed gradients training produces: training needs a gradient compression."""
    mirrors_to_peers: ClassVar[bool] = False
    """It takes ``peers=True``: each rank's own state mirrored every step to a rank on another host
    (:mod:`everystep.peers`)."""
    exact: ClassVar[bool] = True
    """Recovery restores S_t bitwise (on the CPU; a strategy may say what differs on a GPU). A lossy
    one (``naive_diff``) restores an approximation and says how far it may be."""
    sharded_layouts: ClassVar[frozenset[str]] = frozenset()
    """The sharded layouts (:data:`everystep.parallelism.LAYOUTS`) whose ranks' shards it checkpoints;
    a job sharded otherwise is refused before anything is written."""
    sharded_refusal: ClassVar[str] = ""
    full_formats: ClassVar[tuple[str, ...]] = ("safetensors", "dcp")
    """The formats of full checkpoints it writes (``full_format``)."""
    full_formats_reason: ClassVar[str] = ""
    """Why not the others."""
    """Why it refuses a sharded job, where more can be said than that it checkpoints replicated state."""

    def __init__(self, config: StrategyConfig | None = None) -> None:
        self._taken = -1
        """The step of the newest checkpoint taken (:meth:`_due`)."""
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise ConfigError(f"strategy {self.name!r} takes a {self.Config.__name__}, got {type(self.config).__name__}")
        self.errors = BackgroundErrors()
        self._phase = "new"

    # -- lifecycle (public: checks, then the hook) -----------------------------------------------

    def _due(self, step: int, final: bool) -> bool:
        """Whether a checkpoint of ``step`` is due — every ``config.every`` steps, and the final one —
        and not taken already; one that is due counts as taken from here (the caller takes it)."""
        if step == self._taken or not due(step, self.config.every, final=final):
            return False
        self._taken = step
        return True

    def attach(self, ctx: StrategyContext) -> None:
        if self._phase != "new":
            raise EverystepError(f"strategy {self.name!r} is already attached: use one instance per Checkpointer")
        self.ctx = ctx
        self._phase = "attached"
        self._attach()

    @property
    def peer_traffic(self) -> dict[str, float] | None:
        """With ``peers=True`` (:attr:`mirrors_to_peers`), per step mirrored: the bytes this rank sent
        its buddy and the CPU seconds of its mirroring thread (:class:`~everystep.peers.Traffic`);
        None otherwise, or before the first."""
        found = getattr(self, "_peers", None)
        return found.traffic.per_step() if found is not None else None

    def check_layout(self, layout: str | None) -> None:
        """Raise :class:`~everystep.errors.ConfigError` if this strategy, as configured, cannot
        checkpoint a job laid out so (:func:`~everystep.parallelism.sharded_layout`; None: replicated),
        before anything is written. Default: nothing to refuse beyond ``sharded_layouts``."""

    def agree_restore(self) -> None:
        """Collective: every rank calls it at once, before :meth:`recover`."""
        self._expect("attached", "agree_restore()")
        self._agree_restore()

    def recover(self) -> Candidate | None:
        """The newest recoverable state, read and verified, for the caller to load
        (:func:`~everystep.recovery.load`); ``None`` when there is none."""
        self._expect("attached", "recover()")
        if self.ctx.catalog is None:
            return None
        return self._recover()

    def on_start(self, step: int) -> None:
        """Training starts after ``step``: the live objects hold S_step."""
        self._expect("attached", "on_start()")
        self._phase = "started"
        self._on_start(step)

    def on_step_end(self, step: int) -> None:
        self._expect("started", "on_step_end()")
        self.errors.raise_pending()
        self._on_step_end(step)

    def on_state_ready(self, step: int, *, final: bool = False) -> None:
        self._expect("started", "on_state_ready()")
        self.errors.raise_pending()
        self._on_state_ready(step, final)

    def before_update(self, step: int) -> None:
        self._expect("started", "before_update()")
        self._before_update(step)

    def before_layer_update(self, step: int, params: list[torch.Tensor]) -> None:
        self._expect("started", "before_layer_update()")
        self._before_layer_update(step, params)

    def wait(self) -> None:
        """Block until work in flight is done; raise what failed in the background, once."""
        if self._phase in ("attached", "started"):
            self._wait()
        self.errors.raise_pending()

    def close(self) -> None:
        """:meth:`wait`, then release threads and buffers. Once; later calls do nothing."""
        if self._phase in ("new", "closed"):
            self._phase = "closed"
            return
        self._phase = "closed"
        try:
            self._wait()
            self.errors.raise_pending()
        finally:
            self._close()

    def abandon(self) -> None:
        """After an error in training: end as :meth:`close` does, but leave what outlives the
        training process (a checkpoint agent's replica) as a crash would leave it."""
        if self._phase in ("new", "closed"):
            self._phase = "closed"
            return
        self._phase = "closed"
        self._abandon()

    def _expect(self, phase: str, call: str) -> None:
        if self._phase == phase:
            return
        if self._phase == "closed":
            raise EverystepError(f"strategy {self.name!r} is closed: {call} cannot follow close()")
        if self._phase == "new":
            raise EverystepError(f"strategy {self.name!r}: attach() must come before {call}")
        if phase == "started":
            raise EverystepError(f"strategy {self.name!r}: on_start() must come before {call}")
        raise EverystepError(f"strategy {self.name!r}: {call} must come before on_start()")

    # -- hooks (override what the strategy needs) ------------------------------------------------

    def _attach(self) -> None:
        """Check the components, start threads, allocate what does not depend on the step."""

    def _agree_restore(self) -> None:
        """Collective: agree with the other ranks on what :meth:`_recover` finds."""

    def _recover(self) -> Candidate | None:
        """Default: the newest full checkpoint that verifies (see :mod:`everystep.recovery`)."""
        assert self.ctx.directory is not None
        return recover(self.ctx.directory, shards=self.ctx.live_shards())

    def _on_start(self, step: int) -> None:
        """Record the starting state S_step."""

    def _on_step_end(self, step: int) -> None:
        """Right after the update of ``step``: what it consumed (gradients) is still there."""

    def _on_state_ready(self, step: int, final: bool) -> None:
        """S_step is complete; it stays as it is until :meth:`before_update` of the next step."""

    def _before_update(self, step: int) -> None:
        """Right before the update of ``step``: whatever still reads the state must be done."""

    def _before_layer_update(self, step: int, params: list[torch.Tensor]) -> None:
        """Per-layer updates: right before ``params`` are updated in step ``step`` (after
        :meth:`_before_update`, which has already waited for whatever reads the whole state)."""

    def _wait(self) -> None:
        """Block until work in flight is done (failures go to ``self.errors``)."""

    def _close(self) -> None:
        """Release threads and buffers (after :meth:`_wait`, even if it failed)."""

    def _abandon(self) -> None:
        """Default: as :meth:`close`."""
        try:
            self._wait()
            self.errors.raise_pending()
        finally:
            self._close()
