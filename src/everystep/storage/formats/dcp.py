"""Full checkpoints in the torch.distributed.checkpoint (DCP) format, inside an everystep store.

A DCP checkpoint is a directory ``objects/full-<step>.dcp/`` that plain ``torch.distributed.checkpoint``
calls load (``dcp.load``, ``format_utils.dcp_to_torch_save``) without everystep. Its keys are the
flat state keys (``/model/…``, ``/optimizer/state/…``). A tensor every rank holds (what data
parallelism replicates) is written by one rank, the ranks taking turns by size; a sharded tensor
(a DTensor: FSDP2, HSDP, tensor parallelism) is written as each rank's shard of the whole, so that
DCP loads it at another world size or layout (it writes a shard held by several replicas once); state
that differs per rank is stored under ``rank<R>/…``.

Commit follows the store's rules: DCP writes into ``objects/.tmp-full-<step>.dcp/``; each rank
checksums the files it wrote; rank 0 renames the directory into place and commits a manifest
naming every file with its checksum. Loading reads each file once: DCP reads from the file's bytes
in memory, read whole and verified against the manifest when it opens the file (it cannot open a
file the manifest does not name), into buffers of the restore's own; every other file of the
checkpoint is verified too, so that every rank agrees on whether it loads, before the live objects
are touched.

DCP keeps its own metadata file (``.metadata``) in pickle form. A checksum proves nothing against
someone who can write the directory (they can recompute it), so everystep never unpickles that
file with :mod:`pickle`'s default loader: :func:`load_metadata` admits only DCP's metadata
classes, torch's dtypes, layouts and sizes, and a path; anything else — a payload that would
import a callable — is refused before it can run.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ...errors import CorruptCheckpointError
from ...parallelism import shard_like
from ..base import CHECKSUM_ALGORITHM, Manifest, ObjectInfo, new_hasher
from ..catalog import Catalog
from ...tree import merged_meta
from .tensorfile import CHUNK

__all__ = ["write_dcp", "read_dcp", "load_metadata", "DCP_SUFFIX"]

DCP_SUFFIX = ".dcp"

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: every global the stream names must be one of
    DCP's metadata classes or a torch dtype; any other (``os.system``, ``builtins.eval``) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def load_metadata(path: Path, data: bytes | bytearray | None = None) -> Metadata:
    """Read a DCP ``.metadata`` file (``data``: its bytes, read already) without running code from
    it; raises CorruptCheckpointError when it names anything but DCP's metadata types."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes() if data is None else data)).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError) as e:
        raise CorruptCheckpointError(f"DCP metadata {path} was refused: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"DCP metadata {path} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _InMemory(io.RawIOBase):
    """A file's bytes in memory as the seekable stream DCP's reader reads them from (``io.BytesIO``
    would copy them first)."""

    def __init__(self, data: bytearray) -> None:
        super().__init__()
        self._data, self._at = memoryview(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}, before the start")
        self._at = base + offset
        return self._at

    def readinto(self, buffer: Any) -> int:
        got = self._data[self._at:self._at + len(memoryview(buffer).cast("B"))]
        memoryview(buffer).cast("B")[:len(got)] = got
        self._at += len(got)
        return len(got)

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size is None or size < 0 else self._at + size
        got = bytes(self._data[self._at:end])
        self._at += len(got)
        return got


class _VerifiedFiles(FileSystem):
    """The files of one DCP checkpoint, as DCP's reader opens them: each read whole, once, and
    verified against the manifest before DCP reads a byte of it; a path that is not one of the
    checkpoint's files (the metadata names the files: ``../`` or an absolute path) is refused. The
    first refusal is kept in :attr:`error` (DCP wraps what its reads raise in an error of its own)."""

    def __init__(self, catalog: Catalog, directory: Path, files: dict[str, ObjectInfo]) -> None:
        super().__init__()
        self._catalog, self._directory, self.files = catalog, directory, files
        self.opened: set[str] = set()
        self.error: CorruptCheckpointError | None = None

    def read(self, name: str) -> bytearray:
        """The bytes of the checkpoint's file ``name``, verified."""
        self.opened.add(name)
        return self._catalog.read_object(self.files[name])

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        path = Path(path)
        try:
            if mode != "rb" or path.parent != self._directory or path.name not in self.files:
                raise CorruptCheckpointError(f"the DCP metadata of {self._directory.name} names {path}, which is not "
                                             "one of the checkpoint's files")
            data = self.read(path.name)
        except CorruptCheckpointError as e:
            self.error = self.error or e
            raise
        yield _InMemory(data)


class _Reader(dcp.FileSystemReader):
    """DCP's file reader over :class:`_VerifiedFiles`, with the metadata read by :func:`load_metadata`
    from its verified bytes."""

    def __init__(self, path: Path, files: _VerifiedFiles) -> None:
        super().__init__(path)
        self.fs = files
        self._metadata = load_metadata(path / ".metadata", files.read(".metadata"))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return self._metadata


_OTHER_RANKS_OPTIMIZER = re.compile(r"rank\d+(/optimizer/state/.+)")
"""A rank's own optimizer state (ZeRO-1's), read by every rank at another world size."""


def _rank_key(rank: int, key: str) -> str:
    return f"rank{rank}{key}"


def _file_info(path: Path, name: str) -> ObjectInfo:
    """Size and checksum of a written file, under the object name it will have once installed."""
    hasher, nbytes = new_hasher(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
            nbytes += len(chunk)
    return ObjectInfo(name=name, nbytes=nbytes, checksum=f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}")


def write_dcp(catalog: Catalog, channel: str, step: int, tensors: dict[str, torch.Tensor], replicated: set[str],
              skeleton: Any, meta: dict[str, Any] | None = None, *,
              sharded: Mapping[str, torch.Tensor] | None = None) -> Manifest:
    """Save S_step with DCP from every rank, through the store, and commit it (rank 0) once every
    file is durable. ``sharded``: keys whose tensor is this rank's shard of a DTensor, with the
    DTensor; each is saved as a shard of the whole (DCP writes a replicated shard once)."""
    ranks = catalog.ranks
    name = f"full-{step:012d}{DCP_SUFFIX}"
    sharded = sharded or {}
    # Each replicated tensor written by one rank, balanced (DCP would drop the copies itself, but it
    # balances them only among themselves, item by item: a checkpoint of many small replicated
    # tensors next to the shards, FSDP2's step counters, lands them on one rank).
    owners = ranks.owners({k: t.numel() * t.element_size() for k, t in tensors.items()
                           if k in replicated and k not in sharded})
    state = {_rank_key(ranks.rank, k): t for k, t in tensors.items() if k not in replicated and k not in sharded}
    state.update((k, tensors[k]) for k, owner in owners.items() if owner == ranks.rank)
    state.update((k, shard_like(tensors[k], like)) for k, like in sharded.items() if k in tensors)

    def fill(folder: Path) -> list[dict[str, Any]]:
        error: BaseException | None = None
        files: list[dict[str, Any]] = []
        try:
            group = ranks.groups.get(channel) if ranks.distributed else None
            dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), process_group=group,
                     no_dist=not ranks.distributed)
            mine = sorted(p.name for p in folder.iterdir() if p.name.startswith(f"__{ranks.rank}_"))
            if ranks.rank == 0:
                mine.append(".metadata")
            files = [_file_info(folder / f, f"{name}/{f}").to_json() for f in mine]
            catalog.count_written_elsewhere(sum(f["nbytes"] for f in files))
        except BaseException as e:  # reported to every rank
            error = e
        return ranks.exchange(channel, {"files": files, "skeleton": skeleton}, error, f"the DCP checkpoint of step {step}")

    reports = catalog.write_directory(name, fill)
    objects = {f"dcp/{Path(o['name']).name}": ObjectInfo.from_json(o) for p in reports for o in p["files"]}
    manifest = Manifest(kind="full", step=step, objects=objects, meta={
        **(meta or {}), "format": "dcp", "world_size": ranks.world,
        "parts": [{"pieces": {}, "meta": {"skeleton": p["skeleton"]}} for p in reports],
    })
    if ranks.rank == 0:
        catalog.commit(manifest)
    return manifest


def read_dcp(catalog: Catalog, manifest: Manifest, rank: int, *, shards: Mapping[str, torch.Tensor] | None = None
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors of a DCP checkpoint (rank r mod the writer's world size for its own state).

    ``shards``: live DTensors by key; a stored tensor of such a key and of the DTensor's global shape
    is read as a DTensor placed as the live one is (this rank's shard of it, whatever layout and
    world size wrote it); every other tensor whole."""
    shards = shards or {}
    parts = manifest.meta["parts"]
    mine = rank % len(parts)
    other_world = len(parts) != catalog.ranks.world
    names = {info.name.split("/", 1)[0] for info in manifest.objects.values()}
    if len(names) != 1:
        raise CorruptCheckpointError(f"checkpoint {manifest.name} names files in several directories")
    directory = catalog.object_path(names.pop())
    files = _VerifiedFiles(catalog, directory, {info.name.partition("/")[2]: info for info in manifest.objects.values()})
    if ".metadata" not in files.files:
        raise CorruptCheckpointError(f"checkpoint {manifest.name} lacks DCP's .metadata")
    reader = _Reader(directory, files)
    own = _rank_key(mine, "")
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if key.startswith("rank") and not key.startswith(own + "/") and \
                not (other_world and _OTHER_RANKS_OPTIMIZER.fullmatch(key)):
            continue
        size, dtype = getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None)
        if size is None or not isinstance(dtype, torch.dtype) or not all(type(n) is int and n >= 0 for n in size):
            raise CorruptCheckpointError(f"checkpoint {manifest.name}: entry {key!r} is not a tensor")
        wanted[key] = (tuple(size), dtype)
    stored = sum(info.nbytes for info in manifest.objects.values())
    if sum(math.prod(size) * dtype.itemsize for size, dtype in wanted.values()) > stored:
        # IMPORTANT: nothing is allocated from the metadata's sizes beyond what the files hold.
        raise CorruptCheckpointError(f"checkpoint {manifest.name}: its metadata describes more bytes than its "
                                     f"{stored}-byte files hold")
    template = {}
    for key, (size, dtype) in wanted.items():
        like = shards.get(key[len(own):] if key.startswith(own + "/") else key)
        template[key] = torch.empty_like(like, dtype=dtype) if like is not None and tuple(like.shape) == size \
            else torch.empty(size, dtype=dtype)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(template, storage_reader=reader, no_dist=True)
    except BaseException as e:  # (DCP's CheckpointException, which wraps what the reads raised, is a BaseException)
        if files.error is not None and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise files.error from None
        raise
    for name in sorted(set(files.files) - files.opened):  # (so that every rank refuses a damaged checkpoint alike)
        files.read(name)
    tensors = {(k[len(own):] if k.startswith(own + "/") else k): t for k, t in template.items()}
    for key in [k for k in tensors if k.startswith("rank")]:  # (ZeRO-1: another rank's optimizer state)
        tensors.setdefault(_OTHER_RANKS_OPTIMIZER.fullmatch(key)[1], tensors.pop(key))
    return tensors, merged_meta(parts, mine, other_world)
