"""Steady state allocates no cache storage: once warm, every preallocated tensor of the multi-rate policy
keeps its storage, shape, strides and dtype, and every partition its capacity, through action ticks, full and
partial vision updates, scene cuts and instruction changes."""

import numpy as np
import pytest
import torch

from helpers.model_checks import moving_band_frames as camera_frames
from helpers.model_checks import storage_layout
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy


@pytest.mark.parametrize("policy_name, vision_frames, attention", [
    # vision_frames=1: partial updates write only the changed tokens into the decoder's partition
    ("fifo", 1, "segmented"), ("fifo", 1, "gather"),
    ("fifo", 3, "segmented"), ("quota", 3, "segmented"), ("merge", 3, "segmented"), ("h2o", 3, "segmented"),
    ("tiered", 3, "segmented"), ("tiered", 3, "gather"),
])
def test_steady_state_keeps_every_storage_tensor(policy_name, vision_frames, attention):
    config = preset("tiny").replace(vision_frames=vision_frames, image_size=48, state_slots=3)  # 9 tokens a frame
    cache = CacheConfig(attention=attention, vision=VisionMemoryConfig(policy=policy_name))
    policy = MultiRatePolicy(build_vla(config, seed=3), cache)
    rng = np.random.default_rng(1)
    images = [policy.prepare_frames([f]) for f in camera_frames(6)]
    # warm-up: an instruction, a full window of frames, a full ring of states
    policy.update_text("keep lane")
    for i in range(vision_frames + 1):
        policy.update_vision(images[i])
        policy.action_tick(rng.normal(size=4))
    for _ in range(config.state_slots):
        policy.action_tick(rng.normal(size=4))
    before = storage_layout(policy)
    assert len(before[0]) >= 3 * 2 + 4  # k and v of three partitions at least, plus the staging tensors

    partial_updates = 0
    for step in range(8):
        for _ in range(2):
            chunk = policy.action_tick(rng.normal(size=4))
            assert np.isfinite(chunk.actions).all()
        frame = images[step % len(images)]
        policy.update_vision(frame)  # full refresh
        changed = torch.from_numpy(rng.choice(config.tokens_per_camera, size=3, replace=False)).long()
        update = policy.update_vision(frame, [changed])  # partial refresh of 3 tokens
        partial_updates += not update.full
        if step == 4:
            policy.update_vision(images[0], scene_cut=True)
        if step in (3, 6):
            policy.update_text("exit; merge left" if step == 3 else "keep lane")
        assert storage_layout(policy) == before, f"storage changed at step {step}"
    if vision_frames == 1:
        assert partial_updates == 8  # the decoder-side partial path really ran
    assert policy.state_count > 20 and policy.frame_count > 16
