"""``checkfreq``: CheckFreq's snapshot-then-persist.

At each checkpoint the state is copied to a host buffer — tensors the next forward may change
(BatchNorm statistics, RNG) at once, parameters and optimizer state on a snapshot thread that
overlaps the next forward and backward — and a persist thread writes the buffer to storage.
The next ``optimizer.step()`` waits only while that snapshot is still being taken; the wait is
recorded as ``snapshot_wait_seconds``. Two host buffers let one snapshot proceed while the
previous one is still being persisted; with both busy, the next snapshot waits for a buffer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import ConfigError
from ..storage.sharded import ShardPlan
from ..storage.tensorfile import buffer_chunks
from ..transport.host import HostBuffer, HostBufferPool, TensorLayout, snapshot_into
from ..storage.full import write_full
from .base import BackgroundErrors, StrategyConfig, StrategyContext

__all__ = ["CheckFreq"]


@dataclass(kw_only=True, slots=True)
class CheckFreqConfig(StrategyConfig):
    buffers: int = 2
    """Host buffers: 1 is the paper's design (a snapshot waits for the previous persist)."""

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if self.buffers < 1:
            raise ConfigError(f"buffers must be at least 1, got {self.buffers}")


class CheckFreq:
    name: ClassVar[str] = "checkfreq"
    needs_store: ClassVar[bool] = True
    other_world_size: ClassVar[bool] = True
    """Only the full state is stored: a job of another size can resume from it."""
    Config = CheckFreqConfig

    def __init__(self, config: CheckFreqConfig | None = None) -> None:
        self.config = config or CheckFreqConfig()
        self._last = -1
        self._snapshot: Future[Any] | None = None
        self._persists: list[Future[Any]] = []
        self._errors = BackgroundErrors()
        self.write_bandwidth: float | None = None
        """Bytes per second of the last full checkpoint's write, as measured."""

    def attach(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self._pool = HostBufferPool(self.config.buffers)
        self._snapshotter = ThreadPoolExecutor(1, thread_name_prefix="everystep-snapshot")
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="everystep-persist")
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        self._errors.raise_pending()

    def on_state_ready(self, step: int, *, final: bool = False) -> None:
        self._errors.raise_pending()
        if step == self._last or (step % self.config.every and not final):
            return
        self._wait_snapshot()
        plan, skeleton = self.ctx.full_plan(step)
        tensors = plan.local
        layout = TensorLayout.of(tensors)
        buffer = self._pool.acquire(layout)
        stable = self.ctx.stable_keys(tensors)
        volatile = snapshot_into(buffer, tensors, [k for k in tensors if k not in stable])
        stable_keys = [k for k in tensors if k in stable]
        self._snapshot = self._snapshotter.submit(self._take_snapshot, buffer, tensors, stable_keys, volatile)
        self._persists = [f for f in self._persists if not f.done()]
        self._persists.append(self._persister.submit(self._persist, step, self._snapshot, buffer, skeleton, plan))
        self._last = step
        if final:
            self._wait_snapshot()

    def _take_snapshot(
        self, buffer: HostBuffer, tensors: dict[str, torch.Tensor], keys: list[str], volatile: Any
    ) -> None:
        event = snapshot_into(buffer, tensors, keys, stream=self._stream)
        for e in (volatile, event):
            if e is not None:
                e.synchronize()

    def _persist(self, step: int, snapshot: Future[Any], buffer: HostBuffer, skeleton: Any, plan: ShardPlan) -> None:
        try:
            assert self.ctx.store is not None
            try:
                snapshot.result()
            except BaseException as e:
                write_full(self.ctx.store, step, None, skeleton, plan=plan, error=e)  # raises, on every rank
            t0 = time.perf_counter()
            manifest = write_full(self.ctx.store, step, buffer_chunks(buffer.layout, buffer.memoryview()), skeleton,
                                  plan=plan, tensors=buffer.views, format=self.ctx.full_format)
            seconds = time.perf_counter() - t0
            self.write_bandwidth = manifest.nbytes / max(seconds, 1e-9)
            self.ctx.committed(step, seconds=seconds)
            self.ctx.store.retain(self.config.keep)
        except BaseException as e:
            self._errors.record(f"background write of the checkpoint at step {step}", e)
        finally:
            self._pool.release(buffer)

    def _wait_snapshot(self) -> None:
        if self._snapshot is None:
            return
        t0 = time.perf_counter()
        try:
            self._snapshot.result()
        except BaseException as e:
            self._errors.record("snapshot", e)
        finally:
            self._snapshot = None
            self.ctx.stats.snapshot_wait_seconds += time.perf_counter() - t0
        self._errors.raise_pending()

    def before_update(self, step: int) -> None:
        self._wait_snapshot()

    def wait(self) -> None:
        try:
            self._wait_snapshot()
        finally:
            for f in self._persists:
                f.result()  # _persist records its own failures
            self._persists.clear()
        self._errors.raise_pending()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._snapshotter.shutdown(wait=True)
            self._persister.shutdown(wait=True)
