"""Tensor objects in the safetensors format.

Writing streams the header and then the tensors' own bytes (or one flat host buffer laid out by
:class:`~everystep.transport.TensorLayout`) without building the file in memory. Reading goes
through the safetensors library, which parses the header as JSON and never executes code.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load

from ..errors import CorruptCheckpointError
from ..layout import TensorLayout, tensor_bytes

__all__ = ["header_bytes", "tensor_chunks", "buffer_chunks", "load_tensors", "CHUNK"]

CHUNK = 8 << 20

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def header_bytes(layout: TensorLayout, metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a safetensors file for ``layout`` (the same each
    checkpoint of a state: cached by layout and metadata)."""
    return _header_bytes(layout, tuple(metadata.items()) if metadata else ())


@functools.lru_cache(maxsize=16)
def _header_bytes(layout: TensorLayout, metadata: tuple[tuple[str, str], ...]) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for e in layout.entries:
        if e.dtype not in _DTYPES:
            raise TypeError(f"tensor {e.key!r} has dtype {e.dtype}, which the tensor format cannot store")
        header[e.key] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [e.offset, e.offset + e.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _split(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), CHUNK):
        yield view[start : start + CHUNK]


SMALL = 1 << 20
"""Tensors smaller than this are gathered into one chunk: each chunk is one write(2), and the writing
thread takes the GIL back after each — with many small tensors, often enough to slow the training
thread, which waits for it each time."""


def tensor_chunks(layout: TensorLayout, tensors: dict[str, torch.Tensor]) -> Iterator[memoryview]:
    """Header, then each tensor's bytes in layout order, read straight from the tensors (small ones
    gathered into chunks of up to :data:`SMALL` bytes, the header with the first ones)."""
    pending: list[memoryview] = [memoryview(header_bytes(layout))]
    size = len(pending[0])
    for e in layout.entries:
        view = tensor_bytes(tensors[e.key])
        if len(view) >= SMALL:
            if pending:
                yield memoryview(b"".join(pending))
                pending, size = [], 0
            yield from _split(view)
            continue
        if size + len(view) > SMALL:
            yield memoryview(b"".join(pending))
            pending, size = [], 0
        pending.append(view)
        size += len(view)
    if pending:
        yield memoryview(b"".join(pending))


def buffer_chunks(layout: TensorLayout, flat: memoryview) -> Iterator[memoryview]:
    """Header, then the flat host buffer that holds every tensor of ``layout``."""
    yield memoryview(header_bytes(layout))
    yield from _split(flat)


def load_tensors(data: bytes | bytearray, *, what: str) -> dict[str, torch.Tensor]:
    """Parse a tensor object; raise :class:`CorruptCheckpointError` if it is not one."""
    try:
        return _st_load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CorruptCheckpointError(f"{what} is not a valid safetensors file ({e}); it was not loaded") from None
