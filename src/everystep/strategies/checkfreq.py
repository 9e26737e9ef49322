"""``checkfreq``: CheckFreq's snapshot-then-persist.

At each checkpoint the state is copied to a host buffer — tensors the next forward may change
(BatchNorm statistics, RNG) at once, parameters and optimizer state on a snapshot thread that
overlaps the next forward and backward — and a persist thread writes the buffer to storage (with
``persist="process"``, has a writer process write it from shared memory:
:mod:`everystep.agent.writer`).
The next ``optimizer.step()`` waits only while that snapshot is still being taken; the wait is
recorded as ``snapshot_wait_seconds``. Two host buffers let one snapshot proceed while the
previous one is still being persisted; with both busy, the next snapshot waits for a buffer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..agent.writer import WriterProcess
from ..background import Worker, settled
from ..errors import ConfigError
from ..layout import TensorLayout
from ..parallelism import SHARDED_LAYOUTS
from ..storage import write_full
from ..storage.formats import RankShare
from ..storage.region import SlotWriter
from ..transport.host import HostBuffer, HostBufferPool, snapshot_into
from .full_state import FullState, FullStateConfig

__all__ = ["CheckFreq", "CheckFreqConfig", "AsyncSnapshot"]


@dataclass(kw_only=True, slots=True)
class CheckFreqConfig(FullStateConfig):
    buffers: int = 2
    """Host buffers: 1 is the paper's design (a snapshot waits for the previous persist)."""
    persist: str = "thread"
    """Where the snapshots are written: ``"thread"``, a thread of the training process, or
    ``"process"``, a writer process that maps the buffers (:mod:`everystep.agent.writer`; one
    process, checkpoints in everystep's own format)."""
    snapshot: str = "host"
    """``"host"``: the parameters and optimizer state are copied to host memory while the next step's
    forward and backward run, and its update waits for that copy. ``"device"``: they are first copied
    on the training device (as much device memory more as they take, kept from one checkpoint to the
    next), so the update waits only for that copy, and the host copy is made from it — the CheckFreq
    that Checkflow compares its device memory with."""
    writer_timeout: float = 600.0
    """``persist="process"``: seconds a write may go unanswered (a writer stopped or hung) before
    training fails with an error saying so."""

    def __post_init__(self) -> None:
        FullStateConfig.__post_init__(self)
        if self.writer_timeout <= 0:
            raise ConfigError(f"writer_timeout must be a positive number of seconds, got {self.writer_timeout}")
        if self.buffers < 1:
            raise ConfigError(f"buffers must be at least 1, got {self.buffers}")
        if self.persist not in ("thread", "process"):
            raise ConfigError(f"persist must be 'thread' or 'process', got {self.persist!r}")
        if self.snapshot not in ("host", "device"):
            raise ConfigError(f"snapshot must be 'host' or 'device', got {self.snapshot!r}")
        if self.persist == "process" and self.memory:
            raise ConfigError("persist='process' has a writer process write each snapshot to the directory, and "
                              "memory=True writes each one to the memory tier: give one of them")

    def check_job(self, world: int, full_format: str) -> None:
        """``persist="process"`` serves one training process writing everystep's own format."""
        FullStateConfig.check_job(self, world, full_format)
        if self.persist == "process" and (world != 1 or full_format != "safetensors"):
            raise ConfigError("persist='process' writes and commits each checkpoint in the writer process, which "
                              "serves one training process writing everystep's own format: use persist='thread' "
                              "under several processes or with full_format='dcp'")


class CheckFreq(FullState):
    name: ClassVar[str] = "checkfreq"
    other_world_size: ClassVar[bool] = True
    layer_updates: ClassVar[bool] = True
    sharded_layouts: ClassVar[frozenset[str]] = SHARDED_LAYOUTS
    Config = CheckFreqConfig
    config: CheckFreqConfig
    overlap: ClassVar[bool] = True
    """The snapshot overlaps the next forward and backward (False: training waits for it at once)."""

    def __init__(self, config: CheckFreqConfig | None = None) -> None:
        super().__init__(config)
        self.write_bandwidth: float | None = None
        """Bytes per second of the last full checkpoint's write, as measured."""
        """The newest checkpoint started: its staging and upload futures."""

    def _attach(self) -> None:
        self._staging: Future[Any] | None = None
        self._writer: WriterProcess | None = None
        if self.config.persist == "process":
            self.config.check_job(self.ctx.ranks.world, self.ctx.full_format)
            assert self.ctx.directory is not None
            self._writer = WriterProcess(self.ctx.directory.root, keep=self.config.keep,
                                         timeout=self.config.writer_timeout)
            self._pool = HostBufferPool(self.config.buffers, make=self._writer.buffer, dropped=self._writer.drop)
        else:
            self._pool = HostBufferPool(self.config.buffers)
        self._snapshotter = Worker("everystep-snapshot", self.errors)
        self._persister = Worker("everystep-persist", self.errors)
        self._stream = self.ctx.copy_stream()
        self._device_copies: dict[str, torch.Tensor] = {}

    def _on_state_ready(self, step: int, final: bool) -> None:
        if not self._due(step, final):
            return
        self._wait_snapshot()
        share, skeleton = self.ctx.full_share(step)
        tensors = share.local
        # with a memory tier, the snapshot goes straight into its slot (on CUDA by DMA into the mapping)
        buffer = self.tier.begin(tensors, skeleton) if self.tier is not None else self._pool.acquire(TensorLayout.of(tensors))
        stable = self.ctx.stable_keys(tensors)
        volatile = snapshot_into(buffer, tensors, [k for k in tensors if k not in stable])
        stable_keys = [k for k in tensors if k in stable]
        if self.config.snapshot == "device":  # the host copy is made from a copy on the device
            tensors = {**tensors, **self._on_device(tensors, stable_keys)}
        staging = self._snapshotter.submit("snapshot", self._take_snapshot, buffer, tensors, stable_keys, volatile)
        self._persister.post(f"background write of the checkpoint at step {step}", self._persist, step, staging, buffer,
                             skeleton, share)
        self._staging = staging
        if final or not self.overlap:
            self._wait_snapshot()

    def _on_device(self, tensors: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
        """``snapshot="device"``: ``keys`` of ``tensors`` copied on the training device (on its current
        stream), into memory kept for the next checkpoint of the same layout."""
        copies = self._device_copies
        if copies.keys() != set(keys) or any(copies[k].shape != tensors[k].shape or copies[k].dtype != tensors[k].dtype
                                             for k in keys):
            copies = self._device_copies = {k: torch.empty_like(tensors[k]) for k in keys}
        with torch.no_grad():
            torch._foreach_copy_([copies[k] for k in keys], [tensors[k] for k in keys])
        return copies

    def _take_snapshot(
        self, buffer: HostBuffer | SlotWriter, tensors: dict[str, torch.Tensor], keys: list[str], volatile: Any
    ) -> None:
        event = snapshot_into(buffer, tensors, keys, stream=self._stream)
        for e in (volatile, event):
            if e is not None:
                e.synchronize()

    def _persist(self, step: int, staging: Future[Any], buffer: HostBuffer | SlotWriter, skeleton: Any,
                 share: RankShare) -> None:
        try:
            assert self.ctx.catalog is not None
            settled(staging)
            if staging.exception() is not None:
                write_full(self.ctx.catalog, step, None, skeleton, share=share, error=staging.exception())  # raises, on every rank
            if isinstance(buffer, SlotWriter):  # the snapshot is in the memory tier's slot
                assert self.tier is not None
                nbytes, seconds = self.tier.commit(buffer, step, skeleton)
            elif self._writer is not None:  # written, committed and retained there
                t0 = time.perf_counter()
                nbytes = self._writer.write(step, buffer, skeleton).nbytes
                seconds = time.perf_counter() - t0
                self.ctx.catalog.count_written_elsewhere(nbytes)
                self.ctx.record_durable(step, seconds=seconds)
            else:
                nbytes, seconds = self._write_full(step, buffer, skeleton, share=share)
            self.write_bandwidth = nbytes / max(seconds, 1e-9)
        finally:
            if isinstance(buffer, HostBuffer):
                self._pool.release(buffer)
            elif staging.exception() is not None and self.tier is not None:
                self.tier.abort()

    def _wait_snapshot(self) -> None:
        """Wait for the snapshot in flight (charged to ``snapshot_wait_seconds``); raise failures."""
        if self._staging is not None:
            t0 = time.perf_counter()
            settled(self._staging)
            self._staging = None
            self.ctx.waited(time.perf_counter() - t0)
        self.errors.raise_pending()

    def _before_update(self, step: int) -> None:
        if self.config.snapshot == "host":  # ("device": the host copy reads the device's copy, not the state)
            self._wait_snapshot()

    def _wait(self) -> None:
        settled(self._staging)
        self._staging = None
        self._persister.drain()

    def _close(self) -> None:
        self._snapshotter.close()
        self._persister.close()
        if self._writer is not None:
            self._writer.close()


class AsyncSnapshot(CheckFreq):
    """``async``: the snapshot blocks training, the persist runs in the background — DCP's
    ``async_save`` and DataStates' design, the baseline GoCkpt calls Async (``checkfreq``, whose
    snapshot overlaps the next forward and backward, is its Async-O)."""

    name: ClassVar[str] = "async"
    overlap: ClassVar[bool] = False
