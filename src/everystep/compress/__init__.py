"""Gradient compression: a small Compressor protocol, top-k with error feedback, 8-bit
quantisation, and — under DistributedDataParallel — communication hooks that all-gather those or
reuse PyTorch's PowerSGD."""

from .base import Compressed, Compressor, decompress
from .ddp import AllGatherCompression, DDPCompression, PowerSGDCompression, ddp_compression
from .hook import GradientCompression, make_compressor, parameter_names, parse_spec
from .quant import Quant8
from .topk import TopK

__all__ = ["Compressed", "Compressor", "decompress", "GradientCompression", "make_compressor", "parameter_names",
           "parse_spec", "Quant8", "TopK", "DDPCompression", "AllGatherCompression", "PowerSGDCompression",
           "ddp_compression"]
