"""``everystep bench --region-layout``: write throughput of the region's layout against metadata
interleaved with data (LightCheck's Fig. 11).

Both write the same workload state into a memory-mapped file, with the same copies (the tensors'
bytes, from the training device) and the same flush:

- ``separated``: the region's layout — tensors of more than 128 bytes at 128-byte-aligned offsets
  in copy order, the small ones packed, the metadata written once, apart (:class:`Region`);
- ``interleaved``: each tensor's metadata record (JSON: key, dtype, shape) followed at once by its
  bytes, as a serialiser that writes a dictionary in order would lay them out.

Repeats alternate the two; the figure is the median.
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from ...tree import flatten
from ...storage.region import Region, RegionLayout, on_volatile_memory
from ..workloads import build

__all__ = ["measure_layouts"]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _separated(region: Region, tensors: dict[str, torch.Tensor], layout: RegionLayout) -> float:
    t0 = time.perf_counter()
    writer = region.begin(layout, 4096)
    for key, view in writer.views.items():
        _bytes_of(view).copy_(_bytes_of(tensors[key]))
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()
    region.commit(writer, 1, None, checksums={k: "-" for k in tensors})
    return time.perf_counter() - t0


def _interleaved(mm: mmap.mmap, data: torch.Tensor, tensors: dict[str, torch.Tensor], flush: bool) -> float:
    t0 = time.perf_counter()
    offset = 0
    for key, t in tensors.items():
        record = json.dumps({"key": key, "dtype": str(t.dtype), "shape": list(t.shape)}).encode()
        mm[offset:offset + len(record)] = record
        offset += len(record)
        n = t.numel() * t.element_size()
        data[offset:offset + n].copy_(_bytes_of(t))
        offset += n
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()
    if flush:
        mm.flush()
    return time.perf_counter() - t0


def measure_layouts(workload: str, *, device: str = "cpu", repeats: int = 5, where: str | None = None) -> dict[str, Any]:
    """Seconds and GB/s of writing ``workload``'s state (model and optimizer, after one step) both ways."""
    w = build(workload, seed=0, device=device)
    w.loss(w.data.next()).backward()
    w.optimizer.step()
    tensors, _ = flatten({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()["state"]})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    layout = RegionLayout.of(tensors)
    with tempfile.TemporaryDirectory(prefix="everystep-layout-", dir=where) as tmp:
        region = Region.open(os.path.join(tmp, "region.bin"))
        path = os.path.join(tmp, "interleaved.bin")
        flush = not on_volatile_memory(path)
        with open(path, "w+b") as f:
            os.posix_fallocate(f.fileno(), 0, nbytes + 256 * len(tensors))
            mm = mmap.mmap(f.fileno(), nbytes + 256 * len(tensors))
        data = torch.frombuffer(mm, dtype=torch.uint8)
        if device == "cuda":  # both mappings pinned for DMA, as the region's writer pins its own
            torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0)
        times: dict[str, list[float]] = {"separated": [], "interleaved": []}
        try:
            for _ in range(repeats + 1):  # the first round warms the page cache and the registration
                times["separated"].append(_separated(region, tensors, layout))
                times["interleaved"].append(_interleaved(mm, data, tensors, flush))
        finally:
            if device == "cuda":
                torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
            del data
            mm.close()
            region.close()
    result: dict[str, Any] = {"workload": workload, "device": device, "bytes": nbytes, "tensors": len(tensors),
                              "flushed": flush, "repeats": repeats}
    for name, seconds in times.items():
        median = statistics.median(seconds[1:])
        result[name] = {"seconds": median, "gb_per_s": nbytes / median / 1e9, "all_seconds": seconds[1:]}
    result["speedup"] = result["interleaved"]["seconds"] / result["separated"]["seconds"]
    return result
