"""``lowdiff_plus``: LowDiff+ — every step's gradients update a CPU replica in a checkpoint agent.

Layer-wise capture: each parameter's gradient is handed, the moment it is final for this backward
pass, to a copy thread that moves it into a slot of shared memory (on CUDA, on a low-priority side
stream, so that compute and gradient synchronisation go first). In one process a
post-accumulate-grad hook hands it over. Under DDP the local gradient is not final — its bucket's
reduction replaces it — so the reduced bucket is taken from the communication hook's future as it
completes (:func:`~everystep.capture.hooks.reduction_tap`: everystep's compression hooks, or, when
the model has no hook, DDP's own all-reduce registered as one); with a hook of another kind,
every gradient is copied before the step instead.

Right before ``optimizer.step()`` every gradient is checked against what was copied — same
tensor, same version counter as when it became final — and copied again where clipping,
unscaling or another backward changed it in place, so the slot holds exactly what the optimizer
consumes; those copies overlap the optimizer's update (the step ends when they are done). Clipping
multiplies every gradient in place, every step, even by 1: then every copy made during backward
is wasted memory bandwidth. With ``layerwise=None`` (the default) capture during backward stops
after two steps in a row in which most of its copies had to be made again, and the gradients
are copied once, at the step (``True``: always during backward; ``False``: never).

The agent (:mod:`everystep.agent`), a separate process started from a fresh interpreter, holds S_t
in shared memory and advances it with the same optimizer class on the CPU: the step's gradients,
its param-group settings as the optimizer read them, and whether a GradScaler skipped it; then it
takes over what gradients cannot rebuild (RNG, data position, scheduler, buffers, residuals). It
persists the replica as a full checkpoint every ``every`` steps (default: as often as keeps its
writer busy a quarter of the time, from the measured write and step times).

Recovery: after a software failure the agent survives and the restarted process takes the replica
from its memory (``source`` ``memory``); after a hardware failure, the newest full checkpoint on
storage (``disk``). Every ``verify_every`` steps the agent compares a digest of its parameters and
optimizer state with the live ones and a divergence is reported as a warning, then repaired by
sending the agent the full state.

Several ranks: each rank has an agent of its own, which holds a whole replica of its rank's
state (what DDP replicates, and the rank's own RNG, data position and residuals). The ranks mark
the same steps for persistence — they agree on the interval, and on whether any rank lost its
agent, in one small all-gather on the ``control`` channel every ``every`` steps (every 8 with the
measured default) — and each agent writes its rank's part of the checkpoint, which the training
process commits with the other ranks' parts on its ``full`` channel thread. Agents apply a step
only when the next one arrives (see :mod:`everystep.agent.process`); at recovery the ranks agree
on a step every agent can serve, else all load from storage. When any rank's agent is lost, every
rank falls back at the next agreement. An agent never persists once its training process is gone.

Backpressure: at most ``queue`` steps are in flight (memory: ``queue`` slots of one gradient
each, one more under several ranks for the step an agent holds back). Training waits for a free
slot, and the wait is measured (``snapshot_wait_seconds``). An agent that frees no slot within
``agent_timeout`` seconds, or whose connection breaks, is lost: training warns, ends it if it
still runs, and goes on with CheckFreq full checkpoints written by the training process itself.
The agent writes one checkpoint at a time: with ``every`` set, each multiple of P is written, a
write waiting for the one before it (the agent applies no later step meanwhile, so slow storage slows
training, as with CheckFreq); with the measured default, a write due while the writer is busy
moves to the first step after it is free.
"""

from __future__ import annotations

import functools
import math
import queue
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..agent.channel import DISCOVERY_FILE, digest, rank_file
from ..agent.client import AgentLink, AgentLostError
from ..agent.config import AgentConfig
from ..agent.replica import optimizer_class_path, replayed_keys, slot_layout
from ..capture.hooks import ReductionTap, after_backward, reduction_tap
from ..errors import BackgroundWriteError, ConfigError, PeerFailedError
from ..storage.base import ObjectInfo
from ..storage.sharded import commit_written
from ..recovery import Recovered
from ..replay import group_scalars
from ..state import storage_key, unflatten
from ..transport.host import HostBuffer, TensorLayout, snapshot_into
from ..transport.shared import SharedRegion
from ._diff import restore_base
from .base import BackgroundErrors, StrategyConfig, StrategyContext
from .checkfreq import CheckFreq, CheckFreqConfig

__all__ = ["LowDiffPlus", "LowDiffPlusConfig", "common_step"]


@dataclass(kw_only=True, slots=True)
class LowDiffPlusConfig(StrategyConfig):
    every: int | None = None  # type: ignore[assignment]
    """P: the agent persists its replica every P steps; None: from the measured write bandwidth."""
    queue: int = 2
    """Steps in flight to the agent before training waits."""
    verify_every: int = 50
    """Compare the replica with the live state every this many steps (0: never)."""
    verify_sample: int = 1024
    """Elements per tensor the comparison reads (0: all)."""
    grace: float = 30.0
    """Seconds the agent waits for a restarted training process before it exits."""
    agent_timeout: float = 60.0
    """Seconds without a free slot or an answer after which the agent counts as lost."""
    agent_threads: int = 1
    layerwise: bool | None = None
    """Copy gradients while backward produces them: True always, False never (at the optimizer
    step), None until most of those copies turn out changed before the step two steps in a row."""
    busy: float = 0.25
    """With ``every=None``: the share of time the agent's writer may spend writing."""

    def _check_every(self) -> None:
        if self.every is not None and self.every < 1:
            raise ConfigError(f"every must be a positive number of steps or None, got {self.every}")

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if self.queue < 1 or self.agent_threads < 1:
            raise ConfigError("queue and agent_threads must be at least 1")
        if self.verify_every < 0 or self.verify_sample < 0:
            raise ConfigError("verify_every and verify_sample must be >= 0")
        if self.grace <= 0 or self.agent_timeout <= 0 or not 0 < self.busy <= 1:
            raise ConfigError("grace and agent_timeout must be positive and busy in (0, 1]")


def common_step(reachable: list[list[int] | None], on_disk: int) -> int | None:
    """The newest step that every rank's agent can serve (each lists the steps it can reach; None:
    no agent), provided storage holds nothing newer; else None (recover from storage)."""
    if not reachable or any(r is None for r in reachable):
        return None
    best = max(set.intersection(*(set(r) for r in reachable if r is not None)), default=None)
    return best if best is not None and best >= on_disk else None


class LowDiffPlus:
    name: ClassVar[str] = "lowdiff_plus"
    needs_store: ClassVar[bool] = True
    shares_store: ClassVar[bool] = True
    """Another process (the agent) writes to the store: only this strategy may collect its garbage."""
    Config = LowDiffPlusConfig

    def __init__(self, config: LowDiffPlusConfig | None = None) -> None:
        self.config = config or LowDiffPlusConfig()
        self._errors = BackgroundErrors()
        self.link: AgentLink | None = None
        self.fallback: CheckFreq | None = None
        self._lost: str | None = None
        self._fetched = False
        self._slots: list[HostBuffer] = []
        self._free: queue.Queue[int] = queue.Queue()
        self._slot: int | None = None
        self._copied: dict[int, tuple[torch.Tensor, int]] = {}
        self._updated = False
        self._groups: list[dict[str, Any]] = []
        self._has_grad: list[int] = []
        self._skipped = False
        self._index_keys: list[str] = []
        self._volatile: TensorLayout | None = None
        self._diverged: list[str] = []
        self._persisted: list[int] = []
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._abandoned = False
        # Several ranks: the agreement, and the commits of the agents' parts.
        self._found: tuple[AgentLink | None, int | None] = (None, None)
        self._commits: queue.Queue[int | None] = queue.Queue()
        self._parts: dict[int, dict[str, Any]] = {}
        self._parts_ready = threading.Condition()
        self._committer: threading.Thread | None = None
        self._next_check = 0
        self._last_persist = 0
        self._write_seconds = 0.0
        self._step_marks: list[float] = []
        # Layer-wise capture: whether it is on, and how its copies fared.
        self.layerwise = self.config.layerwise is not False
        self.early_copies = 0
        """Gradients copied while backward produced them."""
        self.recopies = 0
        """Of those, the ones copied again at the step because they changed in place (clipping)."""
        self._stale_streak = 0
        self._tap: ReductionTap | None = None
        self._handover: threading.Event | None = None
        """Set when the agent has moved its replica out of the region recovery took over."""
        self._released = False
        self._reduced: list[int] = []
        self._awaiting_end = False

    # -- lifecycle -----------------------------------------------------------------------------

    def attach(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.shared = ctx.ranks.distributed
        self.params = [p for g in ctx.components.optimizer.param_groups for p in g["params"]]
        model = ctx.components.model
        self._hooks = []
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # A post-accumulate-grad hook would see the local gradient, which the bucket's reduction
            # replaces: the reduced bucket is taken from the communication hook instead.
            self._index_of = {p.data_ptr(): i for i, p in enumerate(self.params)}
            self._tap = reduction_tap(model, ctx.components.compression) if self.layerwise else None
            if self._tap is not None:
                self._tap.observers.append(self._on_bucket)
        elif self.layerwise:
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                           for i, p in enumerate(self.params) if p.requires_grad]
        self._stream = torch.cuda.Stream(priority=0) if torch.cuda.is_available() else None
        self.rebases = 0
        """Times the replica was replaced by the live state because the arithmetic differs (GPU)."""
        self._rebase = any(p.device.type != "cpu" for p in self.params)
        self._copier = threading.Thread(target=self._copy_loop, name="everystep-grad-copy", daemon=True)
        self._copier.start()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def agree_restore(self) -> None:
        """Every rank asks its agent what it holds; together they choose a step every agent can
        serve and that is no older than storage's newest, or storage. (Collective: every rank calls
        this at once, before :meth:`restore`.)"""
        store, ranks = self.ctx.store, self.ctx.ranks
        assert store is not None
        if store.access == "read":  # a reader takes nothing from a live agent: storage alone
            return
        link = AgentLink.find(store.root, rank_file(DISCOVERY_FILE, ranks.rank, ranks.world))
        reachable: list[int] | None = None
        if link is not None:
            try:
                hello = link.call("hello", reply="hello", timeout=self.config.agent_timeout + 600)
                if hello["step"] is not None:
                    reachable = [hello["step"]] + ([hello["pending"]] if hello.get("pending") is not None else [])
            except AgentLostError as e:
                warnings.warn(f"the checkpoint agent (pid {link.pid}) could not serve its replica ({e}); "
                              "recovering from storage", RuntimeWarning, stacklevel=3)
                link.kill()
                link = None
        on_disk = max((r.manifest.step for r in store.manifests() if r.manifest and r.manifest.kind == "full"), default=-1)
        views = ranks.all_gather("control", {"agent": link is not None, "reachable": reachable, "disk": on_disk})
        # What a crash left is garbage once no agent writes: in one process, when there is no agent;
        # under several ranks, always (an agent finishes its writes before it answers hello).
        if ranks.rank == 0 and (ranks.distributed or not any(v["agent"] for v in views)):
            store.collect_garbage()
        ranks.barrier("control")
        target = common_step([v["reachable"] for v in views], max(v["disk"] for v in views))
        if target is None and self.shared and reachable is not None:
            ahead = [f"rank {r}: {v['reachable']}" for r, v in enumerate(views)]
            warnings.warn(f"the checkpoint agents hold no step in common that is newer than storage's ({', '.join(ahead)}); "
                          "recovering from storage", RuntimeWarning, stacklevel=3)
        self._found = (link, target)

    def restore(self) -> Recovered | None:
        """The agent's replica if :meth:`agree_restore` chose it, else the newest full checkpoint."""
        store, c = self.ctx.store, self.ctx.components
        assert store is not None
        t0 = time.perf_counter()
        link, target = self._found
        self._found = (None, None)
        self.link = link
        if link is not None and target is not None:
            step = self._fetch(link, target)
            return Recovered(step=step, tree={}, source="memory", manifest=None, seconds=time.perf_counter() - t0)
        full = restore_base(store, c)
        if full is None:
            return None
        return Recovered(step=full.step, tree={}, source="disk", manifest=full, seconds=time.perf_counter() - t0)

    def _fetch(self, link: AgentLink, step: int) -> int:
        reply = link.call("fetch", reply="replica", timeout=self.config.agent_timeout, step=step)
        (fd,) = link.receive_fds(1)
        region, buffer = SharedRegion.holding(reply["layout"], fd=fd)
        # The model copies into its parameters. The optimizer keeps the tensors it is given: its
        # state stays in the region, which the agent hands over (it moves its replica out and says
        # ``released``; the first update waits for that). Anything else is cloned.
        self._handover = threading.Event()
        tensors = {k: v if k.startswith(("/model/", "/optimizer/state/")) else v.clone() for k, v in buffer.views.items()}
        try:
            self.ctx.components.restore(unflatten(reply["skeleton"], tensors))
        finally:
            region.close()
        self._fetched = True
        return int(reply["step"])

    def on_start(self, step: int) -> None:
        store = self.ctx.store
        assert store is not None
        tensors, skeleton = self.ctx.flatten_state(step)
        self._index_keys = self._keys_of_params(tensors)
        ranks = self.ctx.ranks
        if self.link is None:
            self.link = AgentLink.spawn(AgentConfig(
                directory=str(store.root), strategy=self.name, keep=self.config.keep, every=self.config.every,
                busy=self.config.busy, grace=self.config.grace, threads=self.config.agent_threads,
                rank=ranks.rank, world=ranks.world))
        if self.shared:
            self._last_persist = step
            self._next_check = self._check_after(step)
            self._committer = threading.Thread(target=self._commit_loop, name="everystep-agent-commit", daemon=True)
            self._committer.start()
        if not self._fetched:
            self._send_state(step, tensors, skeleton, persist=step == 0)
        self._make_slots(tensors)
        self.link.start_reader(
            {"done": self._on_done, "persisted": self._on_persisted, "part": self._on_part, "diverged": self._on_diverged,
             "error": self._on_error, "released": self._on_released},
            self._on_lost,
        )

    def _check_after(self, step: int) -> int:
        """The next step at which the ranks agree (several ranks): each multiple of ``every``, or
        every 8 steps with the measured interval."""
        every = self.config.every
        return (step // every + 1) * every if every else step + 8

    # -- the agent's messages (reader thread) --------------------------------------------------

    def _on_done(self, msg: dict[str, Any]) -> None:
        self.ctx.in_memory(msg["step"])
        self._free.put(msg["slot"])

    def _on_persisted(self, msg: dict[str, Any]) -> None:
        self._persisted = (self._persisted + [msg["step"]])[-2:]
        self.ctx.committed(msg["step"], count=False)
        if self.ctx.store is not None:
            self.ctx.store.count_written_elsewhere(msg["nbytes"])

    def _on_released(self, msg: dict[str, Any]) -> None:
        self._released = True
        if self._handover is not None:
            self._handover.set()

    def _on_diverged(self, msg: dict[str, Any]) -> None:
        self._diverged.append(f"step {msg['step']}: {msg['detail']}")

    def _on_error(self, msg: dict[str, Any]) -> None:
        if msg["fatal"]:
            self._lose(f"{msg['what']} failed: {msg['detail']}")
        else:
            self._errors.record(msg["what"], RuntimeError(msg["detail"]))

    def _on_lost(self, reason: str) -> None:
        self._lose(reason)

    def _on_part(self, msg: dict[str, Any]) -> None:
        if msg["error"] is None:
            self._write_seconds = msg["seconds"]
        with self._parts_ready:
            self._parts[msg["step"]] = msg
            self._parts_ready.notify_all()

    def _lose(self, reason: str) -> None:
        if self._lost is None:
            self._lost = reason
        if self._handover is not None:
            self._handover.set()
        self._free.put(-1)  # wakes a waiting step
        with self._parts_ready:
            self._parts_ready.notify_all()  # and a commit waiting for a part

    # -- training path -------------------------------------------------------------------------

    def _active(self) -> bool:
        return self.link is not None and self.fallback is None and self._lost is None and bool(self._slots)

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if self.layerwise and self._active():
            self._copy(index, param.grad)

    def _on_bucket(self, bucket: Any) -> Any:
        """A DDP bucket's reduction starts (training thread): where its gradients lie in it, and what
        copies them out of the reduced bucket when its future completes."""
        if not (self.layerwise and self._active()) or (self._slot is None and not self._acquire()):
            return None
        buffer, base = self._slots[self._slot], bucket.buffer()  # type: ignore[index]
        size, start = base.element_size(), base.data_ptr()
        where = [(i, (g.data_ptr() - start) // size, g.numel())
                 for p, g in zip(bucket.parameters(), bucket.gradients())
                 if (i := self._index_of.get(p.data_ptr())) is not None]
        if not self._awaiting_end:
            self._awaiting_end = after_backward(self._on_backward_end)

        def reduced(result: torch.Tensor) -> None:  # the thread that completed the reduction
            try:
                flat = result.detach().reshape(-1)
                event = None
                if flat.is_cuda:
                    event = torch.cuda.Event()
                    event.record()
                for i, offset, n in where:
                    self._jobs.put((buffer, i, flat[offset:offset + n].view(self.params[i].shape), event))
                    self._reduced.append(i)
            except BaseException as e:
                self._errors.record("taking the reduced gradients for the agent", e)

        return reduced

    def _on_backward_end(self) -> None:
        """After DDP copied the reduced buckets into the gradients: what the copies hold is what the
        gradients hold now, until something changes them in place."""
        self._awaiting_end = False
        for i in self._reduced:
            g = self.params[i].grad
            if g is not None:
                self._copied[i] = (g, g._version)
        self._reduced = []

    def _copy(self, index: int, grad: torch.Tensor | None) -> None:
        if grad is None or (self._slot is None and not self._acquire()):
            return
        self._copied[index] = (grad, grad._version)
        event = None
        if grad.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._jobs.put((self._slots[self._slot], index, grad, event))

    def _acquire(self) -> bool:
        if self._lost is not None:
            return False  # (the one wake-up _lose gives may have gone to an earlier wait)
        t0 = time.perf_counter()
        try:
            slot = self._free.get(timeout=self.config.agent_timeout)
        except queue.Empty:
            self._lose(f"it freed no slot within {self.config.agent_timeout:.0f} s")
            slot = -1
        self.ctx.stats.snapshot_wait_seconds += time.perf_counter() - t0
        if slot < 0:
            return False
        self._slot = slot
        return True

    def _copy_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            buffer, index, grad, event = job
            try:
                target = buffer.views[f"g/{index}"]
                if event is None:
                    target.copy_(grad)
                else:
                    assert self._stream is not None
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(event)
                        target.copy_(grad)
                        grad.record_stream(self._stream)
                    self._stream.synchronize()
            except BaseException as e:
                self._errors.record(f"copying the gradient of parameter {index} for the agent", e)
            finally:
                self._jobs.task_done()

    def _take_over(self) -> None:
        """Before the first update after recovery from memory: the optimizer state lives in the
        region the agent handed over, and the agent must be out of it before it changes."""
        handover = self._handover
        assert handover is not None and self.link is not None
        t0 = time.perf_counter()
        if not handover.wait(self.config.agent_timeout):  # set by 'released' or by the agent's loss
            self._lose(f"it did not release the recovered state within {self.config.agent_timeout:.0f} s")
        self._handover = None  # only now: a 'released' arriving during the wait must find the event
        self.ctx.stats.snapshot_wait_seconds += time.perf_counter() - t0
        if not self._released:
            self.link.kill()  # lost before it was out of the region: it must not touch it again

    def before_update(self, step: int) -> None:
        if self._handover is not None:
            self._take_over()
        if self.fallback is not None:
            self.fallback.before_update(step)
        if not self._active():
            return
        self._updated = True
        self._awaiting_end = False
        early, stale = len(self._copied), 0
        for i, p in enumerate(self.params):
            g = p.grad
            seen = self._copied.get(i)
            if g is not None and (seen is None or seen[0] is not g or seen[1] != g._version):
                stale += seen is not None
                self._copy(i, g)  # not copied yet, or changed since: clipped, unscaled, compressed
        self._has_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        self._judge_layerwise(early, stale)

    def _judge_layerwise(self, early: int, stale: int) -> None:
        """Count this step's copies during backward and those made again; with ``layerwise=None``,
        stop copying during backward after two steps in a row that made most of them again."""
        self.early_copies += early
        self.recopies += stale
        if not early:
            return
        self._stale_streak = self._stale_streak + 1 if 2 * stale > early else 0
        if self.config.layerwise is None and self._stale_streak >= 2:
            self.layerwise = False

    def on_step_end(self, step: int) -> None:
        self._errors.raise_pending()
        if self.fallback is not None:
            self.fallback.on_step_end(step)
        self._groups = group_scalars(self.ctx.components.optimizer)
        self._skipped = not self._updated
        t0 = time.perf_counter()
        self._jobs.join()  # the slot must hold this step's gradients before they can change again
        self.ctx.stats.snapshot_wait_seconds += time.perf_counter() - t0
        self._copied.clear()
        self._updated = False
        self._errors.raise_pending()

    def on_state_ready(self, step: int, *, final: bool = False) -> None:
        self._errors.raise_pending()
        if self._abandoned:
            return
        persist = False
        if self.fallback is None and self.shared:
            self._step_marks = (self._step_marks + [time.perf_counter()])[-21:]
            if final or step >= self._next_check:
                persist = self._agree(step, final=final)
        elif self.fallback is None and self._lost is not None:
            self._fall_back(step, self._lost)
            return
        if self.fallback is not None:
            self.fallback.on_state_ready(step, final=final)
            return
        if self._lost is not None:
            return  # several ranks: every rank falls back at the next agreement
        assert self.link is not None
        tensors, skeleton = self.ctx.flatten_state(step)
        replayed, volatile = self._split(tensors)
        every = self.config.verify_every
        rebase = self._rebase and (final or bool(every and step % every == 0))
        fits = TensorLayout.of(volatile) == self._volatile
        if self._diverged or rebase or not fits:
            if self._diverged:
                warnings.warn(f"the checkpoint agent's replica diverged from the live state ({'; '.join(self._diverged)}); "
                              f"sending it the full state of step {step}", RuntimeWarning, stacklevel=2)
            self._diverged = []
            self.rebases += rebase
            self._resync(step, tensors, skeleton, persist=persist if self.shared else None, new_slots=not fits)
        else:
            self._send_step(step, tensors, skeleton, replayed, volatile, persist=persist)
        if final:
            self._sync(persist=True)
            if self._lost is not None and not self.shared:
                # IMPORTANT: a final checkpoint the agent did not make durable is written here, never dropped.
                self._fall_back(step, self._lost)

    def _agree(self, step: int, *, final: bool) -> bool:
        """Several ranks: whether every rank persists ``step``; falls back on every rank if any
        rank's agent is lost. One all-gather on the ``control`` channel, on every rank at once."""
        marks = self._step_marks
        step_seconds = statistics.median(b - a for a, b in zip(marks, marks[1:])) if len(marks) >= 3 else None
        views = self.ctx.ranks.all_gather("control", {"lost": self._lost, "write": self._write_seconds, "step": step_seconds})
        self._next_check = self._check_after(step)
        lost = [f"rank {r}: {v['lost']}" for r, v in enumerate(views) if v["lost"]]
        if lost:
            self._fall_back(step, "; ".join(lost))
            return False
        if final or self.config.every:
            return True
        writes, steps = [v["write"] for v in views], [v["step"] for v in views]
        if min(writes) <= 0:
            return True  # no write measured yet (a start from storage): this one measures it
        if any(x is None for x in steps):
            return False
        interval = max(1, math.ceil(max(writes) / (self.config.busy * max(steps))))
        return step - self._last_persist >= interval

    def _send_step(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, replayed: list[str],
                   volatile: dict[str, torch.Tensor], *, persist: bool) -> None:
        assert self.link is not None
        if self._slot is None and not self._acquire():
            return  # lost while waiting; the next step falls back
        assert self._slot is not None
        event = snapshot_into(self._slots[self._slot], {f"v{k}": t for k, t in volatile.items()})
        if event is not None:
            event.synchronize()
        check = None
        every = self.config.verify_every
        if every and step % every == 0 and not self._rebase:
            check = {"keys": replayed, "sample": self.config.verify_sample,
                     "value": digest(tensors, replayed, self.config.verify_sample)}
        self._expect_part(step, persist)
        try:
            self.link.send("step", step=step, slot=self._slot, groups=self._groups, skipped=self._skipped,
                           has_grad=[] if self._skipped else self._has_grad, skeleton=skeleton, digest=check,
                           persist=persist)
        except AgentLostError as e:
            self._lose(str(e))
        self._slot = None

    def _expect_part(self, step: int, persist: bool) -> None:
        """Several ranks: the agent will write its part of ``step``; the commit thread commits it."""
        if persist:
            self._last_persist = step
            self._persisted = (self._persisted + [step])[-2:]
            self._commits.put(step)

    def _commit_loop(self) -> None:
        while (step := self._commits.get()) is not None:
            try:
                self._commit(step)
            finally:
                self._commits.task_done()
        self._commits.task_done()

    def _commit(self, step: int) -> None:
        """Commit the checkpoint of ``step`` once this rank's agent has written its part (every rank's
        commit thread does this for the same steps in the same order)."""
        store = self.ctx.store
        assert store is not None
        wait = self.config.agent_timeout + 600
        deadline = time.monotonic() + wait
        with self._parts_ready:
            while step not in self._parts and self._lost is None and time.monotonic() < deadline:
                self._parts_ready.wait(deadline - time.monotonic())
            part = self._parts.pop(step, None)
        if part is None and self._lost is None:
            self._lose(f"its part of the checkpoint of step {step} did not come within {wait:.0f} s")
        error: BaseException | None = None
        if part is None:
            error = AgentLostError(f"the checkpoint agent of rank {self.ctx.ranks.rank} is lost: {self._lost}")
        elif part["error"]:
            error = BackgroundWriteError(f"the checkpoint agent's write of its part failed: {part['error']}")
        info = ObjectInfo.from_json(part["info"]) if part is not None and part["info"] else None
        try:
            commit_written(store, "full", kind="full", step=step, info=info, pieces=part["pieces"] if part else {},
                           meta={"writer": "agent"}, rank_meta=part["meta"] if part else {}, error=error)
        except BaseException as e:
            if isinstance(e, AgentLostError) or (isinstance(e, PeerFailedError)
                                                 and set(e.failed.values()) == {AgentLostError.__name__}):
                warnings.warn(f"the checkpoint of step {step} is not committed: {e}", RuntimeWarning, stacklevel=1)
            else:
                self._errors.record(f"the commit of the agents' checkpoint of step {step}", e)
            return
        assert part is not None and info is not None
        store.retain(self.config.keep)
        self.ctx.committed(step, count=False, seconds=part["seconds"])
        store.count_written_elsewhere(info.nbytes)

    def _split(self, tensors: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The keys the agent's optimizer updates (parameters and their state), and everything else."""
        replayed = replayed_keys(self._index_keys, tensors)
        return sorted(replayed), {k: t for k, t in tensors.items() if k not in replayed}

    def _keys_of_params(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        where = {storage_key(t): k for k, t in tensors.items() if t.numel()}
        keys = []
        for i, p in enumerate(self.params):
            key = where.get(storage_key(p.detach()))
            if key is None:
                raise ConfigError(f"optimizer parameter {i} is not in the model's state_dict; lowdiff_plus replicates "
                                  "the parameters the model holds")
            keys.append(key)
        return keys

    # -- the agent's state ---------------------------------------------------------------------

    def _send_state(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, *, persist: bool | None) -> None:
        """Give the agent S_step whole, in a region it adopts as its replica; it persists it if
        ``persist``, or with None if a write is due (one process only)."""
        assert self.link is not None
        region, buffer = SharedRegion.holding(TensorLayout.of(tensors))
        event = snapshot_into(buffer, tensors)
        if event is not None:
            event.synchronize()
        if self.shared:
            self._expect_part(step, persist)
        try:
            self.link.send("init", fds=[region.fd], step=step, layout=buffer.layout, skeleton=skeleton,
                           index_keys=self._index_keys, optimizer_class=optimizer_class_path(self.ctx.components.optimizer),
                           persist=persist)
        finally:
            region.close()

    def _make_slots(self, tensors: dict[str, torch.Tensor]) -> None:
        assert self.link is not None
        _, volatile = self._split(tensors)
        layout = slot_layout(dict(enumerate(self.params)), volatile)
        regions = [SharedRegion.holding(layout) for _ in range(self.config.queue + self.shared)]
        try:
            self.link.send("slots", fds=[r.fd for r, _ in regions], count=len(regions), layout=layout)
        finally:
            for r, _ in regions:
                r.close()
        self._slots = [b for _, b in regions]
        self._volatile = TensorLayout.of(volatile)
        self._free = queue.Queue()
        for i in range(len(regions)):
            self._free.put(i)

    def _resync(self, step: int, tensors: dict[str, torch.Tensor], skeleton: Any, *, persist: bool | None,
                new_slots: bool) -> None:
        """Wait for every step in flight, then give the agent S_step whole, and new slots if the
        step's volatile state no longer fits the old ones (the agent keeps its slots across a new state)."""
        if self.shared:
            self._sync(persist=False)  # the step an agent holds back frees its slot
        held = [self._slot] if self._slot is not None else []
        while len(held) < len(self._slots):
            if not self._acquire():
                return
            held.append(self._slot)  # type: ignore[arg-type]
        self._slot = None
        try:
            self._send_state(step, tensors, skeleton, persist=persist)
            if new_slots:
                self._make_slots(tensors)
            else:
                for slot in held:
                    self._free.put(slot)
        except AgentLostError as e:
            self._lose(str(e))
            return
        self.ctx.in_memory(step)  # the agent's replica is S_step

    def _fall_back(self, step: int, reason: str) -> None:
        """Stop using the agent (under several ranks: every rank's, at the same step) and write full
        checkpoints from the training process, the first of S_step now."""
        assert self.link is not None
        interval = self.config.every or (self._persisted[1] - self._persisted[0] if len(self._persisted) == 2 else 10)
        warnings.warn(
            f"the checkpoint agent (pid {self.link.pid}) is lost: {reason}; recovery from memory is off and the "
            f"training process writes full checkpoints every {interval} steps from now on", RuntimeWarning, stacklevel=3)
        if self.shared:
            if self._lost is None:
                self._sync(persist=False)  # the parts of steps already marked, then their commits
            self._commits.join()
            self._lose(reason)
        self.link.kill()
        self.fallback = CheckFreq(CheckFreqConfig(every=max(1, interval), keep=self.config.keep))
        self.fallback.attach(self.ctx)
        self.fallback.on_state_ready(step, final=True)  # S_step durable now, not at the next multiple

    def _sync(self, *, persist: bool) -> None:
        assert self.link is not None
        try:
            self.link.call("sync", reply="synced", timeout=self.config.agent_timeout + 600, persist=persist)
        except AgentLostError as e:
            self._lose(str(e))
        self._errors.raise_pending()

    def wait(self) -> None:
        if self.fallback is not None:
            self.fallback.wait()
        elif self.link is not None and self._lost is None and self._slots:
            self._sync(persist=False)
        if self._committer is not None:
            self._commits.join()
        self._errors.raise_pending()

    def _stop_threads(self, *, wait: bool = True) -> None:
        self._jobs.put(None)
        self._copier.join()
        for h in self._hooks:
            h.remove()
        if self._tap is not None:
            self._tap.observers.remove(self._on_bucket)
            self._tap = None
        if self._committer is not None:
            self._commits.put(None)
            if wait:  # else it may be in a commit whose peers are gone: it ends with its collective's timeout
                self._committer.join()

    def abandon(self) -> None:
        """Leave the agent as a crashed training process would: no goodbye, no final persist.

        The agent keeps the replica for a restarted process (this is how the benchmark measures
        recovery from memory, and how a Checkpointer leaves on an exception). Only :meth:`close`
        may follow.
        """
        if self._abandoned:
            return
        self._abandoned = True
        self._stop_threads(wait=False)
        if self.link is not None:
            self.link.hang_up()
            self.link = None

    def close(self) -> None:
        if self._abandoned:
            return
        try:
            self.wait()
        finally:
            self._stop_threads()
            if self.link is not None:
                if self._lost is None:
                    self.link.close(timeout=self.config.agent_timeout + 600)
                else:
                    self.link.kill()
            if self.fallback is not None:
                self.fallback.close()
