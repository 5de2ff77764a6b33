"""The fused bf16 attention kernel (backends/cpu_kernels.c, AVX512-BF16): against fp64 attention as near as torch's
form (kv/attention.buffer_attention's matmuls, the tower's softmax_attention) at the node's shapes, the edge rows as
torch's form gives them, its output laid out for the output projection, torch's form wherever it does not apply, and
the policies using it."""

import pytest
import torch

from helpers.numerics import assert_within, bf16_ulp
from vla_node.backends import cpu_features, cpu_kernels
from vla_node.kv.attention import buffer_attention, dense_attention

# skipped only without a C compiler or AVX512-BF16: where both exist, a kernel that fails the library's check against
# fp64 attention (and so is not used) fails these tests instead of skipping them
needs_attention = pytest.mark.skipif(
    cpu_kernels.compiler() is None or cpu_kernels.kernels_switched_off()
    or "avx512_bf16" not in cpu_features.cpu_flags(cpu_features.read_cpuinfo()),
    reason="the fused attention kernel does not run here: it needs a C compiler and a CPU with AVX512-BF16 "
           f"(kernels: {cpu_kernels.status()})")

# heads, kv heads, query rows, keys, head_dim: small's tick (17 and the fused 20 rows) over its prefix buffer, a
# reuse frame's rows over text | frame, the tower's, base's tick (head_dim 80), a tiny block (keys short of a block)
SHAPES = [(8, 2, 17, 272, 64), (8, 2, 20, 272, 64), (8, 2, 80, 244, 64), (6, 6, 196, 196, 64), (16, 4, 17, 300, 80),
          (4, 2, 3, 5, 16)]


def _inputs(heads, kv_heads, rows, keys, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, rows, dim, generator=generator).bfloat16()
    k, v = (torch.randn(kv_heads, keys, dim, generator=generator).bfloat16() for _ in range(2))
    bias = torch.randn(rows, keys, generator=generator)
    bias[:, keys - keys // 4:] = float("-inf")  # slots past a block
    bias[0, :] = float("-inf")  # a row that sees nothing
    return q, k, v, bias


def _error(out, want):
    return ((out.double() - want).norm() / want.norm()).item()


@needs_attention
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("biased", [True, False], ids=["bias", "plain"])
def test_the_kernel_is_as_near_fp64_attention_as_torchs_form(shape, biased):
    """Within bf16's rounding of the output, and within 10% of torch's form's error (nearer at the node's shapes:
    its logits stay fp32; at a handful of keys the output's rounding is all either has)."""
    q, k, v, bias = _inputs(*shape)
    bias = bias if biased else None
    with torch.inference_mode():
        want = dense_attention(q.double(), k.double(), v.double(), None, None if bias is None else bias.double())
        want = want.nan_to_num(0.0)  # the row that sees nothing: zeros, as both forms give it
        got = cpu_kernels.attention(q, k, v, bias)
        # torch's form on the rows that see something: on an AMX Xeon its P V matmul (oneDNN) turned the NaN row
        # of the row that sees nothing into a NaN in another row of the same call, before it zeroes the empty row
        seen = slice(1, None) if biased else slice(None)
        torch_form = buffer_attention(q[:, seen], k, v, None if bias is None else bias[seen])
    assert got is not None and got.shape == q.shape and got.dtype == torch.bfloat16
    assert _error(got[:, seen], want[:, seen]) <= min(1.1 * _error(torch_form, want[:, seen]), 2 ** -8)
    if biased:
        assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))


@needs_attention
def test_its_output_is_the_output_projections_input_as_it_lies():
    """[H, T, D] over [T, H, D] storage: the layer's transpose and reshape to [T, H * D] copy nothing."""
    q, k, v, bias = _inputs(8, 2, 17, 272, 64)
    with torch.inference_mode():
        out = cpu_kernels.attention(q, k, v, bias)
    rows = out.transpose(0, 1).reshape(17, -1)  # [H, T, D] -> [T, H * D]
    assert rows.data_ptr() == out.data_ptr() and rows.is_contiguous()


@needs_attention
def test_strided_queries_and_bias_rows_read_as_their_contiguous_copies():
    """q a slice of the layer's q|k heads, the bias a [rows, keys] slice of a wider workspace (gather_attention)."""
    q, k, v, bias = _inputs(8, 2, 17, 272, 64, seed=3)
    heads = torch.cat([q, torch.randn(2, 17, 64).bfloat16()])[:8]  # [H + KV, T, D] -> q
    wide = torch.full((20, 300), float("nan"))
    wide[:17, :272] = bias
    with torch.inference_mode():
        assert torch.equal(cpu_kernels.attention(heads, k, v, wide[:17, :272]), cpu_kernels.attention(q, k, v, bias))


@needs_attention
def test_keys_and_values_at_odd_element_offsets_and_row_strides_read_as_their_contiguous_copies():
    """k and v views whose rows start 2 bytes off a 4-byte boundary and lie 67 elements apart (the kernel reads K's
    (d, d + 1) pairs and V's rows as 16-bit values, at any element offset)."""
    q, k, v, bias = _inputs(8, 2, 17, 45, 64, seed=5)
    wide = torch.zeros(2, 2, 45, 67, dtype=torch.bfloat16)
    wide[0, :, :, 1:65], wide[1, :, :, 1:65] = k, v
    k_view, v_view = wide[0, :, :, 1:65], wide[1, :, :, 1:65]
    assert k_view.data_ptr() % 4 == 2 and k_view.stride() == v_view.stride() == (45 * 67, 67, 1)
    with torch.inference_mode():
        assert torch.equal(cpu_kernels.attention(q, k_view, v_view, bias), cpu_kernels.attention(q, k, v, bias))


@needs_attention
def test_a_nan_among_a_rows_logits_makes_that_row_nan_as_torchs_softmax_does():
    q, k, v, _ = _inputs(4, 2, 3, 40, 16)
    k[0, 7, 3] = float("nan")  # kv head 0: query heads 0 and 1
    with torch.inference_mode():
        out = cpu_kernels.attention(q, k, v, None)
    assert out[:2].isnan().all() and out[2:].isfinite().all()


@needs_attention
@pytest.mark.usefixtures("attention_on_the_kernel")
def test_a_small_bf16_policy_gives_the_kernel_its_decoder_and_tower_attention():
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla
    from vla_node.runtime.policy import MultiRatePolicy

    policy = MultiRatePolicy(build_vla(preset("small"), seed=0), dtype=torch.bfloat16)
    assert policy._prefix.kernel is policy._workspace.kernel is cpu_kernels.attention
    assert policy.tower_cache.attention is cpu_kernels.unmasked_attention


@needs_attention
def test_where_the_kernel_does_not_apply_it_declines_and_torchs_form_runs():
    q, k, v, bias = _inputs(4, 2, 3, 40, 16)
    with torch.inference_mode():
        assert cpu_kernels.attention(q.float(), k.float(), v.float(), bias) is None  # fp32: torch's form
        assert cpu_kernels.attention(q[..., :8], k[..., :8], v[..., :8], None) is None  # head_dim 8
        assert cpu_kernels.attention(q, k[:, :0], v[:, :0], None) is None  # no keys
        assert cpu_kernels.attention(q, k, v, bias.t().contiguous().t()) is None  # bias columns strided
        assert cpu_kernels.attention(q, k, v, bias.double()) is None
        assert cpu_kernels.attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None) is None
        assert cpu_kernels.attention(q[:3], k, v, None) is None  # 3 heads over 2 kv heads
        out = buffer_attention(q, k, v, bias, kernel=lambda *args: None)  # a kernel declining: torch's form
        assert torch.equal(out, buffer_attention(q, k, v, bias))
    with torch.enable_grad():
        assert cpu_kernels.attention(q, k, v, bias) is None


@needs_attention
def test_the_towers_unmasked_attention_runs_the_kernel_on_its_views_and_softmax_attention_elsewhere():
    """q a view of the tower's permuted q|k|v heads ([n, 3, H, hd] -> [3, H, n, hd]) over the staged k, v: the
    kernel; 4-D (a batch of cameras) or fp32: softmax_attention, its bits."""
    from vla_node.model.vision import softmax_attention

    heads = torch.randn(70, 3, 6, 64).bfloat16().permute(1, 2, 0, 3)  # [3, H, n, hd]
    staged = torch.randn(3, 6, 196, 64).bfloat16()
    with torch.inference_mode():
        got = cpu_kernels.unmasked_attention(heads[0], staged[1], staged[2])
        assert torch.equal(got, cpu_kernels.attention(heads[0], staged[1], staged[2], None))
        want = dense_attention(heads[0].double(), staged[1].double(), staged[2].double())
        assert _error(got, want) <= min(1.1 * _error(softmax_attention(heads[0], staged[1], staged[2]), want), 2 ** -8)
        for q, k, v in ((heads[0][None], staged[1][None], staged[2][None]),
                        (heads[0].float(), staged[1].float(), staged[2].float())):
            assert torch.equal(cpu_kernels.unmasked_attention(q, k, v), softmax_attention(q, k, v))


def test_built_without_avx512_bf16_the_kernel_says_so_and_the_library_still_loads(tmp_path):
    """The portable build (no AVX512-BF16): the attention entry point returns -2, the caller runs torch's form."""
    if cpu_kernels.compiler() is None:
        pytest.skip(f"no C compiler here: {cpu_kernels.status()}")
    lib = cpu_kernels.load(cpu_kernels.build(cpu_kernels.compiler(), tmp_path, (*cpu_kernels.FLAGS, "-mno-avx512bf16")))
    q, k, v, bias = _inputs(4, 2, 3, 40, 16)
    assert cpu_kernels._attention(lib, q, k, v, bias) is None


@needs_attention
@pytest.mark.usefixtures("attention_on_the_kernel")
def test_a_bf16_policy_with_the_kernel_decodes_as_near_the_fp32_reference_as_without_it(monkeypatch):
    """MultiRatePolicy at bf16 (tiny: head_dim 16, the tower's 8: its attention stays torch's) over three frames with
    a tick each, its tick prefix and gathered frame attention on the kernel, then on torch's form: logits as near the
    fp32 policy's either way."""
    from helpers.model_checks import logits_error, tiny_tick_logits
    from vla_node.model.config import preset
    from vla_node.model.vision import softmax_attention
    from vla_node.model.vla import build_vla

    def run(dtype):
        return tiny_tick_logits(build_vla(preset("tiny"), seed=2), dtype)

    fp32_policy, reference = run(torch.float32)
    assert fp32_policy._prefix.kernel is None  # fp32: torch's form, the kernel not even asked
    assert fp32_policy.tower_cache.attention is softmax_attention
    policy, with_kernel = run(torch.bfloat16)
    assert policy._prefix.kernel is policy._workspace.kernel is cpu_kernels.attention
    assert policy.tower_cache.attention is softmax_attention  # tiny's tower heads: 8 wide, not the kernel's
    monkeypatch.setattr(cpu_kernels, "attention_kernel", lambda: None)
    policy, with_torch = run(torch.bfloat16)
    assert policy._prefix.kernel is policy._workspace.kernel is None
    assert policy.tower_cache.attention is softmax_attention

    def error(logits):
        return logits_error(logits, reference)

    assert error(with_kernel) < 2e-2 and error(with_kernel) <= 1.5 * error(with_torch)


@pytest.mark.skipif(not cpu_kernels.amx_tiles(),
                    reason="the kernels do not run on AMX tiles here (a CPU with AMX-BF16 and a Linux kernel that "
                           f"grants them; {cpu_kernels.status()}; {cpu_features.describe()})")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_on_amx_tiles_it_is_as_near_fp64_as_its_vector_path_and_within_a_rounding_of_it(shape):
    """Head dims a multiple of 32 on the tiles (80, 16: the vector path, the same bits), blocks of 16 rows and the
    rest, keys past a block: as near fp64 as the vector path, within a bf16 step of it, the empty row zeros; the
    switch back gives the vector path's bits."""
    lib = cpu_kernels.library()
    q, k, v, bias = _inputs(*shape, seed=5)
    with torch.inference_mode():
        want = dense_attention(q.double(), k.double(), v.double(), None, bias.double()).nan_to_num(0.0)
        tiles = cpu_kernels.attention(q, k, v, bias).clone()  # (a view of the kernel's output)
        lib.amx(0)
        try:
            vector = cpu_kernels.attention(q, k, v, bias).clone()
        finally:
            lib.amx(1)
    if shape[4] % 32:
        assert torch.equal(tiles, vector)
        return
    if shape[2] >= 17:  # a few hundred products a value, summed in two orders: some land a rounding apart
        assert not torch.equal(tiles, vector), "the switch did not change the path"
    assert_within(tiles.float(), vector.float(), bf16_ulp(vector), "tiles against the vector path")
    assert _error(tiles, want) <= max(1.1 * _error(vector, want), 2 ** -9)
    assert torch.equal(tiles[:, 0], torch.zeros_like(tiles[:, 0]))
