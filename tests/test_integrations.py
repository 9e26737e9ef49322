"""PyTorch Lightning and the Hugging Face Trainer with everystep: SIGKILL mid-run, resume with the
documented call, and the losses and final state equal the uninterrupted run's bitwise."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RUNS = Path(__file__).with_name("trainer_runs.py")


IN_PROCESS = pytest.mark.xdist_group("trainers-in-process")
"""Tests that import the trainers into the test process run on one worker (``--dist loadgroup``), which
imports them once."""


def train(trainer: str, directory: Path, out: Path, strategy: str, kill_at: str, reference: Path) -> list[int]:
    """Train with a kill, and again until done (each run a forked child of one process); the exit codes."""
    command = [sys.executable, str(RUNS), trainer, str(directory), str(out), "--strategy", strategy,
               "--kill-at", kill_at, "--reference", str(reference), "--until-done"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"{trainer} runs failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def read(out: Path) -> tuple[list[int], dict[tuple[int, int], set[float]], str | None]:
    """Each run's resumed step, every loss recorded per (step, micro-batch), and the final hash."""
    resumed, losses, final = [], {}, None
    for line in out.read_text().splitlines():
        entry = json.loads(line)
        if "resumed" in entry:
            resumed.append(entry["resumed"])
        elif "final" in entry:
            final = entry["final"]
        elif "killed" not in entry:
            losses.setdefault((entry["step"], entry["batch"]), set()).add(entry["loss"])
    return resumed, losses, final


@pytest.mark.parametrize("trainer, strategy, kill_at, resumes", [
    # each trainer once in `make test`, each strategy once, each resuming mid-epoch (steps 6-10 make
    # the second epoch: a data position one batch off retrains or skips one); the other two in make test-long
    ("lightning", "lowdiff_plus", 8, (7, 8)), ("transformers", "checkfreq", 8, (6, 7, 8)),
    pytest.param("lightning", "checkfreq", 6, (4, 5, 6), marks=pytest.mark.long),
    pytest.param("transformers", "lowdiff_plus", 10, (9, 10), marks=pytest.mark.long)])
def test_killed_and_resumed_equals_the_trainer_alone(tmp_path, trainer, strategy, kill_at, resumes):
    """Killed during step 7 (mid-epoch) or step 11 (the first of an epoch: 5 steps of 2 micro-batches
    make an epoch), then resumed by running the same training again, in a new process; the reference
    is the trainer alone, without everystep (trained first, in the killed run's process)."""
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    codes = train(trainer, tmp_path / "run", out, strategy, str(kill_at), ref)
    _, ref_losses, ref_final = read(ref)
    resumed, losses, final = read(out)
    assert codes == [-signal.SIGKILL, 0], codes
    # lowdiff_plus hands S_t to its agent within step t+1; checkfreq's two host buffers let S_5's
    # persist run on through step 7 (S_6's snapshot waited only for S_4's), so S_4 is the oldest
    # point a kill during step 7 can leave
    assert resumed[0] == 0 and resumed[1] in resumes, resumed
    assert set(losses) == set(ref_losses)
    assert {k: v for k, v in losses.items() if v != ref_losses[k]} == {}
    assert final == ref_final


def launch(*args: str, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """``trainer_runs.py ARGS --ranks N`` under torchrun, N ranks on loopback, no restart: a rank that
    dies ends the job."""
    from everystep.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "0",
               "--master-port", str(free_port()), str(RUNS), *args, "--ranks", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(RUNS.parents[1] / "src"), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


LONG = pytest.mark.long


def _assert_every_rank_equals_the_trainer_alone(out: Path, ref: Path, resumes: tuple[int, ...], ranks: int = 2) -> None:
    runs = [(read(Path(f"{out}-r{r}")), read(Path(f"{ref}-r{r}"))) for r in range(ranks)]
    assert len({run[0][0][1] for run in runs}) == 1 and runs[0][0][0][1] in resumes, [run[0][0] for run in runs]
    for (resumed, losses, final), (_, ref_losses, ref_final) in runs:
        assert resumed[0] == 0 and len(resumed) == 2, resumed
        assert set(losses) == set(ref_losses)
        assert {k: v for k, v in losses.items() if v != ref_losses[k]} == {}
        assert final == ref_final


@pytest.mark.parametrize("trainer, layout, strategy, kill_at, resumes", [
    ("lightning", "ddp", "checkfreq", 6, (4, 5, 6)),
    pytest.param("transformers", "ddp", "checkfreq", 6, (4, 5, 6), marks=LONG),
    pytest.param("lightning", "fsdp", "lightcheck", 10, (9, 10), marks=LONG),
    pytest.param("lightning", "ddp", "lowdiff_plus", 10, (9, 10), marks=LONG),
    pytest.param("transformers", "ddp", "lowdiff_plus", 10, (9, 10), marks=LONG),
    pytest.param("lightning", "fsdp", "checkfreq", 6, (4, 5, 6), marks=LONG),
    pytest.param("lightning", "fsdp", "lowdiff_plus", 10, (9, 10), marks=LONG),
    pytest.param("transformers", "fsdp", "checkfreq", 6, (4, 5, 6), marks=LONG),
    pytest.param("transformers", "fsdp", "lowdiff_plus", 10, (9, 10), marks=LONG),
    pytest.param("transformers", "fsdp", "lightcheck", 10, (9, 10), marks=LONG),
    pytest.param("lightning", "fsdp-tp", "checkfreq", 6, (4, 5, 6), marks=LONG),
    pytest.param("lightning", "fsdp-tp", "lowdiff_plus", 10, (9, 10), marks=LONG),
    pytest.param("lightning", "fsdp-tp", "lightcheck", 10, (9, 10), marks=LONG),
])
def test_several_ranks_killed_and_launched_again_equal_the_trainer_alone(tmp_path, trainer, layout, strategy, kill_at,
                                                                         resumes):
    """Two ranks (gloo, the CPU) — Lightning's DDPStrategy, or its ModelParallelStrategy with FSDP2 (each
    layer and the model ``fully_shard``-ed in ``configure_model``), each rank a slice of the
    ResumableSampler's permutation; the Trainer's own DDP, or FSDP2 (Accelerate's plugin, version 2, each
    GPT2Block sharded; Accelerate's gate that keeps FSDP to accelerators lifted on the CPU), its loader
    sharded by Accelerate; Lightning's FSDP2 + TP on four ranks, a 2 x 2 mesh, each layer's feed-forward
    split over a pair —; rank 0 SIGKILLed during step kill_at + 1, and the other ranks with it, as
    torchrun ends a job; the same job again resumes every rank from one step, and the losses after it
    and the final state are bitwise those of the trainer alone (trained first, by the same ranks). Each
    job's ranks are forked from one process that imported the trainer (``--until-done``)."""
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    ranks = 4 if layout == "fsdp-tp" else 2
    command = [sys.executable, str(RUNS), trainer, str(tmp_path / "run"), str(out), "--strategy", strategy, "--layout",
               layout, "--kill-at", str(kill_at), "--reference", str(ref), "--ranks", str(ranks), "--until-done"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])  # (the other ranks end of their peer's loss, or killed)
    assert len(codes) == 2 and codes[0][0] == -signal.SIGKILL and 0 not in codes[0] and codes[1] == [0] * ranks, codes
    _assert_every_rank_equals_the_trainer_alone(out, ref, resumes, ranks)


@LONG
@pytest.mark.parametrize("trainer", ["lightning", "transformers"])
def test_two_ranks_under_torchrun_killed_and_launched_again_equal_the_trainer_alone(tmp_path, trainer):
    """As above, each job launched by torchrun (no restart: rank 0's death ends it), as a user runs it."""
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    first = launch(trainer, str(tmp_path / "run"), str(out), "--kill-at", "6", "--reference", str(ref))
    assert first.returncode != 0 and "Signal 9 (SIGKILL) received" in first.stderr, first.stderr[-3000:]
    second = launch(trainer, str(tmp_path / "run"), str(out))
    assert second.returncode == 0, second.stderr[-4000:]
    _assert_every_rank_equals_the_trainer_alone(out, ref, (4, 5, 6))


def readme_example(name: str) -> str:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    found = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", readme, re.S)
    assert found, f"README has no example {name!r}"
    return found.group(1)


@IN_PROCESS
@pytest.mark.parametrize("name", ["lightning", "transformers"])
def test_readme_examples_run_as_written(tmp_path, monkeypatch, capsys, name):
    """In this process (the trainers are imported once per worker). Resuming with the same calls is
    what the kill tests above check."""
    import runpy

    script = tmp_path / "example.py"
    script.write_text(readme_example(name))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    assert "resumed from step 0" in capsys.readouterr().out
    assert list((tmp_path / f"ckpt-{name}" / "manifests").iterdir())  # the final checkpoint at least


@IN_PROCESS
def test_bench_measures_each_trainer_against_the_trainer_alone(tmp_path):
    """``everystep bench --trainer``'s runs, in this process: the trainer alone and with checkfreq every
    step, on each trainer's own model and on gpt2-tiny; the summary compares each with the trainer alone."""
    from everystep.errors import ConfigError
    from everystep.eval.bench.command import BenchConfig, summarise_trainer, trainer_table
    from everystep.eval.bench.trainers import measure

    for trainer, workload in (("lightning", "native"), ("transformers", "gpt2-tiny")):
        runs = [measure({"trainer": trainer, "workload": workload, "strategy": strategy, "steps": 4, "warmup": 1,
                         "every": 1, "seed": 0, "repeat": 0, "scratch": str(tmp_path)})
                for strategy in ("none", "checkfreq")]
        assert runs[0]["stall_per_step_seconds"] == 0 and runs[1]["stall_per_step_seconds"] > 0
        summary = summarise_trainer(runs)
        assert summary["none"]["overhead"] == 0.0
        assert summary["checkfreq"]["overhead"] == runs[1]["mean_step_seconds"] / runs[0]["mean_step_seconds"] - 1
        assert "| none (the trainer alone) | 0.0% |" in trainer_table(summary)
    with pytest.raises(ConfigError, match="--trainer runs the workloads gpt2-tiny, native"):
        BenchConfig(trainer="lightning", workload="resnet")
    with pytest.raises(ConfigError, match=r"--trainer compares everystep strategies .*\(not dcp\)"):
        BenchConfig(trainer="transformers", strategies=("none", "dcp"))
    assert BenchConfig(trainer="lightning").every == 1


@IN_PROCESS
def test_lightning_loop_counters_saved_at_a_step_are_lightnings_own_at_that_batch_end(tmp_path):
    """What the callback stores of Lightning's loops when a step ends (inside optimizer.step) is what
    Lightning's own checkpoint holds at that batch's end — the state its mid-epoch resume starts from —
    with accumulation, a step- and an epoch-interval scheduler, and steps across epochs."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from everystep.integrations.lightning import EverystepCallback, ResumableSampler

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2), "interval": "step"},
                           {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "epoch"}]

    seen = []

    class Compare(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if (trainer.fit_loop.epoch_loop.batch_progress.current.ready % 2 == 0
                    or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch):  # a step ended in this batch
                stored = callback.checkpointer._ctx.boundary["data"]["loops"]
                seen.append((trainer.global_step, stored == trainer.fit_loop.state_dict()))

    dataset = TensorDataset(torch.randn(20, 4))
    sampler = ResumableSampler(dataset)
    callback = EverystepCallback(tmp_path / "c", strategy="none", sampler=sampler)
    trainer = L.Trainer(max_steps=8, accumulate_grad_batches=2, callbacks=[callback, Compare()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), DataLoader(dataset, batch_size=4, sampler=sampler))  # 5 batches, 3 steps an epoch
    assert seen == [(step, True) for step in range(1, 9)]


def tiny_trainer(tmp_path: Path, cls: type | None = None) -> tuple[object, object]:
    """A Trainer (``cls``: the plain one by default) of a one-layer GPT-2 for 3 steps, checkpointed every
    step by checkfreq into ``tmp_path/ckpt``; and its callback."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging

    from everystep.integrations.transformers import EverystepCallback

    logging.set_verbosity_error()
    callback = EverystepCallback(tmp_path / "ckpt", strategy="checkfreq", every=1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    dataset = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (16, 8))]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    return (cls or Trainer)(model=model, args=args, train_dataset=dataset, callbacks=[callback]), callback


@IN_PROCESS
def test_a_plain_trainer_checkpoints_with_the_callback_and_refuses_a_directory_it_cannot_resume(tmp_path):
    from everystep.errors import ConfigError

    first, callback = tiny_trainer(tmp_path)
    first.train()
    assert callback.checkpointer.stats.checkpoints == 3 and callback.checkpointer.stats.last_durable_step == 3
    again, _ = tiny_trainer(tmp_path)
    with pytest.raises(ConfigError, match="holds training up to step 3: a plain Trainer cannot resume from it; "
                                          "use everystep.integrations.transformers.EverystepTrainer"):
        again.train()


@IN_PROCESS
def test_a_trainer_resumed_where_training_ended_trains_no_further(tmp_path):
    from everystep.integrations.transformers import EverystepTrainer

    tiny_trainer(tmp_path, EverystepTrainer)[0].train()
    again, callback = tiny_trainer(tmp_path, EverystepTrainer)
    again.train()
    assert callback.resumed_step == 3 and again.state.global_step == 3 and callback.checkpointer.step == 3


@IN_PROCESS
def test_the_lightning_callback_refuses_fsdp1_before_anything_is_written(tmp_path):
    # The refusal comes first in fit's start, from the Trainer's strategy and world size alone: a Trainer
    # of two devices with FSDPStrategy (which Lightning makes on GPUs only) is stood in for by those two.
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from everystep.errors import ConfigError
    from everystep.integrations.lightning import EverystepCallback

    callback = EverystepCallback(tmp_path / "c")
    with pytest.raises(ConfigError, match=r"DDPStrategy's replicas and ModelParallelStrategy's FSDP2 and TP shards "
                                          r"under several processes, not FSDPStrategy's layout"):
        callback.on_fit_start(SimpleNamespace(world_size=2, strategy=FSDPStrategy()), None)
    assert not (tmp_path / "c").exists()


@IN_PROCESS
def test_the_everystep_trainer_refuses_fsdp1_naming_what_checkpoints_fsdp2(tmp_path):
    from types import SimpleNamespace

    from everystep.errors import ConfigError
    from everystep.integrations.transformers import EverystepTrainer

    trainer, _ = tiny_trainer(tmp_path, EverystepTrainer)
    # what Accelerate's state holds for TrainingArguments(fsdp=True, fsdp_config={"version": 1}) on GPUs
    trainer.accelerator.state.fsdp_plugin = SimpleNamespace(fsdp_version=1)
    try:
        with pytest.raises(ConfigError, match=r"FSDP2's shards, not FSDP1's .*fsdp_config=\{'version': 2\}"):
            trainer.train()
    finally:
        trainer.accelerator.state.fsdp_plugin = None
    assert not (tmp_path / "ckpt").exists()


@IN_PROCESS
def test_layouts_the_integrations_do_not_serve_are_refused_before_training(tmp_path):
    """Each with one message naming the layout and what to use."""
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch.strategies import FSDPStrategy

    from everystep.errors import ConfigError
    from everystep.integrations.lightning import _check_layout
    from everystep.integrations.transformers import _check_layout as check_trainer

    for start in ("ddp_spawn", "ddp_fork"):
        with pytest.raises(ConfigError, match=f"start_method='{start.split('_')[1]}'"):
            _check_layout(L.Trainer(accelerator="cpu", devices=2, strategy=start, logger=False))
    _check_layout(L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False))  # (served)
    with pytest.raises(ConfigError, match="not FSDPStrategy's layout: use one of those"):
        _check_layout(SimpleNamespace(strategy=FSDPStrategy(), world_size=2))  # (FSDP1: a GPU's Trainer)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    for world in (1, 2):  # (a subclass of DDPStrategy; made without its __init__, which needs deepspeed installed)
        with pytest.raises(ConfigError, match="does not checkpoint DeepSpeedStrategy's layout"):
            _check_layout(SimpleNamespace(strategy=DeepSpeedStrategy.__new__(DeepSpeedStrategy), world_size=world))
    with pytest.raises(ConfigError, match="does not checkpoint DeepSpeed"):
        check_trainer(SimpleNamespace(world_size=2), deepspeed=True, fsdp_version=None)
    with pytest.raises(ConfigError, match="not FSDP1's"):
        check_trainer(SimpleNamespace(world_size=2), deepspeed=False, fsdp_version=1)
    check_trainer(SimpleNamespace(world_size=2), deepspeed=False, fsdp_version=None)  # (DDP: served)
    check_trainer(SimpleNamespace(world_size=2), deepspeed=False, fsdp_version=2)  # (FSDP2: served)
    from transformers import TrainingArguments

    from everystep.integrations.transformers import _fsdp_version

    def arguments(**given):  # (what a plain Trainer's callback reads the layout from)
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **given)

    assert _fsdp_version(arguments()) is None
    assert _fsdp_version(arguments(fsdp=True, fsdp_config={"version": 2})) == 2
    assert _fsdp_version(arguments(fsdp=True, fsdp_config={"version": 1})) == 1
