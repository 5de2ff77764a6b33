"""Attention of a block of queries over a list of KV segments (one per partition).

Shapes (batch size 1, no batch dim):
  q [n_heads, q_len, head_dim]; a segment's k, v [n_kv_heads, L, head_dim] (L may be 0);
  mask bool [q_len, L] or [L] (True = may attend) or None (all valid);
  bias float [q_len, L] or [L] added to the logits (e.g. log(count) for merged tokens) or None.
Grouped-query attention: query head h uses kv head h // (n_heads // n_kv_heads) (Llama's repeat_kv order).
Scale 1/sqrt(head_dim). A query row that may attend to nothing yields zeros and lse = -inf, never NaN.

Three ways, equal up to float rounding over the same (dequantized) values:
  dense_attention      the plain oracle over one concatenated K/V (fp32 math);
  segmented_attention  per-segment partial attention merged exactly with log-sum-exp (FlashInfer merge_state);
  gather_attention     copies the segments into one preallocated buffer and attends once (buffer_attention).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F


class Segment(NamedTuple):
    """One partition's view for attention; a plain (k, v, mask) tuple works too."""

    k: torch.Tensor  # [n_kv_heads, L, head_dim]
    v: torch.Tensor  # [n_kv_heads, L, head_dim]
    mask: torch.Tensor | None = None  # bool [q_len, L] or [L]
    bias: torch.Tensor | None = None  # float [q_len, L] or [L]


# q [H, T, D], k and v [KV, L, D], bias fp32 [T, L] or None -> out [H, T, D], or None where it does not apply
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], Optional[torch.Tensor]]


def _as_segment(seg: Sequence) -> Segment:
    return seg if isinstance(seg, Segment) else Segment(*seg)


def _check(q: torch.Tensor, seg: Segment) -> int:
    """Validate shapes; returns the GQA group size n_heads // n_kv_heads."""
    if q.dim() != 3:
        raise ValueError(f"attention: q shape {list(q.shape)}: expected [n_heads, q_len, head_dim]")
    hq, tq, d = q.shape
    if seg.k.dim() != 3 or seg.k.shape != seg.v.shape or seg.k.shape[2] != d:
        raise ValueError(f"attention: k {list(seg.k.shape)} / v {list(seg.v.shape)}: expected both "
                         f"[n_kv_heads, L, {d}]")
    hkv, length = seg.k.shape[0], seg.k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"attention: n_heads {hq} with n_kv_heads {hkv}: expected n_heads a multiple of n_kv_heads")
    for name, t in (("mask", seg.mask), ("bias", seg.bias)):
        if t is not None and tuple(t.shape) not in ((tq, length), (length,)):
            raise ValueError(f"attention: {name} shape {list(t.shape)}: expected [{tq}, {length}] or [{length}]")
    if seg.mask is not None and seg.mask.dtype != torch.bool:
        raise ValueError(f"attention: mask dtype {seg.mask.dtype}: expected torch.bool")
    return hq // hkv


_FLOOR = -torch.finfo(torch.float32).max  # stands in for a -inf running max, so that exp(-inf - floor) = 0
_TINY = torch.finfo(torch.float32).tiny


def _scaled_logits(q: torch.Tensor, seg: Segment, g: int) -> torch.Tensor:
    """fp32 logits q k^T / sqrt(D) (+ bias, masked to -inf): [n_kv_heads, g, q_len, L]."""
    hq, tq, d = q.shape
    hkv, length = seg.k.shape[0], seg.k.shape[1]
    qg = q.reshape(hkv, g * tq, d)  # [n_kv_heads, g*q_len, D]: the g query heads of one kv head, stacked
    logits = torch.matmul(qg, seg.k.to(q.dtype).transpose(1, 2)).float()  # [n_kv_heads, g*q_len, L]
    logits = logits.view(hkv, g, tq, length).mul_(1.0 / math.sqrt(d))  # [n_kv_heads, g, q_len, L]
    if seg.bias is not None:
        logits.add_(seg.bias.float())
    if seg.mask is not None:
        logits.masked_fill_(seg.mask.logical_not(), float("-inf"))
    return logits


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one segment: (out fp32 [n_heads, q_len, head_dim], lse fp32 [n_heads, q_len]).

    lse is the log-sum-exp of the scaled (and biased) logits over the attendable keys, -inf if none."""
    seg = Segment(k, v, mask, bias)
    g = _check(q, seg)
    hq, tq, d = q.shape
    hkv, length = k.shape[0], k.shape[1]
    if length == 0:
        return (torch.zeros(hq, tq, d, dtype=torch.float32, device=q.device),
                torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device))
    logits = _scaled_logits(q, seg, g)  # [n_kv_heads, g, q_len, L]
    peak = logits.amax(dim=-1, keepdim=True).clamp_min_(_FLOOR)  # [n_kv_heads, g, q_len, 1]
    p = logits.sub_(peak).exp_()  # masked -> 0
    total = p.sum(dim=-1, keepdim=True)  # [n_kv_heads, g, q_len, 1]
    out = torch.matmul(p.view(hkv, g * tq, length).to(q.dtype), v.to(q.dtype))  # [n_kv_heads, g*q_len, D]
    out = out.float().view(hkv, g, tq, d).div_(total.clamp_min(_TINY))  # [n_kv_heads, g, q_len, D]
    lse = peak.add_(total.log_()).view(hq, tq)  # [n_heads, q_len]; log(0) = -inf for empty rows
    return out.view(hq, tq, d), lse  # [n_heads, q_len, D]


def merge_state(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets (FlashInfer merge_state):
    out = (out_a e^lse_a + out_b e^lse_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b)."""
    return merge_states([out_a, out_b], [lse_a, lse_b])


def merge_states(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_state over any number of partial states at once: outs [n_heads, q_len, D], lses [n_heads, q_len]."""
    lse = torch.stack(list(lses))  # [S, n_heads, q_len]
    peak = lse.amax(dim=0).clamp_min_(_FLOOR)  # [n_heads, q_len]
    w = lse.sub_(peak).exp_()  # [S, n_heads, q_len]; -inf states weigh 0
    total = w.sum(dim=0)  # [n_heads, q_len]
    out = (torch.stack(list(outs)) * w[..., None]).sum(dim=0)  # [n_heads, q_len, D]
    out.div_(total.clamp_min(_TINY)[..., None])
    return out, peak.add_(total.log_())


def segmented_attention(q: torch.Tensor, segments: Sequence[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the union of the segments, merged with log-sum-exp.

    Returns (out [n_heads, q_len, head_dim] in q's dtype, lse fp32 [n_heads, q_len]); lse lets a caller
    merge further segments with merge_state."""
    hq, tq, d = q.shape
    parts = [partial_attention(q, *_as_segment(seg)) for seg in segments]
    if not parts:
        return (torch.zeros(hq, tq, d, dtype=q.dtype, device=q.device),
                torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device))
    if len(parts) == 1:
        out, lse = parts[0]
    else:
        out, lse = merge_states([p[0] for p in parts], [p[1] for p in parts])
    return out.to(q.dtype), lse


class GatherWorkspace:
    """Preallocated buffers for gather_attention: room for K/V of up to max_tokens keys (`views`) and an fp32 logit
    bias [max_q_len, max_tokens] (-inf where a row may not attend); `fused` and `kernel`: buffer_attention's."""

    def __init__(self, n_kv_heads: int, head_dim: int, max_tokens: int, max_q_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", fused: bool = False,
                 kernel: AttentionKernel | None = None) -> None:
        self.k = torch.zeros(n_kv_heads * max_tokens * head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.logit_bias = torch.zeros(max_q_len, max_tokens, dtype=torch.float32, device=device)
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.max_tokens, self.max_q_len, self.fused, self.kernel = max_tokens, max_q_len, fused, kernel

    def views(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `tokens` keys, each [n_kv_heads, tokens, head_dim] and contiguous (the buffers' first elements):
        a slice of a [n_kv_heads, max_tokens, head_dim] buffer would keep its stride between heads, and torch's
        batched matmul copies such an operand before multiplying."""
        shape, n = (self.n_kv_heads, tokens, self.head_dim), self.n_kv_heads * tokens * self.head_dim
        return self.k[:n].view(shape), self.v[:n].view(shape)  # [KV * tokens * hd] -> [KV, tokens, hd]

    @classmethod
    def for_segments(cls, q: torch.Tensor, segments: Sequence[Segment]) -> "GatherWorkspace":
        total = sum(s.k.shape[1] for s in segments)
        return cls(segments[0].k.shape[0], q.shape[2], total, q.shape[1], q.dtype, q.device)


def gather_attention(
    q: torch.Tensor, segments: Sequence[Sequence], workspace: GatherWorkspace | None = None
) -> torch.Tensor:
    """Copy every segment (valid or not; the bias carries validity, so shapes stay static) into one buffer
    and attend once over it (buffer_attention).

    Returns out [n_heads, q_len, head_dim] in q's dtype."""
    segs = [_as_segment(s) for s in segments]
    hq, tq, d = q.shape
    for seg in segs:
        _check(q, seg)
    total = sum(s.k.shape[1] for s in segs)
    if not segs or total == 0:
        return torch.zeros(hq, tq, d, dtype=q.dtype, device=q.device)
    ws = workspace if workspace is not None else GatherWorkspace.for_segments(q, segs)
    if total > ws.max_tokens or tq > ws.max_q_len or ws.k.dtype != q.dtype:
        raise ValueError(f"gather_attention: {total} tokens, q_len {tq}, {q.dtype}: workspace holds "
                         f"{ws.max_tokens} tokens, q_len {ws.max_q_len}, {ws.k.dtype}")
    plain = all(seg.mask is None and seg.bias is None for seg in segs)  # every row sees every key, unbiased
    bias = None if plain else ws.logit_bias[:tq, :total]  # [q_len, total]
    k, v = ws.views(total)
    offset = 0
    for seg in segs:
        end = offset + seg.k.shape[1]
        k[:, offset:end].copy_(seg.k)
        v[:, offset:end].copy_(seg.v)
        if bias is not None:
            fill_bias(bias[:, offset:end], seg.mask, seg.bias)
        offset = end
    # a non-empty segment without a mask or a bias (a bias may hold -inf) is seen by every row: no row is empty
    may_be_empty = not any(seg.mask is None and seg.bias is None and seg.k.shape[1] > 0 for seg in segs)
    return buffer_attention(q, k, v, bias, check_empty=may_be_empty, fused=ws.fused, kernel=ws.kernel)


def fill_bias(out: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """out [q_len, L] fp32 <- the segment's bias (0 when None) where mask allows, -inf where it does not;
    mask and bias [q_len, L] or [L] (broadcast over the rows)."""
    if bias is None:
        out.zero_()
    else:
        out.copy_(bias)
    if mask is not None:
        out.masked_fill_(mask.logical_not(), float("-inf"))
    return out


def buffer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                     check_empty: bool = True, fused: bool = False,
                     kernel: AttentionKernel | None = None) -> torch.Tensor:
    """Attention of q [n_heads, q_len, D] over one K/V buffer k, v [n_kv_heads, L, D] with an additive fp32
    bias [q_len, L] (0 = attend, log(count) for merged tokens, -inf = masked; None = every row attends to every
    key, unbiased). A row that may attend to nothing yields zeros (check_empty=False: the caller knows every row
    attends to something, and the check's pass over the bias is skipped). Returns out [n_heads, q_len, D] in
    q's dtype.

    Two batched matmuls and one softmax, the kv heads never repeated: on a CPU without AMX this is about twice as
    fast as torch's SDPA with a mask, and than a log-sum-exp merge over several segments. `fused`: torch's SDPA
    instead (its flash kernel, fp32 logits; grouped heads as enable_gqa maps them, the same as here): on a CPU with
    AMX it runs its products on the tile unit (fused_attention_pays), 1.2-2.4x faster at the node's shapes.
    `kernel` (instead of the matmuls where it applies; None where it does not): a fused attention with this
    function's contract, its output possibly a view (backends/cpu_kernels.attention: AVX512-BF16, fp32 logits)."""
    if kernel is not None:
        out = kernel(q, k, v, bias)
        if out is not None:
            return out
    hq, tq, d = q.shape
    hkv, length = k.shape[0], k.shape[1]
    if fused:
        mask = None if bias is None else bias[None, None]  # [q_len, L] -> [1, 1, q_len, L]
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=hq != hkv)[0]
        if check_empty and bias is not None:
            _zero_empty_rows(out, bias)
        return out
    g = hq // hkv
    qg = q.reshape(hkv, g * tq, d)  # [n_heads, q_len, D] -> [n_kv_heads, g*q_len, D]: one kv head's g query heads
    logits = torch.matmul(qg, k.transpose(1, 2)).float()  # [n_kv_heads, g*q_len, L]
    logits = logits.view(hkv, g, tq, length).mul_(1.0 / math.sqrt(d))  # [n_kv_heads, g, q_len, L]
    if bias is not None:
        logits.add_(bias)
    p = torch.softmax(logits, dim=-1).view(hkv, g * tq, length)  # -> [n_kv_heads, g*q_len, L]
    out = torch.matmul(p.to(v.dtype), v).view(hq, tq, d)  # [n_kv_heads, g*q_len, D] -> [n_heads, q_len, D]
    if check_empty and bias is not None:
        _zero_empty_rows(out, bias)
    return out.to(q.dtype)


def _zero_empty_rows(out: torch.Tensor, bias: torch.Tensor) -> None:
    """out [n_heads, q_len, D] <- 0 on the rows that may attend to nothing (bias [q_len, L] all -inf)."""
    empty = torch.isneginf(bias).all(dim=-1)  # [q_len]: rows with nothing to attend (softmax gave NaN)
    if bool(empty.any()):
        out.masked_fill_(empty[None, :, None], 0.0)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: plain softmax attention in fp32 (fp64 stays fp64) with explicitly repeated kv heads.
    Returns out [n_heads, q_len, head_dim] in the math dtype."""
    g = _check(q, Segment(k, v, mask, bias))
    hq, tq, d = q.shape
    math_dtype = torch.promote_types(q.dtype, torch.float32)
    kr = k.to(math_dtype).repeat_interleave(g, dim=0)  # [n_heads, L, D]
    vr = v.to(math_dtype).repeat_interleave(g, dim=0)
    if k.shape[1] == 0:
        return torch.zeros(hq, tq, d, dtype=math_dtype, device=q.device)
    logits = q.to(math_dtype) @ kr.transpose(1, 2) / math.sqrt(d)  # [n_heads, q_len, L]
    if bias is not None:
        logits = logits + bias.to(math_dtype)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    attendable = torch.isfinite(logits).any(dim=-1, keepdim=True)  # [n_heads, q_len, 1]
    p = torch.softmax(torch.where(attendable, logits, 0.0), dim=-1)
    p = torch.where(attendable, p, 0.0)
    return p @ vr


def attention_mass(q: torch.Tensor, segment: Sequence, lse: torch.Tensor) -> torch.Tensor:
    """Attention probability each key of `segment` received, summed over heads and query rows: fp32 [L].

    `lse` is the total log-sum-exp from segmented_attention over all segments, so the masses of all
    segments together sum to (number of heads x attending rows). For H2O importance (add_importance)."""
    seg = _as_segment(segment)
    g = _check(q, seg)
    hq, tq, d = q.shape
    hkv, length = seg.k.shape[0], seg.k.shape[1]
    if length == 0:
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    logits = _scaled_logits(q, seg, g)  # [n_kv_heads, g, q_len, L]
    total = lse.view(hkv, g, tq, 1)  # [n_kv_heads, g, q_len, 1]
    total = torch.where(torch.isfinite(total), total, float("inf"))  # rows with nothing: mass 0
    return logits.sub_(total).exp_().sum(dim=(0, 1, 2))  # [L]
