"""``naive_diff``: Check-N-Run-style differential checkpointing, the baseline LowDiff improves on.

At every step the difference between the current parameters and optimizer state and a shadow
copy is computed on the training path, compressed by top-k with ratio ``ratio`` (the shadow
advances by exactly what was kept, so the error does not accumulate), and written by a
background thread. A full checkpoint every ``every`` steps resets the chain.

It is lossy by nature: recovery yields the full checkpoint plus the kept part of each
difference, not S_t. Everything a difference cannot carry (buffers, scheduler, RNG, data
position) is stored exactly with each step. Use :func:`everystep.state.state_error` to measure how far off it is.
"""

from __future__ import annotations

import math
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import ConfigError, CorruptCheckpointError
from ..recovery import Recovered
from ..state import flatten, state_error
from ..storage.sharded import commit_tensors
from ._diff import apply_end_state, end_state, read_differential, restore_base
from .base import BackgroundErrors, StrategyConfig, StrategyContext
from .checkfreq import CheckFreq, CheckFreqConfig

__all__ = ["NaiveDiff", "NaiveDiffConfig", "state_error"]


@dataclass(kw_only=True, slots=True)
class NaiveDiffConfig(StrategyConfig):
    every: int = 50
    ratio: float = 0.01
    """Fraction of each tensor's changed entries kept per step (top-k by magnitude)."""

    def __post_init__(self) -> None:
        StrategyConfig.__post_init__(self)
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"ratio must lie in (0, 1], got {self.ratio}")


class NaiveDiff:
    name: ClassVar[str] = "naive_diff"
    needs_store: ClassVar[bool] = True
    Config = NaiveDiffConfig

    def __init__(self, config: NaiveDiffConfig | None = None) -> None:
        self.config = config or NaiveDiffConfig()
        self._errors = BackgroundErrors()
        self._shadow: dict[str, torch.Tensor] = {}
        self._base = 0
        self._writes: list[Future[Any]] = []

    def attach(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.full = CheckFreq(CheckFreqConfig(every=self.config.every, keep=self.config.keep))
        self.full.attach(ctx)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="everystep-naive-writer")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _live(self) -> dict[str, torch.Tensor]:
        c = self.ctx.components
        tensors, _ = flatten({"model": c.module.state_dict(), "optimizer": c.optimizer.state_dict()["state"]})
        buffers = {f"/model/{n}" for n, _ in c.module.named_buffers()}
        return {k: t for k, t in tensors.items() if t.is_floating_point() and k not in buffers}

    def _reset_shadow(self) -> None:
        self._shadow = {k: t.detach().clone() for k, t in self._live().items()}

    def on_start(self, step: int) -> None:
        if step == 0:
            self.full.on_state_ready(0, final=True)
            self.full.wait()
            self._base = 0
        self._reset_shadow()

    def on_step_end(self, step: int) -> None:
        self._errors.raise_pending()

    def on_state_ready(self, step: int, *, final: bool = False) -> None:
        self._errors.raise_pending()
        deltas: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for key, t in self._live().items():
                shadow = self._shadow.get(key)
                diff = t.detach().reshape(-1) - (shadow.reshape(-1) if shadow is not None else 0)
                k = max(1, math.ceil(self.config.ratio * diff.numel()))
                idx = diff.abs().topk(k, sorted=False).indices.sort().values
                values = diff[idx]
                if shadow is None:
                    shadow = self._shadow[key] = torch.zeros_like(t.detach())
                shadow.view(-1)[idx] += values
                deltas[f"d{key}/values"], deltas[f"d{key}/indices"] = values, idx.to(torch.int32)
        end_tensors, end_skeleton = end_state(self.ctx.components, self.ctx.boundary, step)
        deltas.update({f"end{k}": v for k, v in end_tensors.items()})
        self._writes = [f for f in self._writes if not f.done()]
        self._writes.append(self._writer.submit(self._write, self._base, step, deltas, end_skeleton))
        if step % self.config.every == 0 and not final:
            self.full.on_state_ready(step)
            self._base = step
            self._reset_shadow()

    def _write(self, base: int, step: int, tensors: dict[str, torch.Tensor], end_skeleton: Any) -> None:
        try:
            assert self.ctx.store is not None
            commit_tensors(self.ctx.store, "diff", kind="ndiff", step=step, tensors=tensors,
                           replicated={k for k in tensors if k.startswith("d/")}, requires=(f"full-{base:012d}",),
                           meta={"base": base}, rank_meta={"end": end_skeleton})
            self.ctx.committed(step)
            self.ctx.store.retain(self.config.keep)
        except BaseException as e:
            self._errors.record(f"writing the difference at step {step}", e)

    def before_update(self, step: int) -> None:
        self.full.before_update(step)

    def wait(self) -> None:
        for f in self._writes:
            f.result()
        self._writes.clear()
        self.full.wait()
        self._errors.raise_pending()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            self.full.close()

    def restore(self) -> Recovered | None:
        """The newest full checkpoint plus every verified difference after it: an approximation."""
        store, c = self.ctx.store, self.ctx.components
        assert store is not None
        t0 = time.perf_counter()
        full = restore_base(store, c)
        if full is None:
            return None
        diffs = {r.manifest.step: r.manifest for r in store.manifests()
                 if r.manifest and r.manifest.kind == "ndiff" and r.manifest.meta.get("base") == full.step}
        step, end = full.step, None
        live = self._live()
        while step + 1 in diffs:
            m = diffs[step + 1]
            try:
                tensors, end = read_differential(store, m)
            except CorruptCheckpointError as e:
                warnings.warn(f"the chain of differences from step {full.step} ends at step {step}: {e}", stacklevel=3)
                break
            with torch.no_grad():
                for name in {k[1:].rsplit("/", 1)[0] for k in tensors if k.startswith("d/")}:
                    target = live.get("/" + name)
                    if target is None:  # optimizer state that did not exist yet at the full checkpoint
                        continue
                    target.view(-1)[tensors[f"d/{name}/indices"].long()] += tensors[f"d/{name}/values"]
            step = m.step
        if end is not None:
            apply_end_state(c, end)
        self._base = full.step
        return Recovered(step=step, tree={}, source="disk (lossy)", manifest=full, seconds=time.perf_counter() - t0)
