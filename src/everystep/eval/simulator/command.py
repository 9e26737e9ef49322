"""The ``everystep simulate`` command: costs in, wasted-time tables and figures out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .model import StrategyCosts, analytic_ratio, simulate
from ..plotting import pyplot

__all__ = ["main", "costs_from_bench", "parse_costs"]


def parse_costs(spec: str) -> StrategyCosts:
    parts = spec.split(":")
    if len(parts) != 6:
        raise ConfigError(f"--strategy takes NAME:STEP_S:BASE_S:INTERVAL:LAG:RECOVERY_S; got {spec!r}")
    name, step, base, interval, lag, rec = parts
    try:
        return StrategyCosts(name=name, step_seconds=float(step), base_step_seconds=float(base),
                             interval=int(interval), lag=int(lag), recovery_seconds=float(rec))
    except ValueError as e:
        raise ConfigError(f"--strategy {spec!r}: {e}") from None


def costs_from_bench(report: dict[str, Any]) -> list[StrategyCosts]:
    """Costs measured by ``everystep bench``: the lag is what a hardware failure lost beyond the interval."""
    every = report["config"]["every"] or 1
    summary = report["summary"]
    base = summary["none"]["mean_step_seconds"]
    out = []
    for name, s in summary.items():
        if name == "none":
            continue
        interval = every
        out.append(StrategyCosts(
            name=name, step_seconds=base * (1 + s["overhead"]), base_step_seconds=base, interval=interval,
            lag=max(0, s["lost_steps_hardware"] - interval), recovery_seconds=s["recovery_seconds_disk"] or 0.0,
        ))
    return out


def main(args: argparse.Namespace) -> int:
    costs = [parse_costs(s) for s in args.strategy]
    if args.from_bench:
        try:
            costs += costs_from_bench(json.loads(Path(args.from_bench).read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"--from-bench {args.from_bench} is not a report of `everystep bench --json` "
                              f"({type(e).__name__}: {e})") from None
    if not costs:
        raise ConfigError("give --from-bench JSON or at least one --strategy")
    rows = []
    for c in costs:
        for gpus in args.gpus:
            mtbf = args.mtbf / gpus
            mc = simulate(c, mtbf_seconds=mtbf, job_steps=args.job_steps, trials=args.trials, seed=args.seed)
            rows.append({"strategy": c.name, "gpus": gpus, "mtbf_seconds": mtbf, "monte_carlo": mc["effective_ratio"],
                         "analytic": analytic_ratio(c, mtbf_seconds=mtbf), "failures": mc["mean_failures"]})
    print(f"effective training-time ratio, {args.job_steps} steps, {args.trials} Monte Carlo trials")
    print("| strategy | GPUs | job MTBF (s) | Monte Carlo | analytic | failures |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['gpus']} | {r['mtbf_seconds']:.0f} | {r['monte_carlo']:.4f} | {r['analytic']:.4f} "
              f"| {r['failures']:.1f} |")
    sweep = []
    for mtbf in args.mtbf_sweep:
        for c in costs:
            mc = simulate(c, mtbf_seconds=mtbf, job_steps=args.job_steps, trials=args.trials, seed=args.seed)
            sweep.append({"strategy": c.name, "mtbf_seconds": mtbf, "monte_carlo": mc["effective_ratio"],
                          "analytic": analytic_ratio(c, mtbf_seconds=mtbf)})
    if args.json:
        Path(args.json).write_text(json.dumps({"costs": [_asdict(c) for c in costs],
                                               "by_gpus": rows, "by_mtbf": sweep}, indent=1) + "\n")
    if args.plot:
        _plot(rows, sweep, args.plot)
    return 0


def _asdict(c: StrategyCosts) -> dict[str, Any]:
    return {f: getattr(c, f) for f in c.__slots__}


def _plot(rows: list[dict[str, Any]], sweep: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, data, key, label in ((axes[0], sweep, "mtbf_seconds", "MTBF (s)"), (axes[1], rows, "gpus", "GPUs")):
        for name in dict.fromkeys(r["strategy"] for r in data):
            pts = sorted((r[key], r["monte_carlo"], r["analytic"]) for r in data if r["strategy"] == name)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            line = ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{name}")[0]
            ax.plot(xs, [p[2] for p in pts], linestyle="--", color=line.get_color())
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("effective training-time ratio")
        ax.legend(fontsize=8)
    axes[0].set_title("against MTBF (solid: Monte Carlo, dashed: analytic)")
    axes[1].set_title("against GPUs (job MTBF = MTBF / GPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
