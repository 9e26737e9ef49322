"""Host memory allocated elsewhere (a mapping) made usable for DMA from a GPU."""

from __future__ import annotations

import torch

__all__ = ["pin_in_place", "register_host", "unregister_host"]


def pin_in_place(data: torch.Tensor) -> str | None:
    """Pin ``data``'s memory for DMA from a GPU, in place: None once pinned, else why not."""
    if not torch.cuda.is_available():
        return "no GPU"
    if not data.numel():
        return "nothing to pin"
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(data.data_ptr(), data.numel() * data.element_size(), 0)
    code = int(getattr(rc, "value", rc))
    if code == 0:
        return None
    _clear_last_error()
    try:
        why = cudart.cudaGetErrorString(rc)
    except (AttributeError, TypeError):
        why = "error"
    return f"cudaHostRegister refused it: {why} ({code})"


def _clear_last_error() -> None:
    """A refused registration leaves its error as this thread's last CUDA error, which the next
    kernel launched from the thread would report as its own (torch reads the last error after each
    launch). One launch here takes it, and its report is dropped."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:  # torch.AcceleratorError: the stale "invalid argument", now cleared
        pass


def register_host(data: torch.Tensor) -> bool:
    """Pin ``data``'s memory for DMA from a GPU, in place; False where there is no GPU or the driver
    refuses."""
    return pin_in_place(data) is None


def unregister_host(data: torch.Tensor) -> None:
    """Undo :func:`register_host`, once the GPU's work that may use the memory is done."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
