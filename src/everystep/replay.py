"""Replaying differentials: turn S_k into S_n by applying the updates of steps k+1..n again.

Each step record holds what the optimizer consumed at that step — the compressed gradient of every
parameter that had one, keyed by the parameter's name — and the scalar context the update read
(every param group's hyperparameters, learning rate included, and whether a GradScaler skipped
the step). Replay sets each ``p.grad`` to the decompressed gradient and runs ``step()`` of the same
optimizer class with the same group settings, so the result is bitwise that of training.

Optimizers in ``torch.optim`` update each parameter from its own gradient and state only, so
replay runs in parallel across parameters: the parameters are split into shards, each replayed
by its own optimizer instance that shares the original's per-parameter state, on its own thread.
Reading and decompressing the next records overlaps with applying the current ones.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .compress.base import Compressed, decompress
from .compress.hook import parameter_names
from .state import group_scalars

__all__ = ["StepRecord", "Replayer", "replay_step", "optimizer_like", "group_scalars"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    step: int
    skipped: bool
    groups: list[dict[str, Any]]
    grads: dict[str, Compressed] = field(default_factory=dict)


def replay_step(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]], *, ignore: Iterable[str] = ()) -> None:
    """One update, again: each param group takes its settings from ``groups`` (except the keys in
    ``ignore``), each parameter its gradient from ``grads`` (parameter, gradient or None), then
    ``optimizer.step()``; the gradients are cleared after. The same call with the same inputs gives
    bitwise the same result as the update of training, on the same device."""
    skip = frozenset(ignore)
    with torch.no_grad():
        for group, saved in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k not in skip} if skip else saved)
        for p, g in grads:
            p.grad = g
    optimizer.step()
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def optimizer_like(optimizer: torch.optim.Optimizer,
                   groups: dict[int, list[tuple[torch.Tensor, dict[str, Any]]]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over other tensors: for each group index of ``groups``,
    in order, that param group's settings and the given tensors, each with the given state (the same
    dict, not a copy: its updates land there)."""
    made = type(optimizer)([{**{k: v for k, v in optimizer.param_groups[g].items() if k != "params"},
                             "params": [t for t, _ in members]} for g, members in groups.items()])
    for members in groups.values():
        for t, state in members:
            made.state[t] = state
    return made


class Replayer:
    """Applies step records to a live model and optimizer, on ``threads`` threads."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        names = parameter_names(model)
        entries = [(gi, names[p], p) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]]
        shards: list[list[tuple[int, str, torch.nn.Parameter]]] = [[] for _ in range(min(threads, len(entries)) or 1)]
        loads = [0] * len(shards)
        for entry in sorted(entries, key=lambda e: -e[2].numel()):  # largest first onto the lightest shard
            i = loads.index(min(loads))
            shards[i].append(entry)
            loads[i] += entry[2].numel()
        self.shards = [_Shard(optimizer, shard) for shard in shards if shard]

    def apply(self, records: Iterable[StepRecord]) -> int:
        """Apply ``records`` in order; returns how many steps were applied."""
        if len(self.shards) == 1:
            n = 0
            for record in records:
                self.shards[0].apply(record)
                n += 1
            return n
        queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=8) for _ in self.shards]
        errors: list[BaseException] = []

        def work(shard: _Shard, q: queue.Queue[Any]) -> None:
            while (record := q.get()) is not None:
                if not errors:
                    try:
                        shard.apply(record)
                    except BaseException as e:  # surfaced below
                        errors.append(e)

        threads = [threading.Thread(target=work, args=(s, q), daemon=True) for s, q in zip(self.shards, queues)]
        for t in threads:
            t.start()
        n = 0
        try:
            for record in records:  # reading (and parsing) the next record overlaps with applying
                for q in queues:
                    q.put(record)
                n += 1
        finally:
            for q in queues:
                q.put(None)
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return n


class _Shard:
    """Some parameters of an optimizer, with a private optimizer that shares their state."""

    def __init__(self, optimizer: torch.optim.Optimizer, entries: list[tuple[int, str, torch.nn.Parameter]]) -> None:
        by_group: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for gi, name, p in entries:
            by_group.setdefault(gi, []).append((name, p))
        self.group_index = list(by_group)
        self.params = [by_group[gi] for gi in self.group_index]
        self.optimizer = optimizer_like(optimizer, {gi: [(p, {}) for _, p in ps]
                                                    for gi, ps in zip(self.group_index, self.params)})
        # The original's own state: updates land there, and an entry appears where the update makes
        # one (reading the defaultdict here would give every parameter an empty entry training lacks).
        self.optimizer.state = optimizer.state

    def apply(self, record: StepRecord) -> None:
        if record.skipped:
            return
        groups = [record.groups[gi] for gi in self.group_index]
        grads = ((p, None if (c := record.grads.get(name)) is None else decompress(c, p))
                 for ps in self.params for name, p in ps)
        replay_step(self.optimizer, groups, grads)
