"""Compressors: what they keep, and that error feedback loses nothing over time."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from everystep.compress import Quant8, TopK, make_compressor
from everystep.errors import ConfigError


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.floats(0.001, 1.0), st.integers(1, 5), st.integers(0, 10_000))
def test_topk_keeps_ceil_ratio_entries_and_error_feedback_conserves_the_sum(n, ratio, steps, seed):
    g = torch.Generator().manual_seed(seed)
    comp, like = TopK(ratio), torch.empty(n, dtype=torch.float64)
    sent, total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        grad = torch.randn(n, generator=g, dtype=torch.float64)
        c = comp.compress("w", grad)
        assert c["values"].numel() == max(1, math.ceil(ratio * n))
        assert torch.equal(c["indices"], c["indices"].sort().values)
        sent += comp.decompress(c, like)
        total += grad
    # what was sent plus what is still owed is exactly what was produced
    assert torch.allclose(sent + comp.residuals["w"], total, rtol=0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 500), st.integers(0, 10_000))
def test_quant8_error_is_bounded_by_half_a_step_and_fed_back(n, seed):
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    comp = Quant8()
    c = comp.compress("w", grad)
    assert c["codes"].dtype == torch.int8
    out = comp.decompress(c, grad)
    assert (out - grad).abs().max() <= c["scale"] / 2 + 1e-6
    assert torch.allclose(out + comp.residuals["w"], grad, atol=1e-6)


def test_compressor_specs_are_validated():
    assert make_compressor("topk:0.05").ratio == 0.05
    assert isinstance(make_compressor("quant8"), Quant8)
    for bad, message in [("topk:2", "ratio must lie in"), ("topk:x", "takes a ratio"), ("zip", "unknown compression"),
                         ("powersgd:rank=4", "not available")]:
        with pytest.raises(ConfigError, match=message):
            make_compressor(bad)
