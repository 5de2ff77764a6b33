"""FP16 weights with FP32 compute (fbgemm): exact against fp16-rounded weights, and the cache stays exact."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_node.config import ModelSection
from vla_node.model import build_vla, preset
from vla_node.model.fp16_weights import Fp16WeightLinear, fp16_weights_available, use_fp16_weights
from vla_node.model.packed_weights import packed_weights_available
from vla_node.multirate import CacheConfig, MultiRatePolicy
from vla_node.reference import ReferencePolicy
from vla_node.validate import ConfigError

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not fp16_weights_available(), reason="fbgemm (x86-64) is not in this torch")]


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
        np.testing.assert_array_equal(ours.bins, theirs.bins)
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
    with pytest.raises(ConfigError, match=r"model.weights = 'int4': expected 'fp32', 'fp16', 'packed' or 'auto'"):
        ModelSection(weights="int4")
    with pytest.raises(ConfigError, match=r"model.weights = 'fp16': expected 'fp32' with dtype 'bf16'"):
        ModelSection(weights="fp16", dtype="bf16")


def test_auto_dtype_is_bf16_where_the_cpu_has_bf16_hardware(monkeypatch):
    import vla_node.model.fp16_weights as precision

    for has_bf16, dtype, weights in ((True, "bf16", "packed"), (False, "fp32", "fp16")):
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda: has_bf16)
        section = ModelSection(dtype="auto", weights="auto")
        assert (section.resolved_dtype, section.resolved_weights) == (dtype, weights)
    assert ModelSection(dtype="auto", device="cuda").resolved_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"model.dtype = 'int8': expected fp32, bf16, fp16 or auto"):
        ModelSection(dtype="int8")


def test_cpu_has_bf16_reads_the_cpu_flags():
    from vla_node.model.fp16_weights import cpu_has_bf16

    head = "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
    assert cpu_has_bf16(head + "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert cpu_has_bf16(head + "flags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    assert not cpu_has_bf16(head + "flags\t\t: fpu avx2 avx512f avx512_vnni\n")  # AVX-512 without bf16
    assert not cpu_has_bf16(head + "flags\t\t: fpu avx512_bf16x\n")  # whole flags only
    assert not cpu_has_bf16(head)  # no flags line (not x86, or not Linux)
    assert cpu_has_bf16() == cpu_has_bf16(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
