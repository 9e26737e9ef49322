"""What a strategy works in: the live components and the flat state (:class:`StrategyContext`),
the DTensors a sharded state is read back as (:class:`LiveShards`), and what checkpointing cost
(:class:`CheckpointStats`)."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import Ranks
from ..state import TrainingComponents, loads_into_own_tensors, replaces_state, zero_redundancy
from ..parallelism import shard_like, sharded_layout
from ..tree import OPTIMIZER_STATE_ENTRY, flatten, local_shard
from ..layout import TensorLayout
from ..storage import persist_full
from ..storage.formats import RankShare, buffer_chunks, tensor_chunks
from ..transport.host import HostBuffer

if TYPE_CHECKING:
    from ..storage import Manifest, Catalog, CheckpointDirectory
    from ..storage.remote import Pulled

__all__ = ["StrategyContext", "CheckpointStats", "ParamKeys", "LiveShards", "LoadFate", "as_shards"]


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
    step: int = 0
    """The newest step trained."""

    def remote_holds(self, step: int) -> None:
        """The remote tier holds the checkpoint of ``step`` whole (uploaded, or found there)."""
        self.last_remote_step = max(self.last_remote_step, step)

    @property
    def steps_not_durable(self) -> int:
        """The steps trained since the newest one on storage: what a lost host would lose now."""
        return max(0, self.step - self.last_durable_step)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "checkpoints": self.checkpoints,
            "stall_seconds": self.stall_seconds,
            "snapshot_wait_seconds": self.snapshot_wait_seconds,
            "stall_per_checkpoint_seconds": self.stall_seconds / self.checkpoints if self.checkpoints else 0.0,
            "last_durable_step": self.last_durable_step,
            "last_remote_step": self.last_remote_step,
            "steps_not_durable": self.steps_not_durable,
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


class LoadFate(enum.Enum):
    """What a restore's load does with a stored tensor of the optimizer's state, which says what a read
    may hand it on as (:func:`~everystep.strategies.region_tier.region_candidates`): a view of where it
    lies where the load copies it (``IN_PLACE``, ``MOVED``), lent out of a region where the load keeps
    it (``KEPT``), else a copy of its own."""

    IN_PLACE = "copied into the live optimizer's own tensor: an entry the live optimizer holds already, " \
               "a plain tensor on the host, the optimizer's load torch's own"
    MOVED = "copied onto its parameter's GPU: an entry other than its step counter, the optimizer's load " \
            "torch's own (which moves each such entry to its parameter's device and keeps a step counter as it is)"
    KEPT = "kept as the optimizer's own: an entry the live optimizer does not hold yet, its parameter a plain " \
           "tensor on the host, the optimizer's load torch's own (a dtype not the parameter's is cast: a copy)"
    UNKNOWN = "not known (another key, a load of the optimizer's own, a step counter on a GPU)"


class LiveShards(Mapping[str, torch.Tensor]):
    """The live DTensors of a state by key; an optimizer's state entry that is not there (optimizers
    make their state at the first step, after a restore) is placed as its parameter is, where the
    parameter is a DTensor: ``/optimizer/state/<i>/<name>`` as the i-th parameter over the groups, the
    index ``optimizer.state_dict()`` gives it. A reader places an entry so only where its shape is
    the parameter's (``exp_avg``, not a step counter). :attr:`shapes`: the shape of each tensor of
    the live flat state (of a DTensor, its local shard's). ``onto_devices``: the optimizer's load is
    torch's own; ``in_place``: the keys it loads into the live optimizer's own tensors (:meth:`fate`)."""

    def __init__(self, live: dict[str, torch.Tensor], params: list[torch.Tensor],
                 shapes: dict[str, tuple[int, ...]], *, onto_devices: bool = False,
                 in_place: frozenset[str] = frozenset()) -> None:
        self._live, self._params, self.shapes, self._onto_devices = live, params, shapes, onto_devices
        self._in_place = in_place

    def fate(self, key: str) -> "LoadFate":
        """What a restore's load does with the stored tensor of ``key`` (see :class:`LoadFate`)."""
        if key in self._in_place:
            return LoadFate.IN_PLACE
        param = self._parameter(key) if self._onto_devices else None
        if param is None:
            return LoadFate.UNKNOWN
        if param.device.type != "cpu":
            return LoadFate.UNKNOWN if key.endswith("/step") else LoadFate.MOVED
        return LoadFate.KEPT if type(param) in (torch.Tensor, torch.nn.Parameter) else LoadFate.UNKNOWN

    def _parameter(self, key: str) -> torch.Tensor | None:
        """The parameter whose optimizer state entry ``key`` is, or None for another key."""
        found = OPTIMIZER_STATE_ENTRY.fullmatch(key)
        return self._params[int(found[1])] if found is not None and int(found[1]) < len(self._params) else None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._live:
            return self._live[key]
        param = self._parameter(key)
        if param is not None and local_shard(param) is not param:
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
        self.pulled: Pulled | None = None
        """At a restore, what a remote tier pulled into the directory, which recovery takes as read
        (:func:`~everystep.recovery.read_full`); None after it, or without one."""
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
        optimizer = self.components.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        in_place = frozenset(k for k, t in tensors.items() if type(t) is torch.Tensor and t.device.type == "cpu"
                             and OPTIMIZER_STATE_ENTRY.fullmatch(k)) \
            if not self._sharded and loads_into_own_tensors(optimizer) else frozenset()
        return LiveShards(dict(self._sharded), params, {k: tuple(t.shape) for k, t in tensors.items()},
                          onto_devices=replaces_state(optimizer), in_place=in_place)

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

    def persist_record(self, step: int, write: Callable[[], object], *, keep: int, count: bool = True) -> None:
        """Persist a checkpoint of ``step`` that is not a full one (a differential, a spread
        checkpoint): ``write`` writes and commits it; then it is recorded (:meth:`record_durable`,
        with the seconds it took; ``count``: as a checkpoint) and retention keeps the newest ``keep`` points."""
        assert self.directory is not None
        t0 = time.perf_counter()
        write()
        self.record_durable(step, count=count, seconds=time.perf_counter() - t0)
        self.directory.retain(keep)

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
