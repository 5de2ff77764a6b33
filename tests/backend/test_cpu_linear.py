"""The bf16 linear kernel (backends/cpu_kernels.c, AVX512-BF16): against fp64 as near as oneDNN's primitive on its
prepacked weight at the node's shapes, every fused op rounded once, rows read as they lie, bad inputs named, and the
packed weights choosing it only where it pays (no AMX, or the kernel on AMX tiles itself; at most two threads)."""

import pytest
import torch

from helpers.linear_cases import OPS, linear_inputs, relative_error
from helpers.numerics import assert_within, bf16_ulp
from vla_node.backends import cpu_features, cpu_kernels, packed_weights

# skipped only without a C compiler, AVX512-BF16 or oneDNN's bf16: where they exist, a kernel that fails the library's
# check against fp64 (and so is not used) fails these tests instead of skipping them
needs_linear = pytest.mark.skipif(
    cpu_kernels.compiler() is None or cpu_kernels.kernels_switched_off()
    or "avx512_bf16" not in cpu_features.cpu_flags(cpu_features.read_cpuinfo())
    or not packed_weights.packed_weights_available(),
    reason="the linear kernel does not run here: it needs a C compiler, a CPU with AVX512-BF16 and oneDNN's bf16 "
           f"to compare with (kernels: {cpu_kernels.status()}; {cpu_features.describe()})")

# rows, in, out: small's tick (17 rows: q|k|v, o, gate/up, down, the action head), a reuse frame's decoder rows, the
# tower's 196 tokens (q|k|v, fc2), the state embedding (K = 4), a tail of 10 columns past a tile of 48
SHAPES = [(17, 512, 768), (17, 512, 512), (17, 512, 1536), (17, 1536, 512), (16, 512, 256), (80, 512, 1536),
          (196, 384, 1152), (196, 1536, 384), (1, 4, 512), (5, 48, 58)]
def _onednn(x, weight, bias, op, other):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[0])
    if op == "mul":
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, "mul")
    name, algorithm = packed_weights.PackedMatmul._ONEDNN_OPS[op]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, name, [], algorithm)


@needs_linear
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", list(OPS))
def test_the_kernel_is_as_near_fp64_as_onednn_and_a_bf16_step_from_it(shape, op):
    """fp32 sums, the bias and the op in fp32, one rounding: within a bf16 step of oneDNN's result (two summation
    orders), and as near fp64 as oneDNN (within 10%, and within bf16's rounding)."""
    x, weight, bias, other = linear_inputs(*shape)
    want = OPS[op](x.double() @ weight.double().T + bias.double(), other.double())
    with torch.inference_mode():
        got = cpu_kernels.linear(x, cpu_kernels.pack_linear(weight), shape[2], bias.float(), op,
                                 other if op == "mul" else None)
        theirs = _onednn(x, weight, bias, op, other)
    assert got.shape == (shape[0], shape[2]) and got.dtype == torch.bfloat16
    assert_within(got.float(), theirs.float(), bf16_ulp(theirs), f"kernel against oneDNN ({op})")
    assert relative_error(got, want) <= min(1.1 * relative_error(theirs, want), 2 ** -8)


@needs_linear
def test_rows_are_read_as_they_lie_and_leading_dims_kept():
    """A strided row view (a column slice of a wider buffer) and a 3-D input give the bits of their contiguous
    2-D copy; `other` strided alike."""
    x, weight, bias, other = linear_inputs(12, 64, 96, seed=1)
    wide = torch.randn(12, 80).bfloat16()
    wide[:, 8:72] = x
    strided = wide[:, 8:72]
    packed = cpu_kernels.pack_linear(weight)
    plain = cpu_kernels.linear(x, packed, 96, bias.float(), "mul", other)
    other_wide = torch.zeros(12, 100).bfloat16()
    other_wide[:, 2:98] = other
    assert torch.equal(cpu_kernels.linear(strided, packed, 96, bias.float(), "mul", other_wide[:, 2:98]), plain)
    three = cpu_kernels.linear(x.view(3, 4, 64), packed, 96, bias.float(), "mul", other.view(3, 4, 96))
    assert three.shape == (3, 4, 96) and torch.equal(three.view(12, 96), plain)


@needs_linear
def test_a_nan_input_makes_its_row_nan_and_no_other():
    x, weight, _, _ = linear_inputs(17, 512, 64, seed=2)
    x[3, 100] = float("nan")
    for op in ("none", "silu", "gelu_tanh"):
        y = cpu_kernels.linear(x, cpu_kernels.pack_linear(weight), 64, None, op)
        assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(17) != 3]).all(), op


@needs_linear
def test_bad_inputs_are_refused_with_what_was_expected():
    x, weight, bias, other = linear_inputs(4, 32, 48)
    packed = cpu_kernels.pack_linear(weight)
    with pytest.raises(ValueError, match=r"takes a bf16 CPU x \[..., 32\], got torch.float32 \(4, 32\)"):
        cpu_kernels.linear(x.float(), packed, 48, None)
    with pytest.raises(ValueError, match=r"32 -> 48, none\) takes a bf16 CPU x \[..., 32\], got torch.bfloat16 \(4"):
        cpu_kernels.linear(x[:, :30], packed, 48, None)
    with pytest.raises(ValueError, match=r"and other \[..., 48\], got .* other torch.bfloat16 \(4, 40\)"):
        cpu_kernels.linear(x, packed, 48, None, "mul", other[:, :40])
    with pytest.raises(ValueError, match=r"mul\) takes"):
        cpu_kernels.linear(x, packed, 48, None, "mul")
    with pytest.raises(ValueError, match="K even"):
        cpu_kernels.pack_linear(torch.zeros(16, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"bf16 weight \[N, K\].*got torch.float32"):
        cpu_kernels.pack_linear(weight.float())
    assert not cpu_kernels.linear_fits(torch.zeros(16, 5, dtype=torch.bfloat16))


def test_built_without_avx512_bf16_the_kernel_says_so_and_the_library_still_loads(tmp_path):
    """The portable build (no AVX512-BF16): packing returns -2 (None), and packed weights stay oneDNN's."""
    if cpu_kernels.compiler() is None:
        pytest.skip(f"no C compiler here: {cpu_kernels.status()}")
    lib = cpu_kernels.load(cpu_kernels.build(cpu_kernels.compiler(), tmp_path, (*cpu_kernels.FLAGS, "-mno-avx512bf16")))
    assert cpu_kernels._pack_linear(lib, torch.zeros(16, 2, dtype=torch.bfloat16)) is None


@needs_linear
def test_built_without_amx_the_kernels_run_on_their_vector_path(tmp_path):
    """A build for an AVX512-BF16 CPU without AMX (a Zen 4 or 5 EPYC): it compiles and loads, says no tiles, and its
    linear gives the vector path's bits."""
    flags = (*cpu_kernels.FLAGS, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
    lib = cpu_kernels.load(cpu_kernels.build(cpu_kernels.compiler(), tmp_path, flags))
    assert lib.amx(-1) == 0 and lib.amx(1) == 0
    x, weight, _, _ = linear_inputs(40, 512, 96, seed=3)
    packed = cpu_kernels._pack_linear(lib, weight)
    assert packed is not None
    theirs = cpu_kernels.library()
    with torch.inference_mode():
        got = cpu_kernels._linear(lib, x, packed, 96, None, "none", None)
        theirs.amx(0)
        try:
            vector = cpu_kernels._linear(theirs, x, packed, 96, None, "none", None)
        finally:
            theirs.amx(1)
    assert torch.equal(got, vector)


@needs_linear
def test_packed_weights_take_the_kernel_without_amx_or_on_its_tiles_on_up_to_two_threads_and_onednn_otherwise(
        monkeypatch):
    linear = torch.nn.Linear(64, 40).bfloat16().requires_grad_(False)
    assert packed_weights.kernel_matmuls()  # this process: oneDNN without AMX, or the kernel on AMX tiles itself
    assert packed_weights.PackedLinear(linear).matmul.kernel
    odd = torch.nn.Linear(63, 40).bfloat16().requires_grad_(False)
    assert not packed_weights.PackedLinear(odd).matmul.kernel  # K odd: oneDNN for that one weight
    try:
        torch.set_num_threads(2)
        assert packed_weights.kernel_matmuls()  # the kernel splits its tiles between torch's two threads
        torch.set_num_threads(packed_weights.KERNEL_MAX_THREADS + 1)
        assert not packed_weights.kernel_matmuls()  # unmeasured there: oneDNN's threaded primitive
    finally:
        torch.set_num_threads(1)
    monkeypatch.setattr(cpu_features, "onednn_runs_amx", lambda: True)
    monkeypatch.setattr(cpu_kernels, "amx_tiles", lambda: True)
    assert packed_weights.kernel_matmuls()  # the kernel's own tiles: as fast as oneDNN's AMX or faster
    monkeypatch.setattr(cpu_kernels, "amx_tiles", lambda: False)
    assert not packed_weights.kernel_matmuls()  # oneDNN's AMX beats the vector kernel
    onednn, step = packed_weights.PackedLinear(linear), packed_weights.bucket_step()
    monkeypatch.undo()
    assert not onednn.matmul.kernel and onednn._rows.step == step
    x = torch.randn(17, 64).bfloat16()
    kernel = packed_weights.PackedLinear(linear)
    assert_within(kernel(x).float(), onednn(x).float(), bf16_ulp(onednn(x)), "kernel against oneDNN")
    assert kernel._rows.step == 1 and kernel._rows.pad(x) is x  # nothing padded: nothing compiled per row count


@needs_linear
def test_a_packed_model_on_the_kernel_compiles_nothing_at_warm_up_and_decodes_as_on_onednn(monkeypatch):
    """tiny at bf16 with packed weights, three frames with a tick each: every packed matmul on the kernel (nothing to
    warm), the logits as near the fp32 policy's as with oneDNN's primitives."""
    from helpers.model_checks import logits_error, tiny_tick_logits
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla

    config = preset("tiny")
    _, reference = tiny_tick_logits(build_vla(config, seed=2), torch.float32)
    model = packed_weights.use_packed_weights(build_vla(config, seed=2).bfloat16())
    matmuls = [m.matmul for m in model.modules() if isinstance(m, packed_weights.PackedLinear)]
    assert matmuls and all(m.kernel for m in matmuls)
    assert packed_weights.warm_row_buckets(model, 64, {17, 5}) == 0
    _, on_kernel = tiny_tick_logits(model, torch.bfloat16)
    monkeypatch.setattr(packed_weights, "kernel_matmuls", lambda: False)
    _, on_onednn = tiny_tick_logits(packed_weights.use_packed_weights(build_vla(config, seed=2).bfloat16()),
                                    torch.bfloat16)
    assert logits_error(on_kernel, reference) <= max(1.25 * logits_error(on_onednn, reference), 1e-3)


needs_amx = pytest.mark.skipif(not cpu_kernels.amx_tiles(),
                               reason="the linear kernel does not run on AMX tiles here (a CPU with AMX-BF16 and a "
                                      f"kernel that grants them; {cpu_kernels.status()}; {cpu_features.describe()})")


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 196])
@pytest.mark.parametrize("k, n", [(4, 58), (48, 40), (512, 768), (588, 96)])
def test_on_amx_tiles_the_kernel_is_as_near_fp64_as_its_vector_path_and_a_bf16_step_from_it(rows, k, n):
    """Blocks of 16 rows and the rest, k by 32 on the tiles and the rest by vector (k = 4, 48, 588), a tail of
    columns: every op with a bias within a bf16 step of the vector path (another summation order) and as near fp64;
    the switch back gives the vector path's bits again."""
    lib = cpu_kernels.library()
    x, weight, bias, other = linear_inputs(rows, k, n, seed=rows + k)
    packed = cpu_kernels.pack_linear(weight)
    for op in OPS:
        want = OPS[op](x.double() @ weight.double().T + bias.double(), other.double())
        run = lambda: cpu_kernels.linear(x, packed, n, bias.float(), op, other if op == "mul" else None)  # noqa: E731
        with torch.inference_mode():
            tiles = run()
            lib.amx(0)
            try:
                vector = run()
            finally:
                lib.amx(1)
            assert torch.equal(run(), tiles)
        if k == 512 and rows >= 40:  # 512 products a value, summed in two orders: some land a rounding apart
            assert not torch.equal(tiles, vector), "the switch did not change the path"
        assert_within(tiles.float(), vector.float(), bf16_ulp(vector), f"tiles against the vector path ({op})")
        assert relative_error(tiles, want) <= max(1.1 * relative_error(vector, want), 2 ** -9), op


@needs_amx
@pytest.mark.parametrize("rows", [17, 20, 32, 33, 61, 196])
@pytest.mark.parametrize("k, n", [(48, 40), (512, 512), (588, 96), (1536, 512)])
def test_on_amx_tiles_a_row_gets_the_same_bits_in_any_call(rows, k, n):
    """The tiles sum each row on its own: the last two blocks in one pass (17 to 32 rows: linear_amx_pair, the second
    block's rows copied into zeros), the threads splitting the rows or the columns (linear_amx_row_parts) and blocks
    of any size give a row the bits it gets in a call of its own 16-row block, or alone."""
    x, weight, bias, other = linear_inputs(rows, k, n, seed=rows + k + n)
    packed = cpu_kernels.pack_linear(weight)
    with torch.inference_mode():
        for op in OPS:
            mul = op == "mul"
            whole = cpu_kernels.linear(x, packed, n, bias.float(), op, other if mul else None)
            for first in range(0, rows, 16):
                block = slice(first, min(first + 16, rows))
                alone = cpu_kernels.linear(x[block], packed, n, bias.float(), op, other[block] if mul else None)
                assert torch.equal(whole[block], alone), f"rows {block} of {rows} ({op})"
            last = cpu_kernels.linear(x[-1:], packed, n, bias.float(), op, other[-1:] if mul else None)
            assert torch.equal(whole[-1:], last), f"the last row of {rows} ({op})"
