"""``lowdiff``: LowDiff — the compressed gradients training already computes are the differentials.

Each step's compressed gradient (what the optimizer consumed) goes, in order and without a copy
on the training path, through a bounded *reusing queue* to a writer thread. The writer moves it to
host memory and gathers ``batch`` steps into one object: a concatenation of per-step records,
never a sum (Adam, momentum and weight decay are not linear in the gradient). With
``sum_linear=True`` and plain SGD (no momentum, no weight decay, not Nesterov), a batch stores
the sum of lr·g instead, which is exact in real arithmetic and equal up to rounding in floating
point; any other optimizer is refused.

A full checkpoint every ``every`` steps (F) goes through CheckFreq's asynchronous path. Recovery
loads the newest full checkpoint that verifies and replays the gap-free chain of verified
batches that starts at its step. With ``adapt=True`` and ``mtbf`` seconds, F and b follow LowDiff's
optimum computed from the measured step time, write bandwidth and replay time.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..background import Worker
from ..compress import decompress, parameter_names
from ..errors import ConfigError, EverystepError
from ..policy import LowDiffCosts, lowdiff_integer_optimum
from ..policy.interval import due
from ..recovery import Candidate, Link
from ..replay import Replayer, StepRecord
from ..state import check_group_settings, group_scalars
from ..storage import malformed, manifest_name
from ..storage.formats import RankShare, commit_tensors
from ..transport.host import to_host
from .base import StrategyConfig
from .differential import Differential

__all__ = ["LowDiff", "LowDiffConfig"]


@dataclass(kw_only=True, slots=True)
class LowDiffConfig(StrategyConfig):
    """``every`` is F, the full-checkpoint interval; a differential is recorded every step."""

    every: int = 50
    batch: int = 1
    """b: steps per differential write."""
    queue: int = 64
    """Steps the reusing queue holds before training waits (bounded memory, measured stall)."""
    replay_threads: int = 2
    sum_linear: bool = False
    adapt: bool = False
    mtbf: float | None = None
    """Mean time between failures in seconds, for ``adapt``."""
    residual: str = "keep"
    """``keep``: each batch also stores the compression's error-feedback residuals (dense), so that
    recovery is bitwise. ``drop``: step records only; recovery takes the residuals of the base full
    checkpoint, and training goes on correctly but not bitwise (``source`` says ``lossy``)."""

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if self.residual not in ("keep", "drop"):
            raise ConfigError(f"residual must be 'keep' or 'drop', got {self.residual!r}")
        if self.batch < 1:
            raise ConfigError(f"batch must be at least 1 step, got {self.batch}")
        if self.queue < 1 or self.replay_threads < 1:
            raise ConfigError("queue and replay_threads must be at least 1")
        if self.adapt and (self.mtbf is None or self.mtbf <= 0):
            raise ConfigError("adapt=True needs mtbf, the mean time between failures in seconds")


def _linear_in_gradient(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) is not torch.optim.SGD:
        return False
    return all(
        not g.get("momentum") and not g.get("weight_decay") and not g.get("nesterov") and not g.get("maximize")
        for g in optimizer.param_groups
    )


_TAKING = "moving a step's gradients to host memory for the differential batch"


class LowDiff(Differential):
    name: ClassVar[str] = "lowdiff"
    sharded_refusal: ClassVar[str] = (
        "its differentials are the compressed gradients of a DDP communication hook, which FSDP2 and tensor "
        "parallelism have no equivalent of")
    kind: ClassVar[str] = "diff"
    needs_compression: ClassVar[bool] = True
    Config = LowDiffConfig
    config: LowDiffConfig

    def __init__(self, config: LowDiffConfig | None = None) -> None:
        super().__init__(config)
        self.interval, self.batch = self.config.every, self.config.batch
        self._base = 0
        self._pending = 0  # steps recorded since the last flush
        self._records: list[StepRecord] = []  # the writer's batch in the making (writer thread only)
        self._step_started = 0.0
        self._step_seconds: list[float] = []
        self.replay_seconds: float | None = None
        self.record_bytes = 0
        """Bytes of step records (compressed gradients) this rank wrote, for ``recorded_steps`` steps;
        ``end_bytes``: of the batches' end states."""
        self.end_bytes = 0
        self.recorded_steps = 0
        self.last_costs: LowDiffCosts | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def _attach(self) -> None:
        ctx = self.ctx
        compression = ctx.components.compression
        if compression is None:
            raise ConfigError("lowdiff reuses compressed gradients: pass compression= to the Checkpointer (a "
                              "GradientCompression, or the hook from ddp_compression() that the DDP model uses)")
        self.compression = compression
        if self.config.sum_linear and not _linear_in_gradient(ctx.components.optimizer):
            raise ConfigError(
                f"sum_linear needs an update that is linear in the gradient (plain SGD without momentum, weight "
                f"decay or Nesterov); {type(ctx.components.optimizer).__name__} with these settings is not, so "
                "batches must stay concatenations of per-step records"
            )
        if self.config.adapt and ctx.ranks.distributed:
            raise ConfigError("adapt=True re-plans (F, b) from one process's measurements; under several ranks give "
                              "every and batch (everystep share computes them)")
        self._stream = self.ctx.copy_stream()  # (CUDA: records and end states go to pinned memory on it)
        # The reusing queue: the writer is at most `queue` steps behind, else training waits.
        self._attach_full(self.interval, Worker("everystep-lowdiff-writer", self.errors, bound=self.config.queue))

    def setting(self) -> dict[str, Any]:
        """``every`` is F, the full-checkpoint interval, and ``batch`` b (both as re-planned by ``adapt``)."""
        return {**super().setting(), "every": self.interval, "batch": self.batch}

    # -- training path -------------------------------------------------------------------------

    def _on_step_end(self, step: int) -> None:
        now = time.perf_counter()
        if self._step_started:
            self._step_seconds = (self._step_seconds + [now - self._step_started])[-20:]
        self._step_started = now
        taken = self.compression.take()
        grads = taken or {}
        # (CUDA: into pinned memory on the side stream, one batched copy; the writer waits for it)
        flat, copied = to_host({f"{n}\0{k}": t for n, c in grads.items() for k, t in c.items()}, self._stream)
        record = StepRecord(step=step, skipped=taken is None, groups=group_scalars(self.ctx.components.optimizer),
                            grads={n: {k: flat[f"{n}\0{k}"] for k in c} for n, c in grads.items()})
        t0 = time.perf_counter()
        self._writer.post(_TAKING, self._take, record, copied)  # blocks while the writer is `queue` steps behind
        self.ctx.waited(time.perf_counter() - t0)
        self._pending += 1

    def _on_state_ready(self, step: int, final: bool) -> None:
        if self._pending and (final or due(step, self.interval) or self._pending >= self.batch):
            tensors, skeleton = self.ctx.components.end_state(self.ctx.boundary, step,
                                                              residuals=self.config.residual == "keep")
            tensors, copied = to_host(tensors, self._stream)
            self._writer.post(f"writing the differential batch ending at step {step}", self._flush, self._base, tensors,
                              skeleton, copied)
            self._pending = 0
        if self._full_if_due(step, self.interval, final) and self.config.adapt:
            self._adapt()

    # -- the writer ----------------------------------------------------------------------------

    def _take(self, record: StepRecord, copied: Any) -> None:
        """Writer thread: a step's record into the batch, once its copy to the host (``copied``, an
        event; None: nothing to wait for) is in."""
        try:
            if copied is not None:
                copied.synchronize()
            self._records.append(record)  # (its tensors in host memory: to_host's, or the CPU's own)
        except BaseException:
            self._records = []  # a batch without this step must not be written: the chain ends before it
            raise

    def _flush(self, base: int, end_tensors: dict[str, torch.Tensor], end_skeleton: Any, copied: Any) -> None:
        records, self._records = self._records, []
        if records:
            if copied is not None:
                copied.synchronize()
            self._write_batch(base, records, end_tensors, end_skeleton)

    def _write_batch(self, base: int, records: list[StepRecord], end_tensors: dict[str, torch.Tensor], end_skeleton: Any) -> None:
        assert self.ctx.catalog is not None
        tensors: dict[str, torch.Tensor] = {}
        steps_meta = []
        first, last = records[0].step, records[-1].step
        if self.config.sum_linear:
            records = [self._summed(records)]
        for r in records:
            for name, compressed in r.grads.items():
                for key, t in compressed.items():
                    tensors[f"g/{r.step}/{name}/{key}"] = t
            steps_meta.append({"step": r.step, "skipped": r.skipped, "groups": r.groups, "params": sorted(r.grads)})
        for key, t in end_tensors.items():
            tensors[f"end{key}"] = t
        replicated = {k for k in tensors if k.startswith("g/")}
        share = RankShare.of(tensors, replicated, self.ctx.catalog.ranks)  # the share this rank writes
        # (retention: a batch committed after a newer full checkpoint goes now)
        self.ctx.persist_record(last, functools.partial(
            commit_tensors, self.ctx.catalog, "diff", kind="diff", step=last, tensors=tensors, share=share,
            replicated=replicated, requires=(manifest_name("full", base),), rank_meta={"end": end_skeleton},
            meta={"base": base, "first": first, "last": last, "steps": steps_meta, "compression": self.compression.spec,
                  "summed": self.config.sum_linear}), keep=self.config.keep)
        self.record_bytes += sum(t.nbytes for k, t in share.local.items() if k in replicated)
        self.end_bytes += sum(t.nbytes for k, t in share.local.items() if k not in replicated)
        self.recorded_steps += last - first + 1

    def _summed(self, records: list[StepRecord]) -> StepRecord:
        """One record whose 'gradient' is Σ lr_s·g_s per parameter (plain SGD only), stored dense."""
        like = {n: p for p, n in parameter_names(self.ctx.components.model).items()}
        total: dict[str, torch.Tensor] = {}
        for r in records:
            if r.skipped:
                continue
            lr = r.groups[0]["lr"]
            for name, compressed in r.grads.items():
                g = decompress(compressed, like[name].detach().cpu())
                total[name] = total.get(name, torch.zeros_like(g)).add_(g, alpha=lr)
        return StepRecord(step=records[-1].step, skipped=False, groups=records[-1].groups,
                          grads={n: {"dense": t} for n, t in total.items()})

    # -- adaptation ----------------------------------------------------------------------------

    def _adapt(self) -> None:
        """Re-share (F, b) from what was measured: step time, write bandwidth, replay cost."""
        directory = self.ctx.directory
        if not self._step_seconds or directory is None:
            return
        fulls = directory.fulls()
        if not fulls:
            return
        size = max(m.nbytes for m in fulls)
        tau = sorted(self._step_seconds)[len(self._step_seconds) // 2]
        bandwidth = self.full.write_bandwidth
        if bandwidth is None:  # no full checkpoint has been timed yet
            return
        merge = max(self.replay_seconds or tau * 0.2, 1e-6) * self.batch
        costs = LowDiffCosts(iteration_seconds=tau, mtbf_seconds=float(self.config.mtbf or 3600), write_bandwidth=bandwidth,
                             full_bytes=size, load_seconds=size / bandwidth, merge_seconds=merge)
        self.last_costs = costs
        self.interval, self.batch = lowdiff_integer_optimum(costs)

    # -- recovery ------------------------------------------------------------------------------

    def _recover(self) -> Candidate | None:
        """Newest verified full checkpoint, then the gap-free chain of verified batches, replayed."""
        c = self.ctx.components

        def apply(links: Iterator[Link]) -> None:
            replayer = Replayer(c.model, c.optimizer, threads=self.config.replay_threads)
            t_replay = time.perf_counter()
            for link in links:
                try:
                    records = _records(link, c.optimizer, set(parameter_names(c.model).values()))
                except EverystepError as e:
                    warnings.warn(f"the differential chain from step {link.manifest.meta['base']} ends at step "
                                  f"{link.first - 1}: {e}", stacklevel=5)
                    break
                if link.manifest.meta.get("summed"):
                    self._apply_sum(records)
                else:
                    replayer.apply(records)
            self.replay_seconds = time.perf_counter() - t_replay

        def source(full: int, step: int) -> str:
            lossy = step > full and self.config.residual == "drop" and c.compression is not None
            return f"disk (lossy: residuals of step {full})" if lossy else "disk"

        self._pending = 0
        return self._recover_chain(apply, source)

    def _apply_sum(self, records: list[StepRecord]) -> None:
        names = parameter_names(self.ctx.components.model)
        with torch.no_grad():
            for p, name in names.items():
                for r in records:
                    if name in r.grads:
                        p.sub_(r.grads[name]["dense"].to(p.device).view_as(p))


def _records(link: Link, optimizer: torch.optim.Optimizer, names: set[str]) -> list[StepRecord]:
    """The step records of a LowDiff batch, checked before any is applied: consecutive steps from
    its first to its own, each with this optimizer's settings and gradients of parameters it has;
    raises an EverystepError naming what is wrong."""
    what = f"differential {link.manifest.name}"
    with malformed(what):
        records = [StepRecord(step=s["step"], skipped=s["skipped"], groups=s["groups"],
                              grads={n: _compressed(link.tensors, s["step"], n) for n in s["params"]})
                   for s in link.manifest.meta["steps"]]
        summed = link.manifest.meta.get("summed")
        steps = [link.manifest.step] if summed else list(range(link.first, link.manifest.step + 1))
        if [r.step for r in records] != steps or \
                not all(type(r.skipped) is bool and set(r.grads) <= names for r in records):
            raise ValueError("its records are not those of its steps, of this model's parameters")
        if summed and not all(set(g) == {"dense"} for r in records for g in r.grads.values()):
            raise ValueError("it says its updates are summed, and they are not dense ones")
    for r in records:
        check_group_settings(optimizer, r.groups, partial=True)
    return records


def _compressed(tensors: dict[str, torch.Tensor], step: int, name: str) -> dict[str, torch.Tensor]:
    prefix = f"g/{step}/{name}/"
    found = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not found:
        raise KeyError(f"the record of step {step} lacks parameter {name!r}")
    return found
