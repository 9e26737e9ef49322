"""One training run's configuration (``everystep train``'s flags), checked before any process starts."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...compress import parse_spec
from ...errors import ConfigError
from ...strategies import STRATEGIES, create, default_full_format, full_format_refusal, sharded_refusal
from ..workloads import LAYOUT_OF, OPTIMIZERS, PARALLEL, WORKLOADS, check_device

__all__ = ["TrainConfig", "usable_cores", "check_layout"]


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. Steps are numbered from 1."""

    workload: str = "gpt2-tiny"
    strategy: str = "checkfreq"
    steps: int = 20
    directory: str | None = None
    every: int | None = None
    """Checkpoint interval; None: the strategy's default."""
    keep: int = 2
    seed: int = 0
    threads: int = 1
    optimizer: str = "adamw"
    fail_at: tuple[int, ...] = ()
    fail_mode: str = "software"
    options: dict[str, Any] = field(default_factory=dict)
    compress: str | None = None
    """Gradient compression for training itself (``topk:0.01``, ``quant8``); None trains dense."""
    progress: bool = True
    nproc: int = 1
    """Training processes (ranks), started by the supervisor."""
    parallel: str = "ddp"
    """How the ranks hold the state: ``ddp`` (each a DistributedDataParallel replica), ``fsdp`` (FSDP2
    shards), ``hsdp`` (two replicas, each sharded over half the ranks), or ``zero1`` (DDP with a
    ZeroRedundancyOptimizer); under FSDP2 and HSDP full checkpoints are in DCP's format."""
    deadline: float | None = None
    """Unix time by which the run must have ended: it stops early with a final checkpoint."""
    close_timeout: float | None = 300.0
    """The most seconds the Checkpointer's close waits for storage (``close_timeout``)."""
    full_format: str | None = None
    """How full checkpoints are stored: ``safetensors`` or ``dcp`` (torch.distributed.checkpoint); None:
    ``dcp`` when sharded, else ``safetensors``."""
    stagger: int | None = None
    """At most this many ranks read the checkpoint at once when they restore; None: all."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (each rank on a GPU of its own, NCCL between them, deterministic kernels)."""
    max_nproc: int | None = None
    """The most ranks ``nproc`` may ask for; None: the cores this process may run on."""
    remote: str | None = None
    """An s3:// URL the full checkpoints are also uploaded to (:class:`~everystep.storage.remote.tier.RemoteTier`)."""
    remote_every: int | None = None
    """Steps between uploads; None: Young/Daly's."""
    in_backward: bool = False
    """Update each layer during backward (:class:`~everystep.OptimizerInBackward`; under DDP once its
    bucket is all-reduced) instead of clipping the gradients and calling ``optimizer.step()``."""

    def __post_init__(self) -> None:
        self.fail_at = tuple(sorted(set(self.fail_at)))
        if self.workload not in WORKLOADS:
            raise ConfigError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(sorted(STRATEGIES))}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {self.nproc}")
        if self.stagger is not None and self.stagger < 1:
            raise ConfigError(f"--stagger must be at least 1, got {self.stagger}")
        if self.parallel not in PARALLEL:
            raise ConfigError(f"--parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        strategy = STRATEGIES[self.strategy]
        if self.full_format is None:
            self.full_format = default_full_format(strategy, LAYOUT_OF[self.parallel])
        refusal = full_format_refusal([self.strategy], self.full_format, "drop --full-format")
        if refusal:
            raise ConfigError(refusal)
        if self.parallel != "ddp":
            self._check_sharded()
        if self.remote is not None and not strategy.needs_store:
            raise ConfigError(f"--remote takes a strategy that stores checkpoints; {self.strategy!r} stores nothing")
        check_device(self.device, self.nproc)
        if self.fail_mode not in ("software", "hardware"):
            raise ConfigError(f"--fail-mode must be software or hardware, got {self.fail_mode!r}")
        bad = [s for s in self.fail_at if not 1 <= s <= self.steps]
        if bad:
            raise ConfigError(f"--fail-at steps must lie in 1..{self.steps}; got {', '.join(map(str, bad))}")
        if self.strategy != "none" and self.directory is None:
            raise ConfigError(f"strategy {self.strategy!r} needs --dir")
        if self.in_backward and (self.compress is not None or not STRATEGIES[self.strategy].layer_updates):
            able = ", ".join(sorted(n for n, cls in STRATEGIES.items() if cls.layer_updates))
            raise ConfigError(f"--in-backward takes no --compress, and one of the strategies {able}")
        if self.compress is not None:
            parse_spec(self.compress)  # validates the spec
        elif STRATEGIES[self.strategy].needs_compression:
            raise ConfigError(f"--strategy {self.strategy} reuses compressed gradients: add --compress topk:0.01, quant8 "
                              "or powersgd:rank=4")
        limit = self.max_nproc if self.max_nproc is not None else usable_cores()
        if self.nproc > limit:
            raise ConfigError(f"--nproc {self.nproc} is more ranks than this machine runs at once ({limit}, its usable "
                              "cores); raise the limit with --max-nproc if you mean it")
        flagged = sorted(set(self.options) & {"every", "keep"})
        if flagged:
            raise ConfigError(f"--option {flagged[0]}=…: give --{flagged[0]} instead")
        given = {k: v for k, v in (("every", self.every), ("keep", self.keep)) if v is not None}
        made = create(self.strategy, **given, **self.options)  # validates the options before any process starts
        try:
            made.config.check_job(self.nproc, self.full_format)
        except ConfigError as e:
            raise ConfigError(f"--option: {e} (--nproc {self.nproc}, --full-format {self.full_format})") from None


    def _check_sharded(self) -> None:
        check_layout(self.parallel, [self.strategy], compress=self.compress, in_backward=self.in_backward)


def check_layout(parallel: str, strategies: Iterable[str], *, compress: Any, in_backward: bool,
                 others: str = "") -> None:
    """What a sharded layout (``--parallel``) cannot go with: compression, updates in backward, an
    everystep strategy that does not checkpoint its shards (``others``: what else to suggest)."""
    layout = LAYOUT_OF[parallel]
    if layout is None:
        return
    if compress is not None or in_backward:
        raise ConfigError(f"--parallel {parallel} takes no --compress and no --in-backward (each is built on a "
                          "DistributedDataParallel replica's whole gradients and optimizer)")
    for name in strategies:
        strategy = STRATEGIES.get(name)
        if strategy is not None and layout not in strategy.sharded_layouts:
            why, able = sharded_refusal(strategy, layout)
            raise ConfigError(f"--parallel {parallel}: strategy {name} does not checkpoint {layout} shards ({why}); use "
                              f"one of {', '.join(able)}{others}")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
