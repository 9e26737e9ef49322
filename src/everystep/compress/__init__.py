"""Gradient compression: a small Compressor protocol, top-k with error feedback, 8-bit quantisation."""

from .base import Compressed, Compressor
from .hook import GradientCompression, make_compressor, parameter_names
from .quant import Quant8
from .topk import TopK

__all__ = ["Compressed", "Compressor", "GradientCompression", "make_compressor", "parameter_names", "Quant8", "TopK"]
