"""Tolerances derived from a dtype, for comparing two computations that may run different kernels.

Two computations agree bit for bit only when they run the same kernel on the same shapes. Elsewhere, e.g. a matmul
over a subset of rows against the same rows of a full one (MKL and oneDNN pick their kernel by the row count and
the CPU), or one fused matmul against three, they agree to the rounding of the dtype: these helpers say how far, in
units of the dtype's spacing (ulp) at the largest magnitude of the reference.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vla_node.model.tokenizer import BIN_BASE

MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
FP32_ULPS_PER_LAYER = 8  # what two summation orders of a layer's matmuls (K <= a few hundred) differ by, with room


def ulp(reference: torch.Tensor | float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` at the largest magnitude of `reference` (its smallest normal's spacing at zero)."""
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"ulp of {dtype}: expected one of {sorted(map(str, MANTISSA_BITS))}")
    largest = float(reference.detach().abs().max()) if torch.is_tensor(reference) else abs(float(reference))
    if not math.isfinite(largest):
        raise ValueError(f"ulp at {largest}: expected a finite reference")
    tiny = torch.finfo(dtype).tiny
    return 2.0 ** (math.floor(math.log2(max(largest, tiny))) - MANTISSA_BITS[dtype])


def bf16_ulp(reference: torch.Tensor | float) -> float:
    """One bf16 step at the largest magnitude of `reference`: how far apart two kernels' bf16 results of the same
    fp32-accumulated sum may land (each rounds to nearest, half a step, from sums that differ in the last fp32
    bits), and how far one rounding may move a value, with room."""
    return ulp(reference, torch.bfloat16)


def fp32_ulp(reference: torch.Tensor | float) -> float:
    """One fp32 step at the largest magnitude of `reference`."""
    return ulp(reference, torch.float32)


def fp32_tolerance(reference: torch.Tensor | float, depth: int, ulps: int = FP32_ULPS_PER_LAYER) -> float:
    """An absolute tolerance for an fp32 result that passed through `depth` layers whose matmuls may sum in another
    order: `ulps` fp32 steps a layer, at the largest magnitude of `reference`."""
    if depth < 1:
        raise ValueError(f"depth {depth}: expected the number of layers the result went through (>= 1)")
    return ulps * depth * fp32_ulp(reference)


def assert_within(got: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    """|got - expected| <= atol everywhere (same shape); the message gives the worst difference and the bound."""
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} against {tuple(expected.shape)}"
    worst = float((got.double() - expected.double()).abs().max()) if got.numel() else 0.0
    assert worst <= atol, f"{what}: max |difference| {worst:.3e} > tolerance {atol:.3e}"


def assert_same_bins(ours, theirs, atol: float) -> None:
    """Two action chunks' bins agree, except where theirs is a near tie: a bin may differ only where its logit in
    `theirs` is within 2 * atol of the chosen one's (each side within atol of the exact logits, either may win).
    For chunks whose logits [H*D, vocab] were checked within `atol` of each other."""
    ours_bins, theirs_bins = np.asarray(ours.bins), np.asarray(theirs.bins)
    assert ours_bins.shape == theirs_bins.shape, f"bins {ours_bins.shape} against {theirs_bins.shape}"
    logits = theirs.logits.detach().to("cpu", torch.float64).reshape(ours_bins.size, -1)  # [H*D, vocab]
    for row in np.flatnonzero(ours_bins.reshape(-1) != theirs_bins.reshape(-1)):
        a, b = int(ours_bins.reshape(-1)[row]), int(theirs_bins.reshape(-1)[row])
        gap = float(logits[row, BIN_BASE + b] - logits[row, BIN_BASE + a])
        assert gap <= 2 * atol, f"action {row}: bin {a} against {b}, not a near tie (logits {gap:.3e} apart)"
