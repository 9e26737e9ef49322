"""What a bench's runs say: the summary per strategy (medians over the repeats, each overhead over
the same repeat's ``none``), how much ``none`` itself varied, and the tables printed
(:mod:`everystep.eval.bench.command` runs them)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from .measure import CHECKFLOW_MEMORY

__all__ = ["summarise", "summarise_trainer", "trainer_table", "markdown_table", "reference_spread", "recovery_reads",
           "setting_text", "strategy_notes"]


def _by_strategy(runs: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]], list[float]]]:
    """Per strategy, in the order first run: its runs, and each run's overhead — its mean step time
    over the same repeat's ``none`` run's, minus one."""
    reference = {r["repeat"]: r["mean_step_seconds"] for r in runs if r["strategy"] == "none"}
    for name in dict.fromkeys(r["strategy"] for r in runs):
        mine = [r for r in runs if r["strategy"] == name]
        yield name, mine, [r["mean_step_seconds"] / reference[r["repeat"]] - 1 for r in mine]


def _rate(runs: list[dict[str, Any]]) -> float | None:
    """The median over repeats of what a recovery read over how long it took (GB/s), where it read
    something its run counted."""
    rates = [r["recovery_bytes_read"] / s / 1e9 for r in runs if r.get("recovery_bytes_read")
             and (s := r.get("recovery_seconds_disk") or r.get("recovery_seconds_memory"))]
    return statistics.median(rates) if rates else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per strategy: medians over repeats, overhead relative to the same repeat's ``none``."""
    out: dict[str, dict[str, Any]] = {}
    for name, mine, overheads in _by_strategy(runs):

        def med(key: str, rows: list[dict[str, Any]] = mine) -> Any:
            values = [r[key] for r in rows if r.get(key) is not None]
            return statistics.median(values) if values else None

        out[name] = {
            "overhead": statistics.median(overheads),
            "overheads": overheads,
            "mean_step_seconds": med("mean_step_seconds"),
            "stall_per_checkpoint_seconds": statistics.median(
                r["stall_seconds"] / r["checkpoints"] if r["checkpoints"] else 0.0 for r in mine
            ),
            "bytes_per_step": med("bytes_per_step"),
            "peak_host_bytes": max(r["peak_host_bytes"] for r in mine),
            "peak_device_bytes": med("peak_device_bytes"),
            "recovery_seconds_disk": med("recovery_seconds_disk"),
            "recovery_seconds_memory": med("recovery_seconds_memory"),
            "recovery_bytes_read": med("recovery_bytes_read"),
            "recovery_gb_per_s": _rate(mine),
            **_peak_extra(mine),
            "lost_steps_software": max(r["lost_steps_software"] for r in mine),
            "lost_steps_hardware": max(r["lost_steps_hardware"] for r in mine),
            "recovery_error": max((r["recovery_error"] for r in mine if r.get("recovery_error") is not None), default=None),
            "replay_seconds": next((r["replay_seconds"] for r in mine if r.get("replay_seconds")), None),
            # (the runs that checked their resume: under the GPU check, the first round's)
            "resumes_bitwise": None if not (checked := [r for r in mine if r.get("resumes_bitwise") is not None])
            else all(r["resumes_bitwise"] for r in checked),
            "resume_error": med("resume_error"),
            "rounds": len(mine),
            "setting": mine[0].get("setting"),
            "wall_seconds": med("wall_seconds"),
            **{key: med(key) for key in ("record_bytes_per_step", "end_bytes_per_step", "compressed_bytes_per_step",
                                         "agent_seconds_per_step", "copy_seconds", "hash_seconds", "persist_interval",
                                         "persisted", *CHECKFLOW_MEMORY)
               if key in mine[0]},
        }
        for key in ("bytes_per_step_per_rank", "peer_bytes_per_step_per_rank", "peer_cpu_seconds_per_step_per_rank"):
            # (several ranks: what each wrote; what each sent its buddy, and its mirroring thread's CPU time)
            if key in mine[0]:
                out[name][key] = [statistics.median(r[key][i] for r in mine) for i in range(len(mine[0][key]))]
    return out


def summarise_trainer(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per strategy, runs in a trainer: the median overhead over the same repeat's trainer alone, and
    the training thread's time inside everystep per timed step."""
    out: dict[str, dict[str, Any]] = {}
    for name, mine, overheads in _by_strategy(runs):
        out[name] = {
            "overhead": statistics.median(overheads), "overheads": overheads,
            "mean_step_seconds": statistics.median(r["mean_step_seconds"] for r in mine),
            "stall_per_step_seconds": statistics.median(r["stall_per_step_seconds"] for r in mine),
        }
    return out


def trainer_table(summary: dict[str, dict[str, Any]]) -> str:
    rows = ["| strategy | overhead | overheads per repeat | step (ms) | stall/step (ms) |", "|---|---|---|---|---|"]
    for name, s in summary.items():
        each = ", ".join(f"{o:+.1%}" for o in s["overheads"])
        rows.append(f"| {'none (the trainer alone)' if name == 'none' else name} | {_fmt(s['overhead'], 100, 1, '%')} "
                    f"| {each} | {_fmt(s['mean_step_seconds'], 1e3, 1)} "
                    f"| {_fmt(s['stall_per_step_seconds'], 1e3, 2)} |")
    return "\n".join(rows)


def _fmt(value: Any, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _resumes(s: dict[str, Any]) -> str:
    if s.get("resumes_bitwise") is None:
        return "–"
    error = s.get("resume_error")
    return "yes" if s["resumes_bitwise"] else f"no ({error:.1e})" if error is not None else "no"


def reference_spread(runs: list[dict[str, Any]]) -> float | None:
    """How much ``none``'s mean step time varied between the repeats: the largest less the smallest,
    over their median; None with fewer than two. An overhead smaller than it is not resolved."""
    times = [r["mean_step_seconds"] for r in runs if r["strategy"] == "none"]
    return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else None


def markdown_table(summary: dict[str, dict[str, Any]], spread: float | None = None) -> str:
    """The summary as a table; with ``spread`` (:func:`reference_spread`), an overhead within it is
    marked ``*``: not resolved."""
    head = ("| strategy | overhead | stall/ckpt (ms) | MiB/step | peak host MiB | recovery disk (s) "
            "| recovery mem (s) | lost steps sw/hw | recovery error | resumes bitwise | rounds | setting |")
    rows = [head, "|" + "---|" * 12]
    for name, s in summary.items():
        within = spread is not None and name != "none" and abs(s["overhead"]) < spread
        rows.append(
            f"| {name} | {_fmt(s['overhead'], 100, 1, '%')}{'*' if within else ''} "
            f"| {_fmt(s['stall_per_checkpoint_seconds'], 1e3, 1)} "
            f"| {_fmt(s['bytes_per_step'], 2**-20, 2)} | {_fmt(s['peak_host_bytes'], 2**-20, 0)} "
            f"| {_fmt(s['recovery_seconds_disk'], 1, 3)} | {_fmt(s['recovery_seconds_memory'], 1, 3)} "
            f"| {s['lost_steps_software']}/{s['lost_steps_hardware']} "
            f"| {'–' if s.get('recovery_error') is None else format(s['recovery_error'], '.2e')} "
            f"| {_resumes(s)} | {s.get('rounds', '–')} | {setting_text(s.get('setting'))} |"
        )
    return "\n".join(rows)


_SHOWN = ("every", "batch", "parts", "memory", "persist_every", "snapshot", "agent_threads", "hash_parts", "threads",
          "compress", "samples")
"""The options a table's setting column names, in this order, where a run has them (set, not None)."""


def setting_text(setting: dict[str, Any] | None) -> str:
    """A run's setting (:meth:`~everystep.strategies.base.Strategy.setting`) in a table's cell: LowDiff's
    ``every`` and ``batch`` as its paper's F and b, the others by name."""
    if not setting:
        return "–"
    names = {"every": "F", "batch": "b"} if "batch" in setting else {}
    shown = [(names.get(k, k), setting[k]) for k in _SHOWN if setting.get(k) not in (None, False)]
    return " ".join(f"{k}={'yes' if v is True else v}" for k, v in shown)


def _peak_extra(runs: list[dict[str, Any]]) -> dict[str, int | float | None]:
    """The most memory a restore took beyond what the process held, over the repeats, the bytes of a
    region's slots it mapped in that repeat (pages in memory before the restore, resident while
    mapped: counted in the peak), how long filling the rest as new memory took that process, and what
    the region lent (its pages made the process's own after the restore, counted in the peak) and how
    long making them its own took."""
    measured = [r for r in runs if r.get("recovery_peak_extra_bytes") is not None]
    most = max(measured, key=lambda r: r["recovery_peak_extra_bytes"], default={})
    return {"recovery_peak_extra_bytes": most.get("recovery_peak_extra_bytes"),
            "recovery_mapped_bytes": most.get("recovery_mapped_bytes"),
            "recovery_new_memory_seconds": most.get("recovery_new_memory_seconds"),
            "recovery_lent_bytes": most.get("recovery_lent_bytes"),
            "recovery_lent_seconds": most.get("recovery_lent_seconds")}


def recovery_reads(summary: dict[str, dict[str, Any]]) -> str:
    """What each strategy's recovery read, how fast and with how much memory above what the process
    held, and how long the process then took to fill as much memory new to it, the restore aside (what
    those pages cost on the machine), as a line (empty where no run counted its reads)."""
    parts = []
    for name, s in summary.items():
        read, rate, extra = s.get("recovery_bytes_read"), s.get("recovery_gb_per_s"), s.get("recovery_peak_extra_bytes")
        if read or extra is not None:
            said = f"{read / 2**20:.0f} MiB at {rate:.2f} GB/s" if read and rate else "reads not counted"
            mapped = s.get("recovery_mapped_bytes")
            of_it = f" ({mapped / 2**20:.0f} MiB of it the region's pages mapped)" if mapped and mapped >= 2**20 else ""
            fill, own = s.get("recovery_new_memory_seconds"), max(0, (extra or 0) - (mapped or 0))
            new = f", {own / 2**20:.0f} MiB of new memory filled alone in {fill:.3f} s" if fill is not None else ""
            lent, after = s.get("recovery_lent_bytes"), s.get("recovery_lent_seconds")
            if lent and after is not None:
                new += f", {lent / 2**20:.0f} MiB of it lent and made the process's own after the restore in {after:.3f} s"
            parts.append(f"{name} {said}" + (f", +{extra / 2**20:.0f} MiB{of_it}{new}" if extra is not None else ""))
    return "; ".join(parts)


def strategy_notes(summary: dict[str, dict[str, Any]], *, after: bool = False) -> list[str]:
    """What the bench says of some strategies besides the table: before it (``after`` False), a
    differential chain's replay, what a differential strategy writes, what each rank writes and sends
    its buddy; after it, LowDiff+'s agent's time per step and a memory tier's persist interval."""
    lines: list[str] = []
    for name, s in summary.items():
        if after and s.get("agent_seconds_per_step") is not None:
            lines.append(f"{name}'s agent applied a step in {s['agent_seconds_per_step'] * 1e3:.1f} ms (median), "
                         f"against a training step of {s['mean_step_seconds'] * 1e3:.1f} ms")
        if after and s.get("persist_interval") is not None:
            lines.append(f"{name}'s memory tier wrote the directory every {s['persist_interval']:.0f} step(s) (median; "
                         f"{s['persisted']:.0f} writes a run)")
        if not after and s.get("replay_seconds"):
            r = s["replay_seconds"]
            lines.append(f"{name} replay of the differential chain: serial {r['serial']:.3f} s, "
                         f"parallel (2 threads) {r['parallel_2_threads']:.3f} s")
        if not after and s.get("record_bytes_per_step") and s.get("compressed_bytes_per_step"):
            rec, sent = s["record_bytes_per_step"], s["compressed_bytes_per_step"]
            lines.append(f"{name} writes per step: step records {rec / 2**20:.2f} MiB = {rec / sent:.2f}× the compressed "
                         f"gradient ({sent / 2**20:.2f} MiB), end states (residuals, RNG, …) "
                         f"{s['end_bytes_per_step'] / 2**20:.2f} MiB")
    for name, s in summary.items() if not after else ():
        per_rank = s.get("bytes_per_step_per_rank")
        if per_rank and sum(per_rank):
            shares = ", ".join(f"{b / sum(per_rank):.1%}" for b in per_rank)
            lines.append(f"{name} writes per step {sum(per_rank) / 2**20:.2f} MiB over its {len(per_rank)} ranks: {shares}")
        if sent := s.get("peer_bytes_per_step_per_rank"):
            lines.append(f"{name} sends its buddy per step, by rank: {', '.join(f'{b / 2**10:.1f} KiB' for b in sent)}")
        if cpu := s.get("peer_cpu_seconds_per_step_per_rank"):
            lines.append(f"{name}'s mirroring thread, CPU time per step, by rank: "
                         f"{', '.join(f'{c * 1e3:.1f} ms' for c in cpu)}")
    return lines
