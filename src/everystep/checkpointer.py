"""The Checkpointer: attach to a model and optimizer, restore once, train as usual.

Example::

    with everystep.Checkpointer("ckpt", model, optimizer, scheduler=sched, data=loader) as ckpt:
        start = ckpt.restore()
        for step in range(start + 1, total + 1):
            loss = model(next(batches)).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sched.step()

Step boundaries come from the optimizer's step hooks (see :mod:`everystep.capture.hooks`); with an
:class:`~everystep.OptimizerInBackward`, which updates each layer during backward, from its hooks too.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .arguments import check_arguments
from .capture import StepHooks
from .distributed import Ranks, sample_digests
from .slow_storage import WaitReport, bounded, gave_up
from .errors import (
    CheckpointDirectoryError,
    ConfigError,
    EverystepError,
    StateMismatchError,
    UnclosedCheckpointerWarning,
)
from .optim import OptimizerInBackward
from .parallelism import restart_rounding, sharded_layout
from .recovery import Recovered, load
from .storage import CheckpointDirectory
from .storage.remote import RemoteConfig, RemoteTier
from .state import Stateful, TrainingComponents
from .stopping import StopWatch
from .strategies import STRATEGIES, CheckpointStats, Strategy, StrategyContext, create, default_full_format, sharded_refusal

__all__ = ["Checkpointer"]


def _refuse(strategy: Strategy, layout: str | None, full_format: str | None) -> None:
    """Refuse a job whose state is sharded in a layout the strategy does not checkpoint, or a format
    the strategy does not write, before anything is written."""
    if full_format is not None and full_format not in strategy.full_formats:
        raise ConfigError(f"strategy {strategy.name!r} writes full checkpoints in {' or '.join(map(repr, strategy.full_formats))} "
                          f"format, not full_format={full_format!r}: {strategy.full_formats_reason}")
    strategy.check_layout(layout)
    if layout is not None and layout not in strategy.sharded_layouts:
        why, able = sharded_refusal(strategy, layout)
        instead = (f"use one of the strategies {', '.join(able)}, or " if able else "") + \
            "checkpoint this job with torch.distributed.checkpoint (dcp.save of " \
            "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)), or train with " \
            "DistributedDataParallel"
        raise ConfigError(f"strategy {strategy.name!r} cannot checkpoint a job sharded with {layout}: {why}; nothing "
                          f"was written — {instead}")


class Checkpointer:
    """Checkpoints the complete training state with a chosen strategy.

    Args:
        directory: where checkpoints live; created if absent. Ignored by strategy ``none``. Or an
            open :class:`~everystep.storage.CheckpointDirectory` (the Checkpointer closes it, and
            keeps it as ``self.directory``); one opened with ``access="read"`` makes a reader,
            which restores and changes nothing.
        model, optimizer: the live objects being trained.
        scheduler, scaler, data: optional LR scheduler, GradScaler, and a data-position object
            with ``state_dict()``/``load_state_dict()`` (epoch, index, sampler seed).
        compression: a :class:`~everystep.compress.GradientCompression` (one process) or a DDP
            communication hook from :func:`~everystep.compress.ddp_compression` in use; its
            residuals are saved, and differential strategies reuse its compressed gradients.
        strategy: a name from :data:`everystep.strategies.STRATEGIES` or a strategy instance.
        every, keep, **options: the strategy's configuration, when given by name; ``None`` keeps the
            strategy's default (every step for full_sync and checkfreq, 50 for the differential ones).
        final: write a last checkpoint at a clean :meth:`close` if the last step has none.
        deadline: a Unix time by which the job ends (PyRecover's time-aware exit; see :meth:`should_stop`);
            ``k1``, ``k2``: the buffer kept before it, in longest steps and longest checkpoints.
        stop_signals: signals that ask for a stop at the next :meth:`should_stop` (a preemption
            notice such as ``signal.SIGTERM`` or ``signal.SIGUSR1``); handlers are installed
            while the Checkpointer is open, and a second signal of a kind acts as before.
        full_format: ``"safetensors"`` (everystep's own) or ``"dcp"``: full checkpoints that plain
            ``torch.distributed.checkpoint`` calls can load (see :mod:`everystep.storage.formats.dcp`).
            ``None`` (default): the format the
            directory holds; for a new one, ``"dcp"`` under sharding (FSDP2, HSDP, TP, FSDP+TP)
            where the strategy writes it (all but ``lowdiff_plus``, whose agent writes everystep's
            own), and ``"safetensors"`` otherwise. Both formats load at another world size or layout.
        remote: an ``s3://bucket/prefix`` URL, or a :class:`~everystep.RemoteConfig` (the URL, how
            often to upload, the machines' MTBF, the writer lock's lease): full checkpoints are also
            uploaded there in the background, and :meth:`restore` takes the newest one from there
            when the directory holds nothing as new (a new machine); under several ranks each
            uploads and downloads a share of each checkpoint, rank 0 committing it. See
            :mod:`everystep.storage.remote.tier`.
        close_timeout: the most seconds :meth:`close` waits for storage (the final checkpoint, the
            writes in flight) before it raises :class:`~everystep.errors.StorageTimeoutError` naming
            the step that is durable and the one only in memory, and where; ``None``: no bound.
        stagger: at most this many ranks read the checkpoint at once in :meth:`restore` (ranks
            0..k-1 first, then k..2k-1, …), so that many ranks starting together do not all hit
            storage at the same instant; ``None``: all at once.

    Under ``torch.distributed`` (initialised before the Checkpointer is made, by every rank at the
    same point) every rank opens the same directory: the state that data parallelism replicates is
    written once, split across ranks, each rank's own state (RNG, data position) by that rank, and
    rank 0 commits each checkpoint once every part is durable. A sharded state (FSDP2, HSDP, tensor
    parallelism, FSDP+TP: DTensors; ZeRO-1: each rank's optimizer partition) is written as each rank's
    shards by the strategies whose ``sharded_layouts`` name its layout, and refused by the others
    before anything is written (``docs/several-processes.md``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | CheckpointDirectory | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any | None = None,
        scaler: Any | None = None,
        data: Stateful | None = None,
        compression: Any | None = None,
        strategy: str | Strategy = "checkfreq",
        every: int | None = None,
        keep: int | None = None,
        final: bool = True,
        deadline: float | None = None,
        k1: float = 10.0,
        k2: float = 2.0,
        stop_signals: Sequence[int] = (),
        full_format: str | None = None,
        stagger: int | None = None,
        remote: str | RemoteConfig | None = None,
        close_timeout: float | None = 300.0,
        **options: Any,
    ) -> None:
        self._closed = True  # until construction succeeds
        check_arguments(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, data=data,
                         compression=compression, final=final, deadline=deadline, k1=k1, k2=k2,
                         stop_signals=stop_signals, stagger=stagger, full_format=full_format, close_timeout=close_timeout)
        if moved := [name for name in ("remote_every", "remote_mtbf", "remote_lease") if name in options]:
            raise ConfigError(f"{moved[0]} is RemoteConfig's {moved[0][len('remote_'):]}: give "
                              f"remote=RemoteConfig(url, {moved[0][len('remote_'):]}=...)")
        if remote is not None and not isinstance(remote, (str, RemoteConfig)):
            raise ConfigError(f"remote must be an s3://bucket/prefix URL or a RemoteConfig, got {type(remote).__name__}")
        remote = RemoteConfig(remote) if isinstance(remote, str) else remote  # (a URL checked before anything is made)
        if close_timeout is not None and close_timeout <= 0:
            raise ConfigError(f"close_timeout must be a positive number of seconds or None, got {close_timeout}")
        self.close_timeout = close_timeout
        self._waits = WaitReport()
        if full_format not in ("safetensors", "dcp", None):
            raise ConfigError(f"full_format must be 'safetensors', 'dcp' or None, got {full_format!r}")
        given = {k: v for k, v in (("every", every), ("keep", keep)) if v is not None}
        if not isinstance(strategy, (str, Strategy)):
            raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__}")
        self.strategy: Strategy = create(strategy, **given, **options) if isinstance(strategy, str) else strategy
        self.layout = sharded_layout(model, optimizer)
        """The job's sharded layout (:func:`everystep.parallelism.sharded_layout`), None where it is replicated."""
        _refuse(self.strategy, self.layout, full_format)
        if isinstance(optimizer, OptimizerInBackward):
            if not self.strategy.layer_updates:
                able = ", ".join(sorted(n for n, cls in STRATEGIES.items() if cls.layer_updates))
                raise ConfigError(f"strategy {self.strategy.name!r} reads the gradients after the update, which an "
                                  f"optimizer updating during backward (OptimizerInBackward) frees: use one of {able}")
            if scaler is not None:
                raise ConfigError("an optimizer updating during backward (OptimizerInBackward) takes no GradScaler: "
                                  "the scaler needs every gradient before any update")
        self.components = TrainingComponents(
            model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, data=data, compression=compression
        )
        self.final = final
        self.stats = CheckpointStats()
        store = directory if isinstance(directory, CheckpointDirectory) else None
        self.ranks = store.ranks if store is not None else Ranks.detect()
        if self.ranks.rank == 0 and (why := restart_rounding(model, self.ranks.world)):
            warnings.warn(why, stacklevel=2)
        if stagger is not None and stagger < 1:
            raise ConfigError(f"stagger must be at least 1 rank per wave, got {stagger}")
        if store is None and self.strategy.needs_store:
            if directory is None:
                raise CheckpointDirectoryError(f"strategy {self.strategy.name!r} needs a checkpoint directory")
            store = CheckpointDirectory.open(directory, strategy=self.strategy.name, ranks=self.ranks,
                                             other_world=self.strategy.other_world_size,
                                             extra={"full_format": full_format} if full_format else None,
                                             new_full_format=default_full_format(self.strategy, self.layout))
        self.directory = store
        self.remote: RemoteTier | None = None
        """The remote tier (``remote=``), or None."""
        if store is not None and self.strategy.needs_store and store.full_format not in self.strategy.full_formats:
            store.close()
            raise ConfigError(f"{store.root} holds full checkpoints in the {store.full_format!r} format, which strategy "
                              f"{self.strategy.name!r} does not write ({self.strategy.full_formats_reason}); use "
                              "another directory")
        try:
            if remote is not None:
                self.remote = self._remote(remote)
            self._attach(deadline, k1, k2, stop_signals, stagger)
        except BaseException:
            if store is not None:
                store.undo_create()  # a directory this failed constructor made stays as it was
                store.close()
            raise
        self._closed = False

    def _remote(self, remote: RemoteConfig) -> RemoteTier:
        if self.directory is None:
            raise ConfigError(f"strategy {self.strategy.name!r} stores nothing: it takes no remote")
        return RemoteTier(remote, self.directory, keep=self.strategy.config.keep, uploaded=self.stats.remote_holds)

    def _attach(self, deadline: float | None, k1: float, k2: float, stop_signals: Sequence[int],
                stagger: int | None) -> None:
        directory, model, optimizer, scaler = (self.directory, self.components.model, self.components.optimizer,
                                               self.components.scaler)
        if directory is not None and directory.access == "write" and not self.strategy.shares_store:
            if directory.catalog.leads:
                directory.collect_garbage()  # nothing else writes here: what a crash left is garbage
            self.ranks.barrier("control")
        self.stop_reason: str | None = None
        self.stagger = stagger
        self._ctx = StrategyContext(self.components, directory, self.stats)
        self.strategy.attach(self._ctx)
        self.step = 0
        self.recovered: Recovered | None = None
        self._restored = False
        self._state_ready_pending = False
        self._hooks = StepHooks(
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            step_end=self._timed("_step_end"),
            activity=self._timed("_activity"),
            before_update=self._timed("_before_update"),
        )
        if isinstance(optimizer, OptimizerInBackward):
            self._hooks.add(optimizer.register_layer_pre_hook(self._timed("_before_layer_update")))
        self._watch = StopWatch(deadline, k1=k1, k2=k2, signals=stop_signals)

    # -- public ------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest recoverable state into the live objects; return its step (0 if none).

        Call once, before the first training step. Loading never executes code from the
        checkpoint, and a checkpoint that does not fit the model raises without changing it. With
        a store opened for reading (``CheckpointDirectory.open(..., access="read")``) this only loads:
        nothing is written, and the Checkpointer cannot checkpoint training.
        """
        if self.step or self._restored:
            raise EverystepError("restore() must be called once, before the first training step")
        self._restored = True
        if self.directory is None:
            self.strategy.on_start(0)
            return 0
        held = self.directory.agree_hosts()  # collective under node-local disks: what every host holds
        self._ctx.pulled = self.remote.pull() if self.remote is not None and self.directory.access != "read" else None
        agreeing = time.perf_counter()
        self.strategy.agree_restore()  # collective: before the staggered waves, every rank at once
        agreeing = time.perf_counter() - agreeing
        found: Recovered | None = None
        error: BaseException | None = None
        t0 = 0.0
        per_wave = self.stagger or self.ranks.world
        for wave in range(-(-self.ranks.world // per_wave)):
            if self.ranks.rank // per_wave == wave:
                t0 = time.perf_counter()
                try:
                    candidate = self.strategy.recover()  # (a pulled checkpoint among its sources)
                    found = load(candidate, self.components) if candidate is not None else None
                except BaseException as e:  # after the barriers, so that no rank waits for this one
                    error = e
            if per_wave < self.ranks.world:
                self.ranks.barrier("control")
        self._ctx.pulled = None  # (its state, if the restore did not take it)
        if error is not None:
            raise error
        self.directory.check_restored(found.step if found is not None else 0, held)  # every rank the same step
        if found is not None:
            self.step = self.stats.step = found.step  # (from memory, the directory holds an older one, or none)
            self.stats.last_durable_step = max(self.directory.newest_full_step(), 0) if found.source == "memory" else found.step
            self.recovered = dataclasses.replace(found, seconds=agreeing + time.perf_counter() - t0)
        if self.directory.access != "read":
            self._start()
        return self.step

    def should_stop(self) -> bool:
        """True when training should end now: the deadline is too close or a stop signal came.

        Call once per step, after ``optimizer.step()``, on every rank (the ranks agree in one
        all-reduce, so all stop after the same step). When it returns True, leave the loop: the
        Checkpointer's exit writes the final checkpoint, and ``stop_reason`` says why.
        """
        self._watch.checkpoint_took(self.stats.max_checkpoint_seconds)
        reason = self._watch.reason()
        if not self.ranks.any("control", reason is not None):
            return False
        reasons = self.ranks.all_gather("control", reason)  # only when stopping: say why on every rank
        asked = [(r, why) for r, why in enumerate(reasons) if why is not None]
        rank, why = asked[0]
        self.stop_reason = why if len(reasons) == 1 else f"rank {rank}: {why}"
        return True

    def _start(self) -> None:
        """Tell the strategy where training starts; S_step is what the live objects hold now."""
        if self.ranks.distributed:
            self._check_replicated()
        self.directory.write_marker()  # (only restore() starts so: there is a directory)
        self._ctx.boundary = self.components.capture_boundary()
        self.strategy.on_start(self.step)

    def _check_replicated(self) -> None:
        """Refuse to start when the state that should be the same on every rank is not."""
        tensors, _ = self._ctx.flatten_state(self.step)
        keys = sorted(self._ctx.replicated_keys(tensors))
        digests = self.ranks.all_gather("control", sample_digests(tensors, keys))
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            theirs = digests[differ[0]]
            keys_differ = sorted(set(theirs) ^ set(digests[0])) or [k for k in theirs if theirs[k] != digests[0][k]]
            raise StateMismatchError(
                f"parameters or optimizer state of rank {differ[0]} differ from rank 0's at step {self.step} "
                f"({len(keys_differ)} of {len(digests[0])} tensors, first {keys_differ[0]!r}): everystep stores what "
                "data parallelism replicates once; wrap the model in DistributedDataParallel (or make every rank "
                "start from the same state)"
            )

    def begin_step(self) -> None:
        """The next step is about to start: what changes the state (forward, backward) comes next.

        The model's forward and ``optimizer.step()`` tell the Checkpointer this already; call it where
        neither comes first — a trainer whose step runs forward through a submodule and accumulates
        gradients over micro-batches before the optimizer's step (the Lightning callback calls it at
        each batch's start). Calling it again within a step does nothing.
        """
        self._timed("_activity")()

    def wait(self) -> None:
        """Block until every checkpoint started so far is durable; raise a background failure."""
        self.strategy.wait()

    def close(self) -> None:
        """Write the final checkpoint (if ``final``), wait for work in flight, release resources.

        Raises the first background failure that has not been raised yet.
        """
        if self._closed:
            return
        self._closed = True
        self._hooks.remove()
        self._watch.restore_signals()
        try:
            bounded(self._close_all, self.close_timeout, lambda seconds: gave_up(self.stats, self.strategy, seconds))
        finally:
            self._waits.close()

    def _close_all(self) -> None:
        """The close's work, which waits for storage (:meth:`close` bounds it by ``close_timeout``)."""
        failed = getattr(self, "_failed", False)
        try:
            if self.final and self.step and not failed and not self._reading:
                self._state_ready_pending = False
                self._timed("_final")()
        finally:
            # After an error, like a crash: what outlives the process (a checkpoint agent's replica)
            # stays for a restarted one — under several ranks, this is how a rank ends when a peer died.
            try:
                (self.strategy.abandon if failed else self.strategy.close)()
            finally:
                try:
                    if self.remote is not None:  # the final checkpoint too, unless it ends as a crash would
                        self.remote.close(upload=not failed)
                finally:
                    if self.directory is not None:
                        self.directory.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._failed = True  # the state may be mid-step: no final checkpoint
            try:
                self.close()
            except EverystepError as e:
                cause = e.__cause__ if e.__cause__ is not None else e
                warnings.warn(f"while closing after an error: {e} ({type(cause).__name__})", stacklevel=2)
            return
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._hooks.remove()
            warnings.warn(
                "a Checkpointer was never closed: use it as a context manager or call close(); "
                "checkpoints in flight may be lost",
                UnclosedCheckpointerWarning,
                stacklevel=2,
            )

    @property
    def bytes_written(self) -> int:
        return self.directory.catalog.bytes_written if self.directory is not None else 0

    # -- hooks -------------------------------------------------------------------------------

    def _timed(self, name: str) -> Any:
        """A hook that calls method ``name`` and charges its time to the training stall.

        The hook holds the Checkpointer weakly: hooks live as long as the model, and must not
        keep a forgotten Checkpointer alive (it would never warn that it was not closed).
        """
        ref = weakref.ref(self)

        def hook(*args: Any) -> None:
            me = ref()
            if me is None:
                return
            t0 = time.perf_counter()
            me._waits.enter(me.step, me.stats)  # (a wait of a second or more is said, while it lasts too)
            try:
                getattr(me, name)(*args)
            finally:
                took = time.perf_counter() - t0
                me.stats.stall_seconds += took
                me._waits.took(took, me.step, me.stats)

        return hook

    def _final(self) -> None:
        self.strategy.on_state_ready(self.step, final=True)

    @property
    def _reading(self) -> bool:
        return self.directory is not None and self.directory.access == "read"

    def _step_end(self) -> None:
        self._refuse_reading()
        if not self._restored:
            self._start_unrestored()
        self.step += 1
        self.stats.steps += 1
        self.stats.step = self.step
        self._watch.step_ended()
        self._ctx.boundary = self.components.capture_boundary()
        self._state_ready_pending = True
        self.strategy.on_step_end(self.step)
        if self.remote is not None:
            self.remote.step_end(self.step)

    def _activity(self) -> None:
        if self._state_ready_pending:
            self._state_ready_pending = False
            self.strategy.on_state_ready(self.step)

    def _refuse_reading(self) -> None:
        if self._reading:
            raise EverystepError(f"{self.directory.root} was opened for reading: this Checkpointer restores, "
                                 "it cannot checkpoint training")

    def _before_update(self) -> None:
        self._refuse_reading()
        if not self._restored:
            self._start_unrestored()
        self.strategy.before_update(self.step + 1)

    def _before_layer_update(self, optimizer: Any, params: list[torch.Tensor]) -> None:
        self.strategy.before_layer_update(self.step + 1, params)

    def _start_unrestored(self) -> None:
        """The first step, without restore(): allowed into an empty directory, for a strategy that records no start."""
        self._restored = True  # raise once
        if self.directory is not None:
            self._refuse_unrestored_directory()
            self.directory.write_marker()
        if self.strategy.needs_restore:
            raise EverystepError(
                f"strategy {self.strategy.name!r} needs restore() to be called before the first step "
                "(it records the starting state)"
            )
        self.strategy.on_start(0)

    def _refuse_unrestored_directory(self) -> None:
        assert self.directory is not None
        steps = [r.manifest.step for r in self.directory.catalog.manifests() if r.manifest]
        if steps:
            raise CheckpointDirectoryError(
                f"{self.directory.root} holds checkpoints up to step {max(steps)}, but training started without "
                "restore(); call restore() first or use an empty directory (nothing was deleted)"
            )
