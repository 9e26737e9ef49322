"""How a checkpoint's tensors lie in its objects: tensor files (safetensors), the parts every rank
of a job writes and rank 0 commits, and full checkpoints in torch.distributed.checkpoint's format."""

from typing import TYPE_CHECKING

from ..._lazy import exports

if TYPE_CHECKING:
    from .dcp import DCP_SUFFIX, load_metadata, read_dcp, write_dcp
    from .sharded import RankShare, commit_parts, commit_tensors, commit_written, part_rank, parts_read, read_parts, \
        write_part
    from .tensorfile import buffer_chunks, load_tensors, parse_header, read_tensors, tensor_chunks

__all__ = ["DCP_SUFFIX", "load_metadata", "read_dcp", "write_dcp", "RankShare", "commit_parts", "commit_tensors",
           "commit_written", "part_rank", "parts_read", "read_parts", "write_part", "buffer_chunks", "load_tensors",
           "parse_header", "read_tensors", "tensor_chunks"]

__getattr__, __dir__ = exports(__name__, {
    **dict.fromkeys(["DCP_SUFFIX", "load_metadata", "read_dcp", "write_dcp"], ".dcp"),
    **dict.fromkeys(["RankShare", "commit_parts", "commit_tensors", "commit_written", "part_rank", "parts_read",
                     "read_parts", "write_part"], ".sharded"),
    **dict.fromkeys(["buffer_chunks", "load_tensors", "parse_header", "read_tensors", "tensor_chunks"], ".tensorfile"),
})
