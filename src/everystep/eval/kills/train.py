"""The training driver behind ``everystep train``: one loop, optional failures, crash-restart.

A run with failures is supervised: the loop runs in a child process that kills itself (SIGKILL)
during each planned step, and the supervisor starts a fresh child that recovers and goes on,
until every step is done. Each child appends to a journal (JSON lines) that survives its death;
the summary takes each step's loss from that step's last execution.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ...checkpointer import Checkpointer
from ...distributed import Ranks, free_port, init_process_group
from ...errors import CheckpointDirectoryError, ConfigError, DirectoryInUseError, EverystepError, one_line_warnings
from ...storage import MARKER, CheckpointDirectory
from ...storage.region import on_volatile_memory, memory_path, memory_place, region_path
from ...storage.remote import RemoteConfig
from ...strategies import STRATEGIES
from .faults import FailurePlan, Injector
from ..workloads import build, needs_ddp
from ..._process import die_with
from ..zygote import Forked, Zygote, shared
from .recovering import recover_run, training_state_hash
from .run_config import TrainConfig
from .summary import merge_ranks, summarise

__all__ = ["TrainConfig", "train", "run_supervised", "training_state_hash", "recover_run"]


def run_record(cfg: TrainConfig) -> dict[str, Any]:
    """What ``everystep recover`` needs to rebuild the live objects a differential chain replays into."""
    return {"workload": cfg.workload, "optimizer": cfg.optimizer, "seed": cfg.seed, "compress": cfg.compress,
            "every": cfg.every, "keep": cfg.keep, "options": cfg.options, "full_format": cfg.full_format,
            "device": cfg.device, "in_backward": cfg.in_backward, "parallel": cfg.parallel}


def preflight(cfg: TrainConfig, world: int, *, owner: bool = True) -> None:
    """Refuse, before any process starts or anything is written, a directory this run cannot go
    on with: another process writes there (with ``owner``; under torchrun the job's own rank 0 may
    already hold it, and its open refuses another), another strategy or world size wrote it, or it
    is already past ``cfg.steps``."""
    if cfg.directory is None or not STRATEGIES[cfg.strategy].needs_store or not (Path(cfg.directory) / MARKER).exists():
        return
    pid = CheckpointDirectory.owner(cfg.directory) if owner else None
    if pid is not None:
        raise DirectoryInUseError.of(cfg.directory, pid, "wait for it to end or choose another --dir")
    store = CheckpointDirectory.open(cfg.directory, create=False, access="read")
    try:
        written, strategy = store.marker.get("world_size", 1), store.marker.get("strategy")
        if strategy not in (None, cfg.strategy):
            raise CheckpointDirectoryError(f"{cfg.directory} was written by --strategy {strategy}; this run asks for "
                                           f"{cfg.strategy} — use --strategy {strategy} or another --dir")
        if written != world and not STRATEGIES[cfg.strategy].other_world_size:
            raise CheckpointDirectoryError(
                f"{cfg.directory} was written by {written} rank(s); this run has {world} — strategy {cfg.strategy} "
                f"keeps state per rank: use --nproc {written} or another --dir")
        newest = max((r.manifest.step for r in store.catalog.manifests() if r.manifest), default=0)
        if newest > cfg.steps:
            raise ConfigError(f"{cfg.directory} holds checkpoints up to step {newest}, past --steps {cfg.steps}: ask for "
                              f"--steps {newest + 1} or more to train on, or choose another --dir (nothing was changed)")
    finally:
        store.close()


class Journal:
    """Append-only JSON lines; each record is flushed before the next step begins."""

    def __init__(self, path: str | None) -> None:
        self.records: list[dict[str, Any]] = []
        self._file = open(path, "a", buffering=1) if path else None

    def write(self, **record: Any) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()

    @staticmethod
    def read(path: str) -> list[dict[str, Any]]:
        out = []
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by the kill
        return out


def train(cfg: TrainConfig, journal: Journal, plan: FailurePlan | None = None) -> None:
    """Run (or resume) the loop of ``cfg`` in this process, journaling every step.

    Under torch.distributed (``torchrun`` or the supervisor set RANK and WORLD_SIZE) this process
    is one rank; the process group is created here when it does not exist yet.
    """
    torch.set_num_threads(cfg.threads)
    owns_group = init_process_group(one_process=needs_ddp(cfg.compress) or cfg.parallel != "ddp", device=cfg.device)
    try:
        _train(cfg, journal, plan)
        if owns_group and dist.get_world_size() > 1:
            dist.barrier()  # every rank done with every group (a device mesh's too) before any is torn down
    finally:
        if owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, journal: Journal, plan: FailurePlan | None) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    w = build(cfg.workload, seed=cfg.seed, optimizer=cfg.optimizer, rank=rank, world=world, compress=cfg.compress,
              device=cfg.device, in_backward=cfg.in_backward, parallel=cfg.parallel)
    strategy = cfg.strategy
    directory = cfg.directory if STRATEGIES[strategy].needs_store else None
    store = None
    if directory:
        store = CheckpointDirectory.open(directory, strategy=strategy, ranks=Ranks.detect(),
                                extra={"run": run_record(cfg), "full_format": cfg.full_format},
                                other_world=STRATEGIES[strategy].other_world_size)
    with Checkpointer(
        store, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, compression=w.compression,
        strategy=strategy, every=cfg.every, keep=cfg.keep, deadline=cfg.deadline, full_format=cfg.full_format,
        stagger=cfg.stagger, remote=RemoteConfig(cfg.remote, every=cfg.remote_every) if cfg.remote else None,
        close_timeout=cfg.close_timeout,
        stop_signals=(signal.SIGTERM, signal.SIGUSR1), **cfg.options,
    ) as ckpt:
        t0 = time.perf_counter()
        start = ckpt.restore()
        journal.write(
            event="start", resumed_from=start, recovery_seconds=time.perf_counter() - t0,
            source=ckpt.recovered.source if ckpt.recovered else "none", pid=os.getpid(),
        )

        def settle(step: int) -> None:  # the kill planned in this step is armed after a commit
            ckpt.wait()
            journal.write(event="settled", step=step, **_recoverable_steps(ckpt))
            # every rank has recorded what it saw recoverable before the victim can die (and the
            # supervisor end the others, whose record the summary takes the least of)
            ckpt.ranks.barrier("control")

        inject = Injector(plan, rank, settle=settle)
        bar = tqdm(total=cfg.steps, initial=start, unit="step", disable=None if cfg.progress and rank == 0 else True,
                   leave=False)
        step = start
        for step in range(start + 1, cfg.steps + 1):
            t_step = time.perf_counter()
            inject.point(step, "start")
            loss = w.loss(w.data.next())
            inject.point(step, "forward")
            loss.backward()
            inject.point(step, "backward")
            w.update(after=lambda: inject.point(step, "update"))
            journal.write(event="step", step=step, loss=loss.item(), seconds=time.perf_counter() - t_step,
                          **_recoverable_steps(ckpt), **_counters(ckpt))
            bar.update(1)
            if step < cfg.steps and ckpt.should_stop():
                journal.write(event="stop", step=step, reason=ckpt.stop_reason, at=time.time())
                break
        bar.close()
    inject.finish()
    if plan is None and ckpt.recovered is not None and isinstance(getattr(ckpt.strategy, "replay_seconds", None), float):
        journal.write(event="replay", seconds=ckpt.strategy.replay_seconds)
    final_tree = {"step": step, **ckpt.components.capture(), **ckpt.components.capture_boundary()}
    journal.write(event="end", step=step, final_state_sha256=training_state_hash(final_tree), at=time.time(),
                  **_counters(ckpt))


def _recoverable_steps(ckpt: Checkpointer) -> dict[str, int]:
    """The newest steps a failure could not take: on storage, and in memory that outlives the process."""
    return {"durable": ckpt.stats.last_durable_step, "memory": ckpt.stats.last_memory_step}


def _counters(ckpt: Checkpointer) -> dict[str, Any]:
    return {
        "bytes_written": ckpt.bytes_written,
        "stall_seconds": ckpt.stats.stall_seconds,
        "checkpoints": ckpt.stats.checkpoints,
        "snapshot_wait_seconds": ckpt.stats.snapshot_wait_seconds,
        **({"memory_tier": ckpt.strategy.tier.report()} if ckpt.strategy.tier is not None else {}),
    }


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` to the end (or to an early stop); supervised in child processes when it has
    several ranks or planned failures. Under ``torchrun`` this process is one rank of the job."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    preflight(cfg, int(os.environ["WORLD_SIZE"]) if torchrun else cfg.nproc, owner=not torchrun)
    if torchrun:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        pending = cfg.fail_at[restarts:]
        world = int(os.environ["WORLD_SIZE"])
        plan = FailurePlan(steps=pending, mode=cfg.fail_mode, seed=cfg.seed, world=world) if pending else None
        journal = Journal(None)
        train(cfg, journal, plan)
        return summarise(cfg, journal.records)
    if not cfg.fail_at and cfg.nproc == 1:
        journal = Journal(None)
        train(cfg, journal)
        return summarise(cfg, journal.records)
    return run_supervised(cfg)


FAILURE_GRACE = 10.0
"""Seconds the other ranks have to end on their own after one ended with an error."""


class _Job:
    """One lifetime of the job's ranks; a stop signal to the supervisor is passed on to each rank."""

    def __init__(self, cfg: TrainConfig, pending: list[int], journals: list[str], zygote: Zygote | None) -> None:
        port = free_port()
        self.interrupted = False
        self.software = cfg.fail_mode == "software"
        self.journals = journals
        self.started_before = [_starts(j) for j in journals]
        self.held: int | None = None
        self.procs: list[subprocess.Popen[bytes] | Forked] = []
        for rank, journal in enumerate(journals):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(cfg.nproc),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            if cfg.nproc == 1:
                env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
            env["EVERYSTEP_SUPERVISOR"] = str(os.getpid())
            argv = worker_argv(cfg, journal, pending)
            if zygote is not None:
                self.procs.append(zygote.fork(env, argv))
            else:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "everystep.eval.kills.worker", *argv], env=env,
                                                   start_new_session=True))

    def forward(self, signum: int, frame: Any) -> None:
        """Hold a stop signal for :meth:`wait` to pass on to every rank once every rank has started (its
        Checkpointer handles the signal from then on). The handler only records it: it runs between
        any two bytecodes of this process, inside the zygote channel's lock as well, where polling
        the ranks again would wait for that lock for ever."""
        self.held = signum

    def _pass_held(self) -> None:
        if self.held is None or any(_starts(j) <= n for j, n in zip(self.journals, self.started_before)):
            return
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(self.held)
        self.held = None

    def interrupt(self, signum: int, frame: Any) -> None:
        """Ctrl-C: the first one stops every rank as a preemption would; a second one kills them."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        print("everystep: stopping after the current step with a final checkpoint (Ctrl-C again to kill)",
              file=sys.stderr)
        self.forward(signal.SIGTERM, frame)

    def kill(self, *, groups: bool = True) -> None:
        """Kill every rank still running: with ``groups``, with everything it started (its agent);
        without, the training processes alone, as a software failure leaves the machine."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    if groups:
                        os.killpg(p.pid, signal.SIGKILL)
                    else:
                        p.kill()
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def wait(self) -> list[int]:
        """Exit statuses; when one rank fails the others are killed (their peers are gone). A rank
        that was killed takes the others at once (after a planned software failure only the training
        processes die; their agents live on). A rank that ended with an error leaves the others up to
        ``FAILURE_GRACE`` seconds to end on their own — their collectives with it fail — so that each
        reports what it saw (a peer's failed checkpoint, say) before it is killed."""
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return codes  # type: ignore[return-value]
            self._pass_held()
            if any(c is not None and c != 0 for c in codes):
                failed_at = failed_at or time.monotonic()
                killed = -signal.SIGKILL in codes
                if killed or time.monotonic() - failed_at > FAILURE_GRACE:
                    self.kill(groups=not (self.software and killed))
                    return [p.returncode if c is None else c for p, c in zip(self.procs, codes)]
            time.sleep(0.02)


def _starts(journal: str) -> int:
    """How many process lifetimes have started in this journal so far."""
    try:
        with open(journal) as f:
            return sum('"event": "start"' in line for line in f)
    except FileNotFoundError:
        return 0


def _ranks_with(codes: list[int], code: int) -> str:
    ranks = [r for r, c in enumerate(codes) if c == code]
    if len(codes) == 1:
        return "the training process"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def run_supervised(cfg: TrainConfig) -> dict[str, Any]:
    """Run the job's ranks as child processes (forks of a zygote that imported everything once, where
    the platform allows, kept for this process's later runs: :func:`.zygote.shared`); after a planned
    kill, start them all again."""
    with tempfile.TemporaryDirectory(prefix="everystep-run-") as tmp:
        journals = [os.path.join(tmp, f"journal-r{r}.jsonl") for r in range(cfg.nproc)]
        pending = list(cfg.fail_at)
        return _supervise(cfg, pending, journals, shared(WORKER))


def _supervise(cfg: TrainConfig, pending: list[int], journals: list[str], zygote: Zygote | None) -> dict[str, Any]:
    """Each lifetime of the job until it ends (see :func:`run_supervised`)."""
    while True:
        job = _Job(cfg, pending, journals, zygote)
        previous = {sig: signal.signal(sig, job.forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, job.interrupt)
        try:
            codes = job.wait()
        except BaseException:
            job.kill()  # a second Ctrl-C, or a failure here: leave no rank behind
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if all(c == 0 for c in codes):
            return merge_ranks([summarise(cfg, Journal.read(j)) for j in journals])
        if 2 in codes and -signal.SIGKILL not in codes:
            raise EverystepError(f"training stopped: {_ranks_with(codes, 2)} reported the error above")
        if -signal.SIGKILL not in codes or not pending:
            raise EverystepError(f"the training process failed unexpectedly (exit statuses {codes})")
        pending.pop(0)
        if cfg.fail_mode == "hardware":
            _lose_host_memory(cfg)


def _lose_host_memory(cfg: TrainConfig) -> None:
    """A hardware failure takes the host's memory with it: lightcheck's regions and the memory tiers on
    tmpfs go too (a checkpoint agent's memory goes with its process, which the failure killed)."""
    if cfg.directory is None:
        return  # (a strategy without a region has no region file where its option says)
    for rank in range(cfg.nproc):
        paths = [region_path(Path(cfg.directory), cfg.options.get("region"), rank, cfg.nproc)]
        if cfg.options.get("memory"):  # a full-state strategy's memory tier
            region = cfg.options.get("region")
            paths.append(memory_path(Path(cfg.directory), region, rank, cfg.nproc) if region is not None
                         else memory_place(Path(cfg.directory), rank, cfg.nproc)[0])
        for path in paths:
            if path.exists() and on_volatile_memory(path):
                path.unlink()


def _die_with_supervisor() -> None:
    """Have the kernel kill this worker when its supervisor dies (Linux: ``PR_SET_PDEATHSIG``), so
    that a killed supervisor leaves no rank training on its own; a supervisor already gone ends it now."""
    supervisor = int(os.environ.pop("EVERYSTEP_SUPERVISOR", "0"))
    if supervisor and sys.platform.startswith("linux"):
        die_with(supervisor)


WORKER = f"{__name__}:worker_main"
"""The entry point of a rank's process (:mod:`.zygote` forks it; ``python -m everystep.eval.kills.train`` runs it)."""


def worker_argv(cfg: TrainConfig, journal: str, pending: Sequence[int] = ()) -> list[str]:
    """The arguments of :func:`worker_main` that train one lifetime of a rank of ``cfg`` (its
    failures to come: ``pending``), recording into ``journal``."""
    return [json.dumps({"config": {**asdict(cfg), "fail_at": []}, "plan": list(pending)}), journal]


def worker_main(argv: list[str]) -> int:
    _die_with_supervisor()
    one_line_warnings(os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    spec, journal_path = json.loads(argv[0]), argv[1]
    conf = spec["config"]
    conf["fail_at"] = tuple(conf["fail_at"])
    cfg = TrainConfig(**conf)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = FailurePlan(steps=tuple(spec["plan"]), mode=cfg.fail_mode, seed=cfg.seed, world=world) if spec["plan"] else None
    journal = Journal(journal_path)
    try:
        train(cfg, journal, plan)
    except EverystepError as e:
        rank = os.environ.get("RANK")
        print(f"everystep: error{f' on rank {rank}' if rank else ''}: {e}", file=sys.stderr)
        return 2
    finally:
        journal.close()
    return 0
