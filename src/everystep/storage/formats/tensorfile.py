"""Tensor objects in the safetensors format.

Writing streams the header and then the tensors' own bytes (or one flat host buffer laid out by
:class:`~everystep.transport.TensorLayout`) without building the file in memory. Reading parses the
header as JSON (nothing is executed) and checks it as strictly as the safetensors library does;
from a file (:func:`read_tensors`) each byte is read once, straight into the tensor it belongs to
(by two threads, each half of the file), and verified on the way.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import mmap
import os
import stat
import struct
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import torch

from ...errors import CorruptCheckpointError
from ...layout import TensorLayout, shape_overflows, tensor_bytes
from ..base import ObjectInfo, Reader, check_digest, new_hasher, refuse_constant

__all__ = ["header_bytes", "tensor_chunks", "buffer_chunks", "load_tensors", "read_tensors", "read_object_tensors",
           "parse_header", "CHUNK"]

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


MAX_HEADER = 100 << 20
"""The largest header read (the safetensors library's own limit)."""
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


def parse_header(header: bytes | bytearray | memoryview, data_nbytes: int, *, what: str
                 ) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """The tensors a safetensors header describes — key, dtype, shape, start and end in the data
    section — in the order they lie there; :class:`CorruptCheckpointError` naming ``what`` for
    anything the format does not allow: JSON only (nothing is executed), known dtypes, sizes that
    match the shapes, and the tensors covering the ``data_nbytes`` of the data section exactly, one
    after another (no gap, no overlap), as the safetensors library requires."""
    try:
        found = json.loads(bytes(header), parse_constant=refuse_constant)
        if not isinstance(found, dict):
            raise ValueError("the header is not a JSON object")
        rows = []
        for key, entry in found.items():
            if key == "__metadata__":
                if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                    raise ValueError("its metadata is not strings")
                continue
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise ValueError(f"tensor {key!r} is not described by dtype, shape and data_offsets")
            dtype, shape, offsets = _BY_NAME.get(entry["dtype"]), entry["shape"], entry["data_offsets"]
            if dtype is None:
                raise ValueError(f"tensor {key!r} has an unknown dtype {entry['dtype']!r}")
            if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2 \
                    or not all(type(v) is int and v >= 0 for v in (*shape, *offsets)):
                raise ValueError(f"tensor {key!r} has a shape or offsets that are not whole numbers")
            start, end = offsets
            if shape_overflows(shape, dtype.itemsize):
                raise ValueError(f"tensor {key!r} has a shape {shape} no tensor can have (its strides overflow)")
            if end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {key!r} holds {end - start} bytes, not those of its shape {shape}")
            rows.append((key, dtype, tuple(shape), start, end))
        rows.sort(key=lambda r: (r[3], r[4]))
        at = 0
        for key, _, _, start, end in rows:
            if start != at:
                raise ValueError(f"tensor {key!r} starts at {start}, not where the one before it ends ({at})")
            at = end
        if at != data_nbytes:
            raise ValueError(f"its tensors end at {at}, not at the end of its data ({data_nbytes} bytes)")
        return rows
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{what} is not a valid safetensors file ({e}); it was not loaded") from None


def _split_header(size: int, prefix: bytes, *, what: str) -> int:
    """The header's length, from the first 8 bytes of an object of ``size`` bytes."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"{what} is not a valid safetensors file (it is {size} bytes); it was not loaded")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > min(MAX_HEADER, size - 8):
        raise CorruptCheckpointError(f"{what} is not a valid safetensors file (a header of {n} bytes in {size}); "
                                     "it was not loaded")
    return n


def load_tensors(data: bytes | bytearray | memoryview, *, what: str) -> dict[str, torch.Tensor]:
    """Parse a tensor object held in memory (its checksum verified by the caller): each tensor copied
    out of it once, into memory of its own; :class:`CorruptCheckpointError` if it is not one."""
    n = _split_header(len(data), bytes(data[:8]), what=what)
    view = memoryview(data)
    rows = parse_header(view[8:8 + n], len(data) - 8 - n, what=what)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a read-only buffer: only read here)
        flat = torch.frombuffer(view, dtype=torch.uint8)
    base, tensors = 8 + n, {}
    for key, dtype, shape, start, end in rows:
        t = torch.empty(shape, dtype=dtype)
        if end > start:
            t.view(-1).view(torch.uint8).copy_(flat[base + start:base + end])
        tensors[key] = t
    return tensors


def read_object_tensors(reader: Reader, info: ObjectInfo) -> dict[str, torch.Tensor]:
    """The tensors of the tensor object ``info`` from any reader, its size and checksum verified
    before they are returned: read once, straight into its tensors and hashed on the way
    (:func:`read_tensors`), from a file the reader opens (a local store's:
    :meth:`~everystep.storage.catalog.Catalog.open_object`); else copied out of its verified bytes."""
    open_file = getattr(reader, "open_object", None)
    opened = open_file(info) if open_file is not None else None
    if opened is None:
        return load_tensors(reader.read_object(info), what=f"object {info.name}")
    with opened.file as f:
        return read_tensors(f, opened.size, info.checksum, what=f"object {opened.where}")


def read_tensors(f: BinaryIO, size: int, checksum: str, *, what: str) -> dict[str, torch.Tensor]:
    """Read a tensor object of ``size`` bytes from the file ``f`` once: each tensor straight into
    memory of its own (nothing zero-filled, no intermediate bytes), the checksum computed over what
    was read, in order, and compared once all is read — the caller loads nothing before this
    returns. From a file on disk the data is read by two threads at once, each half of it, the
    first half hashed while the second is read; from a stream, in turn, each tensor hashed by a
    thread of its own while the next is read (the reads and the hash release the interpreter's
    lock). :class:`CorruptCheckpointError` naming ``what`` when it is not a tensor object, is
    shorter or longer than ``size`` or fails ``checksum``."""
    hasher = new_hasher()
    prefix = _read_exactly(f, min(8, size), what)
    n = _split_header(size, prefix, what=what)
    header = _read_exactly(f, n, what)
    hasher.update(prefix)
    hasher.update(header)
    rows = parse_header(header, size - 8 - n, what=what)
    fd = _file_descriptor(f)
    extents = _data_extents(fd, size) if fd is not None else None
    tensors = {key: _empty(shape, dtype, end - start, zeroed=extents is not None) for key, dtype, shape, start, end in rows}
    views = [memoryview(tensors[key].view(-1).view(torch.uint8).numpy()) for key, _, _, start, end in rows if end > start]
    zeroed = [extents is not None and len(v) >= _ZEROED for v in views]
    if fd is None:
        with ThreadPoolExecutor(1, thread_name_prefix="everystep-read-hash") as hashing:  # (one thread: in order)
            for view in views:
                _read_into(f, view, what)
                hashing.submit(hasher.update, view)
        if f.read(1):
            raise CorruptCheckpointError(f"{what} is longer than its manifest says ({size} bytes)")
    else:
        if os.fstat(fd).st_size != size:
            raise CorruptCheckpointError(f"{what} is not the {size} bytes its manifest says (truncated?)")
        first, second = _halves(views, zeroed, 8 + n)
        if extents is not None:  # a file with holes: only its data is read (see _data_extents)
            first, second = _in_extents(first, extents), _in_extents(second, extents)
        with ThreadPoolExecutor(1, thread_name_prefix="everystep-read") as reading:
            later = reading.submit(_pread_into, fd, [s for s in second if s[2]], what)
            _pread_into(fd, [s for s in first if s[2]], what)
            for view, _, _ in first:
                hasher.update(view)
            later.result()
        for view, _, _ in second:
            hasher.update(view)
    check_digest(hasher, checksum, what)
    return tensors


def _file_descriptor(f: BinaryIO) -> int | None:
    """``f``'s descriptor where it is a regular file (which can be read at any offset), else None."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError):  # (io.UnsupportedOperation is an OSError)
        return None
    return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None


Segments = list[tuple[memoryview, int, bool]]
"""Buffers to read into, each with the offset in the file where its bytes lie, and whether to read
them (False: they lie in a hole of the file, and the buffer holds its zeros already)."""

_ZEROED = 1 << 20
"""Tensors of at least this many bytes read from a file with holes lie in fresh anonymous memory."""


def _data_extents(fd: int, size: int) -> list[tuple[int, int]] | None:
    """Where a file with holes (sparse) holds data, as (start, end) offsets; None where it has no
    hole (or the filesystem cannot say). A tensor file is written whole; one with holes is read
    without reading its holes into memory: a forged sparse file of many gigabytes, refused by its
    checksum, would otherwise take as much memory before the refusal. (A filesystem that stores
    blocks of zeros as holes, ZFS with compression, gives the same tensors either way.)"""
    try:
        if os.lseek(fd, 0, os.SEEK_HOLE) >= size:
            return None
        extents, at = [], 0
        while at < size:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # (only a hole past ``at``)
                    break
                raise
            at = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, min(at, size)))
        return extents
    except OSError:
        return None


def _empty(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, *, zeroed: bool) -> torch.Tensor:
    """A tensor to read into; ``zeroed`` and large: over fresh anonymous memory, whose pages cost no
    memory until written (and read as zeros: what a file's hole holds)."""
    if not zeroed or nbytes < _ZEROED:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype, count=nbytes // dtype.itemsize).view(shape)


def _in_extents(segments: Segments, extents: list[tuple[int, int]]) -> Segments:
    """``segments`` cut where the file's data ``extents`` begin and end: the parts in a hole are not
    read where their buffer is zeroed memory (:func:`_empty`; marked not to read by :func:`_halves`),
    and read (as zeros) where it is not."""
    out: Segments = []
    for view, offset, read in segments:
        if read:
            out.append((view, offset, True))
            continue
        at = offset
        for start, end in extents:
            lo, hi = max(start, offset), min(end, offset + len(view))
            if lo >= hi:
                continue
            if lo > at:
                out.append((view[at - offset:lo - offset], at, False))
            out.append((view[lo - offset:hi - offset], lo, True))
            at = hi
        if at < offset + len(view):
            out.append((view[at - offset:], at, False))
    return out


def _halves(views: list[memoryview], zeroed: list[bool], at: int) -> tuple[Segments, Segments]:
    """``views``, which the file holds one after another from offset ``at``, cut at the middle of
    their bytes (a view that spans the middle in two): the first half's and the second's, in order,
    each to be read unless its buffer is ``zeroed`` (then only where the file holds data:
    :func:`_in_extents`)."""
    total = sum(len(v) for v in views)
    middle = at + total // 2
    first: Segments = []
    second: Segments = []
    for view, zero in zip(views, zeroed, strict=True):
        end = at + len(view)
        if end <= middle:
            first.append((view, at, not zero))
        elif at >= middle:
            second.append((view, at, not zero))
        else:
            first.append((view[:middle - at], at, not zero))
            second.append((view[middle - at:], middle, not zero))
        at = end
    return first, second


def _pread_into(fd: int, segments: Segments, what: str) -> None:
    for view, offset, _ in segments:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                raise CorruptCheckpointError(f"{what} is shorter than its manifest says (truncated?)")
            got += n


def _read_exactly(f: BinaryIO, n: int, what: str) -> bytes:
    data = bytearray(n)
    _read_into(f, memoryview(data), what)
    return bytes(data)


def _read_into(f: BinaryIO, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CorruptCheckpointError(f"{what} is shorter than its manifest says (truncated?)")
        got += n
