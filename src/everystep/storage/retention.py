"""Which checkpoints to delete: a pure function of what is committed."""

from __future__ import annotations

from .base import Manifest

__all__ = ["plan_retention"]


def plan_retention(manifests: list[Manifest], *, keep: int) -> list[str]:
    """Names of manifests to discard so that the newest ``keep`` full checkpoints, the
    differentials newer than the newest full checkpoint, and everything those require, remain.

    Ordered by step number, never by name or time. A differential no newer than the newest full
    checkpoint leads to no point that checkpoint does not already give, and goes.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    fulls = sorted((m for m in manifests if m.kind == "full"), key=lambda m: m.step, reverse=True)
    if not fulls:
        return []
    newest = fulls[0].step
    by_name = {m.name: m for m in manifests}
    live = {m.name for m in fulls[:keep]}
    live |= {m.name for m in manifests if m.kind != "full" and m.step > newest}
    stack = list(live)
    while stack:
        for dep in by_name[stack.pop()].requires:
            if dep in by_name and dep not in live:
                live.add(dep)
                stack.append(dep)
    return sorted((m.name for m in manifests if m.name not in live), key=lambda n: (by_name[n].step, n))
