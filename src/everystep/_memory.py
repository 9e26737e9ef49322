"""Host memory allocated elsewhere (a mapping) made usable for DMA from a GPU."""

from __future__ import annotations

import torch

__all__ = ["register_host", "unregister_host"]


def register_host(data: torch.Tensor) -> bool:
    """Pin ``data``'s memory for DMA from a GPU, in place; False where there is no GPU or the driver
    refuses."""
    if not torch.cuda.is_available() or not data.numel():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel() * data.element_size(), 0)
    return int(getattr(rc, "value", rc)) == 0


def unregister_host(data: torch.Tensor) -> None:
    """Undo :func:`register_host`, once the GPU's work that may use the memory is done."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
