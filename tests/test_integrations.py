"""PyTorch Lightning and the Hugging Face Trainer with everystep: SIGKILL mid-run, resume with the
documented call, and the losses and final state equal the uninterrupted run's bitwise."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RUNS = Path(__file__).with_name("trainer_runs.py")


def train(trainer: str, directory: Path, out: Path, strategy: str, kill_at: str | None = None) -> int:
    command = [sys.executable, str(RUNS), trainer, str(directory), str(out), "--strategy", strategy]
    if kill_at:
        command += ["--kill-at", kill_at]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    if done.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"{trainer} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.returncode


def read(out: Path) -> tuple[list[int], dict[tuple[int, int], set[float]], str | None]:
    """Each run's resumed step, every loss recorded per (step, micro-batch), and the final hash."""
    resumed, losses, final = [], {}, None
    for line in out.read_text().splitlines():
        entry = json.loads(line)
        if "resumed" in entry:
            resumed.append(entry["resumed"])
        elif "final" in entry:
            final = entry["final"]
        else:
            losses.setdefault((entry["step"], entry["batch"]), set()).add(entry["loss"])
    return resumed, losses, final


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each trainer without everystep (computed when first asked)."""
    cache: dict[str, tuple] = {}

    def get(trainer: str):
        if trainer not in cache:
            root = tmp_path_factory.mktemp(f"{trainer}-plain")
            train(trainer, root / "run", root / "out.jsonl", "plain")
            cache[trainer] = read(root / "out.jsonl")
        return cache[trainer]

    return get


@pytest.mark.parametrize("strategy", ["checkfreq", "lowdiff_plus"])
@pytest.mark.parametrize("trainer", ["lightning", "transformers"])
def test_killed_twice_and_resumed_equals_the_uninterrupted_run(tmp_path, reference, trainer, strategy):
    """Killed during step 7 (mid-epoch) and step 11 (the first of an epoch: 5 steps of 2 micro-batches
    make an epoch), each time resumed by running the same script again."""
    _, ref_losses, ref_final = reference(trainer)
    out = tmp_path / "out.jsonl"
    codes = []
    for _ in range(5):
        codes.append(train(trainer, tmp_path / "run", out, strategy, kill_at="6,10"))
        if codes[-1] == 0:
            break
    resumed, losses, final = read(out)
    assert codes[-1] == 0 and codes.count(-signal.SIGKILL) >= 2, codes
    # every strategy here makes S_t durable at most a step after t: each resume is from 5..6 or 9..10
    assert resumed[0] == 0 and resumed[1] in (5, 6) and resumed[-1] in (9, 10), resumed
    assert set(losses) == set(ref_losses)
    assert {k: v for k, v in losses.items() if v != ref_losses[k]} == {}
    assert final == ref_final


def readme_example(name: str) -> str:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    found = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", readme, re.S)
    assert found, f"README has no example {name!r}"
    return found.group(1)


@pytest.mark.parametrize("name", ["lightning", "transformers"])
def test_readme_examples_run_as_written_and_a_second_run_resumes(tmp_path, name):
    script = tmp_path / "example.py"
    script.write_text(readme_example(name))
    for expected in ("resumed from step 0", "resumed from step 40"):
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
        assert expected in done.stdout, done.stdout[-2000:]


def test_bench_measures_each_trainer_against_the_trainer_alone(tmp_path):
    """``everystep bench --trainer``'s runs, in this process: the trainer alone and with checkfreq every
    step, on each trainer's own model and on gpt2-tiny; the summary compares each with the trainer alone."""
    from everystep.errors import ConfigError
    from everystep.eval.bench import BenchConfig, summarise_trainer, trainer_table
    from everystep.eval.trainers import measure

    for trainer, workload in (("lightning", "native"), ("transformers", "gpt2-tiny")):
        runs = [measure({"trainer": trainer, "workload": workload, "strategy": strategy, "steps": 4, "warmup": 1,
                         "every": 1, "seed": 0, "repeat": 0, "scratch": str(tmp_path)})
                for strategy in ("none", "checkfreq")]
        assert runs[0]["checkpoints"] == 0 and runs[1]["checkpoints"] >= 3
        summary = summarise_trainer(runs)
        assert summary["none"]["overhead"] == 0.0
        assert summary["checkfreq"]["overhead"] == runs[1]["mean_step_seconds"] / runs[0]["mean_step_seconds"] - 1
        assert "| none (the trainer alone) | 0.0% |" in trainer_table(summary)
    with pytest.raises(ConfigError, match="--trainer runs the workloads gpt2-tiny, native"):
        BenchConfig(trainer="lightning", workload="resnet")
    with pytest.raises(ConfigError, match=r"--trainer compares everystep strategies .*\(not dcp\)"):
        BenchConfig(trainer="transformers", strategies=("none", "dcp"))
    assert BenchConfig(trainer="lightning").every == 1
