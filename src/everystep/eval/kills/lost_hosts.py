"""Hosts lost and replaced, on one machine: a job of two "hosts", each a ``torchrun`` of its own
(elastic c10d rendezvous, restarts allowed) with its own scratch directory for what lives in a
host's memory (LightCheck's regions and mirrors); a host lost is its torchrun and every process
under it SIGKILLed together, and a replacement torchrun started with an empty scratch directory.

The checkpoint directory is shared by both, as a cluster's shared storage would be. The
rendezvous store is held by the process that runs the job, so that losing either host leaves it.

``python -m everystep.eval.kills.lost_hosts`` measures what a lost host costs with and without replicas on
peers (``--strategy lightcheck`` or ``lowdiff_plus``): for each loss, where each rank's state came
from, the steps lost, the seconds ``restore()`` took and the seconds from the replacement's start to
its first step::

    python -m everystep.eval.kills.lost_hosts --strategy lightcheck --workload gpt2-tiny --local 1 --steps 40 --losses 3

(``python -m everystep.eval.kills.lost_hosts rank ...`` is what each torchrun runs on each rank.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PHASES", "TwoHosts", "HostLoss", "lose_hosts", "descendants"]


def rank_main(argv: list[str]) -> None:
    """One rank's training: restore, then every step to ``steps``, each step's loss logged with the
    time; the start logged with where the state came from, how long ``restore()`` took, and when each
    phase of the start ended (:data:`PHASES`)."""
    import faulthandler

    import psutil

    phases = {"started": psutil.Process().create_time()}
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (a rank that hangs says where: kill -USR1, into its host's log)
    import torch.distributed as dist

    from ...checkpointer import Checkpointer
    from ...storage.remote import RemoteConfig
    from .train import training_state_hash
    from ..workloads import build

    phases["imported"] = time.time()
    p = argparse.ArgumentParser(prog="everystep.eval.kills.lost_hosts rank")
    for name in ("directory", "results", "scratch", "strategy", "workload", "parallel"):
        p.add_argument(name)
    for name in ("steps", "persist_every"):
        p.add_argument(name, type=int)
    p.add_argument("peers", choices=("0", "1"))
    p.add_argument("remote", nargs="?")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    phases["grouped"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    w = build(a.workload, seed=0, optimizer="adamw", rank=rank, world=world, parallel=a.parallel)
    phases["built"] = time.time()
    if a.strategy == "lightcheck":
        options = {"region": os.path.join(a.scratch, "region-{rank}.bin"), "persist_every": a.persist_every}
    else:  # lowdiff_plus: its agents keep the state in their memory and persist it; checkfreq: its every
        options = {"every": a.persist_every}
    if a.peers == "1":
        options["peers"] = True
    if a.remote:
        options["remote"] = RemoteConfig(a.remote, every=1, lease=2.0)  # (a lost host's lock: taken over sooner)
    ckpt = Checkpointer(a.directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data, strategy=a.strategy,
                        **options)
    with ckpt, open(os.path.join(a.scratch, f"events-{os.getpid()}.jsonl"), "a") as log:
        start = ckpt.restore()
        phases["restored"] = time.time()
        found = ckpt.recovered
        log.write(json.dumps({"rank": rank, "start": start, "source": found.source if found else None,
                              "restore_seconds": found.seconds if found else None,
                              "read_bytes": ckpt.directory.catalog.bytes_read, "at": time.time(),
                              "phases": phases}) + "\n")
        log.flush()
        for step in range(start + 1, a.steps + 1):
            loss = w.loss(w.data.next())
            loss.backward()
            w.update()
            log.write(json.dumps({"rank": rank, "step": step, "loss": loss.item(), "at": time.time()}) + "\n")
            log.flush()
    final = {"step": a.steps, **ckpt.components.capture(), **ckpt.components.capture_boundary()}
    with open(os.path.join(a.results, f"final-r{rank}.json"), "w") as f:
        json.dump({"hash": training_state_hash(final)}, f)
    dist.destroy_process_group()


PHASES = {"started": "the process started", "imported": "torch imported", "grouped": "the process group made",
          "built": "the model and optimizer built (the optimizer imports torch._dynamo)",
          "restored": "restore() returned"}
"""When each phase of a rank's start ended, as its start event logs them (``phases``, Unix times)."""


class TwoHosts:
    """Two hosts of ``local`` ranks each, one job: a torchrun per host, the rendezvous store held by
    this process. The checkpoint directory is shared by both, or with ``node_local`` each host's own
    (``disk{index}-{n}``: a host restarted in place keeps its disk, a replaced one gets an empty one);
    ``remote``: an ``s3://`` URL the job uploads every full checkpoint to."""

    def __init__(self, tmp: Path, *, local: int, strategy: str, steps: int, workload: str = "gpt2-tiny",
                 parallel: str = "ddp", persist_every: int = 1000, peers: bool = True, node_local: bool = False,
                 remote: str | None = None, max_restarts: int = 20) -> None:
        import torch.distributed as dist

        from ...distributed import free_port

        self.tmp, self.local, self.steps, self.node_local = tmp, local, steps, node_local
        self.args = [strategy, workload, parallel, str(steps), str(persist_every), "1" if peers else "0", *filter(None, [remote])]
        self.shared = tmp / "shared"
        self.results = tmp / "results"
        self.results.mkdir()
        self.disks = [self.shared] * 2 if not node_local else [tmp / "disk0-0", tmp / "disk1-0"]
        self.max_restarts = max_restarts
        self.rdzv_id = "job"
        """The rendezvous of the hosts started from here on (a job that ended closed its own)."""
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False)
        self.hosts: list[tuple[subprocess.Popen[bytes], Path, float]] = []
        self.scratches: list[Path] = []
        for index in range(2):
            self.start(index)

    def start(self, index: int, *, replace: bool = False, env: dict[str, str] | None = None) -> None:
        """Start host ``index`` (again: with an empty scratch directory; ``replace``: a new machine,
        its node-local disk empty too), ``env`` added to its environment."""
        if replace and self.node_local:
            self.disks[index] = self.tmp / f"disk{index}-{len(self.scratches)}"
        scratch = self.tmp / f"host{index}-{len(self.scratches)}"
        scratch.mkdir()
        self.scratches.append(scratch)
        src = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", _TAG: str(scratch),  # (what runs on this host: its checkpoint agents too)
               "EVERYSTEP_HOST": scratch.name,  # (the machine's name is every host's here)
               # Each rendezvous round makes its own store: with torch 2.13 a survivor that keeps the
               # first round's never learns the new round's address, and the re-rendezvous hangs.
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(self.local),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.rdzv_id,
               "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120",
               "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
               "-m", "everystep.eval.kills.lost_hosts", "rank", str(self.disks[index]), str(self.results), str(scratch), *self.args]
        with open(f"{scratch}.log", "w") as out:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        entry = (proc, scratch, time.time())
        if index < len(self.hosts):
            self.hosts[index] = entry
        else:
            self.hosts.append(entry)

    def events(self) -> list[dict[str, Any]]:
        """Every rank's log lines, from every host that ran."""
        found = []
        for scratch in self.scratches:
            for path in scratch.glob("events-*.jsonl"):
                found += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return found

    def newest_step(self) -> int:
        return max((e["step"] for e in self.events() if "step" in e), default=0)

    def newest_committed(self) -> int:
        """The newest full checkpoint that every host's directory has committed (-1: none)."""
        steps = [{int(p.name[5:17]) for p in (disk / "manifests").glob("full-????????????.json")} if disk.is_dir() else set()
                 for disk in set(self.disks)]
        return max(set.intersection(*steps), default=-1)

    def lose(self, index: int) -> None:
        """SIGKILL host ``index``: its torchrun, every process under it and every process started
        there that left it (a checkpoint agent outlives the training process that started it)."""
        proc, scratch, _ = self.hosts[index]
        for pid in [proc.pid, *descendants(proc.pid), *_tagged(str(scratch))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def alive(self) -> bool:
        return all(p.poll() is None for p, _, _ in self.hosts)

    def wait(self, timeout: float) -> None:
        for proc, scratch, _ in self.hosts:
            if proc.wait(timeout) != 0:
                raise RuntimeError(f"host {scratch.name} failed:\n" + self.log(scratch))

    @staticmethod
    def log(scratch: Path) -> str:
        """The end of what a host's torchrun and ranks printed."""
        return Path(f"{scratch}.log").read_text()[-4000:]

    def close(self) -> None:
        for index, (proc, _, _) in enumerate(self.hosts):
            if proc.poll() is None:
                self.lose(index)


_TAG = "EVERYSTEP_HOSTS_TAG"
"""In the environment of everything a host started (its scratch directory): what its loss kills."""


def _tagged(tag: str) -> list[int]:
    wanted = f"{_TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if wanted in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (none where it is gone)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass
class HostLoss:
    """One loss: the step the job had reached, the hosts lost, and what the restart did."""

    reached: int
    hosts: tuple[int, ...]
    replaced_at: float
    """When the replacement hosts were started (Unix time)."""
    starts: list[dict[str, Any]] = field(default_factory=list)
    """The start of each rank after it (``start``, ``source``, ``restore_seconds``, ``read_bytes``: the
    bytes of checkpoint objects it read from storage)."""
    first_step_after: float | None = None
    """Seconds from the replacements' start to the first step any rank finished after it."""
    on_disk: int = -1
    """The newest full checkpoint every host's directory had committed when the hosts were lost."""

    @property
    def resumed(self) -> int | None:
        return min((s["start"] for s in self.starts), default=None)


def lose_hosts(job: TwoHosts, plan: list[tuple[int, tuple[int, ...]]], *, timeout: float = 300,
               replace: bool = False) -> list[HostLoss]:
    """Run ``job`` to its end, losing at each ``(step, hosts)`` of ``plan`` those hosts once some
    rank has finished ``step``, and starting them again at once (``replace``: as new machines, their
    node-local disks empty). Each loss comes at least two steps after the restart from the one
    before (a replacement is not lost before it started)."""
    losses: list[HostLoss] = []
    try:
        for target, victims in plan:
            floor = (losses[-1].reached + 2) if losses else 0
            while job.newest_step() < max(target, floor):
                if not job.alive():
                    raise RuntimeError("a host ended before it was lost")
                time.sleep(0.02)
            for index in victims:
                job.lose(index)
            reached, on_disk = job.newest_step(), job.newest_committed()
            replaced = time.time()
            for index in victims:
                job.start(index, replace=replace)
            losses.append(HostLoss(reached, tuple(victims), replaced, on_disk=on_disk))
        job.wait(timeout)
    finally:
        job.close()
    events = job.events()
    for i, loss in enumerate(losses):
        end = losses[i + 1].replaced_at if i + 1 < len(losses) else float("inf")
        loss.starts = [e for e in events if "start" in e and loss.replaced_at <= e["at"] < end]
        after = [e["at"] for e in events if "step" in e and loss.replaced_at <= e["at"] < end]
        loss.first_step_after = min(after) - loss.replaced_at if after else None
    return losses


def rank0_losses(job: TwoHosts) -> list[float]:
    """Rank 0's loss at every step, from the lifetime that led on (the last to take that step)."""
    timeline: dict[int, float] = {}
    for e in sorted((e for e in job.events() if "step" in e and e["rank"] == 0), key=lambda e: e["at"]):
        timeline[e["step"]] = e["loss"]
    return [timeline[s] for s in range(1, job.steps + 1)]


def final_hashes(job: TwoHosts) -> list[str]:
    return [json.loads((job.results / f"final-r{r}.json").read_text())["hash"] for r in range(2 * job.local)]


def _measure(args: argparse.Namespace) -> None:
    from .run_config import TrainConfig
    from .train import run

    rng = random.Random(args.seed)
    gap = (args.steps - 8) // (args.losses + 1)
    plan = [(4 + (i + 1) * gap + rng.randint(-2, 2), (rng.randrange(2),)) for i in range(args.losses)]
    reference = run(TrainConfig(workload=args.workload, strategy="none", steps=args.steps, nproc=2 * args.local,
                                max_nproc=2 * args.local, parallel=args.parallel, progress=False))
    rows = []
    for peers in (True, False):
        with tempfile.TemporaryDirectory(prefix="everystep-hosts-", dir=args.scratch) as tmp:
            job = TwoHosts(Path(tmp), local=args.local, strategy=args.strategy, steps=args.steps, workload=args.workload,
                           parallel=args.parallel, persist_every=args.persist_every, peers=peers)
            losses = lose_hosts(job, plan)
            bitwise = rank0_losses(job) == reference["losses"] and final_hashes(job) == reference["rank_state_sha256"]
        for loss in losses:
            sources = sorted({s["source"] or "none" for s in loss.starts})
            print(f"peers={peers}: host {loss.hosts[0]} lost after step {loss.reached}: resumed at {loss.resumed} "
                  f"from {', '.join(sources)}; restore {max(s['restore_seconds'] or 0 for s in loss.starts):.3f} s, "
                  f"replacement's start to the first step {loss.first_step_after:.2f} s")
        rows.append((peers, losses, bitwise))
        ends = {name: statistics.median(statistics.median(s["phases"][name] - loss.replaced_at for s in loss.starts)
                                        for loss in losses) for name in PHASES}
        print(f"peers={peers}: after the replacement's start (medians): "
              + "; ".join(f"{what} +{ends[name]:.1f} s" for name, what in PHASES.items()))
    print(f"\n{args.workload}, 2 hosts x {args.local} rank(s) ({args.parallel}), {args.strategy}, {args.steps} steps, "
          f"full checkpoints every {args.persist_every} steps, {args.losses} losses of one host (medians):")
    print(f"| {args.strategy} | restored from | steps lost per loss | restore() (s) | replacement's start to first step (s) "
          "| bitwise |")
    print("|---|---|---|---|---|---|")
    for peers, losses, bitwise in rows:
        sources = sorted({(s["source"] or "none").split(" (")[0] for loss in losses for s in loss.starts})
        lost = [loss.reached - (loss.resumed or 0) for loss in losses]
        restore = statistics.median(max(s["restore_seconds"] or 0 for s in loss.starts) for loss in losses)
        first = statistics.median(loss.first_step_after or float("nan") for loss in losses)
        print(f"| {'peers=True' if peers else 'peers=False'} | {', '.join(sources)} | {statistics.median(lost):g} "
              f"(max {max(lost)}) | {restore:.3f} | {first:.2f} | {'yes' if bitwise else 'no'} |")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        rank_main(argv[1:])
        return
    p = argparse.ArgumentParser(prog="python -m everystep.eval.kills.lost_hosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="lightcheck", choices=("lightcheck", "lowdiff_plus"))
    p.add_argument("--workload", default="gpt2-tiny")
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--local", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--losses", type=int, default=3, help="hosts lost over the run, one at a time (default 3)")
    p.add_argument("--persist-every", type=int, default=10, help="steps between full checkpoints: lightcheck's "
                   "persist_every, lowdiff_plus's every (default 10)")
    p.add_argument("--seed", type=int, default=0, help="draws the steps and hosts lost")
    p.add_argument("--scratch", default=None, help="where the hosts' scratch and shared directories are made")
    _measure(p.parse_args(argv))


if __name__ == "__main__":
    main()
