"""``everystep gpu-check``: its dry run on the CPU holds every section a GPU's report holds, with
real figures; without a GPU the command is one line and exit status 0; a part that fails is
reported with its traceback and the others run."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import pytest
import torch

from everystep.eval.gpu import check as gpu_check
from everystep.eval.bench.libraries import LIBRARIES, missing
from everystep.eval.gpu.check import DRY, EVERY_STEP, SPREAD, Variant
from everystep import tracing
from everystep.eval.gpu.sizes import (ALL_PARTS, BOUND, BOUND_MEMORY_TIER, BOUND_TARGETS, COMPRESSED, DEVICE_SNAPSHOT, GPU,
                                      EVERY_STEP_TARGETS, MEMORY_TIER, ONCE, PARTS, REGIME)
from everystep.eval.gpu.report import markdown
from everystep.eval.bench.interval_search import search_intervals, smallest_within
from everystep.eval.machine import pcie_limit

from .conftest import ROOT, run_cli

pytestmark = pytest.mark.timeout(600)
dry_run = pytest.mark.xdist_group("gpu-check-dry-run")  # one worker runs the dry run once for all its tests


@pytest.fixture(scope="session")  # (not per module: the worker may run other modules' tests between these)
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = run_cli("gpu-check", "--dry-run", "--out", str(out))
    reports = sorted(out.glob("gpu_check_cpu-dry-run_*.json"))
    assert len(reports) == 1, proc.stderr
    return proc, json.loads(reports[0].read_text()), reports[0].with_suffix(".md").read_text(), out


@dry_run
def test_the_dry_run_reports_every_part_and_no_failure(dry):
    proc, report, _, _ = dry
    assert proc.returncode == 0, proc.stderr
    assert report["failures"] == []
    assert {name: p["status"] for name, p in report["parts"].items()} == dict.fromkeys(
        ("tests", "bandwidth", "bench", "bound", "frequency", "memory", "regime"), "ran")
    assert "1 failure" not in proc.stdout and "0 failure(s)" in proc.stdout
    m = report["machine"]
    assert m["torch"] == torch.__version__ and m["cpu_cores"] >= 1 and m["gpu"] is None


@dry_run
def test_the_dry_run_holds_each_cuda_test_with_its_outcome(dry):
    tests = dry[1]["parts"]["tests"]
    with tempfile.TemporaryDirectory() as tmp:  # (a numbered temporary folder would clean up this run's)
        collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                    "--basetemp", f"{tmp}/basetemp", "tests/test_cuda.py"], cwd=ROOT,
                                   env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # (none is needed to collect)
                                   capture_output=True, text=True).stdout
    names = {line.split("::", 1)[1] for line in collected.splitlines() if "::" in line}
    assert {t["name"] for t in tests["tests"]} == names and len(names) >= 18
    outcome = {t["name"]: t["outcome"] for t in tests["tests"]}
    assert outcome["test_device_cuda_without_a_gpu_is_a_clear_error"] == "passed"
    assert tests["counts"]["skipped"] == len(names) - 1  # every other test needs a GPU


@dry_run
def test_the_dry_run_measures_the_copies_it_can_and_says_why_not_the_others(dry):
    rows = {(r["memory"], r["stream"]): r for r in dry[1]["parts"]["bandwidth"]["rows"]}
    assert set(rows) == {(m, s) for m in ("pageable", "pinned", "registered") for s in ("training", "side")}
    for key in (("pageable", "training"), ("registered", "training")):
        assert rows[key]["gb_per_s"] > 0 and rows[key]["exact"] is True and len(rows[key]["seconds"]) == DRY.copies
    for key in (("pinned", "training"), ("pageable", "side")):
        assert rows[key]["gb_per_s"] is None and "need" in rows[key]["why"] and "CUDA" in rows[key]["why"]


@dry_run
def test_the_dry_run_benches_every_variant_interleaved_and_each_resumes_bitwise(dry):
    bench = dry[1]["parts"]["bench"]
    references = [f"none+{c}" for c in dict.fromkeys(COMPRESSED.values())]
    installed = [name for name in LIBRARIES if missing(name) is None]  # (the peers extra, where installed)
    labels = ["none", *references, *EVERY_STEP, *(f"{n}+memory" for n in MEMORY_TIER), *installed, DEVICE_SNAPSHOT,
              *(f"{n}{tier}/{DRY.spread_every}" for n in SPREAD for tier in ("", "+memory"))]
    assert list(bench["summary"]) == labels and bench["rounds"] == DRY.repeats >= 3
    assert set(bench["not_run"]) == set(LIBRARIES) - set(installed)
    for label, s in bench["summary"].items():
        assert s["mean_step_seconds"] > 0
        if label.split("+")[0] not in ("none", "torch_save", "dcp_async", *LIBRARIES):  # (no RNG or data position)
            assert s["resumes_bitwise"] is True, label
    assert bench["summary"]["lowdiff_plus"]["recovery_seconds_memory"] > 0  # from its agent's memory
    assert bench["summary"]["lightcheck"]["recovery_seconds_memory"] > 0  # from its region
    for name in MEMORY_TIER:  # from the memory tier's region, then from the directory
        tiered = bench["summary"][f"{name}+memory"]
        assert tiered["recovery_seconds_memory"] > 0 and tiered["recovery_seconds_disk"] > 0
        assert tiered["persist_interval"] >= 1 and tiered["persisted"] >= 1
    spread = {r["strategy"]: r["every"] for r in bench["runs"]}
    assert spread["gockpt/3"] == 3 and spread["lightcheck"] == 1 and spread["lowdiff_plus"] is None
    timed = {r["strategy"]: len(r["step_seconds"]) for r in bench["runs"]}  # (after a first checkpoint)
    assert timed["gockpt/3"] == DRY.spread_steps - DRY.spread_warmup == 3 * DRY.spread_every
    assert timed["none"] == DRY.steps - DRY.warmup
    assert timed["lowdiff"] == DRY.lowdiff_every  # (F steps timed: one full checkpoint among them)
    for name in ("gockpt", "gockpt_o"):
        g = bench["gockpt_stall_over_async_o"][name]
        assert g["ratio"] > 0 and g["met"] == (g["ratio"] <= g["target_at_most"])
    # lowdiff trains with top-k, and is compared with the none of its round that trains with it too
    by = {(r["strategy"], r["repeat"]): r["mean_step_seconds"] for r in bench["runs"]}
    lowdiff = bench["summary"]["lowdiff"]
    assert lowdiff["reference"] == "none+topk:0.01" and lowdiff["overhead"] == pytest.approx(statistics.median(
        by["lowdiff", r] / by["none+topk:0.01", r] - 1 for r in range(DRY.repeats)))
    assert {r["strategy"]: r.get("compress") for r in bench["runs"]}["lowdiff"] == "topk:0.01"
    assert set(bench["targets"]) == set(EVERY_STEP_TARGETS) and bench["reference_spread"] >= 0
    for name, t in bench["targets"].items():
        assert t["met"] == (bench["summary"][name]["overhead"] <= t["target_at_most"])


@dry_run
def test_the_dry_run_checks_in_its_first_round_and_measures_what_the_disk_bounds_once(dry):
    bench = dry[1]["parts"]["bench"]
    once = {*ONCE, DEVICE_SNAPSHOT, *(f"{n}/{DRY.spread_every}" for n in SPREAD)}
    for label, s in bench["summary"].items():
        assert s["rounds"] == (1 if label in once else DRY.repeats), label
    for r in bench["runs"]:
        if not r["strategy"].startswith("none"):  # (none has nothing to recover)
            assert (r["repeat"] == 0) == (r["resumes_bitwise"] is not None), (r["strategy"], r["repeat"])
        assert r["wall_seconds"] >= sum(r["seconds"].values()) > 0 and set(r["seconds"]) == {"build", "steps", "checks"}
    g = bench["gockpt_stall_over_async_o_memory"]
    assert set(g) == {"gockpt", "gockpt_o"} and all(v["ratio"] > 0 for v in g.values())


@dry_run
def test_every_row_of_the_dry_run_states_its_setting(dry):
    bench, md = dry[1]["parts"]["bench"], dry[2]
    settings = {label: s["setting"] for label, s in bench["summary"].items()}
    assert settings["lowdiff"]["every"] == DRY.lowdiff_every and settings["lowdiff"]["batch"] == DRY.lowdiff_batch
    assert f"| F={DRY.lowdiff_every} b={DRY.lowdiff_batch} threads=1 compress=topk:0.01 |" in md
    assert settings[f"gockpt/{DRY.spread_every}"]["parts"] == DRY.spread_parts
    assert settings[f"gockpt+memory/{DRY.spread_every}"]["memory"] is True
    assert settings["lowdiff_plus"]["agent_threads"] >= 1 and settings["lightcheck"]["hash_parts"] == 1
    assert all(s["threads"] == 1 and "every" in s for s in settings.values())  # (lowdiff_plus: None, its own)


@dry_run
def test_each_run_of_the_dry_run_leaves_a_trace_that_opens(dry):
    """Every run's trace is in the report's folder, gzipped JSON in the Chrome trace format: the
    training thread's steps, everystep's threads by name, and the helper processes' spans."""
    report, folder = dry[1], dry[3]
    traces = folder / report["traces"]["folder"]
    runs = report["parts"]["bench"]["runs"] + report["parts"]["bound"]["runs"] + report["parts"]["regime"]["runs"]
    assert len(report["traces"]["files"]) == len(runs) == len(list(traces.iterdir()))
    lightcheck = tracing.load(traces / "bench_lightcheck_r2.json.gz")["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in lightcheck if e["name"] == "thread_name"}
    spans = [(threads.get((e["pid"], e["tid"])), e["name"]) for e in lightcheck if e["ph"] == "X"]
    assert sum(1 for t, name in spans if (t, name) == ("MainThread", "step")) == DRY.steps
    assert {("everystep-lightcheck-copy", "copy into the region of the state at step N"),
            ("everystep-lightcheck-commit", "checksums")} <= set(spans)
    hashing = [e for e in lightcheck if e["name"] == "process_name" and e["args"]["name"].startswith("region hashing")]
    assert hashing and any(e["ph"] == "X" and e["name"] == "hash" and e["pid"] == hashing[0]["pid"] for e in lightcheck)
    agent = tracing.load(traces / "bench_lowdiff_plus_r1.json.gz")["traceEvents"]
    assert any(e["ph"] == "X" and e["name"] == "agent apply" for e in agent)


@dry_run
def test_the_dry_run_takes_the_every_step_strategies_on_the_gpu_bound_workload_against_their_targets(dry):
    bound = dry[1]["parts"]["bound"]
    assert bound["workload"] == DRY.bound_workload and bound["rounds"] == DRY.repeats
    assert list(bound["summary"]) == ["none", *(f"none+{c}" for c in dict.fromkeys(COMPRESSED.values())),
                                      *(n for n in BOUND if n != "lowdiff"), *(f"{n}+memory" for n in BOUND_MEMORY_TIER),
                                      "lowdiff"]  # (the slowest last: a round cut short by its box loses it alone)
    assert {r["workload"] for r in bound["runs"]} == {DRY.bound_workload}
    assert {len(r["step_seconds"]) for r in bound["runs"] if r["strategy"] != "lowdiff"} == {DRY.bound_steps - DRY.bound_warmup}
    assert set(bound["targets"]) == set(BOUND_TARGETS)
    for name in BOUND:
        assert bound["summary"][name]["resumes_bitwise"] is True, name
    assert bound["summary"]["lowdiff_plus"]["agent_seconds_per_step"] > 0


@dry_run
def test_the_dry_run_searches_both_frequencies_and_reads_checkflows_memory(dry):
    report = dry[1]
    f = report["parts"]["frequency"]
    bench = report["parts"]["bench"]["summary"]
    for name in ("lightcheck", "checkfreq"):
        got = f["strategies"][name]
        assert got["overheads"]["1"] == bench[name]["overhead"]
        assert got["settled"] or f["rounds"] == 0
    mem = report["parts"]["memory"]
    assert mem["plan_feasible"] is True and mem["plan_peak_device_bytes"] > 0 and mem["planned_snapshot_bytes"] > 0
    assert mem["checkflow_peak_device_bytes"] is None and "no CUDA allocator" in mem["why_no_device_figures"]
    assert mem["plan_over_run"] is None and mem["plan_met"] is None and mem["below_device_snapshot"] is None
    assert bench[DEVICE_SNAPSHOT]["resumes_bitwise"] is True


@dry_run
def test_the_dry_run_measures_gockpt_every_k_steps_on_its_own_workload_against_async_o(dry):
    regime = dry[1]["parts"]["regime"]
    every = DRY.regime_every
    assert list(regime["summary"]) == ["none", *(f"{n}/{every}" for n in REGIME)]
    assert {r["workload"] for r in regime["runs"]} == {DRY.regime_workload}
    assert all(v["options"] == {"memory": True} for v in regime["variants"] if v["strategy"] != "none")
    assert all(regime["summary"][f"{n}/{every}"]["persisted"] >= 1 for n in REGIME)  # (the memory tier's)
    assert {len(r["step_seconds"]) for r in regime["runs"]} == {DRY.regime_steps - DRY.regime_warmup}
    for name in ("gockpt", "gockpt_o"):
        g = regime["gockpt_stall_over_async_o"][name]
        assert g["ratio"] is not None and g["met"] == (g["ratio"] <= g["target_at_most"])


@dry_run
def test_the_markdown_report_has_a_section_for_each_part(dry):
    md = dry[2]
    for heading in ("# everystep gpu-check (dry run on the CPU)", "## tests/test_cuda.py", "## Device-to-host bandwidth",
                    "## Every step, and every K steps", "## Every step on a GPU-bound step (mlp)", "## Highest frequency within a 3.5% overhead budget",
                    "## Checkflow's device memory", "## GoCkpt where its copy spans several steps", "## Failures"):
        assert heading in md
    assert "| lightcheck |" in md and "| gockpt/3 |" in md and "None." in md.split("## Failures")[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_command_says_so_in_one_line_and_succeeds(tmp_path):
    proc = run_cli("gpu-check", "--out", str(tmp_path))
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("gpu-check: no GPU: torch ")
    assert not any(tmp_path.iterdir())
    made = subprocess.run(["make", "--no-print-directory", "gpu-check", "GPU_PYTHON=python-without-torch"], cwd=ROOT,
                          capture_output=True, text=True)
    assert made.returncode == 0 and made.stdout == "gpu-check: no GPU: python-without-torch has no torch; nothing to check\n"


def test_a_part_that_fails_is_reported_with_its_traceback_and_the_next_runs(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the copy engine is gone")

    monkeypatch.setattr(gpu_check, "run_bandwidth", broken)
    report, json_path, md_path = gpu_check.gpu_check(DRY, tmp_path, dry_run=True, parts=("bandwidth", "frequency"),
                                                     say=lambda line: None)
    assert report["parts"]["bandwidth"]["status"] == "failed"
    assert report["parts"]["frequency"] == {"status": "not run", "why": "the bench part did not run"}
    assert report["parts"]["tests"] == {"status": "not asked for"}
    [failure] = report["failures"]
    assert failure["part"] == "bandwidth" and "RuntimeError: the copy engine is gone" in failure["traceback"]
    assert "### bandwidth: bandwidth" in md_path.read_text() and json.loads(json_path.read_text()) == report


def test_a_round_that_the_box_cannot_hold_starts_no_run():
    box = gpu_check.Box(0.0)
    failures: list = []
    runs, done = gpu_check.rounds(DRY, [Variant("none", "none", None)], 3, box, failures, "bench", say=lambda s: None)
    assert (runs, done, failures) == ([], 0, [])


def test_the_interval_search_brackets_the_smallest_interval_within_the_budget():
    cost = {"lightcheck": 0.05, "checkfreq": 2.0}  # a fixed cost per checkpoint: overhead cost/k
    rounds = []

    def probe(intervals):
        rounds.append(dict(intervals))
        return {n: cost[n] / k for n, k in intervals.items()}

    measured = search_intervals(cost, probe, 0.035, 64)
    assert smallest_within(measured["lightcheck"], 0.035, 64) == {
        "interval": 2, "settled": True, "overheads": {"1": 0.05, "2": 0.025}}
    found = smallest_within(measured["checkfreq"], 0.035, 64)
    assert found["interval"] == 64 and found["settled"]  # 2.0/32 is over 3.5%, 2.0/64 within
    assert rounds == [{"lightcheck": 2, "checkfreq": 64}, {"checkfreq": 32}]
    capped = search_intervals({"checkfreq": 9.0}, lambda iv: {n: 9.0 / k for n, k in iv.items()}, 0.035, 16)
    assert smallest_within(capped["checkfreq"], 0.035, 16) == {
        "interval": None, "settled": True, "overheads": {"1": 9.0, "16": 9.0 / 16}}  # still over at the cap
    assert search_intervals({"lightcheck": 0.05}, lambda iv: None, 0.035, 64) == {"lightcheck": {1: 0.05}}


def test_a_noisy_search_ends():
    # overheads that go up and down with the interval: the search still stops at a bracket
    noisy = {1: 0.2, 2: 0.01, 4: 0.5, 8: 0.02, 16: 0.3}
    measured = search_intervals({"x": noisy[1]}, lambda iv: {n: noisy[k] for n, k in iv.items()}, 0.035, 16)
    assert smallest_within(measured["x"], 0.035, 16)["interval"] == 8


def test_the_pcie_limit_is_the_links_rate_less_its_encoding():
    assert pcie_limit(4, 16) == pytest.approx(31.5e9, rel=1e-3)
    assert pcie_limit(5, 16) == pytest.approx(63.0e9, rel=1e-3)
    assert pcie_limit(2, 16) == pytest.approx(8.0e9)


def test_the_markdown_of_a_report_without_parts_still_renders():
    report = {"dry_run": False, "date": "2026-01-01T00:00:00+00:00", "seconds": 1.0, "failures": [],
              "sizes": {"workload": "gpt2-small", "device": "cuda", "steps": 25, "warmup": 5, "repeats": 3},
              "machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_bytes": 80 * 2**30, "driver": "570.1",
                          "cuda_runtime": "13.0", "pcie": {"generation": 5, "lanes": 16, "limit_bytes_per_s": 63e9},
                          "torch": "2.11.0", "python": "3.12.3", "platform": "Linux", "cpu": "x", "cpu_cores": 16,
                          "usable_cores": 16},
              "parts": {"tests": {"status": "not asked for"}}}
    md = markdown(report)
    assert "PCIe gen 5 x16 (63.0 GB/s per direction)" in md and "| tests | not asked for |" in md
    assert gpu_check.report_name(report["machine"], False, __import__("datetime").date(2026, 1, 2)) == \
        "gpu_check_nvidia-h100-80gb-hbm3_2026-01-02"


def test_parts_asked_for_alone_share_the_calls_time():
    """The boxes of the default parts not asked for go to those asked for, in proportion: the bench
    alone has the whole call for its rounds; every default part, or the regime, its own box."""
    from everystep.eval.gpu.check import _scale

    call = sum(GPU.boxes[name] for name in PARTS)
    assert GPU.boxes["bench"] * _scale(GPU, ("bench",)) == pytest.approx(call)
    assert sum(GPU.boxes[n] * _scale(GPU, ("bench", "bound")) for n in ("bench", "bound")) == pytest.approx(call)
    assert _scale(GPU, PARTS) == 1.0 and _scale(GPU, ALL_PARTS) == 1.0
    assert GPU.boxes["regime"] * _scale(GPU, ("regime",)) == pytest.approx(max(GPU.boxes["regime"], call))
