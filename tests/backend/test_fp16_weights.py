"""FP16 weights with FP32 compute (fbgemm): exact against fp16-rounded weights, and the cache stays exact."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import assert_same_bins
from vla_node.backends.fp16_weights import Fp16WeightLinear, fp16_weights_available, use_fp16_weights
from vla_node.backends.packed_weights import packed_weights_available
from vla_node.config import ModelSection
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reference import ReferencePolicy
from vla_node.validate import ConfigError

pytestmark = pytest.mark.skipif(not fp16_weights_available(), reason="fbgemm (x86-64) is not in this torch")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(24,), (5, 24), (2, 3, 24)])
def test_linear_equals_fp32_compute_on_fp16_rounded_weights(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x, linear.weight.half().float(), linear.bias)
    got = Fp16WeightLinear(linear)(x)
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= 1e-5


def test_swap_replaces_every_linear_and_keeps_the_cache_exact():
    """With fp16 weights on both sides, the incremental path still equals the reference (the weights are the
    model; the cache's exactness does not depend on them); against fp32 weights the logits move a little."""
    config = preset("tiny").replace(vision_frames=2)
    model = use_fp16_weights(build_vla(config, seed=3))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    reference, policy = ReferencePolicy(model), MultiRatePolicy(model, CacheConfig.exact())
    fp32 = ReferencePolicy(build_vla(config, seed=3))
    rng = np.random.default_rng(0)
    policy.update_text("follow the lane")
    for _ in range(3):
        frame = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
        state = rng.normal(size=config.state_dim).astype(np.float32)
        policy.update_vision(policy.prepare_frames([frame]))
        ours, theirs = policy.action_tick(state), reference.step([frame], "follow the lane", state)
        assert (ours.logits - theirs.logits).abs().max().item() <= 1e-4
        assert_same_bins(ours, theirs, 1e-4)  # other kernels than the reference's: equal but at a near tie
        full = fp32.step([frame], "follow the lane", state).logits
        rel = torch.linalg.vector_norm(theirs.logits - full) / torch.linalg.vector_norm(full)
        assert 0 < rel.item() < 1e-2


def test_swap_refuses_a_model_that_is_not_fp32():
    with pytest.raises(ValueError, match="fp32 CPU model"):
        use_fp16_weights(build_vla(preset("tiny")).to(torch.bfloat16))


def test_config_names_the_key_and_what_is_allowed():
    assert ModelSection(weights="fp16").resolved_weights == "fp16"
    assert ModelSection(weights="auto").resolved_weights == "fp16"  # fp32 compute on this x86 CPU
    assert ModelSection(weights="auto", dtype="bf16").resolved_weights == ("packed" if packed_weights_available()
                                                                           else "bf16")
    with pytest.raises(ConfigError, match=r"model.weights = 'int4': expected 'fp32', 'fp16', 'packed', 'int8' or 'auto'"):
        ModelSection(weights="int4")
    with pytest.raises(ConfigError, match=r"model.weights = 'fp16': expected 'fp32' with dtype 'bf16'"):
        ModelSection(weights="fp16", dtype="bf16")


def test_auto_dtype_is_bf16_where_the_cpu_has_bf16_hardware(monkeypatch):
    import vla_node.backends.fp16_weights as precision
    import vla_node.backends.packed_weights as packed

    monkeypatch.setattr(packed, "packed_kernels_run", lambda: True)  # as where oneDNN runs bf16 (not under AVX2)
    for has_bf16, dtype, weights in ((True, "bf16", "packed"), (False, "fp32", "fp16")):
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda: has_bf16)
        section = ModelSection(dtype="auto", weights="auto")
        assert (section.resolved_dtype, section.resolved_weights) == (dtype, weights)
    assert ModelSection(dtype="auto", device="cuda").resolved_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"model.dtype = 'int8': expected fp32, bf16, fp16 or auto"):
        ModelSection(dtype="int8")


def test_cpu_has_bf16_reads_the_cpu_flags_and_the_onednn_limit():
    """(tests/unit/test_cpu_features.py checks the rules; this, the name config.py and the benches import.)"""
    from vla_node.backends.fp16_weights import cpu_has_bf16

    head = "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
    avx512 = "fpu sse4_1 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni"
    assert cpu_has_bf16(head + f"flags\t\t: {avx512} avx512_bf16\n", "")
    assert cpu_has_bf16(head + f"flags\t\t: {avx512} avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n", "")
    assert not cpu_has_bf16(head + f"flags\t\t: {avx512}\n", "")  # AVX-512 without bf16
    assert not cpu_has_bf16(head + f"flags\t\t: {avx512} avx512_bf16x\n", "")  # whole flags only
    assert not cpu_has_bf16(head + f"flags\t\t: {avx512} avx512_bf16\n", "AVX2")  # oneDNN limited below bf16
    assert not cpu_has_bf16(head, "")  # no flags line (not x86, or not Linux)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert cpu_has_bf16() == cpu_has_bf16(cpuinfo)  # this machine's flags, this process's limit
