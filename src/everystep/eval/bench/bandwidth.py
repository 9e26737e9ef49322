"""Device-to-host copy bandwidth into each kind of host memory, on the training stream and on a side
stream beside compute: the physical limit the checkpointing strategies are held against
(``everystep gpu-check``'s ``bandwidth`` part, run in a process of its own)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["measure_bandwidth"]


def measure_bandwidth(nbytes: int, copies: int) -> dict[str, Any]:
    """Device-to-host copies of ``nbytes`` into each kind of host memory, on each stream; median
    GB/s of ``copies`` timed copies after one untimed. Without CUDA the "device" is the CPU: the
    copies are memory copies, and the rows that need CUDA say so."""
    import torch

    from ...transport.shared import SharedRegion

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    region = SharedRegion(nbytes)
    registered = region.register()
    targets: dict[str, tuple[torch.Tensor | None, str]] = {
        "pageable": (torch.empty(nbytes, dtype=torch.uint8), ""),
        "pinned": (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "") if cuda
        else (None, "pinned memory needs CUDA"),
        "registered": (region.data, "" if registered or not cuda else "the driver refused to register the mapping"),
    }
    rows = []
    try:
        matmul = _matmul_load(device) if cuda else None
        for name, (target, why) in targets.items():
            for stream in ("training", "side"):
                row: dict[str, Any] = {"memory": name, "stream": stream, "gb_per_s": None, "seconds": [],
                                       "exact": None, "overlapped": None, "why": why}
                if name == "registered" and not cuda:
                    row["why"] = "a shared mapping, not registered: no GPU to register it with"
                if target is None:
                    rows.append(row)
                    continue
                if stream == "side" and not cuda:
                    row.update(why="side streams need CUDA")
                    rows.append(row)
                    continue
                seconds, overlapped = [], []
                for i in range(copies + 1):
                    target.zero_()
                    took, overlap = _timed_copy(source, target, side=stream == "side", load=matmul)
                    if i:
                        seconds.append(took)
                        overlapped.append(overlap)
                if cuda:
                    torch.cuda.synchronize()
                row.update(seconds=seconds, gb_per_s=nbytes / statistics.median(seconds) / 1e9,
                           exact=bool(torch.equal(target, source.cpu())),
                           overlapped=all(overlapped) if stream == "side" else None)
                rows.append(row)
    finally:
        del targets
        region.close()
    return {"bytes": nbytes, "copies": copies, "device": str(device), "registered": registered, "rows": rows}


def _matmul_load(device: Any) -> Callable[[float], Any]:
    """Queue matmuls on the current (training) stream for about ``seconds``; returns an event
    recorded after them."""
    import torch

    a = torch.randn(4096, 4096, device=device)
    b = torch.randn(4096, 4096, device=device)
    a @ b  # the library's first call sets itself up: not timed
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(4):
        a @ b
    end.record()
    end.synchronize()
    each = start.elapsed_time(end) / 4 / 1e3

    def load(seconds: float) -> Any:
        for _ in range(max(2, math.ceil(seconds / each) + 1)):
            a @ b
        done = torch.cuda.Event()
        done.record()
        return done

    return load


def _timed_copy(source: Any, target: Any, *, side: bool, load: Callable[[float], Any] | None) -> tuple[float, bool]:
    """Seconds of one copy of ``source`` into ``target``, and whether the matmuls queued before it
    (on a side stream) were still running when it ended."""
    import torch

    if load is None:
        t0 = time.perf_counter()
        target.copy_(source)
        return time.perf_counter() - t0, False
    training = torch.cuda.current_stream()
    stream = torch.cuda.Stream() if side else training
    expected = source.numel() / 20e9  # long enough to cover a copy at 20 GB/s twice over
    done = load(2 * expected) if side else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        target.copy_(source, non_blocking=True)
        end.record(stream)
    end.synchronize()
    overlapped = done is not None and not done.query()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, overlapped
