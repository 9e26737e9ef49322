"""Traces (:mod:`everystep.tracing`): off, a span costs nothing and records nothing; on, each
thread's spans and a helper process's, written as it goes, are gathered into one Chrome trace that
Perfetto opens; and ``everystep bench --trace`` writes one per run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from everystep import tracing

from .conftest import call_cli


def test_a_span_records_nothing_until_tracing_starts(tmp_path):
    with tracing.span("before"):
        pass
    assert not tracing.active() and tracing.stop() is None and tracing.merge(tmp_path / "x") is None


def test_each_threads_spans_and_a_helpers_are_gathered_into_one_trace(tmp_path):
    stem = tmp_path / "run"
    tracing.start(stem)
    try:
        with tracing.span("outer", step=1):
            worker = threading.Thread(target=_span_on_thread, name="everystep-test-worker")
            worker.start()
            worker.join()
        # a helper process started now records beside it, line by line (it may be killed at any time)
        helper = ("import sys; from everystep import tracing; tracing.start_from_env('test helper');"
                  "exec('with tracing.span(\"helped\"): pass'); tracing.stop()")
        subprocess.run([sys.executable, "-c", helper], check=True, env={**os.environ})
    finally:
        part = tracing.stop()
    assert part is not None and part.name.endswith(".part.json") and tracing.ENV not in os.environ
    with open(next(tmp_path.glob("run.*.part.jsonl")), "a") as f:
        f.write('{"ph": "X", "name": "cut sh')  # (a helper killed mid-line)
    path = tracing.merge(stem)
    events = tracing.load(path)["traceEvents"]
    assert not list(tmp_path.glob("*.part.json*"))
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {"outer", "on a thread", "helped"}
    assert spans["outer"]["args"] == {"step": 1} and spans["outer"]["dur"] >= spans["on a thread"]["dur"]
    assert threads[spans["on a thread"]["pid"], spans["on a thread"]["tid"]] == "everystep-test-worker"
    assert processes[spans["helped"]["pid"]].startswith("test helper") and spans["helped"]["pid"] != os.getpid()
    assert spans["outer"]["ts"] <= spans["on a thread"]["ts"] <= spans["helped"]["ts"]  # (one clock for all)
    json.dumps(tracing.load(path))  # (plain JSON: Perfetto's and chrome://tracing's format)


def _span_on_thread() -> None:
    with tracing.span("on a thread"):
        pass


def test_a_bench_run_writes_a_trace_of_its_steps_and_threads(tmp_path, capsys):
    code, stdout, _ = call_cli(capsys, "bench", "--workload", "mlp", "--strategies", "checkfreq", "--steps", "4",
                               "--warmup", "1", "--repeats", "1", "--trace", str(tmp_path / "traces"))
    assert code == 0 and f"a trace of each run in {tmp_path / 'traces'}/" in stdout
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["checkfreq_r1.json", "none_r1.json"]
    events = json.loads((tmp_path / "traces" / "checkfreq_r1.json").read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [(threads[e["tid"]], e["name"]) for e in events if e["ph"] == "X"]
    assert spans.count(("MainThread", "step")) == 4
    assert ("everystep-snapshot", "snapshot") in spans and ("MainThread", "everystep on_state_ready") in spans


def test_trace_with_a_trainer_is_refused_naming_the_flag(capsys):
    code, _, err = call_cli(capsys, "bench", "--workload", "native", "--trainer", "lightning", "--trace", "x")
    assert code != 0 and "--trace" in err
