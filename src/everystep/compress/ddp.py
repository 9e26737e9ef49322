"""Gradient compression inside DistributedDataParallel's communication.

Under data parallelism the compressed form is what crosses the network, so it is computed where
DDP synchronises gradients — in a communication hook — and it is what LowDiff reuses:

``topk:RATIO``, ``quant8``
    Each rank compresses each parameter's gradient in the bucket with its own error-feedback
    residual, the ranks all-gather the compressed forms (one collective per bucket), and every
    rank decompresses all of them and averages them in rank order, so every rank holds the same
    gradient. The residuals differ from rank to rank: each rank's are its own training state.
``powersgd:rank=R``
    PyTorch's own PowerSGD hook (error feedback and warm start on, compression from the third
    step on), unchanged, each bucket finished before the next: its all-reduced factors P and Q
    are the compressed gradient; tensors it does not compress (biases, norms) are all-reduced
    whole.

At the optimizer step — after the user's clipping and a GradScaler's unscaling — each
parameter's record is fixed to what the optimizer really consumes (DESIGN: replay applies
exactly that). Top-k: the union of the ranks' indices and the consumed values there. 8-bit and
PowerSGD: the synchronised form itself when its decompression equals the consumed gradient
bitwise; else that form and the one scalar the gradient was multiplied by (clipping), when that
reproduces it bitwise; else the consumed gradient whole, counted in :attr:`dense_records`.

PowerSGD keeps its error and warm-start factors per DDP bucket, and DDP rebuilds its buckets after
a process's first backward. The state is therefore saved per parameter and laid back into
whatever buckets the resumed process has, in its first backward and again after the rebuild; and
each parameter's first Q is drawn from a seed of its own rather than one per bucket, so that a
resumed process draws what the uninterrupted one drew however the buckets fall.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _powersgd

from ..capture.hooks import ReductionTap
from ..errors import ConfigError, EverystepError
from .base import Compressed, decompress
from .hook import StepRecords, check_kind, load_residual_state, make_compressor, parse_spec, residual_state

__all__ = ["DDPCompression", "AllGatherCompression", "PowerSGDCompression", "ddp_compression"]


def ddp_compression(spec: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> "DDPCompression":
    """The communication hook for ``spec`` (``topk:0.01``, ``quant8``, ``powersgd:rank=4``) on
    ``model``, a DistributedDataParallel model that has not run a backward yet."""
    kind, args = parse_spec(spec)
    if kind == "powersgd":
        return PowerSGDCompression(model, optimizer, rank=args["rank"], spec=spec)
    return AllGatherCompression(model, optimizer, make_compressor(spec))


class DDPCompression(StepRecords, ReductionTap):
    """Base of the communication hooks: the per-step record of what the optimizer consumed. Each
    bucket's synchronised gradient is offered to the tap's observers (``lowdiff_plus`` copies it)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: str) -> None:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError(f"{spec} compression in a communication hook needs a DistributedDataParallel model; "
                              f"got {type(model).__name__}")
        super().__init__(model, optimizer, spec)
        ReductionTap.__init__(self)
        self.group = model.process_group
        self.world = dist.get_world_size(self.group)
        self.dense_records = 0
        """Parameter records stored whole because no compact form reproduced the consumed gradient."""
        self._pending: dict[str, Compressed | None] = {}
        self._mul: torch.Tensor | None = None
        model.register_comm_hook(None, self._hook)

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        # (DDP checks the hook's annotations against the real types; string annotations fail it)
        raise NotImplementedError

    def _record(self, synced: Compressed, grad: torch.Tensor) -> Compressed:
        """A record of ``grad`` from its synchronised form: the form, scaled if need be, or ``grad``."""
        h = decompress(synced, grad)
        if torch.equal(h, grad):
            return synced
        if self._mul is None:
            self._mul = _multiplier(h, grad)
        if self._mul is not None and torch.equal(h * self._mul, grad):
            return {**synced, "mul": self._mul}
        return self._dense(grad)

    def _dense(self, grad: torch.Tensor) -> Compressed:
        self.dense_records += 1
        return {"dense": grad.detach().clone()}

    def _pre_step(self) -> None:
        self._mul = None
        record: dict[str, Compressed] = {}
        with torch.no_grad():
            for name, p in self.params:
                if p.grad is None:
                    continue
                synced = self._pending.pop(name, None)
                record[name] = {"dense": p.grad.detach().clone()} if synced is None else self._record(synced, p.grad)
        self._last = record


def _multiplier(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """The scalar c (a 0-dim tensor of g's dtype) with h·c == g bitwise, if there is one."""
    hf, gf = h.reshape(-1), g.reshape(-1)
    i = int(hf.abs().argmax())
    if hf[i] == 0:
        return None
    c = (gf[i].double() / hf[i].double()).to(g.dtype)
    inf = torch.tensor(float("inf"), dtype=g.dtype)
    candidates, up, down = [c], c, c
    for _ in range(2):  # the rounded quotient is within an ulp or two of the factor used
        up, down = torch.nextafter(up, inf), torch.nextafter(down, -inf)
        candidates += [up, down]
    for cand in candidates:
        if torch.equal(hf * cand, gf):
            return cand
    return None


class AllGatherCompression(DDPCompression):
    """Top-k or 8-bit: compress per parameter, all-gather, decompress and average in rank order."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, compressor: Any) -> None:
        self.compressor = compressor
        super().__init__(model, optimizer, compressor.name)

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        grads = bucket.gradients()
        names = [self.names[p] for p in bucket.parameters()]
        parts = [self.compressor.compress(n, g) for n, g in zip(names, grads)]
        # widest elements first, so that every piece of the byte payload stays aligned for its dtype
        keys = sorted(parts[0], key=lambda k: (-parts[0][k].element_size(), k))
        payload = torch.cat([c[k].reshape(-1).view(torch.uint8) for k in keys for c in parts])
        self.compressed_bytes += payload.numel()
        gathered = [torch.empty_like(payload) for _ in range(self.world)]
        work = dist.all_gather(gathered, payload, group=self.group, async_op=True)

        def finish(_: torch.futures.Future[Any]) -> torch.Tensor:
            per_rank = [_unpack(buf, keys, parts) for buf in gathered]
            with torch.no_grad():
                for i, (name, g) in enumerate(zip(names, grads)):
                    # rank by rank: top-k values and indices, or 8-bit codes and their scales
                    synced = {"scales" if k == "scale" else k: torch.stack([rank[i][k] for rank in per_rank])
                              for k in keys}
                    g.copy_(self._mean(synced, g))
                    self._pending[name] = synced
            return bucket.buffer()

        return self._observed(bucket, work.get_future().then(finish))

    def _mean(self, synced: Compressed, like: torch.Tensor) -> torch.Tensor:
        if "indices" in synced:
            out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
            for values, indices in zip(synced["values"], synced["indices"]):
                out.index_add_(0, indices.long(), values.to(like.dtype))
            return out.div_(self.world).view_as(like)
        return decompress(synced, like)

    def _record(self, synced: Compressed, grad: torch.Tensor) -> Compressed:
        if "indices" in synced:
            # what the optimizer consumes is zero outside the union of the ranks' indices
            indices = torch.unique(synced["indices"].reshape(-1).long())
            values = grad.reshape(-1)[indices]
            if int(torch.count_nonzero(grad)) != int(torch.count_nonzero(values)):
                return self._dense(grad)
            return {"values": values, "indices": indices.to(synced["indices"].dtype)}
        return super()._record(synced, grad)

    def state_dict(self) -> dict[str, Any]:
        return residual_state(self.compressor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_residual_state(self.compressor, state, self.devices())


def _unpack(buf: torch.Tensor, keys: list[str], parts: list[Compressed]) -> list[Compressed]:
    out: list[Compressed] = [{} for _ in parts]
    offset = 0
    for k in keys:
        for i, c in enumerate(parts):
            like = c[k]
            n = like.numel() * like.element_size()
            out[i][k] = buf[offset:offset + n].view(like.dtype).view(like.shape)
            offset += n
    return out


@dataclass(frozen=True)
class _Entry:
    """One gradient in a bucket, and where PowerSGD keeps its factors."""

    name: str
    offset: int
    numel: int
    n: int
    m: int
    rank: int
    p_offset: int = -1  # -1: not compressed (all-reduced whole)
    q_offset: int = -1


def _initial_q(e: _Entry) -> torch.Tensor:
    """A parameter's first Q: standard normal, seeded by its name, the same on every rank."""
    seed = int.from_bytes(hashlib.sha256(e.name.encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.randn(e.m, e.rank, generator=torch.Generator().manual_seed(seed))


class PowerSGDCompression(DDPCompression):
    """PyTorch's PowerSGD hook, its factors kept as the compressed gradient."""

    START = 2
    """Backward passes all-reduced whole before PowerSGD starts (the least PyTorch allows with error
    feedback): it compresses from the third step on."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int = 4,
                 spec: str | None = None) -> None:
        super().__init__(model, optimizer, spec or f"powersgd:rank={rank}")
        self.state = _powersgd.PowerSGDState(process_group=self.group, matrix_approximation_rank=rank,
                                             start_powerSGD_iter=self.START, use_error_feedback=True, warm_start=True,
                                             random_seed=0)
        self._layouts: dict[int, tuple[_Entry, ...]] = {}
        self._canon: dict[str, dict[str, torch.Tensor]] | None = None  # restored state not laid into buckets yet
        self._this_backward: set[int] = set()
        self._backwards = 0

    def _layout(self, bucket: dist.GradBucket) -> tuple[_Entry, ...]:
        """The bucket's gradients as the hook sees them, P and Q offsets in the hook's order."""
        base = bucket.buffer().data_ptr()
        entries, by_shape = [], {}
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            n = g.shape[0] if g.dim() else 1
            m = g.numel() // max(n, 1)
            r = min(n, m, self.state.matrix_approximation_rank)
            entries.append(_Entry(self.names[p], (g.data_ptr() - base) // g.element_size(), g.numel(), n, m, r))
            if _powersgd._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append(len(entries) - 1)
        p_off = q_off = 0
        for indices in by_shape.values():  # the hook groups the tensors it compresses by shape
            for i in indices:
                e = entries[i] = replace(entries[i], p_offset=p_off, q_offset=q_off)
                p_off, q_off = p_off + e.n * e.rank, q_off + e.m * e.rank
        return tuple(entries)

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        b = bucket.index()
        if b in self._this_backward:  # a new backward: the last one's futures have all completed
            self._this_backward.clear()
            self._backwards += 1
            if self._canon is not None:
                if self._backwards == 1:  # DDP may rebuild its buckets now: lay the state out again
                    self._canon = self._canonical()
                    self._clear()
                else:
                    self._canon = None
        self._this_backward.add(b)
        layout = self._layout(bucket)
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        if self._layouts.get(b, layout) != layout and b in self.state.q_memory_dict:
            raise EverystepError(f"DDP rearranged gradient bucket {b} after PowerSGD state was made for it")
        self._layouts[b] = layout
        if compressing and b not in self.state.q_memory_dict:
            self._install(b, layout, bucket.buffer())
        for e in layout:
            self._pending[e.name] = None
        size = bucket.buffer().element_size()
        self.compressed_bytes += size * sum((e.n + e.m) * e.rank if compressing and e.p_offset >= 0 else e.numel
                                            for e in layout)
        fut = _powersgd.powerSGD_hook(self.state, bucket)
        if not compressing:
            return self._observed(bucket, fut)

        def capture(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            p_mem, q_mem = self.state.p_memory_dict[b], self.state.q_memory_dict[b]
            for e in layout:
                if e.p_offset >= 0:
                    self._pending[e.name] = {
                        "p": p_mem[e.p_offset:e.p_offset + e.n * e.rank].view(e.n, e.rank).clone(),
                        "q": q_mem[e.q_offset:e.q_offset + e.m * e.rank].view(e.m, e.rank).clone(),
                    }
            return f.value()

        fut = self._observed(bucket, fut.then(capture))
        # The hook issues its P and Q all-reduces from completion callbacks, on whatever thread
        # completes the previous one; with several buckets in flight the ranks could then issue
        # them in different orders. Finishing each bucket before the next keeps one order.
        fut.wait()
        return fut

    def _canonical(self) -> dict[str, dict[str, torch.Tensor]]:
        """The error and warm-start Q of every parameter, from the buckets they are in now."""
        canon: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        if self._canon is not None:
            canon = {k: dict(v) for k, v in self._canon.items()}
        for b, layout in self._layouts.items():
            error, q_mem = self.state.error_dict.get(b), self.state.q_memory_dict.get(b)
            for e in layout:
                if error is not None:
                    canon["error"][e.name] = error[e.offset:e.offset + e.numel].clone()
                if q_mem is not None and e.q_offset >= 0:
                    canon["q"][e.name] = q_mem[e.q_offset:e.q_offset + e.m * e.rank].clone()
        return canon

    def _install(self, b: int, layout: tuple[_Entry, ...], like: torch.Tensor) -> None:
        """Lay the error and the warm-start Q of bucket ``b``'s parameters into the hook's state:
        restored ones where there are, else each parameter's own initial Q. (Left to itself, the
        hook draws one random Q per bucket, so the draw would depend on how DDP bucketed.)"""
        canon = self._canon or {"error": {}, "q": {}}
        errors, qs = canon["error"], canon["q"]
        if any(e.name in errors for e in layout):
            error = torch.zeros_like(like)
            for e in layout:
                if e.name in errors:
                    error[e.offset:e.offset + e.numel] = errors[e.name].to(like)
            self.state.error_dict[b] = error
        compressed = sorted((e for e in layout if e.p_offset >= 0), key=lambda e: e.q_offset)
        self.state.p_memory_dict[b] = like.new_empty(sum(e.n * e.rank for e in compressed))
        self.state.q_memory_dict[b] = torch.cat(
            [like.new_empty(0)] + [(qs[e.name] if e.name in qs else _initial_q(e)).reshape(-1).to(like) for e in compressed])

    def _clear(self) -> None:
        for d in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            d.clear()
        self._layouts.clear()

    def state_dict(self) -> dict[str, Any]:
        canon = self._canonical()
        return {"kind": self.spec, "iter": self.state.iter, "residuals": canon["error"], "q": canon["q"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_kind(state, self.spec)
        self.state.iter = int(state["iter"])
        self._clear()
        self._canon = {"error": {k: v.clone() for k, v in state["residuals"].items()},
                       "q": {k: v.clone() for k, v in state["q"].items()}}
        self._this_backward.clear()
        self._backwards = 0
