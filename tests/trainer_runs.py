"""Training runs in PyTorch Lightning and the Hugging Face Trainer, checkpointed by everystep, for the
kill-and-resume tests (run as a script, in a process of its own).

    python tests/trainer_runs.py {lightning,transformers} DIR OUT --strategy S [--kill-at K,L,...] [--reference REF]
    torchrun --nproc-per-node 2 tests/trainer_runs.py lightning DIR OUT --ranks 2 ...   # DDP, gloo
    python tests/trainer_runs.py lightning DIR OUT --ranks 2 --until-done ...           # the same, forked

Each run appends the step it resumed from (``{"resumed": N}``), then each micro-batch's loss, to OUT
(a JSON line, written before the next one, so a killed run leaves the lines of what it finished); the
run's end appends the final state's hash. ``--reference REF`` first trains the trainer alone, without
everystep (the same sampler in Lightning), recording the same lines into REF: the run the others must
equal bitwise, made in the same process to spare a start of the trainer. ``--kill-at``
sends SIGKILL to the process during step K+1 for the first K in the list that this process reaches
after training a whole step and that no earlier run was killed at (OUT records each kill as
``{"killed": K}``), at the forward of the step's last micro-batch — after the step's
``optimizer.step()`` has started, so a strategy that writes synchronously has made S_K durable. Run the
same command again until the hash line appears: each run resumes where the last one died — or give
``--until-done``: the script then does so itself, each run a child forked after the trainer's import,
and prints the runs' exit codes (``-9``: killed).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from typing import Any

import torch

import everystep


ACCUMULATE = 2
"""Micro-batches per step in both trainers."""


class Killer:
    """Kills the process at the last micro-batch of step K+1 for each K of ``spec`` (``"6,10"``), once
    the process has trained a whole step — once for each K over all the runs recorded in ``out``: a run
    that resumed before K (the last point was not yet durable when the kill came) trains through it."""

    def __init__(self, spec: str | None, out: str) -> None:
        self.at = {int(k) for k in spec.split(",")} if spec else set()
        self.out = out
        if self.at and os.path.exists(out):
            with open(out) as f:
                self.at -= {json.loads(line).get("killed") for line in f}
        self.first: int | None = None

    def __call__(self, step: int, last_micro_batch: bool) -> None:
        """``step`` is the step being trained (1-based)."""
        if self.first is None:
            self.first = step
        if last_micro_batch and step - 1 in self.at and step > self.first:
            _record(self.out, {"killed": step - 1})
            os.kill(os.getpid(), signal.SIGKILL)


def _record(out: str, entry: dict[str, Any]) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _tokens(n: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(7))


def run_lightning(a: argparse.Namespace, strategy: str | None, out: str) -> None:
    import lightning as L
    from lightning.pytorch.demos import Transformer
    from torch.utils.data import DataLoader, TensorDataset

    from everystep.integrations.lightning import EverystepCallback, ResumableSampler

    rank = int(os.environ.get("RANK", "0"))
    kill = Killer(a.kill_at if strategy and rank == 0 else None, out)  # (torchrun then ends the other ranks)

    class LanguageModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            inputs, target = tokens[:, :-1], tokens[:, 1:]
            loss = torch.nn.functional.nll_loss(self.model(inputs, target).view(-1, 64), target.reshape(-1))
            kill(self.trainer.global_step + 1, (batch_idx + 1) % ACCUMULATE == 0)
            _record(out, {"step": self.trainer.global_step + 1, "batch": batch_idx, "loss": loss.item()})
            return loss

        def on_train_start(self) -> None:
            _record(out, {"resumed": callback.resumed_step if callback else 0})

        def configure_model(self) -> None:
            if a.layout == "ddp":
                return
            from torch.distributed.fsdp import fully_shard

            # FSDP2: each layer's parameters, then the rest, sharded over the data-parallel ranks; with
            # TP each layer's feed-forward first split over the tensor-parallel ones (a 2-D mesh)
            layers = [*self.model.transformer.encoder.layers, *self.model.transformer.decoder.layers]
            if a.layout == "fsdp-tp":
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                for layer in layers:
                    parallelize_module(layer, self.device_mesh["tensor_parallel"],
                                       {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()})
            mesh = self.device_mesh["data_parallel"]
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    L.seed_everything(0, verbose=False)
    dataset = TensorDataset(_tokens(40, 16, 64))
    tensor_parallel = 2 if a.layout == "fsdp-tp" else 1  # (the mesh's inner dimension: ranks 2k, 2k+1 split layers)
    sampler = ResumableSampler(dataset, seed=1, **({"num_replicas": a.ranks // 2, "rank": rank // 2}
                                                   if tensor_parallel > 1 else {}))
    callback = None if strategy is None else EverystepCallback(a.dir, strategy=strategy, every=1, sampler=sampler)
    several = {}
    if a.ranks > 1:  # DDP, FSDP2 or FSDP2 + TP on gloo, each data-parallel rank a slice of the sampler's permutation
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

        several = {"strategy": DDPStrategy(process_group_backend="gloo") if a.layout == "ddp" else
                   ModelParallelStrategy(data_parallel_size=a.ranks // tensor_parallel,
                                         tensor_parallel_size=tensor_parallel),
                   "use_distributed_sampler": False}
    # (torch's clip_grad_norm_ cannot sum norms over DTensors of the 1-D and the 2-D mesh: no clipping there)
    trainer = L.Trainer(max_steps=a.steps, accumulate_grad_batches=ACCUMULATE,
                        gradient_clip_val=None if a.layout == "fsdp-tp" else 1.0,
                        callbacks=[callback] if callback else [],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=a.ranks,
                        **several)
    model = LanguageModel()
    trainer.fit(model, DataLoader(dataset, batch_size=4, sampler=sampler))
    _record(out, {"final": everystep.state_hash({"model": model.state_dict(),
                                                   "optimizer": trainer.optimizers[0].state_dict()})})


def run_transformers(a: argparse.Namespace, strategy: str | None, out: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed
    from transformers.utils import logging

    from everystep.integrations.transformers import EverystepCallback, EverystepTrainer

    logging.set_verbosity_error()
    sharding = {}
    if a.ranks > 1 and a.layout == "fsdp":  # FSDP2 through Accelerate's plugin, each GPT2Block and the model
        _accelerate_shards_on_the_cpu()
        sharding = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
    kill = Killer(a.kill_at if strategy and int(os.environ.get("RANK", "0")) == 0 else None, out)

    class Resumed(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            _record(out, {"resumed": callback.resumed_step if callback else 0})

    class Recording(Trainer if strategy is None else EverystepTrainer):  # type: ignore[misc]
        step, micro = 0, 0  # (the step being trained, and its micro-batch: an epoch's last step may have fewer)

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            step = self.state.global_step + 1
            self.step, self.micro = step, self.micro + 1 if step == self.step else 0
            kill(step, (self.micro + 1) % ACCUMULATE == 0)
            _record(out, {"step": step, "batch": self.micro, "loss": loss.item()})
            return loss

    tokens = _tokens(40, 16, 64)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.2,
                        embd_pdrop=0.2, attn_pdrop=0.2)
    args = TrainingArguments(output_dir=os.path.join(a.dir, "hf"), max_steps=a.steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=ACCUMULATE, learning_rate=3e-3, warmup_steps=2,
                             max_grad_norm=1.0, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             logging_steps=1000, disable_tqdm=True, **({"ddp_backend": "gloo"} if a.ranks > 1 else {}),
                             **sharding)
    callback = None if strategy is None else EverystepCallback(os.path.join(a.dir, "ckpt"), strategy=strategy, every=1)
    set_seed(0)
    trainer = Recording(model=GPT2LMHeadModel(config), args=args, train_dataset=dataset,
                        callbacks=[callback, Resumed()] if callback else [Resumed()])
    trainer.train()
    _record(out, {"final": everystep.state_hash({"model": trainer.model.state_dict(),
                                                   "optimizer": trainer.optimizer.state_dict()})})


def _accelerate_shards_on_the_cpu() -> None:
    """Accelerate turns the Trainer's FSDP on for accelerators only (on the CPU it trains DDP, ignoring
    ``fsdp=``): here it shards on the CPU too, with the same plugin — the one change to its path."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, "everystep", False):
        return

    def sharding_init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    sharding_init.everystep = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = sharding_init  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trainer", choices=["lightning", "transformers"])
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--strategy", default="checkfreq")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at")
    p.add_argument("--reference")
    p.add_argument("--until-done", action="store_true")
    p.add_argument("--ranks", type=int, default=1, help="ranks: under torchrun with as many, or forked here with "
                   "--until-done; each records to OUT and REF with -r<rank> appended")
    p.add_argument("--layout", choices=["ddp", "fsdp", "fsdp-tp"], default="ddp", help="under several ranks: DDP, "
                   "FSDP2 (Lightning's ModelParallelStrategy; the Trainer's FSDP plugin, version 2), or (Lightning) "
                   "FSDP2 and TP on a 2-D mesh, TP over pairs of ranks")
    a = p.parse_args(argv)
    if a.layout == "fsdp-tp" and a.trainer != "lightning":
        p.error("--layout fsdp-tp: Lightning's only")
    torch.set_num_threads(1)
    run = {"lightning": run_lightning, "transformers": run_transformers}[a.trainer]
    if not a.until_done:
        if a.ranks > 1:  # (a rank of torchrun's)
            _rank_files(a, int(os.environ["RANK"]))
        if a.reference:
            run(a, None, a.reference)
        run(a, a.strategy, a.out)
        return
    # The trainer is imported once, here; each run is a child forked from this process (a fresh
    # process in all but the imports), killed or not, and the next resumes where it died. Under
    # several ranks each run is a job of as many children, on loopback; when one dies of a signal
    # the others are SIGKILLed, as torchrun ends a job whose rank failed.
    importlib.import_module("lightning.pytorch.demos" if a.trainer == "lightning" else "transformers.trainer")
    importlib.import_module(f"everystep.integrations.{a.trainer}")
    from everystep.distributed import free_port
    from everystep._process import exit_after

    codes: list[list[int]] = []
    while len(codes) < 4 and (not codes or -signal.SIGKILL in codes[-1]):
        environment = {"WORLD_SIZE": str(a.ranks), "LOCAL_WORLD_SIZE": str(a.ranks), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": f"run-{len(codes)}"}
        pids = []
        for rank in range(a.ranks):
            pid = os.fork()
            if pid == 0:
                exit_after(lambda: _one_run(a, run, rank, environment, first=not codes))
            pids.append(pid)
        ended: dict[int, int] = {}
        while len(ended) < len(pids):
            pid, status = os.wait()
            ended[pid] = os.waitstatus_to_exitcode(status)
            if ended[pid] < 0:
                for other in set(pids) - set(ended):
                    os.kill(other, signal.SIGKILL)
        codes.append([ended[pid] for pid in pids])
    print(json.dumps(codes if a.ranks > 1 else [c for c, in codes]))


def _one_run(a: argparse.Namespace, run: Any, rank: int, environment: dict[str, str], *, first: bool) -> int:
    """A forked child's run: as rank ``rank`` of ``a.ranks`` (``environment`` its job's), the
    reference first on the first run."""
    if a.ranks > 1:
        os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank))
        _rank_files(a, rank)
    if a.reference and first:
        run(a, None, a.reference)
    run(a, a.strategy, a.out)
    return 0


def _rank_files(a: argparse.Namespace, rank: int) -> None:
    """Under several ranks each records to OUT and REF with ``-r<rank>`` appended."""
    a.out, a.reference = f"{a.out}-r{rank}", a.reference and f"{a.reference}-r{rank}"

if __name__ == "__main__":
    sys.exit(main())
