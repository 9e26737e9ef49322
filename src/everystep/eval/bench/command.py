"""``everystep bench``: every strategy on one workload, in one invocation, interleaved.

Each (repeat, strategy) run is a fresh process (clean memory peaks, no state carried over; on Linux
forked from a process that only imported, :func:`measure_run`);
repeat r runs the strategies in an order rotated by r, so that drift in the machine's speed hits
every strategy alike. Overhead is each run's mean step time over the same repeat's ``none`` run,
minus one; the reported figure is the median over repeats.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ... import tracing
from ...distributed import free_port
from ...errors import ConfigError, EverystepError
from ...strategies import STRATEGIES, full_format_refusal
from .table import markdown_table, recovery_reads, reference_spread, strategy_notes, summarise, summarise_trainer, trainer_table
from .measure import base_strategy
from .libraries import ALL_BASELINES, LIBRARIES
from ..workloads import LAYOUT_OF, WORKLOADS, check_device
from ..plotting import pyplot
from ..kills.run_config import check_layout
from ..zygote import Zygote, shared

__all__ = ["BenchConfig", "run_bench", "summarise", "summarise_trainer", "markdown_table", "trainer_table", "recovery_reads",
           "strategy_notes",
           "smallest_interval", "interleaved_order", "run_spec", "measure_run", "reference_spread"]


@dataclass(kw_only=True)
class BenchConfig:
    workload: str = "gpt2-tiny"
    strategies: tuple[str, ...] = ("none", "full_sync", "checkfreq")
    steps: int = 20
    warmup: int = 3
    every: int | None = None
    """Checkpoint interval for every strategy; None leaves each its default (F = 50 for differentials)."""
    repeats: int = 3
    threads: int = 1
    seed: int = 0
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    compress: str | None = None
    """Gradient compression for every strategy, the ``none`` reference included."""
    device: str = "cpu"
    """``cpu`` or ``cuda``: where every run trains."""
    scratch: str | None = None
    """Where each run's checkpoint directory is made (None: the system's temporary directory);
    ``/dev/shm`` keeps lightcheck's region, which lies in that directory by default, in memory."""
    in_backward: bool = False
    """Every run updates each layer during backward (:class:`~everystep.OptimizerInBackward`)."""
    trainer: str | None = None
    """``lightning`` or ``transformers``: every run trains in that trainer, checkpointed by everystep's
    integration (:mod:`everystep.eval.bench.trainers`); ``none`` is the trainer alone."""
    nproc: int = 1
    """Ranks per run (processes on this machine, a gloo or NCCL group on loopback)."""
    full_format: str | None = None
    """``safetensors`` or ``dcp``: how every everystep strategy that stores writes its full
    checkpoints (None: each strategy's own default for the layout)."""
    remote: str | None = None
    """An ``s3://bucket/prefix``: each everystep strategy that stores is also run with the remote tier
    on (as ``<strategy>+remote``, each run under a prefix of its own there)."""
    parallel: str = "ddp"
    """How the ranks hold the state: ``ddp``, ``fsdp``, ``hsdp`` or ``zero1`` (:data:`~.workloads.LAYOUT_OF`)."""
    samples: int | None = None
    """Samples per step and rank (None: the workload's own batch): a larger batch is a longer step
    over the same state."""
    memory: bool = False
    """Each strategy that writes the whole state is also run with its memory tier (``memory=True``,
    as ``<strategy>+memory``): every checkpoint into memory, the directory at the interval the disk takes."""
    peers: bool = False
    """Each strategy that mirrors to peers is also run with ``peers=True`` (as ``<strategy>+peers``),
    every rank counted as a host of its own, so that each mirrors its own part to another."""
    trace: str | None = None
    """A folder: each run writes a Chrome/Perfetto trace there, ``STRATEGY_rN.json``
    (:mod:`everystep.tracing`): its steps, everystep's calls and threads, its helper processes."""

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.trainer is not None:
            self._check_trainer()
        elif self.workload not in WORKLOADS:
            raise ConfigError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        unknown = [s for s in self.strategies if s not in STRATEGIES and s not in ALL_BASELINES
                   and not (s.endswith("+memory") and s[:-7] in STRATEGIES and STRATEGIES[s[:-7]].takes_memory)]
        if unknown:
            raise ConfigError(f"unknown strategies {', '.join(unknown)}; choose from {', '.join(sorted(STRATEGIES))} "
                              f"(NAME+memory: with its memory tier, for those that take one) or the baselines "
                              f"{', '.join(ALL_BASELINES)}")
        if "none" not in self.strategies:
            self.strategies = ("none", *self.strategies)
        if self.steps <= self.warmup:
            raise ConfigError(f"--steps ({self.steps}) must exceed the warm-up steps ({self.warmup})")
        if self.repeats < 1 or (self.every is not None and self.every < 1) or self.threads < 1 \
                or (self.samples is not None and self.samples < 1):
            raise ConfigError("--repeats, --every, --threads and --samples must be at least 1")
        baselines = [s for s in self.strategies if s in ALL_BASELINES]
        if baselines and self.every and self.steps % self.every:
            raise ConfigError(f"--steps ({self.steps}) must be a multiple of --every ({self.every}) for the baselines "
                              f"({', '.join(baselines)}): their check restores the last step, which they save "
                              "only at a multiple of --every")
        if self.in_backward:
            self._check_in_backward()
        if self.nproc != 1 or self.parallel != "ddp":
            self._check_ranks()
        needs = [s for s in self.strategies if s in STRATEGIES and STRATEGIES[s].needs_compression] \
            if self.trainer is None else []
        if needs and not self.compress:
            raise ConfigError(f"{', '.join(needs)} reuses compressed gradients: give --compress (applied to every "
                              "strategy)")
        if self.full_format is not None:
            self._set_full_format()
        if self.remote is not None:
            self._add_remote()
        if self.peers:
            self._add_peers()
        if self.memory:
            self._add_memory()
        if self.trace is not None and self.trainer is not None:
            raise ConfigError("--trace traces the bench's own training loop: it takes no --trainer")

    def _check_trainer(self) -> None:
        from .trainers import TRAINER_WORKLOADS, TRAINERS

        if self.trainer not in TRAINERS:
            raise ConfigError(f"--trainer must be one of {', '.join(TRAINERS)}, got {self.trainer!r}")
        if self.workload not in TRAINER_WORKLOADS:
            raise ConfigError(f"--trainer runs the workloads {', '.join(TRAINER_WORKLOADS)} (native: the trainer's own "
                              f"small model), not {self.workload!r}")
        unable = [s for s in self.strategies if s not in STRATEGIES or not STRATEGIES[s].needs_store and s != "none"]
        if unable or self.compress or self.in_backward or self.device != "cpu" or self.options or self.samples \
                or self.full_format:
            raise ConfigError("--trainer compares everystep strategies on the CPU, without --compress, --in-backward, "
                              "--option, --samples, --full-format or peers"
                              f"{' (not ' + ', '.join(unable) + ')' if unable else ''}")
        if self.every is None:
            self.every = 1  # what the integrations are for

    def _set_full_format(self) -> None:
        """Give every everystep strategy that stores ``full_format`` (a Checkpointer argument, passed
        as its options are)."""
        stores = [s for s in self.strategies if s in STRATEGIES and STRATEGIES[s].needs_store]
        refusal = full_format_refusal(stores, self.full_format, "drop --full-format, or those strategies from --strategies")
        if refusal:
            raise ConfigError(refusal)
        for s in stores:
            self.options[s] = {**self.options.get(s, {}), "full_format": self.full_format}

    def _add_remote(self) -> None:
        from ...storage.stores import parse_url

        try:
            parse_url(self.remote or "")
        except ValueError as e:
            raise ConfigError(f"--remote: {e}") from None
        if self.trainer is not None:
            raise ConfigError("--remote takes no --trainer")
        tiered = [s for s in self.strategies if s in STRATEGIES and STRATEGIES[s].needs_store]
        if not tiered:
            raise ConfigError("--remote needs an everystep strategy that stores checkpoints among --strategies")
        self.strategies = (*self.strategies, *(f"{s}+remote" for s in tiered if f"{s}+remote" not in self.strategies))

    def _add_peers(self) -> None:
        if self.nproc < 2:
            raise ConfigError("--peers mirrors each rank's state to another rank: give --nproc 2 or more")
        able = [s for s in self.strategies if s in STRATEGIES and STRATEGIES[s].mirrors_to_peers]
        if not able:
            mirroring = ", ".join(sorted(s for s, cls in STRATEGIES.items() if cls.mirrors_to_peers))
            raise ConfigError(f"--peers needs a strategy that mirrors to peers among --strategies ({mirroring})")
        self.strategies = (*self.strategies, *(f"{s}+peers" for s in able if f"{s}+peers" not in self.strategies))

    def _add_memory(self) -> None:
        able = [s for s in self.strategies if s in STRATEGIES and STRATEGIES[s].takes_memory]
        if not able:
            taking = ", ".join(sorted(s for s, cls in STRATEGIES.items() if cls.takes_memory))
            raise ConfigError(f"--memory needs a strategy that writes the whole state among --strategies ({taking})")
        if self.nproc != 1 or self.trainer is not None:
            raise ConfigError("--memory runs one training process, without --trainer")
        self.strategies = (*self.strategies, *(f"{s}+memory" for s in able if f"{s}+memory" not in self.strategies))

    def _check_ranks(self) -> None:
        """Several ranks, or a sharded layout: what each run can be, before any starts."""
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {self.nproc}")
        if self.parallel not in LAYOUT_OF:
            raise ConfigError(f"--parallel must be one of {', '.join(LAYOUT_OF)}, got {self.parallel!r}")
        check_device(self.device, self.nproc)
        if self.trainer is not None:
            raise ConfigError("--trainer runs one process: it takes no --nproc or --parallel")
        check_layout(self.parallel, self.strategies, compress=self.compress, in_backward=self.in_backward,
                     others=", or the baselines dcp, dcp_async")
        if self.nproc > 1 and "torch_save" in self.strategies:
            raise ConfigError("--nproc: torch_save writes one process's state_dict to one file; under several ranks "
                              "compare with dcp or dcp_async, which every rank writes")
        libraries = [s for s in self.strategies if s in LIBRARIES]
        if self.nproc > 1 and libraries:
            raise ConfigError(f"--nproc: the libraries {', '.join(libraries)} run in one process here")

    def _check_in_backward(self) -> None:
        if self.compress:
            raise ConfigError("--in-backward takes no --compress (updates in backward train dense)")
        unable = [s for s in self.strategies if s in ALL_BASELINES or not STRATEGIES[s].layer_updates]
        if unable:
            raise ConfigError(f"--in-backward cannot run {', '.join(unable)}: they read the gradients after the "
                              "update, or call optimizer.step() themselves")


def interleaved_order(strategies: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, strategy) pairs; repeat r starts r places further along the list."""
    n = len(strategies)
    return [(r, strategies[(r + i) % n]) for r in range(repeats) for i in range(n)]


def run_spec(cfg: BenchConfig, repeat: int, strategy: str, every: int | None) -> dict[str, Any]:
    """What one (repeat, strategy) run of ``cfg`` is told: the argument of its measuring process."""
    return {
        "trainer": cfg.trainer, "workload": cfg.workload, "strategy": strategy, "steps": cfg.steps, "warmup": cfg.warmup,
        "every": every, "threads": cfg.threads, "seed": cfg.seed, "repeat": repeat,
        "options": cfg.options.get(base_strategy(strategy), {}), "compress": cfg.compress, "device": cfg.device,
        "scratch": cfg.scratch, "in_backward": cfg.in_backward, "nproc": cfg.nproc, "parallel": cfg.parallel,
        "remote": cfg.remote, "samples": cfg.samples,
        "trace": None if cfg.trace is None else str(tracing.run_stem(cfg.trace, strategy, repeat)),
    }


def measure_run(spec: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
    """Measure one run in a process of its own and return what it reports. A run that fails raises
    :class:`EverystepError` with its output's end; one still running after ``timeout`` seconds is
    killed, with whatever it started (a process group of its own). Its trace (``spec["trace"]``), in
    parts one per process, is merged into one file once it has ended, whatever its end.

    On Linux each run is forked from a process that imported torch and the run's module once and ran
    nothing (:mod:`everystep.eval.zygote`): a new process in all but the imports, which a fresh
    interpreter spends seconds on; elsewhere each run is a new interpreter."""
    try:
        return _measure_run(spec, timeout)
    finally:
        if spec.get("trace"):
            tracing.merge(spec["trace"])


def _measure_run(spec: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    module = "everystep.eval.bench.trainers" if spec.get("trainer") else "everystep.eval.bench.measure"
    zygote = shared(f"{module}:forked")
    if spec.get("nproc", 1) > 1:
        return _ranks_run(zygote, module, spec, env, timeout)
    if zygote is not None:
        return _forked_run(zygote, spec, env, timeout)
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:  # the time box passed, or the user interrupted: nothing is left running
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise EverystepError(f"benchmark run of {spec['strategy']} was still running after {timeout:.0f} s "
                                 "and was stopped") from None
        raise
    if proc.returncode != 0:
        raise EverystepError(f"benchmark run of {spec['strategy']} failed:\n{err.strip()[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _forked_run(zygote: Zygote, spec: dict[str, Any], env: dict[str, str], timeout: float | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="everystep-run-") as tmp:
        report, output = os.path.join(tmp, "report.json"), os.path.join(tmp, "output.txt")
        child = zygote.fork(env, [json.dumps(spec), report, output])
        try:
            code = child.wait_for(timeout)
        except BaseException:  # interrupted: nothing is left running
            _kill_group(child.pid)
            raise
        if code is None:
            _kill_group(child.pid)
            child.wait()
            raise EverystepError(f"benchmark run of {spec['strategy']} was still running after {timeout:.0f} s "
                                 "and was stopped")
        if code != 0 or not os.path.exists(report):
            with open(output, errors="replace") as f:
                raise EverystepError(f"benchmark run of {spec['strategy']} failed:\n{f.read().strip()[-4000:]}")
        with open(report) as f:
            return json.loads(f.read())


def _ranks_run(zygote: Zygote | None, module: str, spec: dict[str, Any], env: dict[str, str],
               timeout: float | None) -> dict[str, Any]:
    """One run of ``spec["nproc"]`` ranks, each forked (or, without a zygote, started) with its rank in
    the environment, on a group over loopback and a scratch folder they share; rank 0's report, with
    what each rank wrote (``bytes_per_step_per_rank``; ``bytes_per_step``: all of them). A rank that
    fails ends the others."""
    world = spec["nproc"]
    with tempfile.TemporaryDirectory(prefix="everystep-run-") as tmp, \
            tempfile.TemporaryDirectory(prefix="everystep-bench-", dir=spec.get("scratch")) as shared:
        job = {**spec, "shared": shared}
        base = {**env, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        reports = [os.path.join(tmp, f"report-{r}.json") for r in range(world)]
        outputs = [os.path.join(tmp, f"output-{r}.txt") for r in range(world)]
        ranks: list[Any] = []
        try:
            for r in range(world):
                rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
                if spec["strategy"].endswith("+peers"):
                    rank_env["EVERYSTEP_HOST"] = f"bench host {r}"  # (each rank a host: each mirrors to another)
                argv = [json.dumps(job), reports[r], outputs[r]]
                ranks.append(zygote.fork(rank_env, argv) if zygote is not None else subprocess.Popen(
                    [sys.executable, "-c", f"import sys; from {module} import forked; sys.exit(forked(sys.argv[1:]))",
                     *argv], env=rank_env, start_new_session=True))
            codes = _wait_ranks(ranks, timeout)
        finally:
            for child in ranks:  # (a rank still running: interrupted, or its peer failed)
                _kill_group(child.pid)
        failed = [r for r, code in enumerate(codes) if code is not None and (code != 0 or not os.path.exists(reports[r]))]
        if failed:
            with open(outputs[failed[0]], errors="replace") as f:
                raise EverystepError(f"benchmark run of {spec['strategy']} failed on rank {failed[0]}:\n"
                                     f"{f.read().strip()[-4000:]}")
        if None in codes:
            raise EverystepError(f"benchmark run of {spec['strategy']} on {world} ranks was still running after "
                                 f"{timeout or 0:.0f} s and was stopped")
        found = []
        for path in reports:
            with open(path) as f:
                found.append(json.loads(f.read()))
    per_rank = [r["bytes_per_step"] for r in found]
    extra = {f"{key}_per_rank": [r[key] for r in found] for key in ("peer_bytes_per_step", "peer_cpu_seconds_per_step")
             if found[0].get(key) is not None}
    return {**found[0], "bytes_per_step": sum(per_rank), "bytes_per_step_per_rank": per_rank, **extra}


def _wait_ranks(ranks: list[Any], timeout: float | None) -> list[int | None]:
    """Each rank's exit status (None: still running), once every rank has ended, one has failed (the
    others, waiting for it in a collective, are then ended by the caller), or ``timeout`` passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    codes: list[int | None] = [None] * len(ranks)
    while None in codes:
        for r, child in enumerate(ranks):
            if codes[r] is None:
                codes[r] = child.poll()
        if any(c not in (None, 0) for c in codes) or (deadline is not None and time.monotonic() > deadline):
            return codes
        time.sleep(0.05)
    return codes


def _kill_group(pid: int) -> None:
    """Kill a run and whatever it started (its session's process group), unless it has ended."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_one(cfg: BenchConfig, repeat: int, strategy: str, every: int | None) -> dict[str, Any]:
    return measure_run(run_spec(cfg, repeat, strategy, every))


def run_bench(cfg: BenchConfig, *, progress: bool = True) -> list[dict[str, Any]]:
    """Every (repeat, strategy) run of ``cfg``, interleaved (:func:`interleaved_order`); with
    ``cfg.trace``, each one's trace in that folder."""
    order = interleaved_order(cfg.strategies, cfg.repeats)
    runs: list[dict[str, Any]] = []
    what = f"{cfg.trainer} {cfg.workload}" if cfg.trainer else cfg.workload
    failed: dict[str, str] = {}
    try:
        for repeat, strategy in tqdm(order, desc=f"bench {what}", disable=None if progress else True):
            if strategy in failed:
                continue
            try:
                runs.append(_run_one(cfg, repeat, strategy, cfg.every))
            except EverystepError as e:
                if strategy not in LIBRARIES:
                    raise
                failed[strategy] = str(e)  # (a library that cannot run here: said, not dropped)
                runs.append({"strategy": strategy, "repeat": repeat, "not_run": str(e)})
    finally:
        if cfg.trace is not None:
            tracing.merge_all(cfg.trace)  # (what helpers that outlived their run wrote since)
    return runs


def machine_info(threads: int) -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "training_threads": threads,
    }


def smallest_interval(overhead_at: Callable[[int], float], budget: float, candidates: Sequence[int]) -> int | None:
    """The first interval in ascending ``candidates`` whose measured overhead is within ``budget``."""
    for k in sorted(candidates):
        if overhead_at(k) <= budget:
            return k
    return None


def max_frequency(cfg: BenchConfig, budget: float, candidates: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> dict[str, Any]:
    """For each strategy, the smallest checkpoint interval (steps) with overhead within ``budget``."""
    found: dict[str, Any] = {}
    for strategy in cfg.strategies:
        if strategy == "none":
            continue
        trials: dict[int, float] = {}

        def overhead_at(k: int, strategy: str = strategy, trials: dict[int, float] = trials) -> float:
            runs = []
            for repeat, name in interleaved_order(("none", strategy), cfg.repeats):
                runs.append(_run_one(cfg, repeat, name, k))
            trials[k] = summarise(runs)[strategy]["overhead"]
            return trials[k]

        found[strategy] = {"interval": smallest_interval(overhead_at, budget, candidates), "overheads": trials}
    return found


def plot(summary: dict[str, dict[str, Any]], path: str, title: str) -> None:
    plt = pyplot()

    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    series = [
        ("overhead over none (%)", [100 * summary[n]["overhead"] for n in names]),
        ("MiB written per step", [summary[n]["bytes_per_step"] / 2**20 for n in names]),
        ("recovery from disk (s)", [summary[n]["recovery_seconds_disk"] or 0 for n in names]),
    ]
    for ax, (label, values) in zip(axes, series):
        ax.bar(names, values, color="#4c72b0")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(cfg: BenchConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench's result: the summary of the runs that ran, and ``not_run``, each library that could
    not run here with its own error (:func:`run_bench`)."""
    not_run = {r["strategy"]: r["not_run"] for r in runs if "not_run" in r}
    runs = [r for r in runs if r["strategy"] not in not_run]
    summary = summarise_trainer(runs) if cfg.trainer else summarise(runs)
    return {"machine": machine_info(cfg.threads), "config": asdict(cfg), "summary": summary,
            "reference_spread": reference_spread(runs), "runs": runs, "not_run": not_run}
