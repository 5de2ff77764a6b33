"""The fused CPU kernels (backends/cpu_kernels.c): RMSNorm as torch's rms_norm rounds it (the sum of squares in
another order), the shared-drift move bit for bit as torch's ops compute it, built once per source, compiler and
CPU, and torch's ops wherever they cannot run."""

import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.oracles import torch_shift
from vla_node.backends import cpu_kernels
from vla_node.model.config import preset
from vla_node.model.decoder import RMSNorm
from vla_node.model.vla import build_vla
from vla_node.runtime.vision_cache import VisionTokenCache, shift_reused

# skipped only without a C compiler: where one exists, a kernel that fails its check against torch (and so is not
# used) fails these tests instead of skipping them
needs_kernels = pytest.mark.skipif(cpu_kernels.compiler() is None or cpu_kernels.kernels_switched_off(),
                                   reason=f"the fused CPU kernels do not run here: {cpu_kernels.status()}")
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture
def torch_ops(monkeypatch):
    """The process without the kernels (library() None), as where they cannot be built."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 512), (17, 512), (216, 512), (3, 40), (2, 5, 517)])
def test_rms_norm_rounds_as_torch_but_for_its_sum_order(dtype, shape):
    """Every value equals torch's or, in bf16, is the neighbouring bf16 value (the sum of squares adds in another
    order: its last bit may differ), and few are; in fp32 within a few fp32 steps."""
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    norm = cpu_kernels.KernelRMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data.copy_(torch.randn(shape[-1], generator=generator))
    with torch.inference_mode():
        got = norm(x)
    want = F.rms_norm(x, (shape[-1],), norm.weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:
        # the same signs: the bit patterns count bf16 steps
        steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(steps.max()) <= 1
        assert int((steps > 0).sum()) <= 4 + x.numel() // 5000  # about 1 in 10^5 measured
    else:
        torch.testing.assert_close(got, want, rtol=4 * 2.0**-23, atol=0)


@needs_kernels
def test_rms_norm_leaves_for_torch_where_the_kernel_does_not_apply():
    """With gradients (training), a strided input or another weight dtype the norm is RMSNorm's own torch form:
    the same bits, and a gradient flows."""
    generator = torch.Generator().manual_seed(0)
    plain = RMSNorm(64, 1e-6)
    plain.weight.data.copy_(torch.randn(64, generator=generator))
    norm = cpu_kernels.KernelRMSNorm(64, 1e-6)
    norm.load_state_dict(plain.state_dict())
    x = torch.randn(8, 64, generator=generator, requires_grad=True)
    out = norm(x)
    assert torch.equal(out, plain(x))
    out.sum().backward()
    assert x.grad is not None
    with torch.inference_mode():
        strided = torch.randn(64, 8, generator=generator).t()  # [8, 64], not contiguous
        assert torch.equal(norm(strided), plain(strided))
        assert torch.equal(norm(strided.bfloat16()), plain(strided.bfloat16()))  # fp32 weight, bf16 x


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["tokens-first", "heads", "permuted-qkv"])
def test_the_shared_drift_move_gives_torchs_bits(dtype, layout):
    """shift_reused through the kernel against its torch form: tokens first ([T, W], dim 0), per head ([H, T, hd],
    dim 1) and the packed q|k|v view ([n, 3, H, hd] permuted to [3, H, n, hd], dim 2), rows at both ends."""
    generator = torch.Generator().manual_seed(1)
    tokens, rows = 23, torch.tensor([0, 4, 5, 11, 22])
    sample = rows[[1, 3]]
    shapes = {"tokens-first": ((tokens, 48), 0), "heads": ((3, tokens, 16), 1),
              "permuted-qkv": ((3, 2, tokens, 16), 2)}
    shape, dim = shapes[layout]
    old = torch.randn(shape, generator=generator).to(dtype)
    if layout == "permuted-qkv":
        new = torch.randn(rows.numel(), 3, 2, 16, generator=generator).to(dtype).permute(1, 2, 0, 3)
    else:
        new_shape = list(shape)
        new_shape[dim] = rows.numel()
        new = torch.randn(new_shape, generator=generator).to(dtype)
    out = torch.full_like(old, float("nan"))
    with torch.inference_mode():
        shift_reused(out, old, new, rows, sample, dim)
    assert torch.equal(out, torch_shift(old, new, rows, sample, dim))
    if layout == "permuted-qkv":
        assert not new.is_contiguous()  # the kernel read the view's own strides


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("samples", [1, 2, 3, 5, 7, 8, 13, 16])
def test_the_moves_mean_change_is_torchs_for_any_sample_size(dtype, samples):
    """The mean over the sample sums in the sample's order and divides, as torch's mean does (not a multiply by
    1/s: 3, 5, 7 and 13 would round differently), bit for bit, with values of mixed scales."""
    generator = torch.Generator().manual_seed(samples)
    tokens = 40
    rows = torch.randperm(tokens, generator=generator)[: samples + 4].sort().values
    sample = rows[torch.randperm(rows.numel(), generator=generator)[:samples].sort().values]
    scales = torch.logspace(-3, 3, 64)[torch.randperm(64, generator=generator)]
    old = (torch.randn(tokens, 64, generator=generator) * scales).to(dtype)
    new = (torch.randn(rows.numel(), 64, generator=generator) * scales).to(dtype)
    out = torch.empty_like(old)
    with torch.inference_mode():
        shift_reused(out, old, new, rows, sample, 0)
    assert torch.equal(out, torch_shift(old, new, rows, sample, 0))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_move_adds_its_result_to_the_residual_stream_as_torch_does(dtype):
    """shift_reused with a residual stream: out as without one, and the stream plus out rounded once, as
    residual.add_(out) gives (the kernel's pass and torch's ops alike: a fresh row and a moved one)."""
    generator = torch.Generator().manual_seed(3)
    old = (torch.randn(23, 48, generator=generator) * 4).to(dtype)
    new = torch.randn(5, 48, generator=generator).to(dtype)
    rows = torch.tensor([0, 4, 5, 11, 22])
    stream = (torch.randn(23, 48, generator=generator) * 30).to(dtype)
    want_out = torch_shift(old, new, rows, rows[[1, 3]], 0)
    want = stream.clone().add_(want_out)
    out, got = torch.empty_like(old), stream.clone()
    with torch.inference_mode():
        assert cpu_kernels.shift(out, old, new, rows, rows[[1, 3]], torch.tensor([1, 3]), 0, got)
    assert torch.equal(out, want_out) and torch.equal(got, want)
    out, got = torch.empty_like(old), stream.clone()
    with torch.inference_mode():
        shift_reused(out, old, new, rows, rows[:0], 0, residual=got)  # no sample: torch's ops
    assert torch.equal(got, stream + old.index_copy(0, rows, new))


@needs_kernels
def test_a_layout_the_kernel_cannot_read_is_left_to_torch():
    """fresh whose dims after the token dim are not contiguous, or out the same memory as old: the kernel declines
    (False), shift_reused's torch form gives the result."""
    old = torch.randn(6, 4, 8)
    fresh = torch.randn(2, 8, 4).transpose(1, 2)  # [2, 4, 8], inner dims strided
    rows = torch.tensor([1, 4])
    with torch.inference_mode():
        assert cpu_kernels.shift(torch.empty_like(old), old, fresh, rows, rows[:1], rows[:1] * 0, 0) is False
        assert cpu_kernels.shift(old, old, fresh.contiguous(), rows, rows[:1], rows[:1] * 0, 0) is False  # in place
        out = torch.empty_like(old)
        shift_reused(out, old, fresh, rows, rows[:1], 0)
    assert torch.equal(out, torch_shift(old, fresh, rows, rows[:1], 0))


def _tower_refreshes(dtype):
    """A tiny tower cache's full refresh and two partial ones (shared drift on), each output and the cached
    q|k|v after them."""
    config = preset("tiny").replace(image_size=64)
    tower = build_vla(config, seed=3).to(dtype).vision
    rng = np.random.default_rng(2)
    frames = [torch.from_numpy(rng.random((3, 64, 64), np.float32)).to(dtype) for _ in range(3)]
    cache = VisionTokenCache(tower, 1, dtype, shared_drift_samples=2)
    outputs = []
    for frame, tokens in zip(frames, (None, torch.tensor([0, 3, 5, 9]), torch.tensor([1, 2, 14]))):
        outputs.append(cache.refresh(0, frame, tokens).clone())
        cache.commit()
    return outputs + [cache.qkv.clone(), cache.attn_out.clone(), cache.mlp_out.clone()]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tower_cache_refresh_is_bit_for_bit_the_same_with_the_kernels(dtype, monkeypatch):
    """The tower has no RMSNorm, so its reuse path with the kernel's moves equals torch's ops' bit for bit."""
    with_kernels = _tower_refreshes(dtype)
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    for got, want in zip(with_kernels, _tower_refreshes(dtype)):
        assert torch.equal(got, want)


@needs_kernels
def test_use_cpu_kernels_swaps_every_rmsnorm_and_keeps_its_weights():
    model = build_vla(preset("tiny"), seed=0)
    weights = {name: p.clone() for name, p in model.state_dict().items()}
    cpu_kernels.use_cpu_kernels(model)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(type(m) is cpu_kernels.KernelRMSNorm for m in norms)
    assert all(torch.equal(p, weights[name]) for name, p in model.state_dict().items())


def test_without_the_kernels_torchs_ops_run(torch_ops):
    """Where the library cannot run, KernelRMSNorm is RMSNorm and the move is torch's; use_cpu_kernels swaps
    nothing."""
    model = cpu_kernels.use_cpu_kernels(build_vla(preset("tiny"), seed=0))
    assert not any(isinstance(m, cpu_kernels.KernelRMSNorm) for m in model.modules())
    norm, x = cpu_kernels.KernelRMSNorm(32, 1e-6), torch.randn(4, 32)
    with torch.inference_mode():
        assert torch.equal(norm(x), RMSNorm(32, 1e-6)(x))
        one = torch.tensor([0])
        assert cpu_kernels.shift(torch.empty(4, 32), x, x[:1], one, one, one, 0) is False


@needs_kernels
def test_with_a_c_compiler_the_kernels_build_and_pass_their_check_against_torch():
    assert cpu_kernels.library() is not None, cpu_kernels.status()


@needs_kernels
def test_the_library_is_built_once_per_source_compiler_and_cpu(fresh_library):
    assert isinstance(cpu_kernels.library(), cpu_kernels.Kernels)
    built = list(fresh_library.glob("cpu_kernels-*.so"))
    assert len(built) == 1 and "built with" in cpu_kernels.status()
    stamp = built[0].stat().st_mtime_ns
    assert cpu_kernels._load_threaded(cpu_kernels.compiler(), fresh_library)[0].path == built[0]
    assert built[0].stat().st_mtime_ns == stamp  # the cached one, not rebuilt
    assert not list(fresh_library.glob("*.partial"))


def test_a_failing_compiler_leaves_torchs_ops_and_says_why(fresh_library, monkeypatch, tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such compiler feature' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert cpu_kernels.library() is None
    assert "unavailable" in cpu_kernels.status() and "no such compiler feature" in cpu_kernels.status()
    assert not list(fresh_library.glob("*.so*"))  # no partial library left behind


def test_the_kernels_can_be_switched_off(fresh_library, monkeypatch):
    monkeypatch.setenv("VLA_NODE_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    assert cpu_kernels.status() == "off (VLA_NODE_CPU_KERNELS=0)"


def _kivi_inputs(dtype):
    """K/V [L, H, C, D] of a partition of 11 slots (key groups of 4: two whole, one of 3) at every scale the int8
    storage takes (|x| <= fp16's max): channels spread over 1e-7..3e4, a constant channel (a zero step), an all-zero
    head, one-sided and mixed signs."""
    generator = torch.Generator().manual_seed(7)
    shape = (2, 3, 11, 16)
    scales = torch.logspace(-7, 4.5, 16)[torch.randperm(16, generator=generator)]
    k = torch.randn(shape, generator=generator) * scales
    k[0, 0, :, 3] = 1.7  # constant channel: hi == lo
    k[1, 2] = 0.0
    k[0, 1] = k[0, 1].abs() + 50.0  # all positive: zero well above 0
    v = torch.randn(shape, generator=generator) * scales.flip(0)
    v[1, 1, 5] = -3e-5  # a constant token near fp16's subnormals
    v[0, 2, :, :8] *= 1e3
    return k.clamp(-6e4, 6e4).to(dtype), v.clamp(-6e4, 6e4).to(dtype)


def _int8_partition(kivi):
    from vla_node.kv.partition import KVPartition, PartitionSpec

    partition = KVPartition(PartitionSpec("vision", 11, "int8", 2, 3, 16, key_group=4))
    partition.kivi = kivi
    return partition


def _kivi_storage(partition):
    return [partition.k, partition.k_scale, partition.k_zero, partition.v, partition.v_scale, partition.v_zero]


def _check_kivi_library(lib, dtype):
    """A partition's whole write and read_all through `lib`'s KIVI kernels against torch's ops: the same codes,
    scale and zero bits, the same dequantized values in a view of a larger buffer."""
    k, v = _kivi_inputs(dtype)
    slots, positions = torch.arange(11), torch.arange(11)
    fused, plain = _int8_partition(cpu_kernels.KernelKivi(lib)), _int8_partition(None)
    with torch.inference_mode():
        for partition in (fused, plain):
            partition.write(slots, k, v, positions, 3)
        for got, want in zip(_kivi_storage(fused), _kivi_storage(plain)):
            assert torch.equal(got.view(torch.int8 if got.dtype == torch.int8 else torch.int16),
                               want.view(torch.int8 if want.dtype == torch.int8 else torch.int16))
        assert torch.equal(fused.position, plain.position) and torch.equal(fused.valid, plain.valid)
        for out_dtype in DTYPES:
            reads = []
            for partition in (fused, plain):
                buffer = torch.full((2, 3, 15, 16), float("nan"), dtype=out_dtype)  # slots 2..12 of a prefix
                out_v = torch.empty(2, 3, 11, 16, dtype=out_dtype)
                partition.read_all(buffer[:, :, 2:13], out_v)
                reads.append((buffer, out_v))
            assert torch.equal(reads[0][0][:, :, 2:13], reads[1][0][:, :, 2:13])
            assert reads[0][0][:, :, :2].isnan().all() and reads[0][0][:, :, 13:].isnan().all()  # nothing else written
            assert torch.equal(reads[0][1], reads[1][1])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_kivi_whole_writes_and_reads_give_torchs_bits(dtype):
    _check_kivi_library(cpu_kernels.library(), dtype)


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-f16c is an x86 flag")
def test_kivi_without_f16c_converts_fp16_as_the_hardware_does(tmp_path):
    """Built without the F16C instructions, the kernels convert fp16 scales in integer arithmetic: the same bits
    (rounding to nearest even, subnormals, the outward nextafter steps)."""
    flags = (*cpu_kernels.FLAGS, "-mno-f16c")
    lib = cpu_kernels.load(cpu_kernels.build(cpu_kernels.compiler(), tmp_path, flags))
    for dtype in DTYPES:
        _check_kivi_library(lib, dtype)


@needs_kernels
def test_a_partial_write_or_another_scale_dtype_keeps_torchs_kivi():
    """The kernels take whole writes with fp16 scales: a write of some slots, or fp32 scales, go through torch's
    ops (KernelKivi declines), with the same results as a partition without them."""
    from vla_node.kv.partition import KVPartition, PartitionSpec

    kivi = cpu_kernels.kivi_kernels()
    k, v = _kivi_inputs(torch.bfloat16)
    slots = torch.tensor([1, 4, 9])
    fused, plain = _int8_partition(kivi), _int8_partition(None)
    with torch.inference_mode():
        for partition in (fused, plain):
            partition.write(slots, k[:, :, :3], v[:, :, :3], slots, 1)
        assert all(torch.equal(a, b) for a, b in zip(_kivi_storage(fused), _kivi_storage(plain)))
        wide = KVPartition(PartitionSpec("vision", 11, "int8", 2, 3, 16, key_group=4, scale_dtype="fp32"))
        assert not kivi.quantize_kv(k, v, 4, *_kivi_storage(wide))
        assert not kivi.dequantize_kv(*_kivi_storage(wide), 4, torch.empty_like(k), torch.empty_like(v))
        strided = torch.empty(2, 3, 16, 11, dtype=torch.bfloat16).transpose(2, 3)  # D not contiguous
        assert not kivi.dequantize_kv(*_kivi_storage(fused), 4, strided, torch.empty_like(v))


@needs_kernels
def test_a_policy_with_int8_vision_gives_the_same_logits_with_the_kivi_kernels(monkeypatch):
    """MultiRatePolicy over an int8 vision partition, three frames with a tick each: bit for bit the same logits
    with the kernels as with torch's ops."""
    from vla_node.kv.cache_config import CacheConfig
    from vla_node.kv.vision_config import VisionMemoryConfig
    from vla_node.runtime.policy import MultiRatePolicy

    config = preset("tiny")
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (3, 1, config.image_size, config.image_size, 3), dtype=np.uint8)
    state = np.linspace(-1, 1, config.state_dim, dtype=np.float32)

    def run():
        cache = CacheConfig(vision=VisionMemoryConfig(storage_dtype="int8"))
        policy = MultiRatePolicy(build_vla(config, seed=2), cache)
        assert policy.vision.partitions[0].spec.dtype == "int8"
        policy.update_text("keep lane")
        logits = []
        for frame in frames:
            policy.update_vision(policy.prepare_frames(list(frame)), state=state)
            logits.append(policy.action_tick(state).logits)
        return policy, logits

    fused, with_kernels = run()
    assert isinstance(fused.vision.partitions[0].kivi, cpu_kernels.KernelKivi)
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    plain, with_torch = run()
    assert plain.vision.partitions[0].kivi is None
    assert all(np.array_equal(a, b) for a, b in zip(with_kernels, with_torch))


@needs_kernels
def test_kivi_declines_storage_not_laid_out_as_a_partition_keeps_it():
    """Scales of the wrong count or codes of another dtype: KernelKivi declines (it indexes by the layout), and
    nothing is written."""
    kivi = cpu_kernels.kivi_kernels()
    k, v = _kivi_inputs(torch.float32)
    stored = _kivi_storage(_int8_partition(None))
    before = [t.clone() for t in stored]
    short = [stored[0], stored[1][:, :, :2], stored[2][:, :, :2].contiguous(), *stored[3:]]  # 2 key groups of 3
    with torch.inference_mode():
        assert not kivi.quantize_kv(k, v, 4, *short)
        assert not kivi.quantize_kv(k, v, 0, *stored)
        assert not kivi.quantize_kv(k, v, 4, stored[0].float(), *stored[1:])
        assert not kivi.dequantize_kv(*short, 4, torch.empty_like(k), torch.empty_like(v))
    assert all(torch.equal(a, b) for a, b in zip(stored, before))
