"""Checkflow's planner: the ILP of Eqs. 1–12 against brute force, the checker, Algorithm 1's
splitting and memory relaxation, coarsening."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from everystep.capture.profile import profile_step
from everystep.cli import main
from everystep.eval.workloads import build
from everystep.policy.schedule import Schedule, StepProfile, Tensor, check, coarsen, drifted, plan, solve, split


def _brute_force(profile: StepProfile, bandwidth: float) -> int | None:
    """The least peak over every (snapshot, offload) pair of every tensor; None if none fits."""
    choices = [[(c, s) for c in range(t.updated_at) for s in range(c + 1, profile.steps)] for t in profile.tensors]
    best = None
    for combo in itertools.product(*choices):
        try:
            peak = check(profile, Schedule(tuple(c for c, _ in combo), tuple(s for _, s in combo)), bandwidth=bandwidth)
        except ValueError:
            continue
        best = peak if best is None else min(best, peak)
    return best


@st.composite
def _profiles(draw):
    steps = draw(st.integers(3, 5))
    times = tuple(draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=steps, max_size=steps)))
    resident = tuple(draw(st.lists(st.integers(0, 40), min_size=steps, max_size=steps)))
    tensors = tuple(Tensor(f"w{i}", draw(st.integers(1, 12)), draw(st.integers(1, steps - 1)))
                    for i in range(draw(st.integers(1, 3))))
    return StepProfile(times, resident, tensors), draw(st.sampled_from([2.0, 5.0, 20.0]))


@settings(max_examples=60, deadline=None)
@given(case=_profiles())
def test_the_ilp_finds_the_least_peak_brute_force_finds_and_only_schedules_the_checker_accepts(case):
    profile, bandwidth = case
    status, schedule, peak = solve(profile, bandwidth=bandwidth)
    best = _brute_force(profile, bandwidth)
    if best is None:
        assert status == "infeasible" and schedule is None
        return
    assert status == "optimal" and peak == best
    assert check(profile, schedule, bandwidth=bandwidth) == peak


def test_the_checker_names_the_constraint_a_schedule_breaks():
    profile = StepProfile((1.0, 1.0, 1.0, 1.0), (10, 20, 30, 10), (Tensor("w", 8, 2),))
    assert check(profile, Schedule((0,), (1,)), bandwidth=10) == 30  # held at 0 and 1: 10+8, 20+8
    with pytest.raises(ValueError, match=r"not before its update at 2 \(8\)"):
        check(profile, Schedule((2,), (3,)), bandwidth=10)
    with pytest.raises(ValueError, match=r"not after its snapshot at 1 \(2, 7\)"):
        check(profile, Schedule((1,), (1,)), bandwidth=10)
    with pytest.raises(ValueError, match=r"operator 1 offloads 8 bytes, more than the link moves .* \(9\)"):
        check(profile, Schedule((0,), (1,)), bandwidth=4)


def test_a_tensor_the_link_cannot_move_in_one_operator_is_split_and_planned_in_pieces():
    profile = StepProfile((1.0,) * 6, (0,) * 6, (Tensor("big", 30, 5),))
    assert solve(profile, bandwidth=10)[0] == "infeasible"  # 30 bytes, 10 per operator
    found = plan(profile, bandwidth=10, per_size=10)
    assert found.feasible and found.splits == 1 and len(found.profile.tensors) == 3
    assert sum(t.nbytes for t in found.profile.tensors) == 30
    assert check(found.profile, found.schedule, bandwidth=10) == found.peak
    none = plan(StepProfile((1.0,) * 3, (0,) * 3, (Tensor("big", 30, 2),)), bandwidth=10, per_size=10)
    assert not none.feasible and "cannot offload every snapshot" in none.reason  # 3 operators cannot move 30


def test_a_memory_limit_that_cannot_be_met_is_relaxed():
    profile = StepProfile((1.0,) * 4, (50, 10, 10, 50), (Tensor("w", 20, 3),))
    found = plan(profile, bandwidth=100, per_size=100, memory_limit=40)
    assert found.feasible and found.peak == 50 and found.memory_limit >= 50  # the activations alone reach 50


def test_limits_and_pieces_that_would_never_end_are_bounded():
    """A memory limit of 0 bytes (or 1) is refused or relaxed from the bytes alive, never a quarter
    of nothing at a time; pieces so small that the ILP would hold thousands of tensors end the plan
    as infeasible, naming why."""
    profile = StepProfile((1.0,) * 4, (50, 10, 10, 50), (Tensor("w", 20, 3),))
    with pytest.raises(ValueError, match="memory_limit must be a positive finite number, got 0"):
        plan(profile, bandwidth=100, per_size=100, memory_limit=0)
    for bad in (float("nan"), float("inf"), 0, -5):
        with pytest.raises(ValueError, match="bandwidth must be a positive finite number"):
            plan(profile, bandwidth=bad, per_size=100)
    assert plan(profile, bandwidth=100, per_size=100, memory_limit=1).feasible
    tiny = plan(StepProfile((1.0,) * 3, (0,) * 3, (Tensor("big", 30_000, 2),)), bandwidth=1, per_size=1)
    assert not tiny.feasible and "more than the 4096 the planner takes" in tiny.reason


def test_a_schedule_is_replanned_when_steps_get_twice_as_slow_or_twice_as_fast():
    assert not drifted(1.9, 1.0, 1.0) and drifted(2.1, 1.0, 1.0)
    assert not drifted(0.51, 1.0, 1.0) and drifted(0.49, 1.0, 1.0)  # faster counts too
    assert drifted(1.3, 1.0, 0.25) and drifted(0.79, 1.0, 0.25) and not drifted(0.81, 1.0, 0.25)


def test_splitting_keeps_every_byte_in_nearly_equal_pieces():
    pieces = split(StepProfile((1.0,), (0,), ()), 4).tensors
    assert pieces == ()
    profile = split(StepProfile((1.0, 1.0), (0, 0), (Tensor("a", 1000, 1), Tensor("b", 3, 1))), 400)
    assert [t.nbytes for t in profile.tensors] == [320, 320, 360, 3] and profile.tensors[-1].name == "b"
    assert [t.ranges() for t in profile.tensors[:3]] == [[("a", 0, 320)], [("a", 320, 640)], [("a", 640, 1000)]]
    group = Tensor("g", 300, 1, members=(("x", 100), ("y", 200)))
    halves = split(StepProfile((1.0, 1.0), (0, 0), (group,)), 150).tensors
    assert [t.ranges() for t in halves] == [[("x", 0, 100), ("y", 0, 28)], [("y", 28, 200)]]  # cut at byte 128


def test_coarsening_keeps_each_snapshot_deadline_and_groups_tensors_updated_together():
    times = tuple(float(i % 3 + 1) for i in range(40))
    resident = tuple(i * 2 for i in range(40))
    tensors = (Tensor("a", 5, 30), Tensor("b", 6, 30), Tensor("c", 7, 35))
    coarse, spans = coarsen(StepProfile(times, resident, tensors), 8)
    assert coarse.steps == len(spans) <= 10 and sum(coarse.times) == sum(times)
    assert [t.nbytes for t in coarse.tensors] == [11, 7] and coarse.tensors[0].members == (("a", 5), ("b", 6))
    assert [t.nbytes for t in coarsen(StepProfile(times, resident, tensors), 8, group_bytes=6)[0].tensors] == [5, 6, 7]
    assert [spans[t.updated_at][0] for t in coarse.tensors] == [30, 35]  # a merged step starts at each update
    assert all(coarse.resident[i] == max(resident[a:b]) for i, (a, b) in enumerate(spans))


def _profile(in_backward: bool) -> StepProfile:
    w = build("mlp", seed=0, in_backward=in_backward)

    def one():
        w.loss(w.data.next()).backward()
        w.update()

    one()
    return profile_step(w.model, w.optimizer, one)


def test_a_profiled_step_has_each_layers_forward_and_backward_and_the_update_after_them():
    profile = _profile(False)
    assert profile.steps == 2 * 6 + 1  # 6 leaf modules (3 linear, 2 ReLU, dropout), forward and backward, the update
    assert {t.updated_at for t in profile.tensors} == {profile.steps - 1}  # optimizer.step() updates all
    assert len(profile.tensors) == 6 * 3  # each parameter with exp_avg and exp_avg_sq
    forward_start, backward_start = profile.resident[0], profile.resident[6]
    assert backward_start > forward_start  # the activations saved for backward are alive
    assert all(t > 0 for t in profile.times)


def test_with_updates_in_backward_each_layer_has_its_own_deadline_inside_backward():
    profile = _profile(True)
    deadlines = sorted({t.updated_at for t in profile.tensors})
    assert len(deadlines) == 3 and all(6 <= d < profile.steps for d in deadlines)  # one per linear layer


def test_plan_checkflow_reports_a_feasible_plan_and_an_infeasible_link(tmp_path, capsys):
    assert main(["plan", "--checkflow", "--workload", "gpt2-tiny", "--bandwidth", "1e11", "--batch", "2", "--json",
                 str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "feasible: peak device memory" in out
    r = json.loads((tmp_path / "p.json").read_text())
    assert r["feasible"] and r["peak_none"] <= r["peak"] <= r["peak_checkfreq"] and r["time_steps"] <= 60
    assert r["batch"] == 2
    assert main(["plan", "--checkflow", "--workload", "gpt2-tiny", "--bandwidth", "1kB/s", "--per-size", "0.01"]) == 1
    assert "infeasible: the link" in capsys.readouterr().out
    assert main(["plan", "--checkflow"]) == 2
    assert "--checkflow needs --bandwidth" in capsys.readouterr().err
