"""The ``everystep`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from .cli_args import (MIB, NOT_NEGATIVE, OPTIMIZER_NAMES, PARALLEL_NAMES, POSITIVE, RATE, SIZE, STRATEGY_NAMES, THREADS,
                       WORKLOAD_NAMES, byte_amount, comma_list, gpu_check_parts, one_line, option, preflight, step_list,
                       strategy_option, whole, whole_list)
from .errors import ConfigError, EverystepError, one_line_warnings

__all__ = ["main"]


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def cmd_train(args: argparse.Namespace) -> int:
    import time

    from .eval.kills.train import TrainConfig, run
    from .stopping import deadline_from_environment

    deadline = time.time() + args.deadline if args.deadline is not None else deadline_from_environment()
    cfg = TrainConfig(
        nproc=args.nproc, parallel=args.parallel, deadline=deadline, full_format=args.full_format, stagger=args.stagger,
        workload=args.workload, strategy=args.strategy, steps=args.steps, directory=args.dir,
        every=args.every, keep=args.keep, seed=args.seed, threads=args.threads,
        optimizer=args.optimizer, fail_at=args.fail_at, fail_mode=args.fail_mode, compress=args.compress,
        options={**({"batch": args.batch} if args.batch is not None else {}), **dict(args.option)},
        device=args.device, max_nproc=args.max_nproc, in_backward=args.in_backward,
        remote=args.remote, remote_every=args.remote_every, close_timeout=args.close_timeout,
    )
    summary = run(cfg)
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 reports
    _write_json(args.json, summary)
    ran = len(summary["losses"])
    loss = f"final loss {summary['losses'][-1]:.4f}, " if ran else ""
    world = int(os.environ.get("WORLD_SIZE", cfg.nproc))
    ranks = f" on {world} ranks" if world > 1 else ""
    print(
        f"{summary['strategy']} on {summary['workload']}{ranks}: steps {summary['first_step']}..{summary['first_step'] + ran - 1}"
        f" of {summary['steps']}, {loss}{summary['mean_step_seconds'] * 1e3:.1f} ms/step, "
        f"{summary['bytes_written'] / 2**20:.1f} MiB written, {len(summary['recoveries'])} recoveries"
    )
    for r in summary["recoveries"]:
        print(f"  failed at step {r['failed_at']}: resumed from step {r['resumed_from']} "
              f"({r['source']}, {r['recovery_seconds'] * 1e3:.1f} ms)")
    print(f"final state sha256 {summary['final_state_sha256']}")
    if summary["stopped"]:
        s = summary["stopped"]
        where = f" in {args.dir}" if args.dir else ""
        print(f"stopped early after step {s['step']} of {summary['steps']}: {s['reason']}; the final checkpoint of step "
              f"{s['step']} is{where}; run the same command again to resume")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    from .eval.kills.train import recover_run

    result = recover_run(args.dir, region=args.region)
    _write_json(args.json, result)
    found = result["state_sha256"] is not None
    print(f"step {result['step']}" + (f", state sha256 {result['state_sha256']}, from {result['source']}" if found
                                      else " (no checkpoint)"))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .storage import CheckpointDirectory

    store = CheckpointDirectory.open(args.dir, create=False, access="read")  # (before torch is imported: a wrong path is said at once)
    try:
        from .inventory import inspect_store

        rows = inspect_store(store, args.region)
    finally:
        store.close()  # (a remote's: the folder its DCP files were fetched into goes)
    print(f"{store.root}: strategy {store.marker.get('strategy')}, world size {store.marker.get('world_size')}")
    if not rows:
        print("  no checkpoints")
    for r in rows:
        status = "valid" if r["valid"] else f"INVALID: {r['reason']}"
        print(f"  {r['kind']:>6} step {r['step']:>8}  {r['bytes'] / 2**20:10.2f} MiB  {status}"
              + (f"  [{r['where']}]" if r.get("where") else ""))
    _write_json(args.json, {"directory": str(store.root), "checkpoints": rows})
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .storage import CheckpointDirectory

    store = CheckpointDirectory.open(args.dir, create=False, access="read")  # (as cmd_inspect's)
    try:
        from .inventory import inspect_store, verify_store

        rows = inspect_store(store, args.region)
        problems = verify_store(store, rows)
    finally:
        store.close()
    _write_json(args.json, {"directory": str(store.root), "problems": problems})
    for problem in problems:
        print(problem)
    count = len(rows)
    print(f"{store.root}: {count} checkpoint(s), " + (f"{len(problems)} problem(s)" if problems else "all verify"))
    return 1 if problems else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .eval.bench import command as bench

    options: dict[str, dict[str, Any]] = {"lowdiff": {"batch": args.batch}} if args.batch else {}
    for (strategy, name), value in args.option:
        if strategy not in args.strategies:
            raise EverystepError(f"--option {strategy}.{name}: {strategy!r} is not among --strategies")
        options.setdefault(strategy, {})[name] = value
    cfg = bench.BenchConfig(workload=args.workload, strategies=args.strategies, steps=args.steps, warmup=args.warmup,
                            every=args.every, repeats=args.repeats, threads=args.threads, seed=args.seed,
                            compress=args.compress, options=options, device=args.device,
                            scratch=args.scratch, in_backward=args.in_backward, trainer=args.trainer, nproc=args.nproc,
                            parallel=args.parallel, remote=args.remote, peers=args.peers, samples=args.samples,
                            memory=args.memory, full_format=args.full_format, trace=args.trace)
    if args.trainer:
        if args.region_layout or args.max_frequency or args.plot:
            raise ConfigError("--trainer takes none of --region-layout, --max-frequency, --plot")
        result = bench.report(cfg, bench.run_bench(cfg))
        print(f"{cfg.workload} in {cfg.trainer} on the CPU, {cfg.steps} steps ({cfg.warmup} warm-up), checkpoint every "
              f"{cfg.every} step(s), {cfg.repeats} interleaved repeats, {cfg.threads} training thread(s)")
        print(bench.trainer_table(result["summary"]))
        _write_json(args.json, result)
        return 0
    if args.region_layout:
        from .eval.bench.region_layout import measure_layouts

        r = measure_layouts(cfg.workload, device=cfg.device, repeats=max(cfg.repeats, 3), where=cfg.scratch)
        print(f"region write throughput, {cfg.workload}'s state ({r['bytes'] / 2**20:.1f} MiB in {r['tensors']} tensors) "
              f"from {cfg.device}, {'flushed' if r['flushed'] else 'not flushed (tmpfs)'}, median of {r['repeats']}:")
        print("| layout | seconds | GB/s |\n|---|---|---|")
        for name in ("separated", "interleaved"):
            print(f"| {name} | {r[name]['seconds']:.4f} | {r[name]['gb_per_s']:.2f} |")
        print(f"separated layout: {r['speedup']:.2f}× the interleaved one's throughput")
        _write_json(args.json, {"machine": bench.machine_info(cfg.threads), "region_layout": r})
        return 0
    if args.max_frequency:
        found = bench.max_frequency(cfg, args.budget)
        print(f"smallest checkpoint interval within {args.budget:.1%} overhead on {cfg.workload}:")
        print("| strategy | interval (steps) | overheads measured |\n|---|---|---|")
        for name, f in found.items():
            tried = ", ".join(f"{k}: {v:.1%}" for k, v in f["overheads"].items())
            print(f"| {name} | {f['interval'] if f['interval'] is not None else 'none within budget'} | {tried} |")
        _write_json(args.json, {"machine": bench.machine_info(cfg.threads), "budget": args.budget, "max_frequency": found})
        return 0
    runs = bench.run_bench(cfg)
    result = bench.report(cfg, runs)
    if cfg.remote:
        from .eval.bench.remote import upload_throughput
        from .eval.workloads import state_bytes

        result["upload_throughput"] = upload_throughput(cfg.remote, state_bytes(cfg.workload), repeats=cfg.repeats)
    ranks = f" on {cfg.nproc} ranks ({cfg.parallel})" if cfg.nproc > 1 or cfg.parallel != "ddp" else ""
    print(f"{cfg.workload} on {cfg.device}{ranks}, {cfg.steps} steps ({cfg.warmup} warm-up), checkpoint every "
          f"{cfg.every or 'default'} step(s), compression {cfg.compress or 'off'}, "
          f"{cfg.repeats} interleaved repeats, {cfg.threads} training thread(s)")
    for line in bench.strategy_notes(result["summary"]):
        print(line)
    spread = result["reference_spread"]
    print(bench.markdown_table(result["summary"], spread))
    if spread is not None:
        print(f"none's mean step varied by {spread:.1%} between its {cfg.repeats} rounds (largest less smallest, over "
              f"the median): an overhead within it (*) is not resolved")
    for line in bench.strategy_notes(result["summary"], after=True):
        print(line)
    for name, error in result["not_run"].items():
        print(f"not run: {name}: {error.strip().splitlines()[-1] if error.strip() else error}")
    if read := bench.recovery_reads(result["summary"]):
        print(f"recovery read (median; peak host memory above what the process held, most of the repeats): {read}")
    if "upload_throughput" in result:
        t = result["upload_throughput"]
        print(f"upload of {t['bytes'] / 2**20:.1f} MiB to {cfg.remote}: everystep {t['everystep_bytes_per_second'] / 1e6:.0f} "
              f"MB/s, boto3's upload_fileobj {t['boto3_bytes_per_second'] / 1e6:.0f} MB/s ({t['ratio']:.0%}; medians of "
              f"{t['repeats']}, interleaved)")
    _write_json(args.json, result)
    if cfg.trace:
        print(f"a trace of each run in {cfg.trace}/ (STRATEGY_rN.json: open it at ui.perfetto.dev)")
    if args.plot:
        bench.plot(result["summary"], args.plot, f"{cfg.workload}: checkpoint every {cfg.every or 'default'} step(s), "
                                                 f"compression {cfg.compress or 'off'}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from .eval.simulator import command

    return command.main(args)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.checkflow:
        return _plan_checkflow(args)
    if args.step_seconds is None or args.mtbf is None:
        raise ConfigError("plan needs --step-seconds and --mtbf (or --checkflow with --workload)")
    from .plan import plan

    result = plan(step_seconds=args.step_seconds, ckpt_seconds=args.ckpt_seconds, size_bytes=args.size_bytes,
                  bandwidth=args.bandwidth, mtbf_seconds=args.mtbf, load_seconds=args.load_seconds,
                  merge_seconds=args.merge_seconds)
    for line in result["lines"]:
        print(line)
    _write_json(args.json, {k: v for k, v in result.items() if k != "lines"})
    return 0


def _plan_checkflow(args: argparse.Namespace) -> int:
    from .eval.checkflow_profile import plan_workload

    if args.bandwidth is None:  # (its range, and --per-size's and --time-steps', the parser checks)
        raise ConfigError("--checkflow needs --bandwidth, the device-to-host link (e.g. 25GB/s)")
    limit = int(args.memory_limit) if args.memory_limit is not None else None
    r = plan_workload(args.workload, bandwidth=args.bandwidth, per_size=int(args.per_size), memory_limit=limit,
                      steps=args.time_steps, device=args.device, in_backward=args.in_backward, batch=args.batch)
    mib = 2**20
    print(f"Checkflow plan for {r['workload']} (batch {r['batch']}) on {r['device']}: a {r['step_seconds'] * 1e3:.1f} ms step of "
          f"{r['operators']} operators merged into {r['time_steps']} time steps; {r['checkpoint_bytes'] / mib:.1f} MiB "
          f"to checkpoint in {r['tensors']} tensors, {r['groups']} groups, {r['pieces']} pieces after {r['splits']} "
          f"split(s) of {args.per_size / MIB:g} MiB; link {args.bandwidth / 1e9:g} GB/s; solved in {r['solver_seconds']:.2f} s")
    if r["feasible"]:
        print(f"feasible: peak device memory {r['peak'] / mib:.1f} MiB, against {r['peak_checkfreq'] / mib:.1f} MiB for "
              f"CheckFreq and {r['peak_none'] / mib:.1f} MiB without checkpointing")
    else:
        print(f"infeasible: {r['reason']}")
    _write_json(args.json, r)
    if args.plot and r["feasible"]:
        from .eval.checkflow_profile import plot_schedule

        plot_schedule(r, args.plot)
    return 0 if r["feasible"] else 1


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from .eval.gpu import check as gpu_check

    if args.dry_run:
        sizes = gpu_check.DRY
    else:
        why = gpu_check.no_gpu_reason()
        if why is not None:
            print(f"gpu-check: no GPU: {why}; nothing to check (--dry-run runs the same pipeline on the CPU)")
            return 0
        sizes = gpu_check.GPU
    out = Path(args.out or ("bench-out/gpu-check" if args.dry_run else "docs/results"))
    parts = args.parts or (gpu_check.ALL_PARTS if args.dry_run else gpu_check.PARTS)
    report, json_path, md_path = gpu_check.gpu_check(sizes, out, dry_run=args.dry_run, parts=parts,
                                                     say=lambda line: print(line, file=sys.stderr, flush=True))
    failed = report["failures"]
    print(f"gpu-check: {len(failed)} failure(s) in {report['seconds']:.0f} s; report {json_path} and {md_path}")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import demo

    return demo(Path(args.dir), steps=args.steps)


class _Parser(argparse.ArgumentParser):
    """Bad arguments get one line on stderr (naming the flag) and exit status 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="everystep", description="Checkpointing every training step, with exact recovery.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a workload with a checkpointing strategy, optionally killing it")
    t.add_argument("--workload", choices=WORKLOAD_NAMES, default="gpt2-tiny")
    t.add_argument("--strategy", choices=STRATEGY_NAMES, default="checkfreq")
    t.add_argument("--steps", type=whole(1), default=20)
    t.add_argument("--dir", help="checkpoint directory (needed by every strategy but none)")
    t.add_argument("--every", type=whole(1), help="checkpoint every K steps (default: the strategy's own; 1 for full_sync "
                   "and checkfreq, 50 for lowdiff and naive_diff, from the write bandwidth for lowdiff_plus)")
    t.add_argument("--keep", type=whole(1), default=2, help="full checkpoints to keep (default 2)")
    t.add_argument("--seed", type=whole(0, 2**31 - 1), default=0)
    t.add_argument("--threads", type=THREADS, default=1, help="intra-op threads for training (default 1)")
    t.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default="adamw")
    t.add_argument("--fail-at", type=step_list, default=(), metavar="STEPS", help="kill the training during these steps, e.g. 7,19")
    t.add_argument("--fail-mode", choices=["software", "hardware"], default="software")
    t.add_argument("--compress", metavar="SPEC", help="train with gradient compression: topk:0.01, quant8 or powersgd:rank=4 "
                   "(under --nproc in DDP's communication hook)")
    t.add_argument("--batch", type=whole(1), help="lowdiff: steps per differential write (b)")
    t.add_argument("--option", type=option, action="append", default=[], metavar="NAME=VALUE",
                   help="a strategy option, e.g. verify_every=1 or grace=5 (repeatable)")
    t.add_argument("--nproc", type=whole(1), default=1, help="training processes (ranks) on this machine, each a "
                   "DistributedDataParallel replica over gloo (default 1; under torchrun its own ranks are used)")
    t.add_argument("--max-nproc", type=whole(1), metavar="N", help="the most ranks --nproc may start (default: the "
                   "cores this process may run on)")
    t.add_argument("--deadline", type=POSITIVE, metavar="SECONDS", help="stop with a final checkpoint before this many "
                   "seconds from now have passed (default: SLURM_JOB_END_TIME when set); SIGTERM and SIGUSR1 stop "
                   "the same way at any time")
    t.add_argument("--parallel", choices=PARALLEL_NAMES, default="ddp",
                   help="how the ranks hold the state: DistributedDataParallel replicas (default), FSDP2 shards "
                   "(fully_shard), HSDP (two replicas, each sharded over half the ranks; under both, full "
                   "checkpoints are in DCP's format), or ZeRO-1 (DDP with a ZeroRedundancyOptimizer)")
    t.add_argument("--full-format", choices=["safetensors", "dcp"],
                   help="how full checkpoints are stored: everystep's safetensors parts or a "
                   "torch.distributed.checkpoint directory that plain DCP calls load (the default under --parallel fsdp "
                   "or hsdp, but for lowdiff_plus)")
    t.add_argument("--remote", metavar="s3://BUCKET/PREFIX", help="also upload full checkpoints there in the background, "
                   "and resume from there when --dir has nothing as new (one process; credentials and endpoint from "
                   "the AWS chain: AWS_PROFILE, AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)")
    t.add_argument("--remote-every", type=whole(1), metavar="N", help="upload every N steps (default: Young/Daly's "
                   "interval for the measured upload time and a one-day MTBF)")
    t.add_argument("--close-timeout", type=POSITIVE, default=300.0, metavar="SECONDS", help="the most the end of "
                   "the run waits for storage before it exits with an error naming what is durable (default 300)")
    t.add_argument("--stagger", type=whole(1), metavar="K", help="at most K ranks read a checkpoint at once when they "
                   "restore (default: all)")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="train on the CPU (default) or on CUDA, a GPU per rank, with deterministic kernels")
    t.add_argument("--in-backward", action="store_true", help="update each layer during backward "
                   "(OptimizerInBackward; under --nproc once its bucket is all-reduced) instead of optimizer.step()")
    t.add_argument("--json", metavar="PATH", help="write the run summary here")
    t.set_defaults(func=cmd_train)

    r = sub.add_parser("recover", help="recover the newest valid state without training")
    r.add_argument("--dir", required=True)
    r.add_argument("--json", metavar="PATH")
    r.set_defaults(func=cmd_recover)

    i = sub.add_parser("inspect", help="list stored checkpoints and whether each verifies")
    i.add_argument("dir")
    i.add_argument("--json", metavar="PATH")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("verify", help="check every checksum in a directory; exit 1 naming each file that is wrong")
    v.add_argument("dir")
    v.add_argument("--json", metavar="PATH")
    v.set_defaults(func=cmd_verify)
    for reader in (r, i, v):  # (a reader opens no region a stored file points it to outside the directory)
        reader.add_argument("--region", metavar="PATH", help="where the run's region lies, as its region= option "
                            "said ({rank} replaced by each rank); default: the directory's and the memory tier's")

    b = sub.add_parser("bench", help="measure every strategy side by side on one workload, interleaved")
    b.add_argument("--workload", choices=[*WORKLOAD_NAMES, "native"], default="gpt2-tiny",
                   help="native: with --trainer, the trainer's own small model")
    b.add_argument("--strategies", type=comma_list, default=("none", "full_sync", "checkfreq"), help="comma-separated: "
                   "everystep strategies (NAME+memory: with its memory tier), the baselines torch_save, dcp, "
                   "dcp_async, and with the peers extra the libraries dlrover, lm_resiliency, torch_checkpointing")
    b.add_argument("--steps", type=whole(1), default=20)
    b.add_argument("--warmup", type=whole(0), default=3, help="steps left out of the timing (default 3)")
    b.add_argument("--every", type=whole(1), help="checkpoint interval for every strategy (default: each strategy's own)")
    b.add_argument("--compress", metavar="SPEC", help="gradient compression for every strategy, none included")
    b.add_argument("--batch", type=whole(1), help="lowdiff: steps per differential write")
    b.add_argument("--option", type=strategy_option, action="append", default=[], metavar="STRATEGY.NAME=VALUE",
                   help="an option of one strategy, repeatable (e.g. lowdiff_plus.layerwise=true)")
    b.add_argument("--repeats", type=whole(1), default=3)
    b.add_argument("--samples", type=whole(1), help="samples per step and rank (default: the workload's own batch); "
                   "more is a longer step over the same state")
    b.add_argument("--threads", type=THREADS, default=1)
    b.add_argument("--seed", type=whole(0, 2**31 - 1), default=0)
    b.add_argument("--max-frequency", action="store_true", help="find each strategy's smallest interval within --budget")
    b.add_argument("--budget", type=POSITIVE, default=0.035, help="overhead budget for --max-frequency (default 0.035)")
    b.add_argument("--region-layout", action="store_true", help="write throughput of lightcheck's region layout "
                   "against metadata interleaved with data, on the workload's state")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every run trains (default cpu)")
    b.add_argument("--nproc", type=whole(1), default=1, help="ranks per run, processes on this machine on a group over "
                   "loopback (default 1); each rank's bytes written are reported")
    b.add_argument("--parallel", choices=PARALLEL_NAMES, default="ddp",
                   help="how the ranks hold the state, as for train (default ddp)")
    b.add_argument("--full-format", choices=["safetensors", "dcp"], help="how every everystep strategy that stores "
                   "writes its full checkpoints, as for train (default: each strategy's own, dcp under fsdp or hsdp)")
    b.add_argument("--remote", metavar="s3://BUCKET/PREFIX", help="also run each strategy that stores with the remote "
                   "tier on (as STRATEGY+remote), and compare the upload throughput with boto3's own upload")
    b.add_argument("--peers", action="store_true", help="also run each strategy that mirrors to peers with peers=True "
                   "(as STRATEGY+peers), each rank counted as a host of its own; the bytes each rank sends per step "
                   "are reported (needs --nproc 2 or more)")
    b.add_argument("--memory", action="store_true", help="also run each strategy that writes the whole state with "
                   "its memory tier (memory=True, as STRATEGY+memory): every checkpoint into memory, the directory at "
                   "the interval the disk takes")
    b.add_argument("--scratch", default=None, help="where each run's checkpoint directory is made (default: the "
                   "temporary directory); /dev/shm keeps lightcheck's region in memory")
    b.add_argument("--in-backward", action="store_true", help="every run updates each layer during backward "
                   "(OptimizerInBackward) instead of optimizer.step()")
    b.add_argument("--trainer", choices=["lightning", "transformers"], help="train in PyTorch Lightning or the Hugging "
                   "Face Trainer, checkpointed by everystep's integration (none: the trainer alone); every step "
                   "unless --every")
    b.add_argument("--json", metavar="PATH")
    b.add_argument("--plot", metavar="PATH", help="write a PNG figure")
    b.add_argument("--trace", metavar="DIR", help="write a Chrome/Perfetto trace of each run there (STRATEGY_rN.json: "
                   "its steps, everystep's calls and threads, its helper processes; open it at ui.perfetto.dev)")
    b.set_defaults(func=cmd_bench)

    sm = sub.add_parser("simulate", help="wasted time of a long job under failures: Monte Carlo and analytic")
    sm.add_argument("--from-bench", metavar="JSON", help="per-strategy costs measured by `everystep bench --json`")
    sm.add_argument("--strategy", action="append", default=[], metavar="NAME:STEP_S:BASE_S:INTERVAL:LAG:RECOVERY_S",
                    help="costs given by hand; repeatable")
    sm.add_argument("--mtbf", type=POSITIVE, default=3600.0, help="mean time between failures of one GPU, seconds")
    sm.add_argument("--gpus", type=whole_list, default=(1,), help="GPU counts; the job's MTBF is --mtbf divided by each")
    sm.add_argument("--mtbf-sweep", type=whole_list, default=(), help="MTBF values (s) for the ratio-against-MTBF figure")
    sm.add_argument("--job-steps", type=whole(1), default=10_000)
    sm.add_argument("--trials", type=whole(1), default=200)
    sm.add_argument("--seed", type=whole(0, 2**31 - 1), default=0)
    sm.add_argument("--json", metavar="PATH")
    sm.add_argument("--plot", metavar="PATH", help="PNG: ratio against MTBF and against GPUs")
    sm.set_defaults(func=cmd_simulate)

    pl = sub.add_parser("plan", help="optimal checkpoint interval (Young/Daly) and LowDiff's (F*, b*); with "
                        "--checkflow, Checkflow's snapshot and offload schedule for a workload")
    pl.add_argument("--step-seconds", type=POSITIVE)
    pl.add_argument("--ckpt-seconds", type=POSITIVE, help="training stall per full checkpoint")
    pl.add_argument("--size-bytes", type=SIZE, metavar="SIZE", help="full checkpoint size, e.g. 3GB or 3e9 (with "
                    "--bandwidth, instead of --ckpt-seconds)")
    pl.add_argument("--bandwidth", type=RATE, metavar="RATE", help="write bandwidth, e.g. 1GB/s, 500MB/s or 1e9 "
                    "(bytes/s)")
    pl.add_argument("--mtbf", type=POSITIVE, help="mean time between failures, seconds")
    pl.add_argument("--load-seconds", type=NOT_NEGATIVE, default=0.0)
    pl.add_argument("--merge-seconds", type=POSITIVE, help="time to merge one batched differential (LowDiff)")
    pl.add_argument("--checkflow", action="store_true", help="profile one step of --workload and plan Checkflow's "
                    "snapshots and offloads (--bandwidth: the device-to-host link, e.g. 25GB/s)")
    pl.add_argument("--workload", choices=WORKLOAD_NAMES, default="gpt2-small")
    pl.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    pl.add_argument("--in-backward", action="store_true", help="updates in backward (each layer's own deadline)")
    pl.add_argument("--batch", type=whole(1), help="samples per step (default: the workload's own)")
    pl.add_argument("--plot", metavar="PATH", help="draw the schedule (a PNG): memory per time step, offloads")
    pl.add_argument("--memory-limit", type=byte_amount(rate=False, unit=MIB), metavar="SIZE", help="device memory limit, "
                    "e.g. 80GiB (a bare number: MiB; relaxed if it cannot be met)")
    pl.add_argument("--per-size", type=byte_amount(rate=False, unit=MIB, least=64), default=16 * MIB, metavar="SIZE",
                    help="the pieces a tensor is split into when the link cannot move it in one time step, e.g. 4MiB "
                    "(a bare number: MiB; default 16MiB)")
    pl.add_argument("--time-steps", type=whole(2), default=48, help="operators are merged into at most about this many "
                    "time steps (default 48)")
    pl.add_argument("--json", metavar="PATH")
    pl.set_defaults(func=cmd_plan)

    g = sub.add_parser("gpu-check", help="everything a GPU must show, in one command of about 9 minutes: the CUDA "
                       "tests, device-to-host bandwidth, the every-step bench, LightCheck's highest frequency, "
                       "Checkflow's memory; a report in JSON and Markdown")
    g.add_argument("--dry-run", action="store_true", help="the same pipeline on the CPU with a tiny workload, in about "
                   "a minute (the report under bench-out/gpu-check)")
    g.add_argument("--out", metavar="DIR", help="where the report goes (default docs/results; bench-out/gpu-check "
                   "with --dry-run)")
    g.add_argument("--parts", type=gpu_check_parts, default=None, metavar="PARTS",
                   help="comma-separated, some of tests,bandwidth,bench,bound,frequency,regime (default all but "
                   "tests, the CUDA tests, and regime, GoCkpt on a state that takes several steps to copy, each a "
                   "call of its own; --dry-run: all; memory comes with bench)")
    g.set_defaults(func=cmd_gpu_check)

    d = sub.add_parser("demo", help="train gpt2-tiny, kill it twice, recover, and compare with an uninterrupted run")
    d.add_argument("--dir", default="demo-out")
    d.add_argument("--steps", type=whole(1), default=30)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            one_line_warnings()
            preflight(args)
            return int(args.func(args))
    except EverystepError as e:
        print(f"everystep: error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or folder that cannot be read or written: the system's own words
        where = f": {e.filename}" if e.filename and str(e.filename) not in str(e.strerror) else ""
        print(f"everystep: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("everystep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
