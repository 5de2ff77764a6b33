"""The int8 linear kernel (backends/cpu_kernels.c, AVX512-VNNI, on AMX tiles where the CPU has AMX-INT8): its
arithmetic as quantized_product says (each row of x and each weight column quantized symmetrically, the codes'
products summed exactly, one bf16 rounding after the op) at the node's shapes, the tiles' bits the vector path's, the
quantization's cost against the exact product, rows read as they lie, bad inputs named, and `weights = "int8"`
packing every weight that fits it."""

import pytest
import torch

from helpers.linear_cases import OPS, linear_inputs, relative_error
from helpers.numerics import assert_within, bf16_ulp
from vla_node.backends import cpu_features, cpu_kernels, packed_weights

needs_int8 = pytest.mark.skipif(
    cpu_kernels.compiler() is None or cpu_kernels.kernels_switched_off()
    or not {"avx512_bf16", "avx512_vnni"} <= set(cpu_features.cpu_flags(cpu_features.read_cpuinfo()))
    or not packed_weights.packed_weights_available(),
    reason="the int8 linear kernel does not run here: it needs a C compiler and a CPU with AVX512-VNNI and AVX512-BF16 "
           f"(kernels: {cpu_kernels.status()}; {cpu_features.describe()})")

# rows, in, out: small's tick (q|k|v, o, gate/up, down, the action head), a reuse frame's decoder rows, the tower's
# 196 tokens, the state embedding (K = 4), a tail of 10 columns past a tile of 48
SHAPES = [(17, 512, 768), (17, 512, 512), (17, 512, 1536), (17, 1536, 512), (16, 512, 516), (80, 512, 1536),
          (196, 384, 1152), (196, 1536, 384), (1, 4, 512), (5, 48, 58)]
@needs_int8
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", list(OPS))
def test_the_kernel_computes_its_quantized_arithmetic_and_costs_about_a_percent(shape, op):
    """Within a bf16 step of quantized_product's fp64 result (the sums are exact; only the fp32 scaling and the one
    rounding differ), and within 2% of the unquantized fp64 product (int8's cost; the bf16 kernel's is ~0.2%)."""
    x, weight, bias, other = linear_inputs(*shape)
    bias = bias.float()
    want = OPS[op](cpu_kernels.quantized_product(x, weight) + bias.double(), other.double())
    exact = OPS[op](x.double() @ weight.double().T + bias.double(), other.double())
    with torch.inference_mode():
        got = cpu_kernels.linear_int8(x, cpu_kernels.pack_linear_int8(weight), shape[2], bias, op,
                                      other if op == "mul" else None)
    assert got.shape == (shape[0], shape[2]) and got.dtype == torch.bfloat16
    assert_within(got.float(), want.float(), bf16_ulp(want.bfloat16()), f"kernel against its arithmetic ({op})")
    assert relative_error(got, exact) <= 0.02


@needs_int8
@pytest.mark.skipif("amx_int8" not in cpu_features.cpu_flags(cpu_features.read_cpuinfo()),
                    reason=f"the int8 linear runs on AMX tiles only on a CPU with AMX-INT8 ({cpu_features.describe()})")
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 40, 196])
@pytest.mark.parametrize("k, n", [(4, 58), (68, 40), (512, 768), (588, 96), (1536, 512)])
def test_on_amx_tiles_the_kernel_gives_its_vector_paths_bits(rows, k, n):
    """Blocks of 16 rows and the rest (the last two in one pass where they are 17 to 32 rows), k by 64 on the tiles
    and the rest (k = 4, 68, 588) by the vector product, a tail of columns, every op with a bias: the integer sums are
    exact in any order, so the tiles give the AVX512-VNNI path's bits (its switch, amx(0), turns the tiles off for the
    int8 linear too)."""
    lib = cpu_kernels.library()
    assert lib is not None, cpu_kernels.status()  # a library that failed its self-check fails here
    if lib.amx(-1) != 1:
        pytest.skip("the kernel does not grant this process the AMX tile registers")
    assert cpu_kernels.amx_int8_tiles()
    x, weight, bias, other = linear_inputs(rows, k, n, seed=rows + k)
    x[rows // 2] = 0  # a row of zero codes: the bias alone
    packed = cpu_kernels.pack_linear_int8(weight)
    for op in OPS:
        run = lambda: cpu_kernels.linear_int8(x, packed, n, bias.float(), op, other if op == "mul" else None)  # noqa: E731
        with torch.inference_mode():
            tiles = run()
            lib.amx(0)
            try:
                assert lib.amx_int8() == 0
                vector = run()
            finally:
                lib.amx(1)
        assert torch.equal(tiles.view(torch.int16), vector.view(torch.int16)), op


@needs_int8
def test_packing_quantizes_each_column_symmetrically_and_keeps_its_code_sum():
    """scale = max |w_c| / 127; codes round(w / scale) in [-127, 127] (each column's largest value at +-127); sums the
    columns' code sums; a zero column scale 0, codes 0 (its outputs the bias alone); N padded to 16 columns."""
    _, weight, bias, _ = linear_inputs(1, 64, 50, seed=3)
    bias = bias.float()
    weight[7] = 0
    packed = cpu_kernels.pack_linear_int8(weight)
    assert packed.scale.shape == (64,) and packed.sums.shape == (64,) and packed.codes.shape == (64 * 64,)
    most = weight.float().abs().amax(1)
    torch.testing.assert_close(packed.scale[:50], most / 127, rtol=0, atol=0)
    assert (packed.scale[50:] == 0).all() and (packed.sums[50:] == 0).all()
    codes = torch.where(most[:, None] > 0, torch.round(weight.float() / (most[:, None] / 127)), 0.0)  # [N, K]
    assert torch.equal(packed.sums[:50], codes.sum(1).int()) and codes.abs().amax() == 127
    # the tiles, unpacked: [48 columns a tile][K / 4][cols][4] -> [N, K]
    first = packed.codes[: 48 * 64].view(16, 48, 4).permute(1, 0, 2).reshape(48, 64)
    assert torch.equal(first.float(), codes[:48])
    x = torch.randn(3, 64).bfloat16()
    y = cpu_kernels.linear_int8(x, packed, 50, bias)
    assert torch.equal(y[:, 7], bias[7].bfloat16().expand(3))  # op none: the bias rounded once


@needs_int8
def test_rows_are_read_as_they_lie_and_leading_dims_kept():
    x, weight, bias, other = linear_inputs(12, 64, 96, seed=1)
    bias = bias.float()
    wide = torch.randn(12, 80).bfloat16()
    wide[:, 8:72] = x
    packed = cpu_kernels.pack_linear_int8(weight)
    plain = cpu_kernels.linear_int8(x, packed, 96, bias, "mul", other)
    other_wide = torch.zeros(12, 100).bfloat16()
    other_wide[:, 2:98] = other
    assert torch.equal(cpu_kernels.linear_int8(wide[:, 8:72], packed, 96, bias, "mul", other_wide[:, 2:98]), plain)
    three = cpu_kernels.linear_int8(x.view(3, 4, 64), packed, 96, bias, "mul", other.view(3, 4, 96))
    assert three.shape == (3, 4, 96) and torch.equal(three.view(12, 96), plain)


@needs_int8
def test_a_nan_or_infinite_input_makes_its_row_nan_a_zero_row_gives_the_bias():
    x, weight, bias, _ = linear_inputs(17, 512, 64, seed=2)
    bias = bias.float()
    x[3, 100], x[9, 0], x[12] = float("nan"), float("inf"), 0
    packed = cpu_kernels.pack_linear_int8(weight)
    for op in ("none", "silu", "gelu_tanh"):
        y = cpu_kernels.linear_int8(x, packed, 64, bias, op)
        assert torch.isnan(y[3]).all() and torch.isnan(y[9]).all(), op
        assert torch.isfinite(y[[r for r in range(17) if r not in (3, 9)]]).all(), op
        want = OPS[op](bias.double(), None)
        assert_within(y[12].float(), want.float(), bf16_ulp(want.bfloat16()), f"the zero row ({op})")


@needs_int8
def test_bad_inputs_are_refused_with_what_was_expected():
    x, weight, bias, other = linear_inputs(4, 32, 48)
    packed = cpu_kernels.pack_linear_int8(weight)
    with pytest.raises(ValueError, match=r"int8 linear kernel \(32 -> 48, none\) takes a bf16 CPU x \[..., 32\], "
                                         r"got torch.float32 \(4, 32\)"):
        cpu_kernels.linear_int8(x.float(), packed, 48, None)
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(4, 28\)"):
        cpu_kernels.linear_int8(x[:, :28], packed, 48, None)
    with pytest.raises(ValueError, match=r"and other \[..., 48\], got .* other torch.bfloat16 \(4, 40\)"):
        cpu_kernels.linear_int8(x, packed, 48, None, "mul", other[:, :40])
    with pytest.raises(ValueError, match=r"takes a contiguous fp32 bias \[48\], got torch.bfloat16 \(48,\)"):
        cpu_kernels.linear_int8(x, packed, 48, bias)  # a bf16 bias would be read as fp32
    with pytest.raises(ValueError, match=r"fp32 bias \[48\], got torch.float32 \(40,\)"):
        cpu_kernels.linear(x, cpu_kernels.pack_linear(weight), 48, bias[:40].float())
    with pytest.raises(ValueError, match=r"K a multiple of 4.*got torch.bfloat16 \(16, 6\)"):
        cpu_kernels.pack_linear_int8(torch.zeros(16, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got torch.float32"):
        cpu_kernels.pack_linear_int8(weight.float())
    assert not cpu_kernels.int8_linear_fits(torch.zeros(16, 6, dtype=torch.bfloat16))


def test_built_without_avx512_vnni_the_kernel_says_so_and_the_library_still_loads(tmp_path):
    if cpu_kernels.compiler() is None:
        pytest.skip(f"no C compiler here: {cpu_kernels.status()}")
    lib = cpu_kernels.load(cpu_kernels.build(cpu_kernels.compiler(), tmp_path, (*cpu_kernels.FLAGS, "-mno-avx512vnni")))
    assert cpu_kernels._pack_linear_int8(lib, torch.zeros(16, 4, dtype=torch.bfloat16)) is None


@needs_int8
def test_int8_weights_pack_every_weight_that_fits_and_decode_near_the_fp32_policy():
    """tiny with `weights = "int8"` (loading.load_model): every packed matmul whose K is a multiple of 4 on the int8
    kernel, nothing to warm, and the tick's logits near the fp32 policy's: within 3x the bf16 packed model's error
    (int8 on every matmul against bf16 rounding on every matmul)."""
    from helpers.model_checks import logits_error, tiny_tick_logits
    from vla_node.backends.loading import convert_weights
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla

    config = preset("tiny")
    _, reference = tiny_tick_logits(build_vla(config, seed=2), torch.float32)
    model = convert_weights(build_vla(config, seed=2), "int8")
    linears = [m for m in model.modules() if isinstance(m, packed_weights.PackedLinear)]
    assert linears and all(m.int8 and m.matmul.int8 == cpu_kernels.int8_linear_fits(m.weight) for m in linears)
    assert sum(m.matmul.int8 for m in linears) >= len(linears) - 1  # the state embedding's K may not fit
    assert all(m.__dict__["qkv"].matmul.int8 for m in model.modules() if "qkv" in m.__dict__)
    assert "int8 (cpu_kernels int8 linear)" in repr(linears[0])
    assert packed_weights.warm_row_buckets(model, 64, {17, 5}) == 0
    _, on_int8 = tiny_tick_logits(model, torch.bfloat16)
    _, on_bf16 = tiny_tick_logits(convert_weights(build_vla(config, seed=2), "packed"), torch.bfloat16)
    assert logits_error(on_int8, reference) <= 3 * logits_error(on_bf16, reference)
    odd = packed_weights.PackedLinear(torch.nn.Linear(62, 40).bfloat16().requires_grad_(False), int8=True)
    assert not odd.matmul.int8  # K = 62: the bf16 path for that one weight


def test_the_launch_file_takes_int8_weights_where_the_kernel_runs_and_names_what_it_needs():
    from vla_node.config import ModelSection
    from vla_node.validate import ConfigError

    if packed_weights.int8_weights_available():
        section = ModelSection(dtype="bf16", weights="int8")
        assert section.resolved_weights == "int8" and section.weight_format == "int8"
        assert not ModelSection(dtype="bf16", weights="int8", compiled_tick="auto").resolved_compiled_tick
        with pytest.raises(ConfigError, match="compiled_tick 'on'"):
            ModelSection(dtype="bf16", weights="int8", compiled_tick="on")
    with pytest.raises(ConfigError, match="int8 weights take bf16 compute"):
        ModelSection(dtype="fp32", weights="int8")
