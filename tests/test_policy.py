"""Pure planning functions: Young/Daly and LowDiff's model, checked against calculus and numerics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize, minimize_scalar

from everystep.plan import plan
from everystep.policy import (
    LowDiffCosts,
    lowdiff_integer_optimum,
    lowdiff_optimum,
    lowdiff_wasted_time,
    overhead_at,
    young_daly_interval,
    young_daly_overhead,
)
from everystep.policy.interval import busy_interval, due, median_gap, next_multiple, persist_due


def test_young_daly_closed_form_is_the_minimum_of_p():
    kw = dict(step_seconds=0.5, ckpt_seconds=4.0, mtbf_seconds=3600.0)
    n = young_daly_interval(**kw)
    assert n == pytest.approx(math.sqrt(2 * 4.0 * 3600.0) / 0.5)
    numeric = minimize_scalar(lambda x: overhead_at(x, **kw, load_seconds=7.0), bounds=(1, 10_000), method="bounded")
    assert numeric.x == pytest.approx(n, rel=1e-4)
    assert overhead_at(n, **kw, load_seconds=7.0) == pytest.approx(
        young_daly_overhead(ckpt_seconds=4.0, mtbf_seconds=3600.0, load_seconds=7.0))


def test_young_daly_rejects_nonsense():
    with pytest.raises(ValueError, match="MTBF > 0"):
        young_daly_interval(step_seconds=1, ckpt_seconds=1, mtbf_seconds=0)


costs = st.builds(
    LowDiffCosts,
    iteration_seconds=st.floats(0.01, 10), mtbf_seconds=st.floats(600, 1e6), write_bandwidth=st.floats(1e7, 1e10),
    full_bytes=st.floats(1e6, 1e11), load_seconds=st.floats(0, 100), merge_seconds=st.floats(1e-3, 10),
    gpus=st.integers(1, 1024), job_seconds=st.floats(1e3, 1e7),
)


def test_reduces_to_the_papers_eq10_when_an_iteration_takes_one_second():
    c = LowDiffCosts(iteration_seconds=1.0, mtbf_seconds=7200, write_bandwidth=2e9, full_bytes=6e9,
                     load_seconds=20, merge_seconds=0.4)
    f, b = lowdiff_optimum(c)
    rd, w, s, m = 0.4, 2e9, 6e9, 7200
    assert f == pytest.approx((rd * w**2 / (4 * s**2 * m**2)) ** (1 / 3))  # Eq. 10, as printed
    assert b == pytest.approx((2 * s * rd * m / w) ** (1 / 3))


@settings(max_examples=40, deadline=None)
@given(costs)
def test_closed_form_is_a_stationary_point_and_numerical_minimisation_agrees(c):
    f, b = lowdiff_optimum(c)
    g = lambda x: lowdiff_wasted_time(c, math.exp(x[0]), math.exp(x[1]))  # noqa: E731 (log space keeps both > 0)
    best = g([math.log(f), math.log(b)])
    res = minimize(g, x0=[math.log(f) + 0.7, math.log(b) - 0.7], method="Nelder-Mead",
                   options={"xatol": 1e-10, "fatol": 1e-14 * abs(best), "maxiter": 20_000})
    assert g(res.x) >= best - 1e-9 * abs(best)
    assert math.exp(res.x[0]) == pytest.approx(f, rel=2e-3)
    assert math.exp(res.x[1]) == pytest.approx(b, rel=2e-3)


def test_dimensional_consistency_iteration_time_scales_the_optimum():
    """Halving every duration (iteration, MTBF, merge, load) and doubling bandwidth keeps F* and b* in iterations."""
    c = LowDiffCosts(iteration_seconds=0.5, mtbf_seconds=3600, write_bandwidth=1e9, full_bytes=3e9,
                     load_seconds=10, merge_seconds=0.2)
    half = LowDiffCosts(iteration_seconds=0.25, mtbf_seconds=1800, write_bandwidth=2e9, full_bytes=3e9,
                        load_seconds=5, merge_seconds=0.1)
    (f1, b1), (f2, b2) = lowdiff_optimum(c), lowdiff_optimum(half)
    assert f1 == pytest.approx(f2) and b1 == pytest.approx(b2)


def wasted_per_second(c: LowDiffCosts, F: np.ndarray, B: np.ndarray) -> np.ndarray:
    """T_w / (N·T) written out again from the model (a full checkpoint every F iterations, b = B
    differentials a write), independently of the module's code."""
    tau = c.iteration_seconds
    lost = B * tau / 2 + c.load_seconds + c.merge_seconds / 2 * (F / B - 1)
    return lost / c.mtbf_seconds + c.full_bytes / (F * tau * c.write_bandwidth)


def exhaustive_optimum(c: LowDiffCosts, max_interval: int, max_batch: int) -> tuple[int, int]:
    """The (F, b) with 1 <= b <= F that wastes least, every pair up to the bounds tried."""
    F, B = np.arange(1, max_interval + 1.0)[:, None], np.arange(1, max_batch + 1.0)[None, :]
    cost = np.where(B <= F, wasted_per_second(c, F, B), np.inf)
    f, b = np.unravel_index(np.argmin(cost), cost.shape)
    return int(f) + 1, int(b) + 1


def test_the_integer_optimum_is_the_best_pair_of_all():
    # F* = 1/f* = 5356.6 and b* = 29.9 (Eq. 10 with τ = 0.3 s); the best whole pair is (5367, 30)
    c = LowDiffCosts(iteration_seconds=0.3, mtbf_seconds=3600, write_bandwidth=5e8, full_bytes=1e9,
                     load_seconds=5, merge_seconds=0.05)
    assert lowdiff_integer_optimum(c) == exhaustive_optimum(c, 20_000, 200) == (5367, 30)


def test_plan_reports_both_models_and_explains_missing_inputs():
    out = plan(step_seconds=1, size_bytes=3e9, bandwidth=1e9, mtbf_seconds=3600, load_seconds=10, merge_seconds=0.5)
    assert out["young_daly"]["interval_steps"] == pytest.approx(math.sqrt(2 * 3 * 3600))
    assert out["lowdiff"]["F"] >= out["lowdiff"]["batch"] >= 1
    from everystep.errors import ConfigError

    with pytest.raises(ConfigError, match="give --ckpt-seconds, or both --size-bytes and --bandwidth"):
        plan(step_seconds=1, mtbf_seconds=10)
    with pytest.raises(ConfigError, match="LowDiff's optimum needs --size-bytes"):
        plan(step_seconds=1, mtbf_seconds=10, ckpt_seconds=1, merge_seconds=0.1)


def test_interval_rules():
    assert [s for s in range(1, 10) if due(s, 3)] == [3, 6, 9] and due(7, 3, final=True)
    assert next_multiple(0, 8) == 8 and next_multiple(8, 8) == 16 and next_multiple(9, 8) == 16
    assert median_gap([0.0, 1.0]) is None and median_gap([0.0, 1.0, 3.0, 4.0]) == 1.0
    # a 2 s write every P steps of 0.5 s keeps the writer busy a quarter of the time at P = 16
    assert busy_interval(2.0, 0.5, 0.25) == 16 and busy_interval(0.0, 0.5, 0.25) == 1


def test_the_agents_persist_rule_fixed_and_measured():
    # fixed: the first step at or after each multiple of P, whatever the writer is doing
    fixed = [s for s in range(1, 13) if persist_due(s, (s - 1) // 4 * 4, 4, fixed=True, writing=True)]
    assert fixed == [4, 8, 12]
    assert persist_due(9, 6, 4, fixed=True, writing=False)  # 8 was passed over (it came at 9)
    # measured: P steps after the newest write, and never while one runs (it moves to the first step after)
    assert not persist_due(10, 6, 4, fixed=False, writing=True)
    assert persist_due(11, 6, 4, fixed=False, writing=False) and not persist_due(9, 6, 4, fixed=False, writing=False)
    assert persist_due(3, -1, 1, fixed=False, writing=False)
