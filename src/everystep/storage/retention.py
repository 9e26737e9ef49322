"""Which checkpoints to delete: a pure function of what is committed."""

from __future__ import annotations

from collections.abc import Collection

from .base import Manifest

__all__ = ["plan_retention", "POINTS", "SPREAD_KIND"]

SPREAD_KIND = "spread"
"""The manifest kind of a checkpoint whose parts are brought forward at recovery (GoCkpt's; :mod:`everystep.spread`
writes and reads it)."""
POINTS = ("full", SPREAD_KIND)
"""Kinds of checkpoint that recover on their own (a ``spread`` one: GoCkpt's parts with their
gradients); the other kinds are differentials on top of one."""


def plan_retention(manifests: list[Manifest], *, keep: int, pinned: Collection[str] = ()) -> list[str]:
    """Names of manifests to discard so that the newest ``keep`` checkpoints that recover on their
    own (:data:`POINTS`), the differentials newer than the newest of them, the manifests ``pinned``
    names (a checkpoint being uploaded), and everything those require, remain.

    Ordered by step number, never by name or time. A differential no newer than the newest such
    checkpoint leads to no point that checkpoint does not already give, and goes.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    points = sorted((m for m in manifests if m.kind in POINTS), key=lambda m: m.step, reverse=True)
    if not points:
        return []
    newest = points[0].step
    by_name = {m.name: m for m in manifests}
    live = {m.name for m in points[:keep]}
    live |= {m.name for m in manifests if m.kind not in POINTS and m.step > newest}
    live |= {name for name in pinned if name in by_name}
    stack = list(live)
    while stack:
        for dep in by_name[stack.pop()].requires:
            if dep in by_name and dep not in live:
                live.add(dep)
                stack.append(dep)
    return sorted((m.name for m in manifests if m.name not in live), key=lambda n: (by_name[n].step, n))
