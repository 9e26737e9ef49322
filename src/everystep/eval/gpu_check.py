"""``everystep gpu-check``: everything a GPU must show, in one command that fits a ten-minute call.

On a machine whose torch sees a GPU it runs, in order, each part in its own processes and inside a
time box of its own (:data:`GPU`'s ``boxes``, 9 minutes in all; what a part leaves of its box goes
to the next):

1. ``tests``: ``tests/test_cuda.py`` under pytest, every test's outcome (a failure's traceback);
2. ``bandwidth``: device-to-host copies of :attr:`Sizes.copy_bytes` into pageable, pinned and
   registered (a shared mapping pinned in place, as LightCheck's region and checkfreq's writer
   process use) host memory, on the training stream with the GPU otherwise idle and on a side stream
   while matmuls run on the training stream, against the PCIe link's limit;
3. ``bench``: :data:`EVERY_STEP` checkpointing every step, and :data:`SPREAD` with a checkpoint every
   :attr:`Sizes.spread_every` steps (GoCkpt's copy spread over :attr:`Sizes.spread_parts`), all
   interleaved with one ``none`` reference, each run's resume checked bitwise (the bench's own
   check); GoCkpt's and GoCkpt-O's stall per checkpoint over Async-O's (``checkfreq``: its snapshot
   overlaps the next forward and backward), the runs every K steps timed after the first two
   checkpoints (:attr:`Sizes.spread_warmup`: the host memory a strategy keeps is allocated once in a
   long run);
4. ``frequency``: the smallest checkpoint interval of ``lightcheck`` and of ``checkfreq`` within a
   3.5% overhead budget, searched from the every-step overheads over powers of two;
5. ``memory``: Checkflow's peak device memory (``max_memory_allocated``) in the bench's runs against
   its plan's, CheckFreq's and no checkpointing's.

The report is one JSON and one Markdown file, ``gpu_check_<device>_<date>``, with the machine, every
figure and every failure with its traceback. A part that fails or runs out of its box is reported
so, and the next part runs all the same. ``--dry-run`` runs the same pipeline on the CPU with
:data:`DRY`'s tiny sizes in about a minute; the suite runs it, so the command cannot rot between the
rare times a GPU is at hand.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EverystepError
from .bandwidth import measure_bandwidth
from .machine import machine
from .gpu_report import markdown
from .interval_search import search_intervals, smallest_within
from .gpu_sizes import (ASYNC_O, DRY, EVERY_STEP, GOCKPT_TARGETS, GPU, INTERRUPT_GRACE, LIGHTCHECK_TARGET, PARTS,
                        SPREAD, Sizes)

__all__ = ["Sizes", "GPU", "DRY", "EVERY_STEP", "SPREAD", "gpu_check", "report_name", "no_gpu_reason"]

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


class _Box:
    """A part's time box: the seconds left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def used(self) -> float:
        return time.monotonic() - self.start


def _failure(part: str, what: str, error: BaseException | str) -> dict[str, str]:
    text = error if isinstance(error, str) else "".join(traceback.format_exception(error)).strip()
    return {"part": part, "what": what, "traceback": text}


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


def run_tests(sizes: Sizes, box: _Box, failures: list[dict[str, str]]) -> dict[str, Any]:
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
            failures.append(_failure("tests", c["name"], c["message"] or "(no report)"))
    if timed_out:
        failures.append(_failure("tests", "tests/test_cuda.py", f"still running after {box.seconds:.0f} s, stopped; "
                                 f"output so far:\n{out[-4000:]}"))
    elif proc.returncode not in (0, 1) or not cases:  # 1: some failed (reported above); else pytest itself did not run
        failures.append(_failure("tests", "pytest", f"exit status {proc.returncode}:\n{out[-4000:]}"))
    return {"command": " ".join(["python -m pytest", *workers, "tests/test_cuda.py"]), "exit_status": proc.returncode, "timed_out": timed_out,
            "counts": counts, "tests": cases}


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- 2. device-to-host bandwidth --------------------------------------------------------------


def run_bandwidth(sizes: Sizes, box: _Box, failures: list[dict[str, str]]) -> dict[str, Any]:
    spec = {"copy_bytes": sizes.copy_bytes, "copies": sizes.copies}
    result = _in_process("bandwidth", spec, box)
    missing = [f"{r['memory']} on the {r['stream']} stream" for r in result["rows"] if r["exact"] is False]
    if missing:
        failures.append(_failure("bandwidth", "copies", f"bytes differ after the copy into {', '.join(missing)}"))
    return result


def _in_process(part: str, spec: dict[str, Any], box: _Box) -> dict[str, Any]:
    """Run one of this module's measurements in a fresh process (a CUDA fault there ends that
    process, not the check), inside the box."""
    proc = subprocess.Popen([sys.executable, "-m", "everystep.eval.gpu_check", part, json.dumps(spec)],
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


@dataclass(frozen=True)
class Variant:
    label: str
    strategy: str
    every: int | None
    options: dict[str, Any] = field(default_factory=dict)
    scratch: str | None = None
    steps: int | None = None
    """Steps of its runs, and the first ``warmup`` left out of the timing (None: the sizes')."""
    warmup: int | None = None


def variants(sizes: Sizes) -> list[Variant]:
    """``none``, :data:`EVERY_STEP` every step, :data:`SPREAD` every ``spread_every`` steps
    (labelled ``NAME/K``); lightcheck's checkpoint directory, and so its region, in ``/dev/shm``."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    found = [Variant("none", "none", None)]
    for name in EVERY_STEP:
        every = None if name == "lowdiff_plus" else 1  # lowdiff_plus: its replica every step, persisted at its own interval
        found.append(Variant(name, name, every, scratch=shm if name == "lightcheck" else None))
    for name in SPREAD:
        options = {"parts": sizes.spread_parts} if name.startswith("gockpt") else {}
        found.append(Variant(f"{name}/{sizes.spread_every}", name, sizes.spread_every, options,
                             steps=sizes.spread_steps, warmup=sizes.spread_warmup))
    return found


def _spec(sizes: Sizes, v: Variant, repeat: int, steps: int | None = None) -> dict[str, Any]:
    from .bench import BenchConfig, run_spec

    cfg = BenchConfig(workload=sizes.workload, strategies=(v.strategy,), steps=steps or v.steps or sizes.steps,
                      warmup=v.warmup or sizes.warmup,
                      repeats=1, device=sizes.device, options={v.strategy: v.options}, scratch=v.scratch)
    return run_spec(cfg, repeat, v.strategy, v.every)


def _rounds(sizes: Sizes, chosen: list[Variant], repeats: int, box: _Box, failures: list[dict[str, str]], part: str,
            steps: int | None = None, say: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], int]:
    """Interleaved rounds of ``chosen`` (repeat r starts r places along), each run labelled by its
    variant; a round starts only while the box holds another as long as the first. A variant that
    fails is reported and left out of the rounds after. Returns the runs of complete rounds and
    their number."""
    from .bench import measure_run

    runs: list[dict[str, Any]] = []
    done, first = 0, None
    failed: set[str] = set()
    for r in range(repeats):
        if first is not None and box.left() < first * 1.1:
            say(f"  {part}: {done} round(s); the box has no time for another")
            break
        started = time.monotonic()
        live = [v for v in chosen if v.label not in failed]
        order = [live[(r + i) % len(live)] for i in range(len(live))]
        mine: list[dict[str, Any]] = []
        for i, v in enumerate(order):
            if box.left() <= 0:
                break
            say(f"  {part}: round {r + 1}/{repeats}, run {i + 1}/{len(order)}: {v.label}")
            try:
                got = measure_run(_spec(sizes, v, r, steps), timeout=max(box.left(), 1))
            except EverystepError as e:
                failures.append(_failure(part, f"{v.label}, round {r + 1}", str(e)))
                failed.add(v.label)
                if v.label == "none" or box.left() <= 0:
                    break
                continue
            mine.append({**got, "strategy": v.label, "run_strategy": v.strategy})
        complete = "none" not in failed and {m["strategy"] for m in mine} == {v.label for v in order} - failed
        if not complete:
            say(f"  {part}: round {r + 1} incomplete, left out")
            break
        runs.extend(mine)
        done += 1
        first = first or time.monotonic() - started
    return runs, done


def _exact(strategy: str, device: str) -> bool:
    """Whether a run of ``strategy`` must resume bitwise: not the peers (they keep no RNG or data
    position), not a lossy strategy, not ``lowdiff_plus`` on a GPU (its replica is updated by the
    CPU's arithmetic until the next re-base)."""
    from ..strategies import STRATEGIES

    return strategy in STRATEGIES and STRATEGIES[strategy].exact and not (strategy == "lowdiff_plus" and device == "cuda")


def run_bench_part(sizes: Sizes, box: _Box, failures: list[dict[str, str]], say: Callable[[str], None]) -> dict[str, Any]:
    from .bench import summarise

    chosen = variants(sizes)
    runs, rounds = _rounds(sizes, chosen, sizes.repeats, box, failures, "bench", say=say)
    summary = summarise(runs) if runs else {}
    of = {v.label: v.strategy for v in chosen}
    for label, s in summary.items():
        if s.get("resumes_bitwise") is False and _exact(of[label], sizes.device):
            failures.append(_failure("bench", label, f"{label} did not resume bitwise (state error "
                                     f"{s.get('resume_error')})"))
    spread = sizes.spread_every
    stall = {k: summary.get(f"{k}/{spread}", {}).get("stall_per_checkpoint_seconds") for k in (*GOCKPT_TARGETS, ASYNC_O)}
    versus = {k: (stall[k] / stall[ASYNC_O] if stall[k] is not None and stall[ASYNC_O] else None) for k in GOCKPT_TARGETS}
    return {"variants": [asdict(v) for v in chosen], "rounds": rounds, "summary": summary,
            "gockpt_stall_over_async_o": {k: {"ratio": versus[k], "target_at_most": t,
                                            "met": None if versus[k] is None else versus[k] <= t}
                                        for k, t in GOCKPT_TARGETS.items()},
            "runs": runs}


# -- 4. the highest frequency within the budget -----------------------------------------------


def run_frequency(sizes: Sizes, bench: dict[str, Any], box: _Box, failures: list[dict[str, str]],
                  say: Callable[[str], None]) -> dict[str, Any]:
    """LightCheck's and CheckFreq's smallest interval within the budget (:func:`search_intervals`),
    each round of probes interleaved with a ``none`` run of the same length."""
    from .bench import summarise

    names = ("lightcheck", "checkfreq")
    summary = bench.get("summary", {})
    missing = [n for n in names if n not in summary]
    if missing:
        raise EverystepError(f"the bench measured no every-step overhead of {' and '.join(missing)}")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    rounds = 0

    def probe(intervals: dict[str, int]) -> dict[str, float] | None:
        nonlocal rounds
        if box.left() <= 0:
            return None
        steps = sizes.warmup + max(sizes.steps - sizes.warmup, 2 * max(intervals.values()))  # two checkpoints at least
        chosen = [Variant("none", "none", None)] + [
            Variant(f"{n}@{k}", n, k, scratch=shm if n == "lightcheck" else None) for n, k in intervals.items()]
        runs, done = _rounds(sizes, chosen, sizes.frequency_repeats, box, failures, "frequency", steps=steps, say=say)
        if not done:
            return None
        rounds += 1
        got = summarise(runs)
        return {n: got[f"{n}@{k}"]["overhead"] for n, k in intervals.items() if f"{n}@{k}" in got}

    measured = search_intervals({n: summary[n]["overhead"] for n in names}, probe, sizes.budget, sizes.frequency_cap)
    found = {n: smallest_within(measured[n], sizes.budget, sizes.frequency_cap) for n in names}
    a, b = found["lightcheck"]["interval"], found["checkfreq"]["interval"]
    ratio = b / a if a and b else None
    return {"budget": sizes.budget, "cap": sizes.frequency_cap, "rounds": rounds, "strategies": found,
            "frequency_ratio": ratio, "target_at_least": LIGHTCHECK_TARGET,
            "met": None if ratio is None else ratio >= LIGHTCHECK_TARGET}


# -- 5. Checkflow's device memory -------------------------------------------------------------


def memory_part(bench: dict[str, Any]) -> dict[str, Any]:
    summary = bench.get("summary", {})
    if "checkflow" not in summary:
        raise EverystepError("the bench has no checkflow run to read its memory from")
    flow = summary["checkflow"]
    return {
        "checkflow_peak_device_bytes": flow.get("peak_device_bytes"),
        "plan_peak_device_bytes": flow.get("plan_peak_device_bytes"),
        "plan_feasible": flow.get("plan_feasible"),
        "checkfreq_peak_device_bytes": summary.get("checkfreq", {}).get("peak_device_bytes"),
        "none_peak_device_bytes": summary.get("none", {}).get("peak_device_bytes"),
        "planned_snapshot_bytes": flow.get("planned_snapshot_bytes"),
        "peak_snapshot_bytes": flow.get("peak_snapshot_bytes"),
        "why_no_device_figures": None if flow.get("peak_device_bytes") is not None
        else "no CUDA allocator on this machine: the device figures are the GPU's",
    }


# -- the whole check --------------------------------------------------------------------------


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
    steps: list[tuple[str, Callable[[_Box], dict[str, Any]]]] = [
        ("tests", lambda box: run_tests(sizes, box, failures)),
        ("bandwidth", lambda box: run_bandwidth(sizes, box, failures)),
        ("bench", lambda box: run_bench_part(sizes, box, failures, say)),
        ("frequency", lambda box: run_frequency(sizes, report["parts"]["bench"], box, failures, say)),
        ("memory", lambda box: memory_part(report["parts"]["bench"])),
    ]
    spare = 0.0  # what the parts before left of their boxes goes to the next
    for name, step in steps:
        wanted = name in parts or (name == "memory" and "bench" in parts)
        if not wanted:
            report["parts"][name] = {"status": "not asked for"}
            continue
        needs = "bench" if name in ("frequency", "memory") else None
        if needs and report["parts"].get(needs, {}).get("status") != "ran":
            report["parts"][name] = {"status": "not run", "why": f"the {needs} part did not run"}
            continue
        box = _Box(sizes.boxes.get(name, 0.0) + spare)
        say(f"gpu-check: {name} (time box {box.seconds:.0f} s)")
        before = len(failures)
        try:
            result = step(box)
            status = "ran"
        except Exception as e:  # reported with its traceback; the next part runs all the same
            failures.append(_failure(name, name, e))
            result, status = {}, "failed"
        report["parts"][name] = {"status": status, "seconds": box.used(), "box_seconds": box.seconds,
                                 "failures": len(failures) - before, **result}
        say(f"gpu-check: {name} {status} in {box.used():.0f} s, {len(failures) - before} failure(s)")
        spare = max(box.left(), 0.0)
    report["seconds"] = time.monotonic() - started
    stem = report_name(report["machine"], dry_run, when)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(markdown(report))
    return report, json_path, md_path


def _main(argv: list[str]) -> None:
    part, spec = argv[0], json.loads(argv[1])
    if part != "bandwidth":
        raise SystemExit(f"unknown part {part!r}")
    print(json.dumps(measure_bandwidth(spec["copy_bytes"], spec["copies"])))


if __name__ == "__main__":
    _main(sys.argv[1:])
