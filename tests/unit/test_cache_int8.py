"""INT8 (KIVI) vision partition on a real MultiRatePolicy: its bytes against the same partition in fp16
(scales included), and the action deviation it causes against the all-fp32 cache."""

import numpy as np
import pytest
import torch

from vla_node.bench.cache import action_deviation, run_lockstep
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.model.action_head import ActionChunk
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy


def small_ish(vision_frames: int = 4):
    """head_dim 64 (as in the small and base presets), 16 tokens a frame."""
    return preset("tiny").replace(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256,
                                  image_size=64, vision_frames=vision_frames)


def road_like_frames(n, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    frames = []
    for i in range(n):
        frame = base.copy()
        frame[(i * 11) % 80 : (i * 11) % 80 + 16] = rng.integers(0, 256, (16, 128, 3), dtype=np.uint8)
        frames.append(frame)
    return frames, [rng.normal(scale=0.5, size=4).astype(np.float32) for _ in range(n)]


def vision_storage_bytes(policy: MultiRatePolicy) -> int:
    """K/V data plus INT8 scales and zero points of every vision partition, counted from the tensors."""
    total = 0
    for p in policy.vision.partitions:
        tensors = [p.k, p.v] + ([p.k_scale, p.k_zero, p.v_scale, p.v_zero] if p.spec.quantized else [])
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


@pytest.mark.parametrize("vision_frames", [4, 3])  # 64 slots: one whole key group; 48: a partial group
def test_int8_vision_partition_takes_at_most_055_of_fp16(vision_frames):
    config = small_ish(vision_frames)
    assert config.head_dim == 64
    model = build_vla(config, seed=7)
    int8 = MultiRatePolicy(model, CacheConfig())  # the default: vision int8
    fp16 = MultiRatePolicy(model, CacheConfig(vision=VisionMemoryConfig(storage_dtype="fp16")))
    frames, states = road_like_frames(vision_frames + 1)
    run_lockstep({"int8": int8, "fp16": fp16}, frames, states)  # both full and in use
    assert int8.vision.partitions[0].spec.dtype == "int8" and fp16.vision.partitions[0].spec.dtype == "fp16"
    assert int8.vision.tokens_used == fp16.vision.tokens_used == vision_frames * config.tokens_per_frame
    int8_bytes, fp16_bytes = int8.kv_bytes()["vision"], fp16.kv_bytes()["vision"]
    assert int8_bytes == vision_storage_bytes(int8)  # kv_bytes counts the scales and zero points
    assert fp16_bytes == vision_storage_bytes(fp16)
    assert int8.vision.partitions[0].nbytes()["scales"] > 0
    ratio = int8_bytes / fp16_bytes
    print(f"vision int8 {int8_bytes} B / fp16 {fp16_bytes} B = {ratio:.4f}")
    assert 0.5 < ratio <= 0.55


def test_int8_action_deviation_against_fp32_is_small(record_property):
    config = small_ish(4)
    model = build_vla(config, seed=7)
    frames, states = road_like_frames(8, seed=1)
    policies = {
        "default": MultiRatePolicy(model, CacheConfig()),  # text bf16, vision int8, action fp32
        "vision_int8": MultiRatePolicy(model, CacheConfig(text_dtype="fp32")),  # only the vision partition lossy
        "exact": MultiRatePolicy(model, CacheConfig.exact()),
    }
    runs = run_lockstep(policies, frames, states)
    for name in ("default", "vision_int8"):
        dev = action_deviation(runs[name].chunks, runs["exact"].chunks, config)
        record_property(f"{name}_deviation", dev)
        print(name, dev)
        assert dev["finite"] and dev["steps"] == len(frames)
        assert dev["max_abs_logit_diff"] > 0.0  # INT8 is lossy: a zero would mean it was not quantized
        assert dev["logits_rel_l2"] < 0.02  # measured ~1e-3
        assert dev["top1_agreement"] >= 0.9  # measured 0.98: random weights give near-ties between bins
        assert dev["action_diff_pct_of_range_max"] <= 100.0


def test_action_deviation_measures_what_it_says():
    config = small_ish(1)
    bins = np.array([[3, 5]] * config.action_horizon)  # [H, D]
    logits = torch.zeros(config.action_tokens, config.vocab_size)
    same = ActionChunk(np.zeros((config.action_horizon, 2), np.float32), bins, logits)
    moved_logits = logits.clone()
    moved_logits[0, 0] = 0.5
    moved_actions = np.zeros((config.action_horizon, 2), np.float32)
    moved_actions[0, 1] = 0.5  # a quarter of the [-1, 1] range
    moved_bins = bins.copy()
    moved_bins[0, 1] = 9
    moved = ActionChunk(moved_actions, moved_bins, moved_logits)
    zero = action_deviation([same, same], [same, same], config)
    assert zero["max_abs_logit_diff"] == 0.0 and zero["top1_agreement"] == 1.0
    assert zero["action_diff_pct_of_range_max"] == 0.0 and zero["logits_rel_l2"] == 0.0 and zero["finite"]
    dev = action_deviation([moved, same], [same, same], config)
    assert dev["max_abs_logit_diff"] == pytest.approx(0.5)
    assert dev["top1_agreement"] == pytest.approx(1 - 1 / (2 * bins.size))
    assert dev["action_diff_pct_of_range_max"] == pytest.approx(25.0)
