"""One measured training run, in its own process: ``python -m everystep.eval.bench.measure SPEC``.

Prints one JSON line: step times after warm-up, checkpoint stall, bytes written, peak memory,
steps that a failure would lose at each step end, and the time to recover from what was stored.
"""

from __future__ import annotations

import contextlib
import uuid
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ... import tracing
from ...checkpointer import Checkpointer
from ...state import capture_rng, restore_rng
from ...distributed import init_process_group
from ...tree import flatten, state_error
from ...storage.region import memory_path
from ...strategies import STRATEGIES
from ..workloads import build, needs_ddp

__all__ = ["measure", "RESUME_STEPS", "CHECKFLOW_MEMORY"]

CHECKFLOW_MEMORY = ("plan_feasible", "plan_peak_device_bytes", "planned_snapshot_bytes", "peak_snapshot_bytes")
"""What a ``checkflow`` run reports of its snapshot memory (:func:`_checkflow_memory`)."""

RESUME_STEPS = 2
"""Steps trained on after recovery, and on the uninterrupted run, whose losses must match bitwise."""


def _build(spec: dict[str, Any], seed: int) -> Any:
    """The run's workload; under several ranks (``RANK``, ``WORLD_SIZE``), this rank's, laid out as
    ``spec["parallel"]`` says."""
    return build(spec["workload"], seed=seed, compress=spec.get("compress"), device=spec.get("device", "cpu"),
                 in_backward=spec.get("in_backward", False), rank=int(os.environ.get("RANK", "0")),
                 world=int(os.environ.get("WORLD_SIZE", "1")), parallel=spec.get("parallel", "ddp"),
                 batch=spec.get("samples"))


def _scratch(spec: dict[str, Any]) -> Any:
    """Where the run's checkpoints go: the folder its ranks share (``spec["shared"]``, made and removed
    by the bench), or a temporary one of its own."""
    if "shared" in spec:
        return contextlib.nullcontext(spec["shared"])
    return tempfile.TemporaryDirectory(prefix="everystep-bench-", dir=spec.get("scratch"))


@contextlib.contextmanager
def _tier_removed(directory: str, options: dict[str, Any]) -> Iterator[None]:
    """A run's memory tier in its default place is gone after the run, as its directory (a run that
    failed leaves it, as a crash would)."""
    given = options.get("region")
    try:
        yield
    finally:
        if options.get("memory") and given is None:
            shutil.rmtree(memory_path(Path(directory), None, 0, 1).parent, ignore_errors=True)


def _across_ranks(result: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's result, where under several ranks every rank's recovery counts: it resumes bitwise
    only if every rank does, and its errors are the largest of any rank's (each over its own shards)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return result
    checks = ("resumes_bitwise", "recovery_error", "resume_error")
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, {k: result.get(k) for k in checks})
    merged = dict(result)
    if all(f["resumes_bitwise"] is not None for f in found):
        merged["resumes_bitwise"] = all(f["resumes_bitwise"] for f in found)
    for key in ("recovery_error", "resume_error"):
        if all(f[key] is not None for f in found):
            merged[key] = max(f[key] for f in found)
    return merged


def _attach(w: Any, directory: str | None, strategy: str, options: dict[str, Any], **kw: Any) -> Checkpointer:
    return Checkpointer(directory, w.model, w.optimizer, scheduler=w.scheduler, data=w.data,
                        compression=w.compression, strategy=strategy, **{**options, **kw})


def base_strategy(name: str) -> str:
    """The strategy a bench run's name (``lightcheck+peers``, ``checkfreq+remote``) runs."""
    return name.split("+", 1)[0]


def _model_and_optimizer(w: Any) -> dict[str, torch.Tensor]:
    """The model's and the optimizer's tensors (of a sharded state: this rank's shards)."""
    tensors, _ = flatten({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()["state"]}, sharded={})
    return {k: t.detach().clone() for k, t in tensors.items()}


def _recover(spec: dict[str, Any], directory: str, strategy: str, options: dict[str, Any]
             ) -> tuple[float, int, Any, Checkpointer, dict[str, Any]]:
    """A fresh workload restored from ``directory``: the seconds, the step, the workload, its
    Checkpointer, and what the restore read and how much host memory it took on top of what the
    process held (:func:`peak_during`)."""
    fresh = _build(spec, spec["seed"])  # the same workload (its data, its targets) at S_0: recovery must bring S_steps
    options = {k: v for k, v in options.items() if k != "remote"}  # (recovery from this machine's tiers)
    t0 = time.perf_counter()
    with _attach(fresh, directory, strategy, options, final=False) as again:
        tier = again.strategy.tier
        region = tier.region if tier is not None else getattr(again.strategy, "region", None)

        def restored() -> int:  # (the pages a restore lent, made the process's own after it, counted in its peak)
            step = again.restore()
            if region is not None:
                region.lending.settle()
            return step

        recovered, extra = peak_during(restored)
        seconds = again.recovered.seconds if again.recovered else time.perf_counter() - t0
        lent = region.lending if region is not None and region.lending.bytes else None
        mapped = region.bytes_read if region is not None else 0  # (its slots' pages, resident while mapped)
        read = again.directory.catalog.bytes_read + mapped
    return seconds, recovered, fresh, again, {"recovery_bytes_read": read, "recovery_peak_extra_bytes": extra,
                                              "recovery_mapped_bytes": mapped,
                                              "recovery_lent_bytes": lent.bytes if lent else None,
                                              "recovery_lent_seconds": lent.seconds if lent else None}


def new_memory_seconds(nbytes: int | None) -> float | None:
    """The seconds this process takes to fill ``nbytes`` of memory it does not hold yet (on the run's
    training threads, ``--threads``), measured right after a restore that took as much: what those pages cost here (the kernel, and on a
    virtual machine its host, providing them), apart from anything the restore did with them."""
    if not nbytes:
        return None
    t0 = time.perf_counter()
    torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    return time.perf_counter() - t0


def peak_during(call: Any) -> tuple[Any, int | None]:
    """``call()``'s result, and the most host memory the process held during it beyond what it held
    before (Linux: its peak resident size reset first, ``/proc/self/clear_refs``); None where that
    cannot be read."""
    def status(field: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                line = next((line for line in f if line.startswith(field + ":")), None)
        except OSError:
            return None
        return int(line.split()[1]) * 1024 if line else None

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (the peak resident size starts again from the current one)
        before = status("VmRSS")
    except OSError:
        before = None
    result = call()
    peak = status("VmHWM") if before is not None else None
    return result, (max(0, peak - before) if peak is not None and before is not None else None)


def _step(w: Any, before_update: Any = None) -> torch.Tensor:
    """One step of the bench's training loop; ``before_update`` runs right before ``optimizer.step()``."""
    with tracing.span("forward and backward"):
        loss = w.loss(w.data.next())
        loss.backward()
    with tracing.span("update"):
        w.update(before=before_update)
    if loss.is_cuda:  # the training stream only, as a loop that reads its loss waits: not the copy streams
        with tracing.span("wait for the training stream"):
            torch.cuda.current_stream().synchronize()
    return loss


def _timed_step(w: Any, step: int, before_update: Any = None) -> float:
    """One step, traced as ``step`` (the training stream's share of it too, on a GPU); its seconds."""
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and w.device.type == "cuda" else None
    t0 = time.perf_counter()
    with tracing.span("step", step=step), tracing.device_span("step", stream, step=step):
        _step(w, before_update)
    return time.perf_counter() - t0


def _loop_setting(spec: dict[str, Any]) -> dict[str, Any]:
    """What a run's setting holds of the training loop: its threads, and its gradient compression and
    samples a step where given."""
    return {"threads": spec["threads"], **{k: spec[k] for k in ("compress", "samples") if spec.get(k)}}


def _peaks() -> dict[str, int | None]:
    """The process's peak host memory and the device allocator's peak so far: read right after the
    timed steps, before the run's own checks copy anything."""
    return {"peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_device_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}


@contextlib.contextmanager
def _traced(spec: dict[str, Any]) -> Iterator[None]:
    """Record the run's trace where ``spec["trace"]`` says (a path stem; None: no trace): this
    process's part is written on leaving, its helpers' as they end."""
    if not spec.get("trace"):
        yield
        return
    tracing.start(spec["trace"])
    try:
        yield
    finally:
        tracing.stop()


def _train_on(w: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of :data:`RESUME_STEPS` more steps, and the model and optimizer state after them."""
    losses = [_step(w).item() for _ in range(RESUME_STEPS)]
    return losses, _model_and_optimizer(w)


def _resume_check(fresh: Any, after: tuple[list[float], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Train the recovered workload on as the uninterrupted one did: ``resumes_bitwise`` when the
    losses and the state then are bitwise the same, and ``resume_error``, how far the state is."""
    losses, state = _train_on(fresh)
    bitwise = (losses == after[0] and state.keys() == after[1].keys()
               and all(torch.equal(state[k], after[1][k]) for k in state))
    return {"resumes_bitwise": bitwise, "resume_error": state_error(state, after[1])}


def _split_bytes(ckpt: Checkpointer, steps: int) -> dict[str, float]:
    """Per step, over the whole run: what a differential strategy wrote, by kind, and the compressed
    gradients training produced (sizes, not times: no warm-up to leave out)."""
    strategy, compression = ckpt.strategy, ckpt.components.compression
    recorded = getattr(strategy, "recorded_steps", 0)
    if not recorded or compression is None:
        return {}
    return {"record_bytes_per_step": strategy.record_bytes / recorded,
            "end_bytes_per_step": strategy.end_bytes / recorded,
            "compressed_bytes_per_step": compression.compressed_bytes / steps}


def _checkflow_memory(strategy: Any) -> dict[str, Any]:
    """Checkflow's snapshot memory: the plan's device peak and snapshot bytes, against what it held."""
    if not hasattr(strategy, "planned_snapshot_bytes"):
        return {}
    found = strategy.plans[-1] if strategy.plans else None
    return {"plan_feasible": found.feasible if found else None,
            "plan_peak_device_bytes": found.peak if found else None,
            "planned_snapshot_bytes": strategy.planned_snapshot_bytes if found else None,
            "peak_snapshot_bytes": strategy.peak_snapshot_bytes}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One run as ``spec`` says (:func:`~everystep.eval.bench.command.run_spec`): the timed steps, and, unless
    ``spec["checks"]`` is false, the recovery and resume checks after them. ``seconds`` says where
    the run's own time went: building the workload (and the Checkpointer, its restore), the steps,
    the checks (and the Checkpointer's close)."""
    torch.set_num_threads(spec["threads"])
    init_process_group(one_process=needs_ddp(spec.get("compress")), device=spec.get("device", "cpu"))  # PowerSGD: DDP's hook
    name = spec["strategy"]
    strategy = base_strategy(name)  # (+remote: the same strategy, uploading; +peers: mirroring; +memory: its memory tier)
    if strategy not in STRATEGIES:  # a baseline: only its runs import DCP (a second of start-up)
        return measure_baseline(spec)
    steps, warmup, checks = spec["steps"], spec["warmup"], spec.get("checks", True)
    options = {**({"every": spec["every"]} if spec.get("every") else {}), **spec.get("options", {})}
    if name.endswith("+peers"):
        options["peers"] = True
    if name.endswith("+memory"):
        options["memory"] = True
    if name.endswith("+remote"):
        # a prefix of the run's own (under several ranks, the name of the folder they share)
        options["remote"] = f"{spec['remote']}/{os.path.basename(spec['shared']) if 'shared' in spec else uuid.uuid4().hex[:12]}"
    clock = time.perf_counter()
    seconds: dict[str, float] = {}
    with _scratch(spec) as tmp, _tier_removed(f"{tmp}/ckpt", options):
        directory = f"{tmp}/ckpt" if STRATEGIES[strategy].needs_store else None
        if options.get("memory") and options.get("region") is None:
            # its default place, named: a clean close leaves it, to recover from
            options["region"] = str(memory_path(Path(f"{tmp}/ckpt"), None, 0, 1).with_name("rank-{rank}.bin"))
        w = _build(spec, spec["seed"])
        times, lost_sw, lost_hw = [], [], []
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        # (traced from the attach: the helper processes it starts record their spans too)
        with _traced(spec), _attach(w, directory, strategy, options) as ckpt:
            ckpt.restore()
            seconds["build"], clock = time.perf_counter() - clock, time.perf_counter()
            stall_at_warmup, checkpoints_at_warmup, bytes_at_warmup = 0.0, 0, 0
            for step in range(1, steps + 1):
                if step == warmup + 1:
                    ckpt.wait()  # what the warm-up started is not charged to the timed steps
                    stall_at_warmup, checkpoints_at_warmup = ckpt.stats.stall_seconds, ckpt.stats.checkpoints
                    bytes_at_warmup = ckpt.bytes_written
                took = _timed_step(w, step)
                if step > warmup:
                    times.append(took)
                stats = ckpt.stats
                lost_hw.append(step - stats.last_durable_step)
                lost_sw.append(step - max(stats.last_durable_step, stats.last_memory_step))
            stall = ckpt.stats.stall_seconds - stall_at_warmup
            with tracing.span("wait for the checkpoints in flight"):
                ckpt.wait()  # count what the timed steps wrote, not the final checkpoint written at close
            peaks = _peaks()  # (before any copy of the state below)
            seconds["steps"], clock = time.perf_counter() - clock, time.perf_counter()
            checkpoints_measured = ckpt.stats.checkpoints - checkpoints_at_warmup
            bytes_measured = ckpt.bytes_written - bytes_at_warmup
            split = {**_split_bytes(ckpt, steps), **_checkflow_memory(ckpt.strategy)}
            setting = {**ckpt.strategy.setting(), **_loop_setting(spec)}
            live = _model_and_optimizer(w) if checks else {}
            memory, rng = None, None
            tier = ckpt.strategy.tier.report() if ckpt.strategy.tier is not None else None
            if strategy == "lowdiff_plus" and checks:  # a software failure: the agent outlives the training process
                ckpt._activity()  # S_steps is complete; hand it over as the next forward would
                ckpt.wait()
                ckpt.final = False  # a crashed process writes no final checkpoint
                ckpt.strategy.abandon()
                ckpt.directory.close()  # the directory is free, as a dead process leaves it
                memory = _recover(spec, directory, strategy, options)  # (from the agent's memory)
                rng = capture_rng()  # as recovered: the uninterrupted run's next steps, below, draw from it too
        after = _train_on(w) if checks else None  # the uninterrupted run's next steps (the Checkpointer is closed)
        result: dict[str, Any] = {
            "strategy": name,
            "repeat": spec["repeat"],
            "every": spec["every"],
            "setting": setting,
            "step_seconds": times,
            "mean_step_seconds": sum(times) / len(times),
            "stall_seconds": stall,
            "checkpoints": checkpoints_measured,
            "bytes_per_step": bytes_measured / (steps - warmup),
            **peaks,
            "full_format": ckpt.directory.full_format if ckpt.directory is not None else None,
            "lost_steps_software": max(lost_sw),
            "lost_steps_hardware": max(lost_hw),
            **_UNCHECKED,
            **split,
            **({"remote_step": ckpt.stats.last_remote_step} if name.endswith("+remote") else {}),
            **({"agent_seconds_per_step": ckpt.strategy.agent_seconds_per_step} if strategy == "lowdiff_plus" else {}),
            **(_copy_and_hash(ckpt.strategy) if strategy == "lightcheck" else {}),
            **(tier or {}),
            **((ckpt.strategy.peer_traffic or {"peer_bytes_per_step": None}) if name.endswith("+peers") else {}),
        }
        if checks:
            assert after is not None
            _check(spec, result, memory, rng, after, live, directory, strategy, options, tier)
        seconds["checks"] = time.perf_counter() - clock
    return _across_ranks({**result, "seconds": seconds})


_UNCHECKED: dict[str, Any] = dict.fromkeys((
    "recovery_seconds_disk", "recovery_seconds_memory", "recovery_bytes_read", "recovery_peak_extra_bytes",
    "recovery_mapped_bytes", "recovery_new_memory_seconds", "recovery_lent_bytes", "recovery_lent_seconds",
    "recovery_error", "replay_seconds", "resumes_bitwise", "resume_error"))
"""What a run's checks report, None where they were not run (``spec["checks"]`` false)."""


def _check(spec: dict[str, Any], result: dict[str, Any], memory: Any, rng: Any, after: Any,
           live: dict[str, torch.Tensor], directory: str | None, strategy: str, options: dict[str, Any],
           tier: dict[str, Any] | None) -> None:
    """The run's recovery and resume checks, into ``result``: recovery from memory where the strategy
    keeps one, then from disk, each timed, and whether training resumes bitwise."""
    steps = spec["steps"]
    if memory is not None:
        seconds, recovered, fresh, again, _ = memory
        if recovered != steps or again.recovered is None or again.recovered.source != "memory":
            raise RuntimeError(f"recovered step {recovered} from {again.recovered}, expected {steps} from memory")
        result["recovery_seconds_memory"] = seconds
    if memory is not None and dist.is_initialized() and dist.get_world_size() > 1:
        # Under several ranks the agents persist only the steps the ranks agree on (with the measured
        # interval, maybe none of this short run's) and nothing as their processes go: what the
        # run recovered from their memory is what is checked.
        fresh = memory[2]
        result["recovery_error"] = state_error(_model_and_optimizer(fresh), live)
        assert rng is not None
        restore_rng(rng)
        result.update(_resume_check(fresh, after))
    elif directory is not None:
        if tier is not None:  # the region outlives the training process: read from there, then the host lost
            seconds, recovered, _, again, _ = _recover(spec, directory, strategy, options)
            if recovered != steps or again.recovered is None or again.recovered.source != "memory":
                raise RuntimeError(f"recovered step {recovered} from {again.recovered}, expected {steps} from memory")
            result["recovery_seconds_memory"] = seconds
            memory_path(Path(directory), options["region"], 0, 1).unlink()  # (the host lost)
        seconds, recovered, fresh, again, io = _recover(spec, directory, strategy, options)
        extra = io["recovery_peak_extra_bytes"]
        result.update(io, recovery_new_memory_seconds=new_memory_seconds(
            None if extra is None else max(0, extra - io["recovery_mapped_bytes"])))
        from_region = again.recovered is not None and again.recovered.source == "region"  # lightcheck's memory
        result["recovery_seconds_memory" if from_region else "recovery_seconds_disk"] = seconds
        if recovered != steps:
            raise RuntimeError(f"recovered step {recovered}, expected {steps}")
        result["recovery_error"] = state_error(_model_and_optimizer(fresh), live)
        result.update(_resume_check(fresh, after))
        if strategy == "lowdiff":
            replay = {}
            for threads in (1, 2):
                r = _recover(spec, directory, strategy, {**options, "replay_threads": threads})[3]
                replay[threads] = r.strategy.replay_seconds
            result["replay_seconds"] = {"serial": replay[1], "parallel_2_threads": replay[2]}


def _copy_and_hash(strategy: Any) -> dict[str, float | None]:
    """LightCheck's median time per checkpoint to copy the state (CUDA: on the device) and to have its
    checksums (the commit thread's wait for the copies and the hash)."""
    return {"copy_seconds": statistics.median(strategy.copy_seconds) if strategy.copy_seconds else None,
            "hash_seconds": statistics.median(strategy.hash_seconds) if strategy.hash_seconds else None}


def measure_baseline(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`measure` for a baseline (:mod:`everystep.eval.bench.baselines`): the same loop, counters and checks."""
    from .baselines import Baseline
    from .libraries import ALL_BASELINES

    steps, warmup, checks = spec["steps"], spec["warmup"], spec.get("checks", True)
    clock, seconds = time.perf_counter(), {}
    with _scratch(spec) as tmp:
        w = _build(spec, spec["seed"])
        baseline: Baseline = ALL_BASELINES[spec["strategy"]](Path(tmp) / "ckpt", w, spec.get("every") or 1)
        try:
            times, lost = [], []
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            seconds["build"], clock = time.perf_counter() - clock, time.perf_counter()
            try:
                with _traced(spec):
                    for step in range(1, steps + 1):
                        if step == warmup + 1:
                            baseline.wait()
                            at_warmup = (baseline.stall_seconds, baseline.checkpoints, baseline.bytes_written)
                        t0 = time.perf_counter()
                        _timed_step(w, step, baseline.before_update)
                        with tracing.span("baseline after_step", step=step):
                            baseline.after_step(step)  # (its save is part of the step)
                        if step > warmup:
                            times.append(time.perf_counter() - t0)
                        lost.append(step - baseline.last_durable_step)
                    baseline.wait()
            finally:
                baseline.close()
            peaks = _peaks()
            seconds["steps"], clock = time.perf_counter() - clock, time.perf_counter()
            result = {
                "strategy": spec["strategy"], "repeat": spec["repeat"], "every": spec["every"],
                "setting": {"every": spec.get("every") or 1, **_loop_setting(spec)}, "step_seconds": times,
                "mean_step_seconds": sum(times) / len(times), "stall_seconds": baseline.stall_seconds - at_warmup[0],
                "checkpoints": baseline.checkpoints - at_warmup[1],
                "bytes_per_step": (baseline.bytes_written - at_warmup[2]) / (steps - warmup), **peaks,
                "lost_steps_software": max(lost), "lost_steps_hardware": max(lost), **_UNCHECKED,
            }
            if checks:
                live = _model_and_optimizer(w)
                after = _train_on(w)
                fresh = _build(spec, spec["seed"])
                t0 = time.perf_counter()
                recovered, extra = peak_during(lambda: baseline.load(fresh))
                took = time.perf_counter() - t0
                if recovered != steps:
                    raise RuntimeError(f"{spec['strategy']} recovered step {recovered}, expected {steps}")
                result.update({f"recovery_seconds_{baseline.recovers_from}": took}, recovery_peak_extra_bytes=extra,
                              recovery_mapped_bytes=0,
                              recovery_new_memory_seconds=new_memory_seconds(extra),
                              recovery_error=state_error(_model_and_optimizer(fresh), live),
                              **_resume_check(fresh, after))
            seconds["checks"] = time.perf_counter() - clock
            return _across_ranks({**result, "seconds": seconds})
        finally:
            baseline.end()


def forked(argv: list[str]) -> int:
    """The entry point of a run forked by ``everystep bench``'s zygote (:func:`~everystep.eval.zygote.report_entry`)."""
    from ..zygote import report_entry

    return report_entry(measure, argv)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
