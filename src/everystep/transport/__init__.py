"""Device-to-host movement of state: flat host buffers, a reusable pool, snapshot copies."""

from .host import HostBuffer, HostBufferPool, TensorLayout, snapshot_into

__all__ = ["HostBuffer", "HostBufferPool", "TensorLayout", "snapshot_into"]
