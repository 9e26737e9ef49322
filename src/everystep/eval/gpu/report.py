"""``everystep gpu-check``'s report as Markdown: the machine, then each part's figures as tables,
then every failure with its traceback."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown"]

MIB = 2**20


def _num(value: Any, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{suffix}"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the machine, then each part's figures, then every failure."""
    m, parts = report["machine"], report["parts"]
    lines = [f"# everystep gpu-check{' (dry run on the CPU)' if report['dry_run'] else ''}: "
             f"{m['gpu'] or 'no GPU'}, {report['date']}", ""]
    pcie = m.get("pcie") or {}
    link = (f"PCIe gen {pcie['generation']} x{pcie['lanes']} ({_num(pcie['limit_bytes_per_s'], 1e-9)} GB/s per "
            "direction)") if "generation" in pcie else "PCIe link unknown"
    lines += [f"- GPU: {m['gpu'] or 'none'} ({_num(m['gpu_memory_bytes'], 2**-30, 0)} GiB), driver {m['driver'] or '–'}, "
              f"CUDA {m['cuda_runtime'] or '–'}, {link}",
              f"- torch {m['torch']}, Python {m['python']}, {m['platform']}",
              f"- CPU: {m['cpu']}, {m['cpu_cores']} cores ({m['usable_cores']} usable)",
              f"- sizes: {report['sizes']['workload']} on {report['sizes']['device']}, {report['sizes']['steps']} steps "
              f"({report['sizes']['warmup']} warm-up), up to {report['sizes']['repeats']} interleaved repeats",
              f"- whole check: {report['seconds']:.0f} s, {len(report['failures'])} failure(s)",
              *_traces_md(report.get("traces")), ""]
    lines += ["| part | status | seconds | box (s) | failures |", "|---|---|---|---|---|"]
    for name, p in parts.items():
        lines.append(f"| {name} | {p['status']} | {_num(p.get('seconds'), 1, 0)} | {_num(p.get('box_seconds'), 1, 0)} "
                     f"| {p.get('failures', '–')} |")
    lines += _tests_md(parts.get("tests", {})) + _bandwidth_md(parts.get("bandwidth", {}), pcie)
    lines += _bench_md(parts.get("bench", {})) + _bound_md(parts.get("bound", {})) + _frequency_md(parts.get("frequency", {}))
    lines += _memory_md(parts.get("memory", {})) + _regime_md(parts.get("regime", {}))
    lines += ["", "## Failures", ""]
    if not report["failures"]:
        lines.append("None.")
    for f in report["failures"]:
        lines += [f"### {f['part']}: {f['what']}", "", "```", f["traceback"], "```", ""]
    return "\n".join(lines) + "\n"


def _traces_md(traces: dict[str, Any] | None) -> list[str]:
    if not traces or not traces["files"]:
        return []
    return [f"- traces: {len(traces['files'])} runs' in `{traces['folder']}/` (open one at ui.perfetto.dev or in "
            "chrome://tracing: each step, everystep's calls and threads, its helper processes, on a GPU the streams)"]


def _tests_md(p: dict[str, Any]) -> list[str]:
    if "tests" not in p:
        return []
    c = p["counts"]
    out = ["", "## tests/test_cuda.py", "",
           f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"
           f"{' (stopped at its time box)' if p['timed_out'] else ''}: `{p['command']}`", "",
           "| test | outcome | seconds |", "|---|---|---|"]
    out += [f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} |" for t in p["tests"]]
    return out


def _bandwidth_md(p: dict[str, Any], pcie: dict[str, Any]) -> list[str]:
    if "rows" not in p:
        return []
    limit = pcie.get("limit_bytes_per_s")
    out = ["", "## Device-to-host bandwidth", "",
           f"{p['bytes'] / MIB:.0f} MiB from {p['device']}, median of {p['copies']} copies; the side stream's copies "
           "run while matmuls run on the training stream.", "",
           "| host memory | stream | GB/s | of the link | bytes exact | overlapped the matmuls | note |",
           "|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        share = _num(r["gb_per_s"] * 1e9 / limit, 100, 0, "%") if limit and r["gb_per_s"] else "–"
        flag = {True: "yes", False: "no", None: "–"}
        out.append(f"| {r['memory']} | {r['stream']} | {_num(r['gb_per_s'], 1, 2)} | {share} | {flag[r['exact']]} "
                   f"| {flag[r['overlapped']]} | {r['why']} |")
    return out


def _bench_md(p: dict[str, Any]) -> list[str]:
    if "summary" not in p:
        return []
    from ..bench.command import markdown_table

    out = ["", "## Every step, and every K steps (`NAME/K`)", "", f"{p['rounds']} interleaved round(s); overhead: mean "
           "step time over the same round's `none` (for a strategy that trains with a gradient compression, the `none` "
           "that trains with it), minus one, median over rounds.", "",
           markdown_table(p["summary"], p.get("reference_spread")), *_spread_md(p), *_targets_md(p)]
    out += [f"Not run: `{name}`: {why}" for name, why in p.get("not_run", {}).items()]
    out += _stall_md(p["gockpt_stall_over_async_o"])
    if p.get("gockpt_stall_over_async_o_memory"):
        out += _stall_md(p["gockpt_stall_over_async_o_memory"], " with their memory tier (`NAME+memory/K`)")
    return out


def _stall_md(ratios: dict[str, dict[str, Any]], tier: str = "") -> list[str]:
    out = ["", f"| GoCkpt stall per checkpoint over Async-O's (`checkfreq`){tier} | ratio | paper's target | met |",
           "|---|---|---|---|"]
    for name, g in ratios.items():
        met = {True: "yes", False: "no", None: "–"}[g["met"]]
        out.append(f"| {name} | {_num(g['ratio'], 100, 1, '%')} | ≤ {g['target_at_most']:.0%} | {met} |")
    return out


def _regime_md(p: dict[str, Any]) -> list[str]:
    if "summary" not in p:
        return []
    from ..bench.command import markdown_table

    samples = f", {p['samples']} sample(s) a step" if p.get("samples") else ""
    return ["", f"## GoCkpt where its copy spans several steps ({p['workload']}{samples}, every {p['every']} steps)", "",
            f"{p['rounds']} interleaved round(s), overhead as above.", "",
            markdown_table(p["summary"], p.get("reference_spread")), *_spread_md(p), *_stall_md(p["gockpt_stall_over_async_o"])]


def _bound_md(p: dict[str, Any]) -> list[str]:
    if "summary" not in p:
        return []
    from ..bench.command import markdown_table

    return ["", f"## Every step on a GPU-bound step ({p['workload']})", "", f"{p['rounds']} interleaved round(s), overhead "
            "as above.", "", markdown_table(p["summary"], p.get("reference_spread")), *_spread_md(p), *_targets_md(p)]


def _spread_md(p: dict[str, Any]) -> list[str]:
    spread = p.get("reference_spread")
    if spread is None:
        return ["", "`none` ran once: its spread between rounds is not known, and no overhead is resolved against it."]
    return ["", f"`none`'s mean step varied by {spread:.1%} between rounds: an overhead within it (`*`) is not resolved."]


def _targets_md(p: dict[str, Any]) -> list[str]:
    out = ["", "| strategy | overhead | target | met |", "|---|---|---|---|"]
    for name, t in p.get("targets", {}).items():
        met = {True: "yes", False: "no", None: "not measured"}[t["met"]]
        out.append(f"| {name} | {_num(t['overhead'], 100, 1, '%')} | ≤ {t['target_at_most']:.0%} | {met} |")
    return out


def _frequency_md(p: dict[str, Any]) -> list[str]:
    if "strategies" not in p:
        return []
    out = ["", f"## Highest frequency within a {p['budget']:.1%} overhead budget", "",
           "| strategy | smallest interval (steps) | settled | overheads measured (interval: overhead) |",
           "|---|---|---|---|"]
    for name, f in p["strategies"].items():
        tried = ", ".join(f"{k}: {o:+.1%}" for k, o in f["overheads"].items())
        interval = f["interval"] if f["interval"] is not None else f"none up to {p['cap']}"
        out.append(f"| {name} | {interval} | {'yes' if f['settled'] else 'no'} | {tried} |")
    ratio = p["frequency_ratio"]
    out += ["", f"LightCheck's frequency over CheckFreq's: {_num(ratio, 1, 1, '×')} (the paper's: ≥ "
            f"{p['target_at_least']:.0f}×; {'met' if p['met'] else 'not met' if p['met'] is False else 'not measured'})."]
    return out


def _memory_md(p: dict[str, Any]) -> list[str]:
    if "plan_peak_device_bytes" not in p:
        return []
    rows = [("checkflow, as run (max_memory_allocated)", p["checkflow_peak_device_bytes"]),
            ("checkflow, its plan", p["plan_peak_device_bytes"]),
            ("checkfreq (max_memory_allocated)", p["checkfreq_peak_device_bytes"]),
            ("checkfreq snapshotting on the device first (max_memory_allocated)", p.get("device_snapshot_peak_device_bytes")),
            ("none (max_memory_allocated)", p["none_peak_device_bytes"]),
            ("checkflow's snapshots at once, planned", p["planned_snapshot_bytes"]),
            ("checkflow's snapshots at once, as run", p["peak_snapshot_bytes"])]
    out = ["", "## Checkflow's device memory", "", "| what | MiB |", "|---|---|"]
    out += [f"| {what} | {_num(v, 1 / MIB, 1)} |" for what, v in rows]
    ratio, met = p.get("plan_over_run"), p.get("plan_met")
    out += ["", f"Checkflow's plan over its run: {_num(ratio, 1, 2, '×')} (within {p.get('plan_target', 0):.0%}: "
            f"{'met' if met else 'not met' if met is False else 'not measured'}); below the CheckFreq that snapshots "
            f"on the device: {'yes' if p.get('below_device_snapshot') else 'no' if p.get('below_device_snapshot') is False else 'not measured'}."]
    if p.get("why_no_device_figures"):
        out += ["", p["why_no_device_figures"] + "."]
    return out
