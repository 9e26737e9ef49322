"""The failure simulator against the cases that have a closed form."""

from __future__ import annotations

import pytest

from everystep.eval.simulator.model import StrategyCosts, analytic_ratio, exact_expected_seconds, simulate


@pytest.mark.parametrize("interval, recovery", [(1, 0.0), (5, 2.0), (20, 10.0)])
def test_monte_carlo_matches_the_exact_renewal_expectation(interval, recovery):
    c = StrategyCosts(name="x", step_seconds=1.0, base_step_seconds=0.9, interval=interval, recovery_seconds=recovery)
    mc = simulate(c, mtbf_seconds=50.0, job_steps=2000, trials=400, seed=1)
    exact = exact_expected_seconds(c, mtbf_seconds=50.0, job_steps=2000)
    assert mc["mean_wall_seconds"] == pytest.approx(exact, abs=4 * mc["stderr_wall_seconds"])


def test_no_failures_means_only_the_steady_overhead():
    c = StrategyCosts(name="x", step_seconds=1.1, base_step_seconds=1.0, interval=10, lag=3, recovery_seconds=5)
    mc = simulate(c, mtbf_seconds=1e15, job_steps=500, trials=3)
    assert mc["effective_ratio"] == pytest.approx(1 / 1.1)
    assert analytic_ratio(c, mtbf_seconds=1e15) == pytest.approx(1 / 1.1)


def test_analytic_first_order_model_agrees_when_failures_are_rare():
    c = StrategyCosts(name="x", step_seconds=1.0, base_step_seconds=0.95, interval=10, lag=2, recovery_seconds=20)
    mc = simulate(c, mtbf_seconds=2000, job_steps=20_000, trials=100, seed=2)
    assert mc["effective_ratio"] == pytest.approx(analytic_ratio(c, mtbf_seconds=2000), rel=3e-3)


def test_lag_costs_more_and_longer_intervals_lose_more_per_failure():
    base = dict(name="x", step_seconds=1.0, base_step_seconds=1.0, recovery_seconds=1.0)
    r = lambda **kw: simulate(StrategyCosts(**{**base, **kw}), mtbf_seconds=100, job_steps=3000, trials=60, seed=3)["effective_ratio"]  # noqa: E731
    assert r(interval=1, lag=5) < r(interval=1, lag=0)
    assert r(interval=50) < r(interval=5)


def test_exact_form_refuses_cases_it_does_not_cover():
    with pytest.raises(ValueError, match="lag 0"):
        exact_expected_seconds(StrategyCosts(name="x", step_seconds=1, base_step_seconds=1, lag=1), mtbf_seconds=10, job_steps=10)
