"""Hugging Face Transformers: every-step checkpointing with any everystep strategy, and bit-exact resume.

::

    from transformers import TrainingArguments
    from everystep.integrations.transformers import EverystepCallback, EverystepTrainer

    args = TrainingArguments(output_dir="out", max_steps=1000, save_strategy="no", report_to=[])
    trainer = EverystepTrainer(model=model, args=args, train_dataset=dataset,
                               callbacks=[EverystepCallback("ckpt", strategy="lowdiff_plus", every=1)])
    trainer.train()

Run the same script again after a crash: ``train()`` resumes from everystep's newest recoverable point.

:class:`EverystepCallback` checkpoints a plain ``Trainer`` too; resuming needs :class:`EverystepTrainer`,
because a callback cannot move the trainer's loop to another step. It resumes through the trainer's
own resume path — the global step, the epoch, the batches of the epoch already trained (skipped in
the data loader's seeded order), the random generators re-set after the skip — with the state taken
from everystep instead of a ``checkpoint-N`` directory. Unlike ``resume_from_checkpoint=True``, which
takes the highest ``checkpoint-N`` without checking that it is complete, it never loads a
checkpoint that does not verify, and its newest point is at most one step old.

What resume leaves out: ``TrainerState``'s history (``log_history``, ``total_flos``, best metric),
which logging and reporting keep; the loss logged at the first logging step after resume covers
only the steps trained since. Scope: one process, or DistributedDataParallel or FSDP2 (Accelerate's
plugin, ``fsdp_config={"version": 2}``) under ``torchrun`` or ``accelerate launch`` (each rank resumes
from the same step: the ranks agree through the Checkpointer; each rank skips its own slice of the
epoch's batches, as Accelerate shards the loader); no DeepSpeed, no FSDP1. Tested on the CPU (gloo),
FSDP2 with Accelerate's gate that keeps FSDP to accelerators lifted.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..checkpointer import Checkpointer
from ..errors import ConfigError
from ..state import capture_rng, restore_rng

__all__ = ["EverystepCallback", "EverystepTrainer"]

_NEEDED = ("_init_training_state", "_prepare_for_training", "_run_epoch", "_load_rng_state")
if not all(hasattr(Trainer, name) for name in _NEEDED):  # the resume path's seams, as of Transformers 5.3
    import transformers

    raise ImportError(f"everystep's Trainer integration needs transformers>=5.3,<6 (found {transformers.__version__}): "
                      'pip install "everystep[transformers]"')

_RESUMED = "<everystep>"
"""What the trainer's resume path is given in place of a checkpoint directory."""


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (whose step calls the inner one's)."""
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _check_layout(args: Any, *, deepspeed: bool, fsdp_version: int | None) -> None:
    """Refuse, before training, a layout the integration does not serve, naming it and what to use:
    one process, DistributedDataParallel, or FSDP2 (Accelerate's plugin, ``fsdp_version=2``) under
    ``torchrun`` (``accelerate launch``) are served."""
    if deepspeed:
        raise ConfigError("everystep's Trainer integration does not checkpoint DeepSpeed: its engine keeps the "
                          "optimizer's state partitioned in its own structures, which torch's optimizer state_dict "
                          "does not hold; train with DistributedDataParallel (torchrun, no deepspeed=), FSDP2 "
                          "(fsdp_config={'version': 2}), or use DeepSpeed's own checkpoints")
    if fsdp_version is not None and fsdp_version != 2:
        raise ConfigError(f"everystep's Trainer integration checkpoints FSDP2's shards, not FSDP{fsdp_version}'s "
                          f"({args.world_size} processes here): FSDP1 flattens parameters into FlatParameters, which "
                          "the Checkpointer refuses; set fsdp_config={'version': 2} (Accelerate's FSDP2 plugin)")


def _fsdp_version(args: Any, accelerator: Any = None) -> int | None:
    """The FSDP version the Trainer shards with, or None: from Accelerate's state where the
    Trainer has one, else from its arguments (Accelerate ignores ``fsdp=`` on the CPU)."""
    if accelerator is not None:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        return None if plugin is None else int(getattr(plugin, "fsdp_version", 1))
    if not getattr(args, "fsdp", None) or getattr(args, "fsdp_plugin_args", None) is None:
        return None
    return int(args.fsdp_plugin_args.get("fsdp_version", 1))


class EverystepCallback(TrainerCallback):
    """Checkpoints a ``Trainer``'s training with an everystep strategy.

    Args:
        directory: where checkpoints live (see :class:`~everystep.Checkpointer`).
        strategy, every, keep, **options: as for :class:`~everystep.Checkpointer`.

    The :class:`~everystep.Checkpointer` is :attr:`checkpointer` once training has started; it is
    closed (writing the final checkpoint) when training ends, and abandoned like a crash when
    :class:`EverystepTrainer`'s ``train()`` raises.
    """

    def __init__(self, directory: str | os.PathLike[str], *, strategy: str = "checkfreq", every: int | None = None,
                 keep: int | None = None, **options: Any) -> None:
        self.directory = directory
        self.strategy = strategy
        self.every, self.keep, self.options = every, keep, options
        self.checkpointer: Checkpointer | None = None
        self.resumed_step = 0
        self._open = False

    def open(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any) -> int:
        """Attach to the live objects and restore the newest recoverable state; return its step."""
        self.close()
        self._open = True
        self.checkpointer = Checkpointer(self.directory, model, _torch_optimizer(optimizer), scheduler=scheduler,
                                         scaler=scaler, strategy=self.strategy, every=self.every, keep=self.keep,
                                         **self.options)
        self.resumed_step = self.checkpointer.restore()
        return self.resumed_step

    def close(self, error: BaseException | None = None) -> None:
        """Close the Checkpointer: after ``error``, as after a crash (no final checkpoint). It stays
        :attr:`checkpointer`, for its statistics."""
        ckpt = self.checkpointer
        if ckpt is None or not self._open:
            return
        self._open = False
        if error is None:
            ckpt.close()
        else:
            ckpt.__exit__(type(error), error, error.__traceback__)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self._open:  # EverystepTrainer opened it
            return
        _check_layout(args, deepspeed=bool(getattr(args, "deepspeed", None)), fsdp_version=_fsdp_version(args))
        if args.fp16:
            raise ConfigError("with fp16 the GradScaler is training state a callback cannot reach: use "
                              "everystep.integrations.transformers.EverystepTrainer")
        if self.open(model, optimizer, lr_scheduler, None):
            step = self.resumed_step
            self.close()
            raise ConfigError(f"{self.directory} holds training up to step {step}: a plain Trainer cannot resume from "
                              "it; use everystep.integrations.transformers.EverystepTrainer (or an empty directory)")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()


class EverystepTrainer(Trainer):
    """A ``Trainer`` that resumes from its :class:`EverystepCallback`'s directory when ``train()`` starts.

    Give it the callback in ``callbacks=`` as to any ``Trainer``; ``train()`` takes no
    ``resume_from_checkpoint`` (the directory holds the newest point).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        found = [c for c in self.callback_handler.callbacks if isinstance(c, EverystepCallback)]
        if len(found) != 1:
            raise ConfigError(f"EverystepTrainer needs one EverystepCallback in callbacks=, got {len(found)}")
        self.everystep: EverystepCallback = found[0]
        self._per_epoch = 0
        self._resume: tuple[int, int] | None = None
        self._rng: dict[str, Any] | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            raise ConfigError("EverystepTrainer resumes from its EverystepCallback's directory: call train() without "
                              "resume_from_checkpoint")
        _check_layout(self.args, deepspeed=self.is_deepspeed_enabled,
                      fsdp_version=_fsdp_version(self.args, self.accelerator))
        self._resume, self._rng = None, None
        try:
            return super().train(None, *args, **kwargs)
        except BaseException as e:
            self.everystep.close(e)
            raise

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, *args: Any, **kwargs: Any) -> Any:
        self._per_epoch = num_update_steps_per_epoch
        return super()._init_training_state(max_steps, num_update_steps_per_epoch, *args, **kwargs)

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        model, loader = super()._prepare_for_training(*args, **kwargs)
        # the optimizer and scheduler exist now, and Accelerate has placed the optimizer's state
        step = self.everystep.open(self.model, self.optimizer, self.lr_scheduler, self.accelerator.scaler)
        if step:
            self.state.global_step = step
            self._resume = (step // self._per_epoch, step % self._per_epoch * self.args.gradient_accumulation_steps)
            self._rng = capture_rng()
        return model, loader

    def _run_epoch(self, **kwargs: Any) -> Any:
        if self.state.global_step >= self.state.max_steps:
            return None  # resumed where training had ended: the loop would train one step before it checks
        if self._resume is not None:
            epochs, batches = self._resume
            if kwargs["epoch"] < epochs:
                return None  # trained before the run that wrote the checkpoint stopped
            kwargs.update(resume_from_checkpoint=_RESUMED, epochs_trained=epochs,
                          steps_trained_in_current_epoch=batches)
        return super()._run_epoch(**kwargs)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint != _RESUMED:
            return super()._load_rng_state(checkpoint)
        assert self._rng is not None
        restore_rng(self._rng)
