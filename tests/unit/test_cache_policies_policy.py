"""Every vision-memory policy inside the multi-rate policy, with vision_frames=3, through a sequence with an
instruction change and a scene cut.

- Each policy in a lossless setting (fp32 storage; knobs that keep every token) equals the reference path,
  whose frame history is flushed at the same scene cut: the policies' plumbing (importance tracking, a hot
  tier, merge bias) adds nothing to the result. (tests/unit/test_multirate.py covers fifo without a scene cut.)
- Each policy in a lossy setting (the default int8 storage, knobs that evict / merge / demote) stays
  finite, keeps its kv bytes and stays inside its capacity and window, and really does what it says.
"""

import numpy as np
import pytest
import torch

from helpers.numerics import assert_same_bins
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reference import ReferencePolicy

WINDOW = 3
STEPS = 9
INSTRUCTION_CHANGE_AT = 3
SCENE_CUT_AT = 6


def tiny_config():
    return preset("tiny").replace(vision_frames=WINDOW, state_slots=2, image_size=48)  # 9 tokens a frame


def sequence(seed=0):
    """STEPS (frame, state, instruction, scene_cut): a moving band over one background, then a cut to
    another background."""
    rng = np.random.default_rng(seed)
    backgrounds = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(2)]
    out = []
    for i in range(STEPS):
        frame = backgrounds[i >= SCENE_CUT_AT].copy()
        frame[(i * 7) % 40 : (i * 7) % 40 + 8] = rng.integers(0, 256, (8, 64, 3), dtype=np.uint8)
        instruction = "follow the lane" if i < INSTRUCTION_CHANGE_AT else "exit; merge left"
        out.append((frame, rng.normal(size=4).astype(np.float32), instruction, i == SCENE_CUT_AT))
    return out


def drive(policy: MultiRatePolicy, on_step=None):
    """Run the sequence through the policy: text on a change, a full vision update, one action tick."""
    instruction = None
    chunks = []
    for i, (frame, state, text, cut) in enumerate(sequence()):
        if text != instruction:
            policy.update_text(text)
            instruction = text
        policy.update_vision(policy.prepare_frames([frame]), scene_cut=cut)
        chunks.append(policy.action_tick(state))
        if on_step is not None:
            on_step(i, policy)
    return chunks


LOSSLESS = {
    "fifo": dict(),
    "quota": dict(quota_decay=1.0),  # every age keeps all its tokens
    "merge": dict(merge_threshold=1.0),  # nothing is more similar than 1.0: no merges (log-count bias 0)
    "h2o": dict(),  # the default capacity holds the full window: importance is tracked, nothing evicted early
    "tiered": dict(hot_dtype="fp32"),  # hot and cold tiers both fp32: demotion moves tokens losslessly
}


@pytest.mark.parametrize("policy_name", sorted(LOSSLESS))
def test_lossless_policy_equals_reference_across_instruction_change_and_scene_cut(policy_name):
    config = tiny_config()
    vision = VisionMemoryConfig(policy=policy_name, storage_dtype="fp32", window_frames=WINDOW,
                                tokens_per_frame=config.tokens_per_frame, **LOSSLESS[policy_name])
    policy = MultiRatePolicy(build_vla(config, seed=11),
                             CacheConfig(text_dtype="fp32", action_dtype="fp32", vision=vision))
    reference = ReferencePolicy(build_vla(config, seed=11))
    ours = drive(policy)
    for i, (frame, state, text, cut) in enumerate(sequence()):
        if cut:
            reference.frames = [None] * config.vision_frames  # the reference's window flushed at the cut
        theirs = reference.step([frame], text, state)
        diff = (ours[i].logits - theirs.logits).abs().max().item()
        assert diff <= 1e-4, (policy_name, i, diff)
        assert_same_bins(ours[i], theirs, 1e-4)  # other kernels than the reference's: equal but at a near tie
    stats = policy.vision.stats()
    assert stats["scene_cut_flushes"] == 1 and stats["merged_tokens"] == 0
    if policy_name == "tiered":
        assert stats["demoted_tokens"] > 0  # the hot tier really handed frames to the cold one


def lossy_vision(policy_name: str, tokens_per_frame: int) -> VisionMemoryConfig:
    knobs = {
        "fifo": dict(),
        "quota": dict(quota_decay=0.5, quota_min_tokens=2),  # 9, 4, 2 tokens by age
        "merge": dict(merge_threshold=0.3),  # low enough that tokens do merge with these random weights
        "h2o": dict(capacity_tokens=2 * tokens_per_frame),  # two frames' room for a three-frame window
        "tiered": dict(),  # hot bf16 (one frame), cold int8
    }[policy_name]
    return VisionMemoryConfig(policy=policy_name, window_frames=WINDOW, tokens_per_frame=tokens_per_frame, **knobs)


@pytest.mark.parametrize("policy_name", ["fifo", "quota", "merge", "h2o", "tiered"])
def test_lossy_policy_stays_finite_and_bounded(policy_name):
    config = tiny_config()
    tpf = config.tokens_per_frame
    vision = lossy_vision(policy_name, tpf)
    policy = MultiRatePolicy(build_vla(config, seed=11), CacheConfig(vision=vision))
    assert policy.vision.partitions[0].spec.dtype == "int8"
    kv_at_start = policy.kv_bytes()
    capacity = sum(p.capacity for p in policy.vision.partitions)
    seen = []

    def check(i, p: MultiRatePolicy):
        assert p.kv_bytes() == kv_at_start, i  # preallocated: never grows
        assert p.vision.tokens_used <= capacity and len(p.vision.history) <= WINDOW, i
        for part in p.vision.partitions:
            used = part.frame_id[part.valid]
            assert used.numel() == 0 or int(used.min()) > i - WINDOW, i  # nothing older than the window
        if i == SCENE_CUT_AT:
            assert p.vision.history == [i]  # the cut flushed every older frame
            assert torch.all(p.vision.partitions[0].frame_id[p.vision.partitions[0].valid] == i)
        seen.append(p.vision.tokens_used)

    chunks = drive(policy, check)
    for chunk in chunks:
        assert torch.isfinite(chunk.logits).all() and np.isfinite(chunk.actions).all()
    stats = policy.vision.stats()
    assert stats["scene_cut_flushes"] == 1
    full_window = WINDOW * tpf
    expected_most = {"fifo": full_window, "quota": tpf + 4 + 2, "merge": full_window,
                     "h2o": 2 * tpf, "tiered": full_window}[policy_name]
    if policy_name == "merge":
        assert stats["merged_tokens"] > 0 and max(seen) <= expected_most
    else:
        assert max(seen) == expected_most
    if policy_name in ("quota", "h2o"):  # a full window holds fewer tokens than three whole frames
        assert min(seen[WINDOW:SCENE_CUT_AT]) == expected_most < full_window
    if policy_name == "tiered":
        assert stats["demoted_tokens"] > 0
