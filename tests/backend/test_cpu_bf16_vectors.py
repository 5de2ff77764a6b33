"""The kernels' bf16 vector forms (backends/cpu_kernels.c: 32 values at a time, rounded by the bf16 unit where no
lane is a NaN or a subnormal, else in integer arithmetic) on each build the kernels may get: -march=native, without
AVX512-BF16 (integer rounding alone) and without AVX-512 (the compiler's vectors of the scalar form). RoPE
(cpu_kernels.apply_rope) and the shared-drift move give torch's bits on each, special values included."""

import platform

import numpy as np
import pytest
import torch

from helpers.oracles import torch_shift
from vla_node.backends import cpu_kernels
from vla_node.model import decoder

needs_kernels = pytest.mark.skipif(cpu_kernels.compiler() is None or cpu_kernels.kernels_switched_off(),
                                   reason=f"the fused CPU kernels do not run here: {cpu_kernels.status()}")
x86 = platform.machine() in ("x86_64", "AMD64")
BUILDS = ["native", "-mno-avx512bf16", "-mno-avx512f"] if x86 else ["native"]
# infinities, the largest finite values (a product or a sum past them overflows), NaN, bf16 subnormals, the
# smallest normal, signed zeros
SPECIAL = [float("inf"), -float("inf"), float("nan"), 3.3895e38, -3.3895e38, 9.2e-41, -1.1e-40, 1.18e-38, 0.0, -0.0]


@pytest.fixture(scope="module", params=BUILDS)
def lib(request, tmp_path_factory):
    if request.param == "native":
        return cpu_kernels.library()
    flags = (*cpu_kernels.FLAGS, request.param)
    return cpu_kernels.load(cpu_kernels.build(cpu_kernels.compiler(), tmp_path_factory.mktemp("kernels"), flags))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits but for NaNs' payloads (NaN where the other is NaN): a bf16 NaN is 0xffff from torch's
    vectorized conversion and 0x7fc0 from its scalar one, as from the kernels."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def _with_special_values(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] with SPECIAL at the start of its first row, in the middle of a row and in the last row's tail."""
    flat = x.reshape(-1, x.shape[-1])  # [..., n] -> [rows, n]
    special = torch.tensor(SPECIAL).to(x.dtype)
    n = min(special.numel(), flat.shape[1])
    flat[0, :n] = special[:n]
    mid = flat.shape[1] // 2
    flat[flat.shape[0] // 2, mid : mid + n] = special[: flat.shape[1] - mid]
    flat[-1, -n:] = special[:n]
    return x


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 34, 128, 2])
def test_rope_gives_torchs_bits_on_every_build(lib, dtype, head_dim):
    """RoPE of a strided q|k view (the heads of a matmul's output: rows apart by every head's width) and of a
    contiguous one: head_dim 64 and 128 (the roll reads whole chunks), 80 (base; a stack copy), 34 (a masked tail)
    and 2; special values in x and in the tables; products and sums that overflow."""
    generator = torch.Generator().manual_seed(head_dim)
    heads, rows = 3, 11
    matmul_out = torch.randn(rows, (heads + 1) * head_dim, generator=generator).to(dtype)
    strided = matmul_out[:, : heads * head_dim].reshape(rows, heads, head_dim).transpose(0, 1)  # [H, rows, hd]
    cos = torch.randn(rows, head_dim, generator=generator).to(dtype) * 4
    signed_sin = _with_special_values(torch.randn(rows, head_dim, generator=generator).to(dtype))
    _with_special_values(matmul_out)
    matmul_out[2] *= 3e38  # overflowing products
    for x in (strided, strided.contiguous()):
        got = cpu_kernels._rope(lib, x, cos, signed_sin)
        assert _bits_equal(got, decoder.apply_rope(x, cos, signed_sin))
        assert got.is_contiguous() and got.shape == x.shape


@needs_kernels
def test_rope_leaves_for_torch_where_the_kernel_does_not_apply():
    """apply_rope takes torch's ops (the same values) for a layout or dtype the kernel does not read, and under
    autograd, where a tensor with history needs torch's ops."""
    x = torch.randn(2, 5, 8).bfloat16()
    cos, sin = torch.randn(5, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    cases = [(x.half(), cos.half(), sin.half()),  # fp16: no kernel
             (x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin),  # last dim strided
             (x, cos.t().contiguous().t(), sin),  # a table not contiguous
             (x, cos.float(), sin),  # the tables in another dtype
             (x[..., :7], cos[:, :7], sin[:, :7])]  # an odd head_dim
    with torch.inference_mode():
        for args in cases:
            assert torch.equal(cpu_kernels.apply_rope(*args), decoder.apply_rope(*args))
    grad = x.float().requires_grad_()
    out = cpu_kernels.apply_rope(grad, cos.float(), sin.float())
    out.sum().backward()
    assert grad.grad is not None


@needs_kernels
def test_apply_rope_runs_the_kernel_in_inference():
    """apply_rope in inference on a strided bf16 view (as the decoder's q|k heads come) runs the kernel, with torch's
    bits."""
    calls = []
    original = cpu_kernels._rope
    x = torch.randn(11, 4, 64).bfloat16().transpose(0, 1)
    cos, sin = torch.randn(11, 64).bfloat16(), torch.randn(11, 64).bfloat16()
    with torch.inference_mode():
        cpu_kernels._rope = lambda *args: calls.append(args) or original(*args)
        try:
            got = cpu_kernels.apply_rope(x, cos, sin)
        finally:
            cpu_kernels._rope = original
    assert calls and torch.equal(got, decoder.apply_rope(x, cos, sin))


@needs_kernels
def test_the_bf16_move_rounds_special_values_as_torch_on_every_build(lib):
    """The bf16 move gives torch's bits for infinities, overflow to infinity, NaNs, bf16 and fp32 subnormals, near
    ties and a tail of 19 lanes, in out and in the residual stream."""
    generator = torch.Generator().manual_seed(7)
    tokens, width = 9, 83  # two full 32-lane chunks and a tail
    rows, sample, at = torch.tensor([1, 4, 8]), torch.tensor([4, 8]), torch.tensor([1, 2])
    old = _with_special_values(torch.randn(tokens, width, generator=generator).bfloat16())
    old[5] = torch.tensor(9.2e-41).bfloat16()  # bf16 subnormals: plus a tiny move, fp32 subnormals
    old[6] = 1.0 + torch.arange(width) * 2.0**-8  # near ties
    new = old[rows].clone()
    new[1] += 1e-38  # the move: ~5e-39 in every lane, an fp32 subnormal
    new[2, :40] += torch.randn(40, generator=generator).bfloat16() * 3e38  # overflowing lanes too
    stream = _with_special_values(torch.randn(tokens, width, generator=generator).bfloat16())
    want = torch_shift(old, new, rows, sample, 0)
    want_stream = stream.clone().add_(want)
    out, got_stream = torch.empty_like(old), stream.clone()
    with torch.inference_mode():
        cpu_kernels._shift(lib, out, old, new, (0, width), rows, sample, at, 0, got_stream)
    assert _bits_equal(out, want) and _bits_equal(got_stream, want_stream)
    assert want.isnan().any() and want.isinf().any() and (want.float().abs() < 1.2e-38).logical_and(want != 0).any()


@needs_kernels
def test_a_bf16_policys_frames_and_ticks_run_rope_through_the_kernel_with_torchs_logits(monkeypatch):
    """A bf16 MultiRatePolicy behind the reuse gate (full frames, partial ones with the tick in their pass, ticks
    alone): every RoPE goes through the kernel, and the logits are bit for bit those of torch's RoPE."""
    from vla_node.bench.reuse import GatedPolicy
    from vla_node.kv.cache_config import CacheConfig
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla
    from vla_node.runtime.policy import MultiRatePolicy
    from vla_node.runtime.reuse import ReuseConfig

    config = preset("tiny")
    rng = np.random.default_rng(3)
    first = rng.integers(0, 256, (1, config.image_size, config.image_size, 3), dtype=np.uint8)
    frames = [first.copy() for _ in range(4)]
    for i, frame in enumerate(frames[1:], 1):  # a patch changes per frame: partial refreshes
        frame[0, 8 * i : 8 * i + 8, :16] = rng.integers(0, 256, (8, 16, 3), dtype=np.uint8)
    state = np.linspace(-1, 1, config.state_dim, dtype=np.float32)

    def run():
        policy = MultiRatePolicy(build_vla(config, seed=2).to(torch.bfloat16), CacheConfig())
        policy.update_text("keep lane")
        gated, logits, partial = GatedPolicy(policy, ReuseConfig()), [], 0
        for frame in frames:
            update, plans = gated.update_vision(policy.prepare_frames(list(frame)), state=state)
            partial += not plans[0].full
            logits.append(update.chunk.logits)
            logits.append(policy.action_tick(state).logits)
        assert partial == len(frames) - 1
        return logits

    calls = []
    kernel = cpu_kernels._rope
    monkeypatch.setattr(cpu_kernels, "_rope", lambda *args: calls.append(args[1].shape) or kernel(*args))
    with_kernel = run()
    assert len(calls) >= 4 * config.num_layers and all(shape[-1] == config.head_dim for shape in calls)
    monkeypatch.setattr(cpu_kernels, "apply_rope", decoder.apply_rope)
    kernel_calls = len(calls)
    with_torch = run()
    assert len(calls) == kernel_calls  # torch's RoPE alone
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(with_kernel, with_torch))
