"""Every-step checkpointing inside PyTorch Lightning and the Hugging Face Trainer, measured.

``everystep bench --trainer lightning|transformers`` runs :func:`measure` once per (repeat, strategy),
interleaved, each in a fresh process, and reports each strategy's step time against the trainer
alone (strategy ``none``: no everystep at all) in the same repeat.

Workloads: ``gpt2-tiny`` (everystep's, as in the bench's loop) and ``native``, a small model of the
trainer's own ecosystem — Lightning's demo ``Transformer`` (2 layers, width 64, vocab 256), or
Transformers' ``GPT2LMHeadModel`` from a config of the same size — on random tokens.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

from ..workloads import Workload, build

__all__ = ["TRAINERS", "TRAINER_WORKLOADS", "measure"]

TRAINERS = ("lightning", "transformers")
TRAINER_WORKLOADS = ("gpt2-tiny", "native")
_VOCAB, _SEQ, _BATCH = 256, 32, 8


def _tokens(w: Workload | None, n: int, seed: int) -> tuple[torch.Tensor, int]:
    """``n`` samples of ``seq + 1`` tokens, and the batch size: drawn from ``w``'s data, or, for the
    native models (``w`` None), at random."""
    if w is not None:
        batches = [w.data.next() for _ in range(-(-n // w.data.batch_size))]
        return torch.cat(batches)[:n], w.data.batch_size
    return torch.randint(0, _VOCAB, (n, _SEQ + 1), generator=torch.Generator().manual_seed(seed)), _BATCH


def _workload(spec: dict[str, Any]) -> Workload | None:
    """everystep's workload of ``spec`` (its model and data), or None for the trainer's own model."""
    return None if spec["workload"] == "native" else build(spec["workload"], seed=spec["seed"])


class _Tokens(torch.nn.Module):
    """A model of :mod:`~everystep.eval.workloads` whose forward takes the tokens and returns the loss."""

    def __init__(self, w: Workload) -> None:
        super().__init__()
        self.model, self._criterion = w.model, w.criterion

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self._criterion(self.model, tokens)}


def _stall(callback: Any) -> float:
    """The training thread's time inside everystep so far."""
    ckpt = getattr(callback, "checkpointer", None)
    return ckpt.stats.stall_seconds if ckpt is not None else 0.0


def _lightning(spec: dict[str, Any], directory: str, marks: list[tuple[float, float]]) -> Any:
    import lightning as L
    from lightning.pytorch.demos import Transformer
    from torch.utils.data import DataLoader, TensorDataset

    from ...integrations.lightning import EverystepCallback, ResumableSampler

    seed, w = spec["seed"], _workload(spec)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if w is None:
                self.net = Transformer(vocab_size=_VOCAB, ninp=64, nhead=2, nhid=128, nlayers=2)
            else:
                self.net = _Tokens(w)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            if w is not None:
                return self.net(tokens)["loss"]
            inputs, target = tokens[:, :-1], tokens[:, 1:]
            return torch.nn.functional.nll_loss(self.net(inputs, target).view(-1, _VOCAB), target.reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            marks.append((time.perf_counter(), _stall(callback)))

    L.seed_everything(seed, verbose=False)
    tokens, batch = _tokens(w, spec["steps"] * 8, seed)
    dataset = TensorDataset(tokens)
    sampler = ResumableSampler(dataset, seed=seed)
    callbacks: list[Any] = [Clock()]
    callback = None
    if spec["strategy"] != "none":
        callback = EverystepCallback(directory, strategy=spec["strategy"], every=spec["every"], sampler=sampler)
        callbacks.insert(0, callback)
    trainer = L.Trainer(max_steps=spec["steps"], callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Module(), DataLoader(dataset, batch_size=batch, sampler=sampler))
    return callback


def _transformers(spec: dict[str, Any], directory: str, marks: list[tuple[float, float]]) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed
    from transformers.utils import logging

    from ...integrations.transformers import EverystepCallback, EverystepTrainer

    logging.set_verbosity_error()
    seed, w = spec["seed"], _workload(spec)

    class Clock(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            marks.append((time.perf_counter(), _stall(callback)))

    set_seed(seed)
    tokens, batch = _tokens(w, spec["steps"] * 8, seed)
    if w is None:
        model: torch.nn.Module = GPT2LMHeadModel(GPT2Config(vocab_size=_VOCAB, n_positions=64, n_embd=64, n_layer=2,
                                                            n_head=2))
        dataset: list[dict[str, torch.Tensor]] = [{"input_ids": t, "labels": t} for t in tokens]
    else:
        model = _Tokens(w)
        dataset = [{"tokens": t} for t in tokens]
    args = TrainingArguments(output_dir=os.path.join(directory, "trainer"), max_steps=spec["steps"],
                             per_device_train_batch_size=batch, learning_rate=1e-3, save_strategy="no", report_to=[],
                             use_cpu=True, seed=seed, disable_tqdm=True, logging_steps=10**6)
    callbacks: list[Any] = [Clock()]
    callback = None
    if spec["strategy"] != "none":
        callback = EverystepCallback(os.path.join(directory, "ckpt"), strategy=spec["strategy"], every=spec["every"])
        callbacks.insert(0, callback)
    cls = Trainer if callback is None else EverystepTrainer
    cls(model=model, args=args, train_dataset=dataset, callbacks=callbacks).train()
    return callback


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One run: ``spec`` names ``trainer``, ``workload``, ``strategy`` (``none``: the trainer alone),
    ``steps``, ``warmup``, ``every``, ``seed``, ``repeat`` and ``scratch`` (where the checkpoint
    directory is made, or ``None`` for the system's temporary directory)."""
    torch.set_num_threads(spec.get("threads", 1))
    marks: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="everystep-trainer-", dir=spec.get("scratch")) as scratch:
        run = {"lightning": _lightning, "transformers": _transformers}[spec["trainer"]]
        run(spec, os.path.join(scratch, "ckpt"), marks)
    warmup, steps = spec["warmup"], spec["steps"]
    if len(marks) != steps or not 0 < warmup < steps:
        raise RuntimeError(f"{spec['trainer']} ran {len(marks)} of {steps} steps (warm-up {warmup})")
    (t0, stall0), (t1, stall1) = marks[warmup - 1], marks[-1]
    return {
        **{k: spec[k] for k in ("trainer", "workload", "strategy", "repeat")},
        "mean_step_seconds": (t1 - t0) / (steps - warmup),
        "stall_per_step_seconds": (stall1 - stall0) / (steps - warmup),
    }


def forked(argv: list[str]) -> int:
    """The entry point of a run forked by ``everystep bench``'s zygote (:func:`~everystep.eval.zygote.report_entry`)."""
    from ..zygote import report_entry

    return report_entry(measure, argv)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
