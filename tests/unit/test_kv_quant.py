"""KIVI INT8 quantization: error bounds (<= half a step per element), outward-rounded parameters, round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vla_node.kv import quant

SCALE_DTYPES = [torch.float16, torch.float32]


def _sample(seed: int, shape: tuple[int, ...], spread: float, offset: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * spread + offset


def _assert_within_half_step(x, x_hat, step):
    err = (x - x_hat).abs()
    bound = step * 0.5 * (1 + 1e-5) + x.abs() * 1e-6  # half a step, plus fp32 rounding of the arithmetic
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    heads=st.integers(1, 3),
    groups=st.integers(1, 4),
    group=st.sampled_from([1, 2, 8, 32]),
    dim=st.sampled_from([1, 4, 16, 64]),
    spread=st.sampled_from([1e-4, 0.1, 1.0, 30.0]),
    offset=st.sampled_from([0.0, -3.0, 250.0]),
    scale_dtype=st.sampled_from(SCALE_DTYPES),
)
def test_keys_per_channel_error_is_at_most_half_a_step(seed, heads, groups, group, dim, spread, offset, scale_dtype):
    k = _sample(seed, (heads, groups * group, dim), spread, offset)
    qk = quant.quantize_keys(k, group, scale_dtype)
    assert qk.data.dtype == torch.int8 and qk.scale.dtype == scale_dtype
    assert qk.scale.shape == (heads, groups, dim)  # one scale per channel per group of tokens
    step = qk.scale.float().repeat_interleave(group, dim=1)  # [H, T, D]
    _assert_within_half_step(k, quant.dequantize_keys(qk, group), step)
    # outward rounding: every member lies inside [zero, zero + 255 * scale]
    grouped = k.reshape(heads, groups, group, dim)
    assert bool((qk.zero.float() <= grouped.amin(dim=2)).all())
    assert bool((qk.zero.float() + 255 * qk.scale.float() >= grouped.amax(dim=2) - 1e-6 * grouped.abs().amax(dim=2)).all())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tokens=st.integers(1, 40),
    dim=st.sampled_from([1, 4, 16, 64]),
    spread=st.sampled_from([1e-4, 0.1, 1.0, 30.0]),
    offset=st.sampled_from([0.0, -3.0, 250.0]),
    scale_dtype=st.sampled_from(SCALE_DTYPES),
)
def test_values_per_token_error_is_at_most_half_a_step(seed, tokens, dim, spread, offset, scale_dtype):
    v = _sample(seed, (2, tokens, dim), spread, offset)
    qv = quant.quantize_values(v, scale_dtype)
    assert qv.scale.shape == (2, tokens, 1)  # one scale per token
    _assert_within_half_step(v, quant.dequantize_values(qv), qv.scale.float())


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_requantizing_dequantized_values_gives_the_same_codes(scale_dtype):
    v = _sample(1, (3, 50, 64), 2.0, 0.5)
    qv = quant.quantize_values(v, scale_dtype)
    again = quant.quantize_with(quant.dequantize_values(qv), qv.scale, qv.zero)
    assert torch.equal(again, qv.data)
    k = _sample(2, (3, 64, 64), 2.0, 0.5)
    qk = quant.quantize_keys(k, 32, scale_dtype)
    qk2 = quant.quantize_keys(quant.dequantize_keys(qk, 32), 32, scale_dtype)
    assert torch.equal(quant.dequantize_keys(qk2, 32), quant.dequantize_keys(qk, 32))


def test_codes_use_the_full_int8_range_and_extremes_are_exact():
    x = torch.linspace(-1.0, 1.0, 256).reshape(1, 256)
    q = quant.quantize(x, dim=-1, scale_dtype=torch.float32)
    assert int(q.data.min()) == -128 and int(q.data.max()) == 127
    x_hat = quant.dequantize(q.data, q.scale, q.zero)
    assert float((x_hat - x).abs().max()) <= float(q.scale) / 2 + 1e-6


def test_constant_and_masked_groups():
    x = torch.full((1, 8, 4), 10.003)
    q = quant.quantize(x, dim=1, scale_dtype=torch.float16)
    assert float((quant.dequantize(q.data, q.scale, q.zero) - x).abs().max()) <= 1e-4
    # a group with no live member gets zero 0 and the smallest scale instead of inf/nan
    live = torch.zeros(1, 8, 1, dtype=torch.bool)
    scale, zero = quant.quant_params(x, dim=1, scale_dtype=torch.float16, live=live)
    assert bool(torch.isfinite(scale.float()).all()) and float(zero.abs().max()) == 0.0
    # the range comes from live members only
    live[0, :4] = True
    y = torch.cat([torch.zeros(1, 4, 4), torch.full((1, 4, 4), 1000.0)], dim=1)
    scale, zero = quant.quant_params(y, dim=1, scale_dtype=torch.float16, live=live)
    assert float(scale.float().max()) < 1e-3


def test_dequantize_into_buffers_of_any_float_dtype():
    v = _sample(3, (2, 10, 16), 1.0, 0.0)
    q = quant.quantize_values(v)
    ref = quant.dequantize_values(q)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(2, 10, 16, dtype=dtype)
        got = quant.dequantize(q.data, q.scale, q.zero, out=out)
        assert got is out
        assert torch.equal(out, ref.to(dtype))  # the same fp32 arithmetic, then one cast


def test_keys_need_whole_groups():
    with pytest.raises(ValueError, match="multiple of group 32"):
        quant.quantize_keys(torch.zeros(2, 33, 8), 32)
