"""``everystep gpu-check``: everything a GPU must show, in one command that fits a ten-minute call.

On a machine whose torch sees a GPU it runs, in order, each part in its own processes and inside a
time box of its own (:data:`GPU`'s ``boxes``, 9 minutes in all; what a part leaves of its box goes
to the next, and the boxes of default parts not asked for to those asked for, in proportion); the
bench, bound and regime parts in interleaved rounds (:func:`~everystep.eval.gpu.rounds.rounds`: the
checks in the first, the runs bound by the disk in it alone), each run traced into the report's folder:

1. ``tests``, only when asked for (``--parts tests``, a call of its own): ``tests/test_cuda.py``
   under pytest, every test's outcome (a failure's traceback);
2. ``bandwidth``: device-to-host copies of :attr:`Sizes.copy_bytes` into pageable, pinned and
   registered (a shared mapping pinned in place, as LightCheck's region and checkfreq's writer
   process use) host memory, on the training stream with the GPU otherwise idle and on a side stream
   while matmuls run on the training stream, against the PCIe link's limit;
3. ``bench``: :data:`EVERY_STEP` checkpointing every step (``lowdiff`` with top-k 1%, F and b its
   paper's, over a ``none`` that trains with the same compression), :data:`MEMORY_TIER` every step
   with their memory tier (``NAME+memory``) and CheckFreq snapshotting on the device first
   (:data:`DEVICE_SNAPSHOT`), each against its target
   (:data:`EVERY_STEP_TARGETS`) beside ``none``'s spread between rounds, and :data:`SPREAD` with a
   checkpoint every :attr:`Sizes.spread_every` steps (GoCkpt's copy spread over
   :attr:`Sizes.spread_parts`), all interleaved with one ``none`` reference, each run's resume
   checked bitwise (the bench's own check); GoCkpt's and GoCkpt-O's stall per checkpoint over
   Async-O's (``checkfreq``: its snapshot overlaps the next forward and backward), the runs every K
   steps timed after the first two checkpoints (:attr:`Sizes.spread_warmup`: the host memory a
   strategy keeps is allocated once in a long run);
4. ``bound``: :data:`BOUND` and :data:`BOUND_MEMORY_TIER` (with its memory tier) every step on the
   GPU-bound workload (:attr:`Sizes.bound_workload`),
   interleaved with ``none``, each against its target (:data:`BOUND_TARGETS`), beside ``none``'s spread;
5. ``frequency``: the smallest checkpoint interval of ``lightcheck`` and of ``checkfreq`` within a
   3.5% overhead budget, searched from the every-step overheads over powers of two;
6. ``memory``: Checkflow's peak device memory (``max_memory_allocated``) in the bench's runs against
   its plan's (within :data:`PLAN_TARGET`), CheckFreq's, the device-snapshotting CheckFreq's (which it
   should stay below) and no checkpointing's.

The report is one JSON and one Markdown file, ``gpu_check_<device>_<date>``, with the machine, every
figure and every failure with its traceback. A part that fails or runs out of its box is reported
so, and the next part runs all the same. ``--dry-run`` runs the same pipeline on the CPU with
:data:`DRY`'s tiny sizes in about a minute; the suite runs it, so the command cannot rot between the
rare times a GPU is at hand.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...errors import EverystepError
from ..bench.bandwidth import measure_bandwidth
from ..machine import machine
from .report import markdown
from ..bench.libraries import LIBRARIES, missing
from ..bench.interval_search import search_intervals, smallest_within
from .rounds import Variant, bound_variants, exact, over_references, regime_variants, rounds, targets, variants
from .sizes import ASYNC_O, BOUND_TARGETS, DEVICE_SNAPSHOT, DRY, EVERY_STEP, EVERY_STEP_TARGETS, GOCKPT_TARGETS, GPU, INTERRUPT_GRACE, LIGHTCHECK_TARGET, PARTS, ALL_PARTS, PLAN_TARGET, SPREAD, Box, Sizes, failure

__all__ = ["Sizes", "GPU", "DRY", "EVERY_STEP", "SPREAD", "PARTS", "ALL_PARTS", "gpu_check", "report_name",
           "no_gpu_reason"]

def no_gpu_reason() -> str | None:
    """Why this machine cannot run the GPU check (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        return f"torch {torch.__version__} ({build}) sees no GPU here"
    return None


def report_name(machine: dict[str, Any], dry_run: bool, when: _dt.datetime) -> str:
    """``gpu_check_<device>_<YYYY-MM-DD>``: the GPU's name in lower case, words joined by ``-``."""
    device = "cpu-dry-run" if dry_run else re.sub(r"[^a-z0-9]+", "-", (machine.get("gpu") or "gpu").lower()).strip("-")
    return f"gpu_check_{device}_{when:%Y-%m-%d}"


# -- running a part ---------------------------------------------------------------------------


def _python_env(root: Path | None) -> dict[str, str]:
    """The environment of this check's processes: everystep importable from where it was imported,
    and the test dependencies carried beside the checkout (``.gpu-deps``: ``make gpu-deps``)."""
    import everystep

    paths = [str(Path(everystep.__file__).resolve().parents[1])]
    if root is not None and (root / ".gpu-deps").is_dir():
        paths.append(str(root / ".gpu-deps"))
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


def _checkout() -> Path | None:
    """The checkout the package was imported from, when it has its tests (not an installed copy)."""
    import everystep

    root = Path(everystep.__file__).resolve().parents[2]
    return root if (root / "tests" / "test_cuda.py").is_file() else None


# -- 1. the CUDA tests ------------------------------------------------------------------------


def _junit(path: Path) -> list[dict[str, Any]]:
    """Every test case of pytest's JUnit XML (a file this check's own pytest wrote): its name,
    outcome, seconds and, when it did not pass, pytest's report of why."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # what an interrupted xdist run leaves of a test it did not finish
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.text or found.get("message") or "").strip()
                break
        cases.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message})
    return cases


def run_tests(sizes: Sizes, box: Box, failures: list[dict[str, str]]) -> dict[str, Any]:
    root = _checkout()
    if root is None:
        raise EverystepError("tests/test_cuda.py is not beside the package (an installed copy): run the check from "
                             "a checkout, with PYTHONPATH=src")
    env = _python_env(root)
    probe = subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True, env=env, cwd=root)
    if probe.returncode != 0:
        raise EverystepError(f"{sys.executable} cannot import pytest: run `make gpu-deps` where the project is "
                             "installed and carry .gpu-deps with the checkout")
    workers = []
    if sizes.test_workers and subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True, env=env,
                                             cwd=root).returncode == 0:
        workers = ["-n", str(sizes.test_workers)]  # the tests are small: several share the GPU
    with tempfile.TemporaryDirectory(prefix="everystep-gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        # its own temporary folder: pytest's default one, numbered, would clean up the numbered folders
        # of a pytest that runs this check (the suite's dry run), tests still running in them
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(xml),
                   "--basetemp", str(Path(tmp) / "basetemp"), "-o", "junit_logging=no", *workers, "tests/test_cuda.py"]
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=max(box.left() - INTERRUPT_GRACE, 1))
        except subprocess.TimeoutExpired:  # interrupted, pytest still reports the tests that ran
            timed_out = True
            proc.send_signal(signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=INTERRUPT_GRACE)
            except subprocess.TimeoutExpired:
                _kill(proc)
                out, _ = proc.communicate()
        finally:
            if proc.poll() is None:
                _kill(proc)
        cases = _junit(xml) if xml.is_file() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    for c in cases:
        if c["outcome"] in ("failed", "error"):
            failures.append(failure("tests", c["name"], c["message"] or "(no report)"))
    if timed_out:
        failures.append(failure("tests", "tests/test_cuda.py", f"still running after {box.seconds:.0f} s, stopped; "
                                 f"output so far:\n{out[-4000:]}"))
    elif proc.returncode not in (0, 1) or not cases:  # 1: some failed (reported above); else pytest itself did not run
        failures.append(failure("tests", "pytest", f"exit status {proc.returncode}:\n{out[-4000:]}"))
    return {"command": " ".join(["python -m pytest", *workers, "tests/test_cuda.py"]), "exit_status": proc.returncode, "timed_out": timed_out,
            "counts": counts, "tests": cases}


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- 2. device-to-host bandwidth --------------------------------------------------------------


def run_bandwidth(sizes: Sizes, box: Box, failures: list[dict[str, str]]) -> dict[str, Any]:
    spec = {"copy_bytes": sizes.copy_bytes, "copies": sizes.copies}
    result = _in_process("bandwidth", spec, box)
    missing = [f"{r['memory']} on the {r['stream']} stream" for r in result["rows"] if r["exact"] is False]
    if missing:
        failures.append(failure("bandwidth", "copies", f"bytes differ after the copy into {', '.join(missing)}"))
    return result


def _in_process(part: str, spec: dict[str, Any], box: Box) -> dict[str, Any]:
    """Run one of this module's measurements in a fresh process (a CUDA fault there ends that
    process, not the check), inside the box."""
    proc = subprocess.Popen([sys.executable, "-m", "everystep.eval.gpu.check", part, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_python_env(None),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(box.left(), 1))
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.communicate()
        raise EverystepError(f"{part}: still running after {box.seconds:.0f} s, stopped") from None
    if proc.returncode != 0:
        raise EverystepError(f"{part} failed (exit status {proc.returncode}):\n{err.strip()[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


# -- 3. the bench -----------------------------------------------------------------------------


def _measured(sizes: Sizes, chosen: list[Variant], box: Box, failures: list[dict[str, str]], part: str,
              say: Callable[[str], None], traces: Path | None) -> tuple[list[dict[str, Any]], int, dict[str, dict[str, Any]]]:
    """Interleaved rounds of ``chosen`` (:func:`rounds`, each run's trace in ``traces``): their runs,
    the rounds done and the summary, each overhead over its reference (:func:`over_references`), and a
    failure for each exact strategy that did not resume bitwise."""
    from ..bench.command import summarise

    runs, done = rounds(sizes, chosen, sizes.repeats, box, failures, part, say=say, traces=traces)
    summary = summarise(runs) if runs else {}
    over_references(summary, runs, chosen)
    of = {v.label: v.strategy for v in chosen}
    for label, s in summary.items():
        if s.get("resumes_bitwise") is False and exact(of[label], sizes.device):
            failures.append(failure(part, label, f"{label} did not resume bitwise (state error "
                                    f"{s.get('resume_error')})"))
    return runs, done, summary


def run_bench_part(sizes: Sizes, box: Box, failures: list[dict[str, str]], say: Callable[[str], None],
                   traces: Path | None = None) -> dict[str, Any]:
    from ..bench.command import reference_spread

    chosen = variants(sizes)
    runs, done, summary = _measured(sizes, chosen, box, failures, "bench", say, traces)
    return {"variants": [asdict(v) for v in chosen], "rounds": done, "summary": summary,
            "not_run": {name: why for name in LIBRARIES if (why := missing(name)) is not None},
            "reference_spread": reference_spread(runs), "targets": targets(summary, EVERY_STEP_TARGETS),
            "gockpt_stall_over_async_o": _stall_over_async_o(summary, sizes.spread_every),
            "gockpt_stall_over_async_o_memory": _stall_over_async_o(summary, sizes.spread_every, "+memory"),
            "runs": runs}


def run_regime_part(sizes: Sizes, box: Box, failures: list[dict[str, str]], say: Callable[[str], None],
                    traces: Path | None = None) -> dict[str, Any]:
    """GoCkpt where it applies: :data:`REGIME` every ``regime_every`` steps on a workload whose state
    takes several steps to copy, interleaved with ``none``; GoCkpt's and GoCkpt-O's stall per
    checkpoint over Async-O's against the paper's bounds."""
    from ..bench.command import reference_spread

    chosen = regime_variants(sizes)
    runs, done, summary = _measured(sizes, chosen, box, failures, "regime", say, traces)
    return {"workload": sizes.regime_workload, "samples": sizes.regime_samples, "every": sizes.regime_every,
            "variants": [asdict(v) for v in chosen], "rounds": done, "summary": summary,
            "reference_spread": reference_spread(runs),
            "gockpt_stall_over_async_o": _stall_over_async_o(summary, sizes.regime_every), "runs": runs}


def _stall_over_async_o(summary: dict[str, dict[str, Any]], every: int, tier: str = "") -> dict[str, dict[str, Any]]:
    """GoCkpt's and GoCkpt-O's stall per checkpoint over Async-O's (runs labelled ``NAME/every``;
    with ``tier`` ``+memory``, ``NAME+memory/every``)."""
    stall = {k: summary.get(f"{k}{tier}/{every}", {}).get("stall_per_checkpoint_seconds")
             for k in (*GOCKPT_TARGETS, ASYNC_O)}
    versus = {k: (stall[k] / stall[ASYNC_O] if stall[k] is not None and stall[ASYNC_O] else None) for k in GOCKPT_TARGETS}
    return {k: {"ratio": versus[k], "target_at_most": t, "met": None if versus[k] is None else versus[k] <= t}
            for k, t in GOCKPT_TARGETS.items()}


def run_bound_part(sizes: Sizes, box: Box, failures: list[dict[str, str]], say: Callable[[str], None],
                   traces: Path | None = None) -> dict[str, Any]:
    """The strategies built to take every step, every step on the GPU-bound workload, interleaved
    with ``none``: each one's overhead against its target, beside ``none``'s spread between rounds."""
    from ..bench.command import reference_spread

    chosen = bound_variants(sizes)
    runs, done, summary = _measured(sizes, chosen, box, failures, "bound", say, traces)
    return {"workload": sizes.bound_workload, "variants": [asdict(v) for v in chosen], "rounds": done,
            "summary": summary, "reference_spread": reference_spread(runs), "targets": targets(summary, BOUND_TARGETS),
            "runs": runs}


# -- 4. the highest frequency within the budget -----------------------------------------------


def run_frequency(sizes: Sizes, bench: dict[str, Any], box: Box, failures: list[dict[str, str]],
                  say: Callable[[str], None]) -> dict[str, Any]:
    """LightCheck's and CheckFreq's smallest interval within the budget (:func:`search_intervals`),
    each round of probes interleaved with a ``none`` run of the same length."""
    from ..bench.command import summarise

    names = ("lightcheck", "checkfreq")
    summary = bench.get("summary", {})
    missing = [n for n in names if n not in summary]
    if missing:
        raise EverystepError(f"the bench measured no every-step overhead of {' and '.join(missing)}")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    probes = 0

    def probe(intervals: dict[str, int]) -> dict[str, float] | None:
        nonlocal probes
        if box.left() <= 0:
            return None
        steps = sizes.warmup + max(sizes.steps - sizes.warmup, 2 * max(intervals.values()))  # two checkpoints at least
        chosen = [Variant("none", "none", None)] + [
            Variant(f"{n}@{k}", n, k, scratch=shm if n == "lightcheck" else None) for n, k in intervals.items()]
        runs, done = rounds(sizes, chosen, sizes.frequency_repeats, box, failures, "frequency", steps=steps, say=say,
                            checks=False)
        if not done:
            return None
        probes += 1
        got = summarise(runs)
        return {n: got[f"{n}@{k}"]["overhead"] for n, k in intervals.items() if f"{n}@{k}" in got}

    measured = search_intervals({n: summary[n]["overhead"] for n in names}, probe, sizes.budget, sizes.frequency_cap)
    found = {n: smallest_within(measured[n], sizes.budget, sizes.frequency_cap) for n in names}
    a, b = found["lightcheck"]["interval"], found["checkfreq"]["interval"]
    ratio = b / a if a and b else None
    return {"budget": sizes.budget, "cap": sizes.frequency_cap, "rounds": probes, "strategies": found,
            "frequency_ratio": ratio, "target_at_least": LIGHTCHECK_TARGET,
            "met": None if ratio is None else ratio >= LIGHTCHECK_TARGET}


# -- 5. Checkflow's device memory -------------------------------------------------------------


def memory_part(bench: dict[str, Any]) -> dict[str, Any]:
    summary = bench.get("summary", {})
    if "checkflow" not in summary:
        raise EverystepError("the bench has no checkflow run to read its memory from")
    flow = summary["checkflow"]
    run, plan = flow.get("peak_device_bytes"), flow.get("plan_peak_device_bytes")
    device = summary.get(DEVICE_SNAPSHOT, {}).get("peak_device_bytes")
    plan_over_run = plan / run if plan is not None and run else None
    return {
        "checkflow_peak_device_bytes": flow.get("peak_device_bytes"),
        "plan_peak_device_bytes": flow.get("plan_peak_device_bytes"),
        "plan_feasible": flow.get("plan_feasible"),
        "checkfreq_peak_device_bytes": summary.get("checkfreq", {}).get("peak_device_bytes"),
        "device_snapshot_peak_device_bytes": device,
        "plan_over_run": plan_over_run,
        "plan_target": PLAN_TARGET,
        "plan_met": None if plan_over_run is None else abs(plan_over_run - 1) <= PLAN_TARGET,
        "below_device_snapshot": None if device is None or run is None else run < device,
        "none_peak_device_bytes": summary.get("none", {}).get("peak_device_bytes"),
        "planned_snapshot_bytes": flow.get("planned_snapshot_bytes"),
        "peak_snapshot_bytes": flow.get("peak_snapshot_bytes"),
        "why_no_device_figures": None if flow.get("peak_device_bytes") is not None
        else "no CUDA allocator on this machine: the device figures are the GPU's",
    }


# -- the whole check --------------------------------------------------------------------------


def _scale(sizes: Sizes, parts: Sequence[str]) -> float:
    """How much larger each box is when some of the default parts are not asked for: their boxes go
    to the parts asked for, in proportion (``--parts bench`` alone has the call's time for its rounds)."""
    asked = sum(sizes.boxes.get(name, 0.0) for name in parts if name in sizes.boxes)
    call = sum(sizes.boxes.get(name, 0.0) for name in PARTS)
    return max(1.0, call / asked) if asked else 1.0


def gpu_check(sizes: Sizes, out: Path, *, dry_run: bool, parts: tuple[str, ...] = PARTS,
              say: Callable[[str], None] = print, now: _dt.datetime | None = None) -> tuple[dict[str, Any], Path, Path]:
    """Run the parts, write the report (JSON and Markdown under ``out``), and return it with the
    two paths."""
    when = now or _dt.datetime.now(_dt.timezone.utc)
    started = time.monotonic()
    failures: list[dict[str, str]] = []
    report: dict[str, Any] = {"kind": "everystep gpu-check", "format": 1, "date": when.isoformat(timespec="seconds"),
                              "dry_run": dry_run, "machine": machine(), "sizes": asdict(sizes), "parts": {},
                              "failures": failures}
    stem = report_name(report["machine"], dry_run, when)
    traces = out / f"{stem}_traces"
    steps: list[tuple[str, Callable[[Box], dict[str, Any]]]] = [
        ("tests", lambda box: run_tests(sizes, box, failures)),
        ("bandwidth", lambda box: run_bandwidth(sizes, box, failures)),
        ("bench", lambda box: run_bench_part(sizes, box, failures, say, traces)),
        ("bound", lambda box: run_bound_part(sizes, box, failures, say, traces)),
        ("frequency", lambda box: run_frequency(sizes, report["parts"]["bench"], box, failures, say)),
        ("memory", lambda box: memory_part(report["parts"]["bench"])),
        ("regime", lambda box: run_regime_part(sizes, box, failures, say, traces)),
    ]
    spare = 0.0  # what the parts before left of their boxes goes to the next
    scale = _scale(sizes, parts)
    for name, step in steps:
        wanted = name in parts or (name == "memory" and "bench" in parts)
        if not wanted:
            report["parts"][name] = {"status": "not asked for"}
            continue
        needs = "bench" if name in ("frequency", "memory") else None
        if needs and report["parts"].get(needs, {}).get("status") != "ran":
            report["parts"][name] = {"status": "not run", "why": f"the {needs} part did not run"}
            continue
        box = Box(sizes.boxes.get(name, 0.0) * scale + spare)
        say(f"gpu-check: {name} (time box {box.seconds:.0f} s)")
        before = len(failures)
        try:
            result = step(box)
            status = "ran"
        except Exception as e:  # reported with its traceback; the next part runs all the same
            failures.append(failure(name, name, e))
            result, status = {}, "failed"
        report["parts"][name] = {"status": status, "seconds": box.used(), "box_seconds": box.seconds,
                                 "failures": len(failures) - before, **result}
        say(f"gpu-check: {name} {status} in {box.used():.0f} s, {len(failures) - before} failure(s)")
        spare = max(box.left(), 0.0)
    report["traces"] = _compress_traces(traces)
    report["seconds"] = time.monotonic() - started
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(markdown(report))
    return report, json_path, md_path


def _compress_traces(folder: Path) -> dict[str, Any]:
    """Gather what each run's helpers wrote after it ended into its trace, gzip each (Perfetto opens
    ``.json.gz`` as it is); the folder and the traces' names, relative to the report."""
    from ... import tracing

    names: list[str] = []
    for path in tracing.merge_all(folder) if folder.is_dir() else []:
        packed = path.with_name(path.name + ".gz")
        packed.write_bytes(gzip.compress(path.read_bytes()))
        path.unlink()
        names.append(packed.name)
    return {"folder": folder.name, "files": names}


def _main(argv: list[str]) -> None:
    part, spec = argv[0], json.loads(argv[1])
    if part != "bandwidth":
        raise SystemExit(f"unknown part {part!r}")
    print(json.dumps(measure_bandwidth(spec["copy_bytes"], spec["copies"])))


if __name__ == "__main__":
    _main(sys.argv[1:])
