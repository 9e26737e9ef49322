"""PyTorch Lightning: every-step checkpointing with any everystep strategy, and bit-exact resume.

::

    import lightning as L
    from torch.utils.data import DataLoader
    from everystep.integrations.lightning import EverystepCallback, ResumableSampler

    sampler = ResumableSampler(dataset, seed=0)
    trainer = L.Trainer(max_steps=1000, enable_checkpointing=False,
                        callbacks=[EverystepCallback("ckpt", strategy="lowdiff_plus", every=1, sampler=sampler)])
    trainer.fit(model, DataLoader(dataset, batch_size=8, sampler=sampler))

Run the same script again after a crash: ``fit`` resumes from everystep's newest recoverable point.

What it restores beyond Lightning's own checkpoint: the random generators (torch, Python, NumPy),
the data position inside the epoch (through :class:`ResumableSampler`; Lightning restarts a plain
loader from the epoch's start), and a point at most one step old whatever the strategy. Lightning's
loop counters (global step, epoch, batch index) are restored as Lightning's own mid-epoch checkpoint
holds them, so ``max_steps``, accumulation and step-interval schedulers go on where they stopped.

Under several processes: ``DDPStrategy`` (the ranks started by ``torchrun`` or by ``strategy="ddp"``'s
own launcher; ``ddp_spawn`` and ``ddp_fork`` are refused) and ``ModelParallelStrategy`` (FSDP2 and TP
shards, with the strategies the Checkpointer checkpoints them with); make the Trainer with
``use_distributed_sampler=False``, so that each rank iterates its slice of the
:class:`ResumableSampler` (``DistributedSampler``'s semantics). Every rank resumes from the same step
(the ranks agree through the Checkpointer). ``FSDPStrategy`` (FSDP1), DeepSpeed and XLA are refused.

Scope: one optimizer, automatic optimization. Bit-exact resume also needs the data to
draw no randomness from torch's global generator outside the training step: a validation
``DataLoader`` should be given its own ``generator=`` (each ``iter()`` of a loader without one draws
from the global generator), and random augmentations in loader workers are seeded from that draw.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import lightning.pytorch as pl
import torch

from ..checkpointer import Checkpointer
from ..errors import ConfigError
from ..state import capture_rng, restore_rng
from . import one_scheduler

__all__ = ["EverystepCallback", "ResumableSampler"]


class ResumableSampler(torch.utils.data.Sampler[int]):
    """The indices of a dataset, in an order fixed by ``seed`` and the epoch, that can start mid-epoch.

    Give the same object to the train ``DataLoader`` (``sampler=``) and to :class:`EverystepCallback`
    (``sampler=``): on resume the callback sets the epoch and the first sample, and the next pass over
    the loader starts there. Lightning calls :meth:`set_epoch` at each epoch's start.

    Under several processes (``DDPStrategy``; the Trainer made with ``use_distributed_sampler=False``,
    so that Lightning does not wrap it) it has ``DistributedSampler``'s semantics: the permutation is
    padded with its first indices to a multiple of the world size, and rank r takes every world-th
    index from the r-th; its length and position count this rank's samples.

    Args:
        data_source: the dataset, or its length.
        shuffle: a new permutation each epoch (``torch.randperm`` from a generator seeded with
            ``seed + epoch``); ``False``: the dataset's order.
        seed: the permutations' seed.
        num_replicas, rank: the ranks that share the epoch, and this one's; ``None``: torch.distributed's
            when it is initialised at the first pass (Lightning initialises it in ``fit``), else one.
    """

    def __init__(self, data_source: Sized | int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None) -> None:
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._start = 0
        self.num_replicas, self.rank = num_replicas, rank
        if (num_replicas is None) != (rank is None) or (num_replicas is not None and not 0 <= rank < num_replicas):
            raise ValueError(f"num_replicas and rank go together, 0 <= rank < num_replicas; got {num_replicas}, {rank}")

    def _ranks(self) -> tuple[int, int]:
        if self.num_replicas is not None and self.rank is not None:
            return self.num_replicas, self.rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, start: int) -> None:
        """The next pass is over ``epoch``, from this rank's ``start``-th sample (passes after it from 0)."""
        if not 0 <= start <= len(self):
            raise ValueError(f"start must be within the epoch's {len(self)} samples, got {start}")
        self.epoch, self._start = epoch, start

    def __len__(self) -> int:
        world, _ = self._ranks()
        return -(-self.length // world)

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        if self.shuffle:
            order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.length)
        world, rank = self._ranks()
        if world > 1:  # (DistributedSampler's: padded to a multiple of the world size, then strided)
            padded = len(self) * world
            order = torch.cat([order, order[: padded - self.length]]) if padded > self.length else order
            order = order[rank:padded:world]
        return iter(order[start:].tolist())


class _LoopPosition:
    """The data position the Checkpointer captures at each step's end: Lightning's loop counters as
    Lightning's own checkpoint at that batch's end holds them, and where the sampler is in the epoch.

    The step ends inside ``optimizer.step()``, before Lightning counts the batch as processed and the
    step as completed, and before it steps step-interval schedulers; those counts are completed here.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.live = False
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if not self.live:  # before training: the state restored (or the start)
            return self.loaded if self.loaded is not None else {"loops": None, "epoch": 0, "samples": 0,
                                                                  "end_of_epoch": False}
        trainer = self.trainer
        loops = trainer.fit_loop.state_dict()  # new dicts, completed here (the Checkpointer copies the result)
        loops.pop("combined_loader", None)  # a stateful loader's own state counts batches prefetched
        batches = loops["epoch_loop.batch_progress"]
        for count in (batches["total"], batches["current"]):
            count["processed"] = count["started"]
        step = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
        for count in step.values():
            count["completed"] = count["ready"]
        in_epoch, last = batches["current"]["ready"], bool(batches["is_last_batch"])
        stepped = sum(1 for c in trainer.lr_scheduler_configs if not c.reduce_on_plateau and (
            (c.interval == "step" and in_epoch % c.frequency == 0)
            or (c.interval == "epoch" and last and (trainer.current_epoch + 1) % c.frequency == 0)))
        for count in loops["epoch_loop.scheduler_progress"].values():
            count["ready"] += stepped
            count["completed"] += stepped
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or 0
        return {"loops": loops, "epoch": trainer.current_epoch, "samples": in_epoch * batch_size,
                "end_of_epoch": last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = copy.deepcopy(state)


def _check_layout(trainer: pl.Trainer) -> None:
    """Refuse, before training, a Lightning strategy the callback cannot serve, naming it and what to use."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, XLAStrategy

    strategy = trainer.strategy
    if isinstance(strategy, (DeepSpeedStrategy, XLAStrategy)):  # (DDPStrategy's subclasses, of other layouts)
        raise ConfigError(f"EverystepCallback does not checkpoint {type(strategy).__name__}'s layout: its engine keeps "
                          "the model's and the optimizer's state in structures of its own; use DDPStrategy or "
                          "ModelParallelStrategy (FSDP2, TP), or the strategy's own checkpoints")
    if trainer.world_size == 1 and not isinstance(strategy, DDPStrategy) or isinstance(strategy, ModelParallelStrategy):
        return  # (ModelParallelStrategy's FSDP2 and TP: the Checkpointer refuses a strategy that cannot shard)
    name = type(strategy).__name__
    if not isinstance(strategy, DDPStrategy):
        raise ConfigError(f"EverystepCallback checkpoints DDPStrategy's replicas and ModelParallelStrategy's FSDP2 "
                          f"and TP shards under several processes, not {name}'s layout: use one of those, or "
                          "everystep.Checkpointer in a training loop")
    if getattr(strategy, "_start_method", "popen") != "popen":
        raise ConfigError(f"EverystepCallback under DDPStrategy needs ranks that run the script themselves (torchrun, "
                          f"or strategy='ddp', whose launcher starts the script again per rank), not "
                          f"start_method={strategy._start_method!r} ('ddp_spawn', 'ddp_fork'): fit then trains in "
                          "processes of its own, each with a copy of the callback, and the callback the script "
                          "holds never learns the step resumed from nor closes a checkpointer")


class EverystepCallback(pl.Callback):
    """Checkpoints a Lightning run with an everystep strategy and resumes it from the newest
    recoverable point when ``fit`` starts.

    Args:
        directory: where checkpoints live (see :class:`~everystep.Checkpointer`).
        strategy, every, keep, **options: as for :class:`~everystep.Checkpointer`.
        sampler: the :class:`ResumableSampler` of the train ``DataLoader``, which makes the data
            position exact on resume. Without one, a run resumed mid-epoch sees the loader restart
            from the epoch's beginning (a warning says so).

    The :class:`~everystep.Checkpointer` is :attr:`checkpointer` once ``fit`` has started; it is closed
    (writing the final checkpoint) when training ends, and abandoned like a crash on an exception.
    """

    def __init__(self, directory: str | os.PathLike[str], *, strategy: str = "checkfreq", every: int | None = None,
                 keep: int | None = None, sampler: ResumableSampler | None = None, **options: Any) -> None:
        if sampler is not None and not isinstance(sampler, ResumableSampler):
            raise TypeError(f"sampler must be an everystep ResumableSampler, got {type(sampler).__name__}")
        self.directory = directory
        self.strategy = strategy
        self.every, self.keep, self.options = every, keep, options
        self.sampler = sampler
        self.checkpointer: Checkpointer | None = None
        self.resumed_step = 0
        self._position: _LoopPosition | None = None
        self._rng_after_restore: dict[str, Any] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_layout(trainer)
        if not pl_module.automatic_optimization:
            raise ConfigError("EverystepCallback needs automatic optimization (automatic_optimization = True)")
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"EverystepCallback checkpoints one optimizer; configure_optimizers returned "
                              f"{len(trainer.optimizers)}")
        self._position = _LoopPosition(trainer)
        self.checkpointer = Checkpointer(
            self.directory, pl_module, trainer.optimizers[0],
            scheduler=one_scheduler([c.scheduler for c in trainer.lr_scheduler_configs]),
            scaler=getattr(trainer.precision_plugin, "scaler", None), data=self._position,
            strategy=self.strategy, every=self.every, keep=self.keep, **self.options,
        )
        self.resumed_step = self.checkpointer.restore()
        if not self.resumed_step:
            return
        position = self._position.loaded
        assert position is not None and position["loops"] is not None
        trainer.fit_loop.load_state_dict(position["loops"])
        if position["end_of_epoch"]:
            if self.sampler is not None:
                self.sampler.resume(position["epoch"] + 1, 0)
        else:
            # The loader's first iter() draws from torch's generator, which the uninterrupted run did
            # at the epoch's start: the generator is put back once that draw is done (on_train_start).
            self._rng_after_restore = capture_rng()
            if self.sampler is not None:
                self.sampler.resume(position["epoch"], position["samples"])
                # Lightning warns that a loader without state_dict() restarts the epoch: the sampler resumes it
                warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the "
                                        "epoch ended and your dataloader is not resumable")
            else:
                warnings.warn("resuming mid-epoch without a ResumableSampler: the train loader restarts from the "
                              "epoch's beginning, so the data differs from the uninterrupted run's; give "
                              "EverystepCallback(sampler=...) the loader's ResumableSampler", stacklevel=2)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sampler is not None and self._loader_sampler(trainer) is not self.sampler:
            raise ConfigError("the sampler given to EverystepCallback is not the train DataLoader's: pass the same "
                              "ResumableSampler to both (under several processes, with the Trainer made with "
                              "use_distributed_sampler=False, so that Lightning does not replace it)")
        if self._rng_after_restore is not None:
            restore_rng(self._rng_after_restore)
            self._rng_after_restore = None
        assert self._position is not None
        self._position.live = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # training_step may run forward through a submodule, and micro-batches accumulate gradients
        # before the optimizer's step: the step's start is here
        assert self.checkpointer is not None
        self.checkpointer.begin_step()

    @staticmethod
    def _loader_sampler(trainer: pl.Trainer) -> Any:
        loader = trainer.train_dataloader
        if loader is not None and getattr(loader, "batch_size", None) is None:
            raise ConfigError("EverystepCallback(sampler=...) needs a train DataLoader with a batch_size "
                              "(not a batch_sampler), to count the samples of the batches trained")
        return getattr(loader, "sampler", None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.checkpointer is not None:
            self.checkpointer.__exit__(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()  # closed already after training; here when training never started
