"""Attention over KV segments: segmented (log-sum-exp merge) and gather both equal the dense oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.oracles import concat_segments
from vla_node.bench.attention import bench_attention
from vla_node.kv.attention import (
    GatherWorkspace,
    Segment,
    attention_mass,
    buffer_attention,
    dense_attention,
    gather_attention,
    merge_state,
    partial_attention,
    segmented_attention,
)
from vla_node.kv.partition import KVPartition, PartitionSpec

TOL = 1e-5


def _segments(draw_lengths, n_kv, q_len, d, seed, mask_kinds, with_bias):
    g = torch.Generator().manual_seed(seed)
    segs = []
    for length, kind in zip(draw_lengths, mask_kinds):
        k = torch.randn(n_kv, length, d, generator=g)
        v = torch.randn(n_kv, length, d, generator=g)
        if kind == "none":
            mask = None
        elif kind == "slots":
            mask = torch.rand(length, generator=g) < 0.6  # [L], as a partition's valid mask
        elif kind == "rows":
            mask = torch.rand(q_len, length, generator=g) < 0.5  # [q_len, L]
        else:
            mask = torch.zeros(length, dtype=torch.bool)  # nothing valid
        bias = torch.log(torch.randint(1, 5, (length,), generator=g).float()) if with_bias else None
        segs.append(Segment(k, v, mask, bias))
    return segs


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    q_len=st.integers(1, 6),
    d=st.sampled_from([4, 16, 32]),
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    data=st.data(),
    with_bias=st.booleans(),
)
def test_segmented_and_gather_equal_dense(seed, n_kv, group, q_len, d, lengths, data, with_bias):
    kinds = data.draw(st.lists(st.sampled_from(["none", "slots", "rows", "empty"]), min_size=len(lengths),
                               max_size=len(lengths)))
    segs = _segments(lengths, n_kv, q_len, d, seed, kinds, with_bias)
    q = torch.randn(n_kv * group, q_len, d, generator=torch.Generator().manual_seed(seed + 1))
    whole = concat_segments(segs, q_len)
    ref = dense_attention(q, whole.k, whole.v, whole.mask, whole.bias)
    out, lse = segmented_attention(q, segs)
    gathered = gather_attention(q, segs)
    assert not out.isnan().any() and not gathered.isnan().any()
    assert float((out - ref).abs().max()) <= TOL
    assert float((gathered - ref).abs().max()) <= TOL
    # lse is the log-sum-exp of the attendable logits (-inf where a row attends to nothing)
    logits = (q @ whole.k.repeat_interleave(group, 0).transpose(1, 2)) / math.sqrt(d)
    if whole.bias is not None:
        logits = logits + whole.bias
    ref_lse = torch.logsumexp(logits.masked_fill(~whole.mask, float("-inf")), dim=-1)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if bool(finite.any()):
        assert float((lse[finite] - ref_lse[finite]).abs().max()) <= 1e-4
    # the attention mass of all segments adds up to one per attending (head, row)
    masses = [attention_mass(q, s, lse) for s in segs]
    assert sum(float(m.sum()) for m in masses) == pytest.approx(float(finite.sum()), abs=1e-3)


def test_fully_masked_rows_give_zeros_not_nan():
    q = torch.randn(4, 3, 8)
    k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # row 1 may attend to nothing
    for out in (segmented_attention(q, [(k, v, mask)])[0], gather_attention(q, [(k, v, mask)]),
                dense_attention(q, k, v, mask)):
        assert not out.isnan().any() and float(out[:, 1].abs().max()) == 0.0
    bias = torch.zeros(3, 5)
    bias[1] = float("-inf")  # row 1 blocked by the bias of a segment without a mask
    blocked = Segment(k, v, None, bias)
    for out in (segmented_attention(q, [blocked])[0], gather_attention(q, [blocked]),
                dense_attention(q, k, v, None, bias)):
        assert not out.isnan().any() and float(out[:, 1].abs().max()) == 0.0
    out, lse = segmented_attention(q, [])
    assert float(out.abs().max()) == 0.0 and bool(torch.isneginf(lse).all())
    assert float(gather_attention(q, [(k[:, :0], v[:, :0], None)]).abs().max()) == 0.0


def test_merge_state_is_exact_and_associative():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 16, generator=g)
    parts = [(torch.randn(2, n, 16, generator=g), torch.randn(2, n, 16, generator=g)) for n in (5, 9, 3)]
    a, b, c = (partial_attention(q, k, v) for k, v in parts)
    left = merge_state(*merge_state(*a, *b), *c)
    right = merge_state(*a, *merge_state(*b, *c))
    ref = dense_attention(q, torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1))
    for out, _ in (left, right):
        assert float((out - ref).abs().max()) <= TOL
    assert float((left[1] - right[1]).abs().max()) <= 1e-5


def test_gqa_maps_query_heads_to_kv_heads_like_repeat_kv():
    q = torch.randn(6, 1, 8)
    k = torch.randn(2, 4, 8)
    v = torch.zeros(2, 4, 8)
    v[1] = 1.0  # kv head 1 outputs ones, kv head 0 zeros
    out, _ = segmented_attention(q, [(k, v, None)])
    assert out[:3].abs().max() == 0 and torch.allclose(out[3:], torch.ones(3, 1, 8))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        segmented_attention(torch.randn(5, 1, 8), [(k, v, None)])


def test_bf16_segmented_and_gather_track_fp32():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 24, 64, generator=g)
    segs = [Segment(torch.randn(2, n, 64, generator=g), torch.randn(2, n, 64, generator=g),
                    torch.rand(n, generator=g) < 0.9) for n in (48, 196, 24)]
    ref, _ = segmented_attention(q, segs)
    qb = q.bfloat16()
    segs_b = [Segment(s.k.bfloat16(), s.v.bfloat16(), s.mask) for s in segs]
    ws = GatherWorkspace(2, 64, 268, 24, torch.bfloat16)
    out_b, _ = segmented_attention(qb, segs_b)
    gat_b = gather_attention(qb, segs_b, ws)
    assert out_b.dtype == torch.bfloat16 and gat_b.dtype == torch.bfloat16
    assert float((out_b.float() - ref).abs().max()) < 0.05
    assert float((gat_b.float() - ref).abs().max()) < 0.05


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.03)])
def test_the_fused_kernel_equals_the_matmuls_with_masks_biases_gqa_and_empty_rows(dtype, tol):
    """buffer_attention on torch's SDPA (fused=True, what an AMX CPU runs) against its two matmuls and softmax, and
    both against the fp32 oracle: grouped heads, masked slots, log(count) biases, a row with nothing to attend
    (zeros), through gather_attention's workspace too."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 6, 16, generator=g)
    k, v = torch.randn(2, 30, 16, generator=g), torch.randn(2, 30, 16, generator=g)
    bias = torch.rand(6, 30, generator=g).log1p()  # merged tokens' log(count)-like biases
    bias[:, 25:] = float("-inf")
    bias[4] = float("-inf")  # row 4 may attend to nothing
    oracle = dense_attention(q, k, v, None, bias)
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    fused = buffer_attention(qd, kd, vd, bias, fused=True)
    plain = buffer_attention(qd, kd, vd, bias)
    assert fused.dtype == dtype and fused.shape == (8, 6, 16) and not fused.isnan().any()
    assert float(fused[:, 4].abs().max()) == 0.0
    for out in (fused, plain):
        assert float((out.float() - oracle).abs().max()) < tol
    ws = GatherWorkspace(2, 16, 30, 6, dtype, fused=True)
    segs = [Segment(kd[:, :25], vd[:, :25], None, bias[:, :25]), Segment(kd[:, 25:], vd[:, 25:], bias[0, 25:] == 0)]
    assert float((gather_attention(qd, segs, ws).float() - oracle).abs().max()) < tol
    assert torch.equal(buffer_attention(qd, kd, vd, None, fused=True).float(),
                       buffer_attention(qd, kd, vd, torch.zeros(6, 30), fused=True).float())  # no bias = a zero one


def test_gather_workspace_is_reused_and_checked():
    """One buffer for every call, its K/V views contiguous at any key count (a slice with the whole buffer's stride
    between heads would be copied by the batched matmul), and a key count past its room refused."""
    ws = GatherWorkspace(2, 8, 20, 4)
    ptr = ws.k.data_ptr()
    for tokens in (1, 13, 20):
        k, v = ws.views(tokens)
        assert k.shape == v.shape == (2, tokens, 8) and k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() == ptr and v.data_ptr() == ws.v.data_ptr()
    q = torch.randn(4, 4, 8)
    segs = [(torch.randn(2, 10, 8), torch.randn(2, 10, 8), None), (torch.randn(2, 10, 8), torch.randn(2, 10, 8), None)]
    gather_attention(q, segs, ws)
    assert ws.k.data_ptr() == ptr
    with pytest.raises(ValueError, match="workspace holds 20 tokens"):
        gather_attention(q, segs + [segs[0]], ws)


def test_attention_over_int8_partitions_equals_dense_over_dequantized_values():
    spec = dict(n_layers=2, n_kv_heads=2, head_dim=32)
    text = KVPartition(PartitionSpec("text", 16, "bf16", **spec))
    vision = KVPartition(PartitionSpec("vision", 100, "int8", key_group=32, **spec))
    g = torch.Generator().manual_seed(1)
    text.write(torch.arange(12), torch.randn(2, 2, 12, 32, generator=g), torch.randn(2, 2, 12, 32, generator=g),
               torch.arange(12), 0)
    vision.write(torch.arange(5, 85), torch.randn(2, 2, 80, 32, generator=g), torch.randn(2, 2, 80, 32, generator=g),
                 torch.arange(80), 1)
    bufs = [torch.empty(2, 16, 32), torch.empty(2, 16, 32), torch.empty(2, 100, 32), torch.empty(2, 100, 32)]
    q = torch.randn(8, 3, 32, generator=g)
    segs = [Segment(*text.read(1, bufs[0], bufs[1])), Segment(*vision.read(1, bufs[2], bufs[3]))]
    whole = concat_segments(segs, 3)
    ref = dense_attention(q, whole.k, whole.v, whole.mask)
    assert float((segmented_attention(q, segs)[0] - ref).abs().max()) <= TOL
    assert float((gather_attention(q, segs) - ref).abs().max()) <= TOL


def test_bench_attention_reports_both_paths():
    result = bench_attention(q_lens=(1,), vision_tokens=(196,), dtypes=("fp32",), repeats=2)
    (case,) = result["cases"]
    assert case["segmented_us"] > 0 and case["gather_us"] > 0 and case["vision"] == 196
