"""The fused attention kernel (torch's SDPA) where it pays: the same attention as the matmuls and softmax it replaces,
chosen by the CPU, and wired through the whole cache."""

import numpy as np
import pytest
import torch

from helpers.numerics import assert_same_bins, assert_within, bf16_ulp
from vla_node.backends import cpu_kernels
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vision import fused_attention, softmax_attention
from vla_node.model.vla import build_vla
from vla_node.runtime import policy as policy_module
from vla_node.runtime.policy import MultiRatePolicy, fused_attention_pays
from vla_node.runtime.reuse import ReuseConfig


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.03)])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_the_towers_fused_attention_equals_softmax_attention(dtype, tol, batch):
    """[H, n, hd] (the tower cache's, given a batch dim for SDPA's flash kernel) and [N, H, n, hd], against the fp64
    value: each within its dtype's rounding, neither further than the other's error allows."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*batch, 6, rows, 64, generator=g) for rows in (9, 40, 40))
    exact = softmax_attention(q.double(), k.double(), v.double())
    fused = fused_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert fused.shape == (*batch, 6, 9, 64) and fused.dtype == dtype
    for out in (fused, softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype))):
        assert float((out.double() - exact).abs().max()) < tol


def test_fused_attention_runs_only_where_it_measured_faster(monkeypatch):
    """SDPA where oneDNN runs AMX, unless the CPU kernels run on AMX tiles themselves (their attention then)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for amx, kernel_tiles in ((True, False), (False, False), (True, True), (False, True)):
        monkeypatch.setattr(policy_module, "onednn_runs_amx", lambda amx=amx: amx)
        monkeypatch.setattr(cpu_kernels, "amx_tiles", lambda tiles=kernel_tiles: tiles)
        assert fused_attention_pays(torch.bfloat16, cpu) is (amx and not kernel_tiles)
        assert not fused_attention_pays(torch.float32, cpu)  # fp32: the matmuls the parity tests pinned
        assert not fused_attention_pays(torch.bfloat16, cuda)


def test_a_policy_on_the_fused_kernel_decodes_as_on_the_matmuls(monkeypatch):
    """Every attention of the cache (the tower cache's, the frame pass's, the tick's over the prefix buffer) on the
    fused kernel: a full frame with its tick, a partial frame (the reuse path) and a tick alone give the chunks the
    matmul path gives, to bf16 rounding: logits within 2% of their norm and within a few bf16 steps each, bins the
    same but at near ties (random weights: flat logits)."""
    config = preset("tiny").replace(image_size=64)
    model = build_vla(config, seed=3).to(torch.bfloat16)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2)]
    frames[1][:16] = frames[0][:16]  # the top rows of patches unchanged: a partial update
    state = np.ones(config.state_dim, np.float32)
    chunks = {}
    for fused in (True, False):
        monkeypatch.setattr(policy_module, "fused_attention_pays", lambda dtype, device, fused=fused: fused)
        policy = MultiRatePolicy(model, CacheConfig(), torch.bfloat16, reuse=ReuseConfig(shared_drift_samples=2))
        assert policy.fused_attention is fused and policy._prefix.fused is fused and policy._workspace.fused is fused
        assert policy.tower_cache.attention is (fused_attention if fused else softmax_attention)
        policy.update_text("follow the lane")
        tokens = torch.arange(8, 16)  # the patches below the unchanged rows
        chunks[fused] = [policy.update_vision(policy.prepare_frames([frames[0]]), state=state).chunk,
                         policy.update_vision(policy.prepare_frames([frames[1]]), [tokens], state=state).chunk,
                         policy.action_tick(state)]
    for a, b in zip(chunks[True], chunks[False]):
        rel = torch.linalg.vector_norm(a.logits - b.logits) / torch.linalg.vector_norm(b.logits)
        atol = 8 * bf16_ulp(b.logits)
        assert rel.item() < 2e-2
        assert_within(a.logits, b.logits, atol, "logits")
        assert_same_bins(a, b, atol)
