"""The smallest checkpoint interval within an overhead budget, searched over powers of two from an
every-step overhead (``everystep gpu-check``'s ``frequency`` part)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["search_intervals", "smallest_within"]


def search_intervals(every_step: dict[str, float], probe: Callable[[dict[str, int]], dict[str, float] | None],
                     budget: float, cap: int) -> dict[str, dict[int, float]]:
    """Per strategy, the overheads measured at powers of two on the way to its smallest interval
    within ``budget``: from :func:`_first_probe`'s guess, down while within the budget, up while not,
    until that interval is bracketed or ``cap`` is passed. ``probe`` measures one interval per
    strategy, all in one round, and returns their overheads (a strategy left out failed: its search
    ends), or None when there is no time for the round."""
    measured = {n: {1: o} for n, o in every_step.items()}
    wanted: dict[str, int | None] = {n: _first_probe(o, budget, cap) for n, o in every_step.items()}
    while True:
        probes = {}
        for n, k in wanted.items():
            k = _next(measured[n], k, budget, cap)
            if k is not None:
                probes[n] = k
        if not probes:
            return measured
        got = probe(probes)
        if got is None:
            return measured
        for n, k in probes.items():
            if n not in got:
                wanted[n] = None
                continue
            measured[n][k] = got[n]
            wanted[n] = k // 2 if got[n] <= budget else k * 2


def _first_probe(overhead: float, budget: float, cap: int) -> int:
    """The power of two at which an overhead measured every step, spread over the interval, falls
    within the budget (an overhead that is a fixed cost per checkpoint falls as 1/interval)."""
    if overhead <= budget:
        return 1
    return min(cap, 2 ** math.ceil(math.log2(overhead / budget)))


def _next(measured: dict[int, float], wanted: int | None, budget: float, cap: int) -> int | None:
    """The next interval to measure from ``wanted`` on, or None when the search is over (bracketed:
    a known interval within the budget next to one over it; or past 1 or the cap)."""
    down = None
    while wanted is not None and 1 <= wanted <= cap and wanted in measured:  # known: go on in its direction
        within = measured[wanted] <= budget
        if down is not None and within != down:
            return None
        down = within
        wanted = wanted // 2 if within else wanted * 2
    return wanted if wanted is not None and 1 <= wanted <= cap else None


def smallest_within(measured: dict[int, float], budget: float, cap: int) -> dict[str, Any]:
    """The smallest interval measured within the budget, and whether the search settled it: the
    interval below it was measured over the budget (or it is 1), or none was within up to the cap."""
    within = [k for k, o in measured.items() if o <= budget]
    best = min(within) if within else None
    below = measured.get(best // 2) if best else None
    settled = best == 1 or (below is not None and below > budget) or (best is None and cap in measured)
    return {"interval": best, "settled": settled, "overheads": {str(k): o for k, o in sorted(measured.items())}}
