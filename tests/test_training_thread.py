"""What a strategy costs the training thread, counted on the CPU for what a GPU step would pay.

On a GPU the training thread's step is the host launching kernels: every Python call a strategy
makes there is host time in the step, and every read of a device tensor into the host (``.item()``,
``.cpu()``, ``.tolist()``, a ``synchronize()``) stops it until the device catches up. Both are counted
here on the CPU (``tools/python_calls.py``), each strategy against ``none`` training alike: it may
add no wait for the device at all, and at most its stated bound of Python calls a step.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

from .conftest import ROOT

WORKLOAD = "gpt2-tiny"
STEPS, WARMUP = 6, 4

# (strategy, options, compression, most Python calls a step on the training thread over none's)
BOUNDS = [
    ("lightcheck", {"every": 1}, None, 400),  # measured 224: a few hooks, the copy handed to its thread
    ("lowdiff", {"every": 50, "batch": 8}, "topk:0.01", 300),  # 111: a step record handed to its writer
    ("lowdiff_plus", {}, None, 1800),  # 1,332: the gradients handed over as backward makes them
    ("checkfreq", {"every": 1}, None, 2500),  # 1,868: the state flattened each step, its snapshot posted
    ("checkfreq", {"every": 1, "memory": True}, None, 2500),  # 1,785
    ("async", {"every": 1}, None, 2500),  # 1,886
    ("gockpt", {"every": 4, "parts": 3}, None, 2400),  # 1,734 (a part copied each step)
    ("gockpt_o", {"every": 4, "parts": 3}, None, 1600),  # 1,176
    ("checkflow", {"every": 1, "memory": True}, None, 5600),  # 4,294: a hook per operator, ranges per piece
]
"""Each bound is about 1.3 times what was measured on gpt2-tiny (56 tensors of state) when it was set."""


@functools.cache
def _tool():
    spec = importlib.util.spec_from_file_location("python_calls", ROOT / "tools" / "python_calls.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@functools.cache
def _measured(strategy: str, options: tuple, compress: str | None) -> dict:
    return _tool().measure_threads(strategy, WORKLOAD, steps=STEPS, warmup=WARMUP, options=dict(options),
                                   compress=compress)


def _ids(case):
    strategy, options, compress, _ = case
    return strategy + ("+memory" if options.get("memory") else "")


@pytest.mark.xdist_group("training-thread")  # (one worker measures none once for all)
@pytest.mark.parametrize("case", BOUNDS, ids=_ids)
def test_a_strategy_makes_the_training_thread_wait_for_nothing_and_calls_little(case):
    strategy, options, compress, bound = case
    mine = _measured(strategy, tuple(sorted(options.items())), compress)
    none = _measured("none", (), compress)
    assert mine["syncs"] == none["syncs"], f"{strategy} reads tensors on the training thread: {mine['syncs']}"
    extra = mine["calls"]["MainThread"] - none["calls"]["MainThread"]
    assert extra <= bound, f"{strategy} makes {extra:.0f} Python calls a step on the training thread (at most {bound})"


def test_the_counts_see_a_read_of_a_tensor_on_the_training_thread(monkeypatch):
    """The gate fails where it should: a strategy whose step end reads a tensor (``.item()``) on the
    training thread is counted."""
    from everystep.strategies.lightcheck import LightCheck

    original = LightCheck._on_step_end

    def reads(self, step):
        next(self.ctx.components.model.parameters()).sum().item()
        return original(self, step)

    monkeypatch.setattr(LightCheck, "_on_step_end", reads)
    got = _tool().measure_threads("lightcheck", "mlp", steps=2, warmup=1, options={"every": 1})
    none = _tool().measure_threads("none", "mlp", steps=2, warmup=1, options={})
    assert got["syncs"]["item"] == none["syncs"]["item"] + 1
