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
import typing
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import torch

from .. import tracing
from ..background import BackgroundErrors
from ..errors import ConfigError, EverystepError
from ..policy.interval import due
from ..recovery import Candidate, recover
from .context import StrategyContext

if TYPE_CHECKING:
    from pathlib import Path

    from ..peers import Peers
    from ..storage.region import Region, SlotWriter
    from ..transport.host import HostBuffer

__all__ = ["Strategy", "StrategyConfig", "Tier"]


class Tier(typing.Protocol):
    """A tier in memory a strategy keeps its checkpoints in beside the directory
    (:class:`~everystep.strategies.memory_tier.MemoryTier`): the base class drives its restore and
    its end; the strategy puts each checkpoint in it, copied (:meth:`write`) or taken straight into
    a slot (:meth:`begin`, then :meth:`commit`, or :meth:`abort`)."""

    path: Path
    region: Region | None

    def agree(self) -> None: ...

    def recover(self, own: typing.Callable[[], Candidate | None]) -> Candidate | None: ...

    def on_start(self, step: int) -> None: ...

    def write(self, step: int, source: HostBuffer | dict[str, torch.Tensor], skeleton: typing.Any,
              meta: dict[str, typing.Any] | None = None) -> tuple[int, float]: ...

    def begin(self, tensors: dict[str, torch.Tensor], skeleton: typing.Any,
              meta: dict[str, typing.Any] | None = None) -> SlotWriter: ...

    def abort(self) -> None: ...

    def commit(self, writer: SlotWriter, step: int, skeleton: typing.Any,
               meta: dict[str, typing.Any] | None = None) -> tuple[int, float]: ...

    def wait(self) -> None: ...

    def finish(self) -> None: ...

    def close(self, *, clean: bool = False) -> None: ...

    def report(self) -> dict[str, int]: ...


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
    takes_memory: ClassVar[bool] = False
    """It writes the whole state and takes ``memory=True`` (:mod:`everystep.strategies.memory_tier`)."""
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
    """Why it refuses a sharded job, where more can be said than that it checkpoints replicated state."""
    full_formats: ClassVar[tuple[str, ...]] = ("safetensors", "dcp")
    """The formats of full checkpoints it writes (``full_format``)."""
    full_formats_reason: ClassVar[str] = ""
    """Why not the others."""

    def __init__(self, config: StrategyConfig | None = None) -> None:
        self._taken = -1
        """The newest step handed to this strategy (:meth:`_first`; with :meth:`_due`, checkpointed)."""
        self.tier: Tier | None = None
        """With ``memory=True`` (a strategy that writes the whole state): its memory tier
        (:class:`~everystep.strategies.memory_tier.MemoryTier`), made at attach by :meth:`_make_tier`."""
        self.peers: Peers | None = None
        """With ``peers=True`` (:attr:`mirrors_to_peers`) under several hosts: this rank's part in the
        replicas on peers (set at attach)."""
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise ConfigError(f"strategy {self.name!r} takes a {self.Config.__name__}, got {type(self.config).__name__}")
        self.errors = BackgroundErrors()
        self._phase = "new"

    # -- lifecycle (public: checks, then the hook) -----------------------------------------------

    def _due(self, step: int, final: bool) -> bool:
        """Whether a checkpoint of ``step`` is due — every ``config.every`` steps, and the final one —
        and not taken already; one that is due counts as taken from here (the caller takes it)."""
        return due(step, self.config.every, final=final) and self._first(step)

    def _first(self, step: int) -> bool:
        """Whether S_step is handed to this strategy for the first time (``on_state_ready`` may come
        again for a step: at the final checkpoint); from here it has been."""
        if step == self._taken:
            return False
        self._taken = step
        return True

    def attach(self, ctx: StrategyContext) -> None:
        if self._phase != "new":
            raise EverystepError(f"strategy {self.name!r} is already attached: use one instance per Checkpointer")
        self.ctx = ctx
        self._phase = "attached"
        self._attach()
        try:
            self.tier = self._make_tier()
        except BaseException:
            self._close()
            raise

    @property
    def peer_traffic(self) -> dict[str, float] | None:
        """With ``peers=True`` (:attr:`mirrors_to_peers`), per step mirrored: the bytes this rank sent
        its buddy and the CPU seconds of its mirroring thread (:class:`~everystep.peers.Traffic`);
        None otherwise, or before the first."""
        return self.peers.traffic.per_step() if self.peers is not None else None

    def setting(self) -> dict[str, typing.Any]:
        """What a report says it ran with: its options of a plain type (``every`` among them), each as
        resolved where the strategy resolves it at attach (LowDiff's F and b, LowDiff+'s agent threads)."""
        found = {f.name: getattr(self.config, f.name) for f in fields(self.config)}
        return {k: v for k, v in found.items() if type(v) in _PLAIN}

    def check_layout(self, layout: str | None) -> None:
        """Raise :class:`~everystep.errors.ConfigError` if this strategy, as configured, cannot
        checkpoint a job laid out so (:func:`~everystep.parallelism.sharded_layout`; None: replicated),
        before anything is written. Default: nothing to refuse beyond ``sharded_layouts``."""

    def agree_restore(self) -> None:
        """Collective: every rank calls it at once, before :meth:`recover`."""
        self._expect("attached", "agree_restore()")
        self._agree_restore()
        if self.tier is not None:
            self.tier.agree()

    def recover(self) -> Candidate | None:
        """The newest recoverable state, read and verified, for the caller to load
        (:func:`~everystep.recovery.load`); ``None`` when there is none."""
        self._expect("attached", "recover()")
        if self.ctx.catalog is None:
            return None
        if self.tier is not None:
            return self.tier.recover(self._recover)
        return self._recover()

    def on_start(self, step: int) -> None:
        """Training starts after ``step``: the live objects hold S_step."""
        self._expect("attached", "on_start()")
        self._phase = "started"
        self._on_start(step)
        if self.tier is not None:
            self.tier.on_start(step)

    def on_step_end(self, step: int) -> None:
        self._expect("started", "on_step_end()")
        self.errors.raise_pending()
        with tracing.span("everystep on_step_end", step=step):
            self._on_step_end(step)

    def on_state_ready(self, step: int, *, final: bool = False) -> None:
        self._expect("started", "on_state_ready()")
        self.errors.raise_pending()
        with tracing.span("everystep on_state_ready", step=step):
            self._on_state_ready(step, final)

    def before_update(self, step: int) -> None:
        self._expect("started", "before_update()")
        with tracing.span("everystep before_update", step=step):
            self._before_update(step)

    def before_layer_update(self, step: int, params: list[torch.Tensor]) -> None:
        self._expect("started", "before_layer_update()")
        with tracing.span("everystep before_layer_update", step=step):
            self._before_layer_update(step, params)

    def wait(self) -> None:
        """Block until work in flight is done; raise what failed in the background, once."""
        if self._phase in ("attached", "started"):
            self._wait()
            if self.tier is not None:
                self.tier.wait()
        self.errors.raise_pending()

    def close(self) -> None:
        """:meth:`wait`, then release threads and buffers. Once; later calls do nothing."""
        if self._phase in ("new", "closed"):
            self._phase = "closed"
            return
        self._phase = "closed"
        clean = False
        try:
            self._wait()
            if self.tier is not None:
                self.errors.raise_pending()
                self.tier.finish()  # the newest checkpoint to the directory
            self.errors.raise_pending()
            clean = True
        finally:
            try:
                self._close()
            finally:
                if self.tier is not None:
                    self.tier.close(clean=clean)

    def abandon(self) -> None:
        """After an error in training: end as :meth:`close` does, but leave what outlives the
        training process (a checkpoint agent's replica) as a crash would leave it."""
        if self._phase in ("new", "closed"):
            self._phase = "closed"
            return
        self._phase = "closed"
        try:
            self._abandon()
        finally:
            if self.tier is not None:
                self.tier.close()

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

    def _make_tier(self) -> Tier | None:
        """The memory tier, or None (the default: none)."""
        return None

    def _agree_restore(self) -> None:
        """Collective: agree with the other ranks on what :meth:`_recover` finds."""

    def _recover(self) -> Candidate | None:
        """Default: the newest full checkpoint that verifies (see :mod:`everystep.recovery`)."""
        assert self.ctx.directory is not None
        return recover(self.ctx.directory, shards=self.ctx.live_shards(), pulled=self.ctx.pulled)

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
