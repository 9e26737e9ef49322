"""The checkpointing libraries a user would pick today, run by ``everystep bench`` as baselines
(:class:`~everystep.eval.bench.baselines.Baseline`) beside everystep's strategies, on the same loop: each
configured as its documentation recommends for the fastest save it offers. They are the ``peers``
extra (``pip install "everystep[peers]"``, ``make install-peers``), never a dependency of everystep.

- ``dlrover``: DLRover's Flash Checkpoint (``DdpCheckpointer``): every ``every`` steps the state
  dict is copied into shared memory (``StorageType.MEMORY``), and every :data:`DISK_EVERY` steps
  its saver process writes it to the directory (``StorageType.DISK``). Without ``dlrover-run`` (a
  job master and its elastic agent), the checkpointer starts the saver process itself, as its
  documentation says of jobs under ``torchrun``: a child that ends with the training process's own
  exit, but lives on, orphaned, after a SIGKILL of it, when a restarted process may still find its
  memory (:mod:`everystep.eval.kills.libraries` shows both). The bench restores it within the process.
- ``lm_resiliency``: GEMINI's in-memory checkpoints (``enable_resiliency``), taken by its hook
  after ``optimizer.step()`` every ``every`` steps into host slots (pinned on a GPU) with the RNG
  and the caller's state (the scheduler and the data position, through ``extra_state_fn``), flushed
  to node-local files every :data:`DISK_EVERY` steps with its CRC-32 (``verify_integrity``). Its
  memory is replicated to a peer rank; in one process nothing outlives it but the files, from
  which a new handle recovers.
- ``torch_checkpointing``: ``CheckpointManager`` with its asynchronous saver (staging into shared
  memory, pinned on a GPU, and a writer process; one save in flight), the model's, optimizer's and
  scheduler's state dicts every ``every`` steps, ``optimizer.step()`` under ``manager.lock()`` as
  its guide says. Its direct I/O is off: its ``O_DIRECT`` writes of sizes that are not multiples of
  the block size fail with ``EINVAL`` on ext4 (the checkpoint is then lost).

None of them keeps the data position unless it is given as the caller's state (GEMINI): the bench's
resume check shows whether training goes on bitwise after each one's restore.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

from .baselines import BASELINES, Baseline, checkpoint_size, load_user_state, user_state

__all__ = ["LIBRARIES", "ALL_BASELINES", "DlroverFlash", "LmResiliency", "TorchCheckpointing", "DISK_EVERY", "missing"]

DISK_EVERY = 100
"""Steps between the writes to disk of the libraries that keep checkpoints in memory: the interval
DLRover's example and GEMINI's default (``disk_flush_interval``) give."""

_MODULES = {"dlrover": "dlrover.trainer.torch.flash_checkpoint.ddp", "lm_resiliency": "lm_resiliency",
            "torch_checkpointing": "torch_checkpointing"}


def missing(name: str) -> str | None:
    """Why the library of baseline ``name`` cannot run here (not installed, with its error), or None."""
    import importlib

    try:
        importlib.import_module(_MODULES[name])
    except ImportError as e:
        return f"{name} is not installed ({e}): pip install \"everystep[peers]\" (make install-peers)"
    return None


def _on_gpu(workload: Any) -> bool:
    return any(p.is_cuda for p in workload.model.parameters())


class DlroverFlash(Baseline):
    name = "dlrover"
    recovers_from: ClassVar[str] = "memory"

    def __init__(self, directory: Path, workload: Any, every: int) -> None:
        super().__init__(directory, workload, every)
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        logging.getLogger("dlrover").setLevel(logging.WARNING)  # (its INFO lines, several a save)
        self._kinds = StorageType
        self._checkpointer = DdpCheckpointer(str(directory))

    def _save(self, step: int) -> None:
        disk = step % DISK_EVERY == 0
        # (at its default path, <dir>/<step>/rank_0.pt, the one its load_checkpoint reads: its example's
        # own path, given, is written but never found by the load)
        self._checkpointer.save_checkpoint(step, user_state(self.w, step),
                                           storage_type=self._kinds.DISK if disk else self._kinds.MEMORY)
        if disk:
            self.last_durable_step = step  # (written by its saver process in the background)

    def wait(self) -> None:
        written = list(self.directory.glob("*/rank_*.pt"))
        self.bytes_written = sum(checkpoint_size(p) for p in written)

    def resume(self, workload: Any) -> int | None:
        try:
            return self.load(workload)
        except LookupError:
            return None

    def load(self, workload: Any) -> int:
        state = self._checkpointer.load_checkpoint()
        if not state:
            raise LookupError("dlrover's load_checkpoint found nothing")
        return load_user_state(workload, state)

    def end(self) -> None:
        """End the saver process it started: a daemon, which multiprocessing ends only at an
        interpreter's normal exit (a bench run leaves by ``os._exit``). Not at :meth:`close`: its
        :meth:`load` from memory asks the saver."""
        saver = getattr(getattr(self._checkpointer, "_engine", None), "saver_proc", None)
        if saver is not None and saver.is_alive():
            saver.terminate()
            saver.join(timeout=10)


class LmResiliency(Baseline):
    name = "lm_resiliency"
    recovers_from: ClassVar[str] = "disk"

    def __init__(self, directory: Path, workload: Any, every: int) -> None:
        super().__init__(directory, workload, every)
        # (a run's identity, which its restart gives again to take the node-local files: the directory's)
        self._run = "everystep-" + hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:16]
        self._handle = self._enable(workload)

    def _enable(self, w: Any) -> Any:
        from lm_resiliency import InMemoryCkptConfig, enable_resiliency

        handle = enable_resiliency(
            w.model, w.optimizer, interval=self.every, enable_detection=False,
            checkpoint=InMemoryCkptConfig(interval=self.every, disk_flush_interval=DISK_EVERY,
                                          disk_folder=str(self.directory), run_id=self._run, pin_memory=_on_gpu(w),
                                          verify_integrity=True),
            device=next(w.model.parameters()).device,
            extra_state_fn=lambda: {"scheduler": w.scheduler.state_dict(), "data": w.data.state_dict()},
            load_extra_state_fn=lambda s: (w.scheduler.load_state_dict(s["scheduler"]),
                                           w.data.load_state_dict(s["data"])))
        manager = handle.ckpt_manager
        save = manager.save

        def timed(*args: Any, **kwargs: Any) -> Any:  # (its capture, on the training thread: the stall)
            t0 = time.perf_counter()
            try:
                return save(*args, **kwargs)
            finally:
                self.stall_seconds += time.perf_counter() - t0
                self.checkpoints += 1

        manager.save = timed
        return handle

    def after_step(self, step: int) -> None:  # (its hook after optimizer.step() took the checkpoint)
        if step % DISK_EVERY == 0:
            self.last_durable_step = step

    def wait(self) -> None:
        self.bytes_written = sum(checkpoint_size(p) for p in self.directory.rglob("*") if p.is_file())

    def load(self, workload: Any) -> int:
        """As a restarted process: the handle flushes what it holds for the restart and closes; a new
        one on ``workload`` recovers from the node-local files."""
        self._handle.flush_for_restart()
        self._handle.close()
        self._handle = self._enable(workload)
        return int(self._handle.recovered_step)

    def resume(self, workload: Any) -> int | None:  # (the handle made on ``workload`` recovered into it)
        step = int(self._handle.recovered_step)
        return step if step >= 0 else None

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()


class TorchCheckpointing(Baseline):
    name = "torch_checkpointing"
    recovers_from: ClassVar[str] = "disk"
    keep = 2

    def __init__(self, directory: Path, workload: Any, every: int) -> None:
        super().__init__(directory, workload, every)
        self._manager = self._make()
        self._write: Any = None
        self._writing = 0
        self._held: Any = None

    @staticmethod
    def _make() -> Any:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        return CheckpointManager(CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def _path(self, step: int) -> Path:
        return self.directory / f"step-{step:012d}"

    def before_update(self) -> None:
        t0 = time.perf_counter()
        self._held = self._manager.lock()  # (waits while a capture of the state is in progress)
        self._held.__enter__()
        self.stall_seconds += time.perf_counter() - t0

    def after_step(self, step: int) -> None:
        if self._held is not None:
            self._held.__exit__(None, None, None)
            self._held = None
        super().after_step(step)

    def _save(self, step: int) -> None:
        self._finish()
        self._write = self._manager.save(str(self._path(step)), user_state(self.w, step))
        self._writing = step

    def _finish(self) -> None:
        if self._write is None:
            return
        self._write.result()
        self._write = None
        self.bytes_written += checkpoint_size(self._path(self._writing))
        self.last_durable_step = self._writing
        for old in sorted(self.directory.glob("step-*"))[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        self._finish()

    def resume(self, workload: Any) -> int | None:
        return self.load(workload) if any(self.directory.glob("step-*")) else None

    def load(self, workload: Any) -> int:
        """As a restarted process: a new manager reads the newest checkpoint written."""
        self._manager.close()
        self._manager = self._make()
        newest = sorted(self.directory.glob("step-*"))[-1]
        # (the model's tensors as the template its values are read into; the rest read as stored: a
        # fresh optimizer's empty state would take none of the saved one)
        got = self._manager.load(str(newest), into={"model": workload.model.state_dict(), "optimizer": None,
                                                    "scheduler": None, "step": None})
        return load_user_state(workload, got)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()


LIBRARIES: dict[str, type[Baseline]] = {cls.name: cls for cls in (DlroverFlash, LmResiliency, TorchCheckpointing)}

ALL_BASELINES: dict[str, type[Baseline]] = {**BASELINES, **LIBRARIES}
"""PyTorch's own ways and the libraries, by the names ``everystep bench --strategies`` takes."""
