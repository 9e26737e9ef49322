"""What a PyTorch user would run instead of everystep, each the way its documentation shows it, so
that ``everystep bench`` measures them beside everystep's strategies with the same loop.

- ``torch_save``: ``torch.save`` of the model's, optimizer's and scheduler's state dicts to a
  temporary file, fsynced, renamed over the previous checkpoint; ``torch.load(weights_only=True)``
  to recover.
- ``dcp``: ``torch.distributed.checkpoint.save`` of an application state (a ``Stateful`` holding
  ``get_state_dict(model, optimizer)`` and the scheduler), one directory per checkpoint; ``dcp.load``.
- ``dcp_async``: ``dcp.async_save`` with a ``DefaultStager`` (pinned memory and its own stream on
  CUDA; on a CPU-only machine its CUDA options are off, as they must be there), the next save
  waiting for the previous upload and the next ``optimizer.step()`` for the staging, as TorchTitan
  does it.

Under several ranks (``everystep bench --nproc``) ``dcp`` and ``dcp_async`` save from every rank into
one directory per checkpoint, each rank its state (under FSDP2 its shards), as TorchTitan runs them;
``torch_save``, one process's ``state_dict`` in one file, runs in one process only.

Like a user's, none of them saves the RNG or the data position: the bench's resume check shows
whether training goes on bitwise after their recovery. Their checkpoints live in the bench's own
temporary directory; DCP stores the scheduler's plain values in pickle form, which its loader
unpickles, so load a baseline's checkpoint only from a directory you trust.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["BASELINES", "Baseline", "checkpoint_size", "user_state", "load_user_state", "TorchSave", "DcpSave", "DcpAsyncSave"]


def user_state(w: Any, step: int) -> dict[str, Any]:
    """What a user saves of a workload in the documentation's examples: the model's, optimizer's and
    scheduler's state dicts, and the step (no RNG, no data position)."""
    return {"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict(),
            "scheduler": w.scheduler.state_dict(), "step": step}


def load_user_state(w: Any, state: dict[str, Any]) -> int:
    """Load what :func:`user_state` saved into workload ``w``; its step."""
    w.model.load_state_dict(state["model"])
    w.optimizer.load_state_dict(state["optimizer"])
    w.scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def checkpoint_size(path: Path) -> int:
    """The bytes of a checkpoint: a file's, or a folder's files'."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Baseline:
    """A baseline's checkpointing, driven by the bench's training loop.

    Call order: :meth:`before_update` before each ``optimizer.step()``; :meth:`after_step` after
    each step; :meth:`wait`, then :meth:`close` at the end; :meth:`load` into a fresh workload;
    :meth:`end` last, whatever happened.
    The counters match :class:`~everystep.strategies.CheckpointStats`'s names.
    """

    name: ClassVar[str]
    recovers_from: ClassVar[str] = "disk"
    """Where :meth:`load` reads in the bench's check (a restore within the process): ``"disk"`` or
    ``"memory"``."""

    def __init__(self, directory: Path, workload: Any, every: int) -> None:
        self.directory, self.w, self.every = directory, workload, every
        directory.mkdir(parents=True, exist_ok=True)
        self.stall_seconds = 0.0
        self.checkpoints = 0
        self.bytes_written = 0
        self.last_durable_step = 0

    def after_step(self, step: int) -> None:
        if step % self.every == 0:
            t0 = time.perf_counter()
            self._save(step)
            self.stall_seconds += time.perf_counter() - t0
            self.checkpoints += 1

    def before_update(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        self.wait()

    def end(self) -> None:
        """After the checks (:meth:`load`): end what the baseline started that outlives :meth:`close`."""

    def _save(self, step: int) -> None:
        raise NotImplementedError

    def load(self, workload: Any) -> int:
        """Restore the newest checkpoint into ``workload``'s model, optimizer and scheduler; its step."""
        raise NotImplementedError

    def resume(self, workload: Any) -> int | None:
        """In a restarted process (made on ``workload``): restore what is found; its step, or None
        where nothing is."""
        return self.load(workload)


class TorchSave(Baseline):
    name = "torch_save"

    @property
    def _path(self) -> Path:
        return self.directory / "checkpoint.pt"

    def _save(self, step: int) -> None:
        w = self.w
        tmp = self.directory / "checkpoint.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save(user_state(w, step), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)
        self.bytes_written += checkpoint_size(self._path)
        self.last_durable_step = step

    def load(self, workload: Any) -> int:
        return load_user_state(workload, torch.load(self._path, map_location="cpu", weights_only=True))


class _AppState(Stateful):
    """DCP's documented pattern: the application's state as one ``Stateful``."""

    def __init__(self, workload: Any, step: int = 0) -> None:
        self.w, self.step = workload, step

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.w.model, self.w.optimizer)
        return {"model": model, "optimizer": optimizer, "scheduler": self.w.scheduler.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.w.model, self.w.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.w.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])


def _ranks() -> tuple[int, int]:
    """This process's rank and the job's world size (0 and 1 outside torch.distributed)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DcpSave(Baseline):
    """Under several ranks every rank saves its state (its shards, under FSDP2) into one directory per
    checkpoint, as TorchTitan does; rank 0 removes the old ones."""

    name = "dcp"
    keep = 2

    def __init__(self, directory: Path, workload: Any, every: int) -> None:
        super().__init__(directory, workload, every)
        self.rank, self.world = _ranks()

    def _checkpoint(self, step: int) -> Path:
        return self.directory / f"step-{step:012d}"

    def _committed(self, step: int) -> None:
        path = self._checkpoint(step)
        # this rank's files (DCP names them __<rank>_<n>.distcp), and its index on the coordinator
        self.bytes_written += checkpoint_size(path) if self.world == 1 else \
            sum(checkpoint_size(p) for p in path.glob(f"__{self.rank}_*")) \
            + (checkpoint_size(path / ".metadata") if self.rank == 0 else 0)
        self.last_durable_step = step
        old = sorted(self.directory.glob("step-*"))[:-self.keep] if self.rank == 0 else []
        for path in old:
            shutil.rmtree(path, ignore_errors=True)

    def _save(self, step: int) -> None:
        dcp.save({"app": _AppState(self.w, step)}, checkpoint_id=self._checkpoint(step), no_dist=self.world == 1)
        self._committed(step)

    def load(self, workload: Any) -> int:
        newest = sorted(self.directory.glob("step-*"))[-1]
        state = _AppState(workload)
        dcp.load({"app": state}, checkpoint_id=newest, no_dist=self.world == 1)
        return state.step


class DcpAsyncSave(DcpSave):
    name = "dcp_async"

    def __init__(self, directory: Path, workload: Any, every: int) -> None:
        super().__init__(directory, workload, every)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        on_gpu = torch.cuda.is_available() and any(p.is_cuda for p in workload.model.parameters())
        self._options = StagingOptions(on_gpu, on_gpu, on_gpu, on_gpu)
        self._stager = DefaultStager(self._options)
        # TorchTitan's async save under several ranks: a gloo group of its own for the uploads' collectives,
        # which run in the background beside training's
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._staging: Any = None
        self._upload: Any = None
        self._uploading = 0
        self.stagers_renewed = 0
        """Stagers replaced after their staging closed them (see :meth:`_renew_stager`)."""

    def _save(self, step: int) -> None:
        self._finish_upload()  # one upload at a time
        self._renew_stager()
        # The stager deep-copies what it is given: the state dicts, not the Stateful holding the workload.
        response = dcp.async_save({"app": _AppState(self.w, step).state_dict()}, checkpoint_id=self._checkpoint(step),
                                  async_stager=self._stager, process_group=self._group, no_dist=self.world == 1)
        # An AsyncSaveResponse when staging runs in the background (CUDA); else staging is done, and
        # the response is the upload's future.
        self._staging = getattr(response, "staging_completion", None)
        self._upload = getattr(response, "upload_completion", response)
        self._uploading = step

    def _renew_stager(self) -> None:
        """A new stager where the last one was closed by its own staging.

        Under torch 2.11 on a GPU, ``DefaultStager`` closes its ``StateDictStager`` after each staging;
        that empties the table its deep copy dispatches on, and the next ``async_save`` fails in
        staging with ``KeyError: <class 'type'>``. The close dropped the pinned buffers too, so a new
        stager costs what the next staging would have cost there anyway."""
        from torch.distributed.checkpoint.staging import DefaultStager

        inner = getattr(self._stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self._stager.close()
            self._stager = DefaultStager(self._options)
            self.stagers_renewed += 1

    def before_update(self) -> None:
        if self._staging is not None:  # the parameters may change only once staging has copied them
            t0 = time.perf_counter()
            self._staging.result()
            self._staging = None
            self.stall_seconds += time.perf_counter() - t0

    def _finish_upload(self) -> None:
        if self._upload is not None:
            self._upload.result()
            self._upload = None
            self._committed(self._uploading)

    def wait(self) -> None:
        self.before_update()
        self._finish_upload()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._stager.close()


BASELINES: dict[str, type[Baseline]] = {cls.name: cls for cls in (TorchSave, DcpSave, DcpAsyncSave)}
