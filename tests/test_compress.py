"""Compressors: what they keep, and that error feedback loses nothing over time."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from everystep.compress import Quant8, TopK, decompress, make_compressor, parse_spec
from everystep.compress.ddp import _multiplier
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
    assert parse_spec("powersgd") == ("powersgd", {"rank": 4}) and parse_spec("powersgd:rank=2")[1] == {"rank": 2}
    for bad, message in [("topk:2", "ratio must lie in"), ("topk:x", "takes a ratio"), ("zip", "unknown compression"),
                         ("powersgd:rank=0", "takes a rank"), ("powersgd:4", "takes a rank"),
                         ("powersgd:rank=4", "needs a DDP model")]:
        with pytest.raises(ConfigError, match=message):
            make_compressor(bad)


def test_decompress_reads_every_record_form():
    like = torch.empty(2, 3)
    g = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(decompress({"dense": g}, like), g)
    sparse = decompress({"values": torch.tensor([1.5, -2.0]), "indices": torch.tensor([1, 4], dtype=torch.int32)}, like)
    assert torch.equal(sparse, torch.tensor([[0, 1.5, 0], [0, -2.0, 0]]))
    codes = torch.tensor([[1, -2, 3, 0, 5, 127], [2, 2, 2, 2, 2, 2]], dtype=torch.int8)
    scales = torch.tensor([0.5, 0.25])
    assert torch.equal(decompress({"codes": codes[0], "scale": scales[0]}, like), (codes[0].float() * 0.5).view(2, 3))
    mean = decompress({"codes": codes, "scales": scales}, like)
    assert torch.allclose(mean, ((codes[0].float() * 0.5 + codes[1].float() * 0.25) / 2).view(2, 3))
    p, q = torch.randn(2, 1), torch.randn(3, 1)
    assert torch.allclose(decompress({"p": p, "q": q}, like), p @ q.T)
    c = torch.tensor(0.3)
    assert torch.equal(decompress({"dense": g, "mul": c}, like), g * c)
    with pytest.raises(KeyError, match="not a gradient record"):
        decompress({"x": g}, like)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.floats(1e-4, 1.0), st.integers(0, 10_000))
def test_the_one_factor_of_a_clipped_gradient_is_found_exactly(n, factor, seed):
    h = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    c = torch.tensor(factor, dtype=torch.float32)
    g = h * c  # what clip_grad_norm_ does: one multiplication by a 0-dim tensor
    found = _multiplier(h, g)
    assert found is not None and torch.equal(h * found, g)
    assert _multiplier(torch.zeros(n), g) is None
