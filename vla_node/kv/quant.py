"""KIVI INT8 quantization: asymmetric int8 with a scale and a zero point per group.

Keys are quantized per channel (one scale/zero per head_dim channel over a group of token slots), values
per token (one scale/zero per token over its head_dim channels), as in KIVI (Liu et al. 2024).

Mapping, for a group with stored scale `s` and zero point `z` (both in the scale dtype, fp16 by default):

    q = round((x - z) / s) - 128          in [-128, 127]
    x' = (q + 128) * s + z                computed in fp32

The stored parameters are rounded *outward* (z down, s up) when they are cast to the scale dtype, so that
every member of the group lies inside [z, z + 255 s]: the dequantization error of every element is then at
most s / 2 (half a step), with no clamping error, whatever the scale dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

Q_OFFSET = 128  # int8 code q represents level q + 128 in [0, 255]
Q_LEVELS = 255  # number of steps between the lowest and the highest level


class Quantized(NamedTuple):
    """int8 codes with the scale and zero point of their group (broadcastable against `data`)."""

    data: torch.Tensor  # int8
    scale: torch.Tensor  # scale dtype, keepdim shape of the reduced dimension
    zero: torch.Tensor  # scale dtype, same shape as scale


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast fp32 `x` to `dtype`, rounding toward -inf (the result is <= x)."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    too_high = y.to(x.dtype) > x
    return torch.where(too_high, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast fp32 `x` to `dtype`, rounding toward +inf (the result is >= x)."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    too_low = y.to(x.dtype) < x
    return torch.where(too_low, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def quant_params(
    x: torch.Tensor,
    dim: int,
    scale_dtype: torch.dtype = torch.float16,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point over `dim` (kept as size 1) of fp32 `x`, rounded outward into `scale_dtype`.

    `live` (bool, broadcastable to x) restricts the range to live members; a group with no live member
    gets zero = 0 and the smallest scale."""
    x = x.float()
    if live is None:
        lo = x.amin(dim=dim, keepdim=True)
        hi = x.amax(dim=dim, keepdim=True)
    else:
        lo = torch.where(live, x, float("inf")).amin(dim=dim, keepdim=True)
        hi = torch.where(live, x, float("-inf")).amax(dim=dim, keepdim=True)
        empty = torch.isinf(lo)  # no live member in the group
        lo = torch.where(empty, 0.0, lo)
        hi = torch.where(empty, 0.0, hi)
    zero = _round_down(lo, scale_dtype)
    tiny = torch.finfo(scale_dtype).tiny
    step = ((hi - zero.float()) / Q_LEVELS).clamp_min(tiny)
    scale = _round_up(step, scale_dtype)
    return scale, zero


def quantize_with(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """int8 codes of `x` for given (broadcastable) scale and zero point."""
    levels = x.to(torch.float32, copy=True).sub_(zero).div_(scale)  # one fp32 buffer, every step in place
    return levels.round_().clamp_(0, Q_LEVELS).sub_(Q_OFFSET).to(torch.int8)


def quantize(
    x: torch.Tensor,
    dim: int,
    scale_dtype: torch.dtype = torch.float16,
    live: torch.Tensor | None = None,
) -> Quantized:
    """Asymmetric int8 quantization of `x` with one scale/zero per slice reduced over `dim`."""
    scale, zero = quant_params(x, dim, scale_dtype, live)
    return Quantized(quantize_with(x, scale, zero), scale, zero)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(q + 128) * scale + zero, in fp32 unless `out` (any float dtype, shape of q) is given.

    With an fp32 `out` nothing is allocated beyond broadcasting; other dtypes go through an fp32 copy."""
    if out is None or out.dtype != torch.float32:
        x = q.to(torch.float32).add_(Q_OFFSET).mul_(scale).add_(zero)
        if out is None:
            return x
        return out.copy_(x)
    out.copy_(q)
    return out.add_(Q_OFFSET).mul_(scale).add_(zero)


def quantize_keys(k: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.float16) -> Quantized:
    """KIVI keys: per channel over groups of `group` consecutive tokens.

    k [..., T, D] with T a multiple of `group` -> data int8 [..., T, D], scale/zero [..., T // group, D]."""
    *lead, t, d = k.shape
    if t % group:
        raise ValueError(f"quantize_keys: token count {t} is not a multiple of group {group}")
    grouped = k.reshape(*lead, t // group, group, d)  # [..., n_groups, group, D]
    q, scale, zero = quantize(grouped, dim=-2, scale_dtype=scale_dtype)
    return Quantized(q.reshape(*lead, t, d), scale.squeeze(-2), zero.squeeze(-2))  # [..., T, D]


def dequantize_keys(qk: Quantized, group: int) -> torch.Tensor:
    """Inverse of quantize_keys, fp32 [..., T, D]."""
    *lead, t, d = qk.data.shape
    grouped = qk.data.reshape(*lead, t // group, group, d)  # [..., n_groups, group, D]
    x = dequantize(grouped, qk.scale.unsqueeze(-2), qk.zero.unsqueeze(-2))
    return x.reshape(*lead, t, d)  # [..., T, D]


def quantize_values(v: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> Quantized:
    """KIVI values: per token over head_dim. v [..., T, D] -> scale/zero [..., T, 1]."""
    return quantize(v, dim=-1, scale_dtype=scale_dtype)


def dequantize_values(qv: Quantized) -> torch.Tensor:
    """Inverse of quantize_values, fp32 [..., T, D]."""
    return dequantize(qv.data, qv.scale, qv.zero)


class WholeKivi(Protocol):
    """KIVI over a whole partition in fewer passes, with the same bits as this module's torch ops (for one, the
    fused CPU kernels: backends/cpu_kernels.KernelKivi). A partition given one (KVPartition.kivi) uses it where it
    applies: each method returns False, having changed nothing, where it does not, and the partition runs torch's.
    Shapes as KVPartition stores them: k, v, codes [L, H, C, D]; key scale/zero [L, H, ceil(C / group), D]; value
    scale/zero [L, H, C, 1]."""

    def quantize_kv(self, k: torch.Tensor, v: torch.Tensor, group: int, codes_k: torch.Tensor,
                    scale_k: torch.Tensor, zero_k: torch.Tensor, codes_v: torch.Tensor, scale_v: torch.Tensor,
                    zero_v: torch.Tensor) -> bool:
        """Keys per channel over groups of `group` slots (the last group may be shorter), values per token, into
        the given storage."""

    def dequantize_kv(self, codes_k: torch.Tensor, scale_k: torch.Tensor, zero_k: torch.Tensor,
                      codes_v: torch.Tensor, scale_v: torch.Tensor, zero_v: torch.Tensor, group: int,
                      out_k: torch.Tensor, out_v: torch.Tensor) -> bool:
        """Both dequantized into out_k, out_v [L, H, C, D] (views along C of a larger buffer work)."""
