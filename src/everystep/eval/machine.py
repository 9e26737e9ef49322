"""What a report was taken on: the GPU, its driver and PCIe link (from ``nvidia-smi``), torch, the
CPU and its cores."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["machine", "pcie_limit"]


def _nvidia_smi(fields: str) -> list[str] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "--id=0"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [v.strip() for v in out.stdout.strip().split(",")] if out.returncode == 0 and out.stdout.strip() else None


def pcie_limit(generation: int, lanes: int) -> float:
    """A PCIe link's bytes/s in one direction: its transfer rate per lane less its line encoding
    (8b/10b to generation 2, 128b/130b from 3)."""
    rate = {1: 2.5e9, 2: 5e9, 3: 8e9, 4: 16e9, 5: 32e9, 6: 64e9}[generation]
    return rate * lanes * (0.8 if generation <= 2 else 128 / 130) / 8


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The GPU, its driver and link, torch and the CPU this report was taken on."""
    import torch

    from .kills.run_config import usable_cores

    info: dict[str, Any] = {
        "gpu": None, "gpu_memory_bytes": None, "driver": None, "cuda_runtime": torch.version.cuda,
        "pcie": None, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu": _cpu_model(), "cpu_cores": os.cpu_count(), "usable_cores": usable_cores(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
        found = _nvidia_smi("driver_version,pcie.link.gen.max,pcie.link.width.max,pcie.link.gen.current,"
                            "pcie.link.width.current")
        if found and len(found) == 5:
            info["driver"] = found[0]
            try:
                gen, width = int(found[1]), int(found[2])
                info["pcie"] = {"generation": gen, "lanes": width, "limit_bytes_per_s": pcie_limit(gen, width),
                                "generation_now": found[3], "lanes_now": found[4]}
            except (ValueError, KeyError):
                info["pcie"] = {"unreadable": found[1:]}
    return info
