"""Multi-rate decoding over the KV cache against the reference path (full recompute)."""

import pytest
import torch

from helpers.model_checks import assert_incremental_equals_reference, frames_and_states
from helpers.numerics import assert_same_bins
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy, StageAborted
from vla_node.runtime.reference import ReferencePolicy


@pytest.mark.parametrize("decode", ["parallel", "autoregressive"])
@pytest.mark.parametrize("attention", ["segmented", "gather"])
@pytest.mark.parametrize("tick_prefix", [True, False])
def test_incremental_equals_reference_with_instruction_change(decode, attention, tick_prefix):
    config = preset("tiny").replace(vision_frames=3, state_slots=2, action_decode=decode)
    cache = CacheConfig(text_dtype="fp32", action_dtype="fp32", attention=attention, tick_prefix=tick_prefix,
                        vision=VisionMemoryConfig(storage_dtype="fp32"))
    assert_incremental_equals_reference(MultiRatePolicy(build_vla(config, seed=5), cache),
                                        ReferencePolicy(build_vla(config, seed=5)))


def test_a_parallel_tick_longer_than_every_other_block_fits_the_gather_workspace():
    """Without the prefix buffer, a parallel tick's block is the state plus H*D queries: 1 + 24 rows here, more
    than the 24 text slots (the longest other block)."""
    config = preset("tiny").replace(action_horizon=12)
    cache = CacheConfig(text_dtype="fp32", action_dtype="fp32", attention="gather", tick_prefix=False,
                        vision=VisionMemoryConfig(storage_dtype="fp32"))
    assert 1 + config.action_tokens > max(config.tokens_per_frame, config.max_text_tokens, config.state_slots)
    assert_incremental_equals_reference(MultiRatePolicy(build_vla(config, seed=5), cache),
                                        ReferencePolicy(build_vla(config, seed=5)))


@pytest.mark.parametrize("decode", ["parallel", "autoregressive"])
@pytest.mark.parametrize("window", [1, 2])  # 1: the decoder's frame-token cache; 2: a plain frame block
def test_a_stage_reports_the_fraction_of_the_whole_stage_done(decode, window):
    """The pipeline asks at each check whether the rest of the stage (1 - fraction) still fits: the fractions a
    stage reports must only grow, from 0 to below 1, across its towers, its decoder blocks and its queries."""
    config = preset("tiny").replace(vision_frames=window, num_cameras=2, action_decode=decode)
    policy = MultiRatePolicy(build_vla(config, seed=1), CacheConfig())
    frames = list(frames_and_states(3))

    def fractions(stage) -> list[float]:
        seen = []
        stage(lambda fraction: seen.append(fraction) or True)
        assert seen and seen[0] == 0.0 and all(a <= b for a, b in zip(seen, seen[1:])) and seen[-1] < 1.0, seen
        return seen

    fractions(lambda check: policy.update_text("go", check))
    for frame, state in frames[:2]:
        vision = fractions(lambda check: policy.update_vision(policy.prepare_frames([frame, frame]), check=check))
        assert 0.5 in vision and max(vision) > 0.5  # the towers, then the decoder
        fractions(lambda check: policy.action_tick(state, check))
    text = fractions(lambda check: policy.update_text("stop", check))  # the text, then the cached frames
    assert max(text) > 0.5


def test_aborted_stages_leave_the_cache_unchanged():
    config = preset("tiny").replace(vision_frames=2)
    policy = MultiRatePolicy(build_vla(config, seed=1), CacheConfig())
    policy.update_text("go")
    frames = list(frames_and_states(3))
    policy.update_vision(policy.prepare_frames([frames[0][0]]))
    policy.action_tick(frames[0][1])
    def cache_state():
        partitions = [policy.text, *policy.vision.partitions, policy.action]
        return [t.clone() for p in partitions for t in p._data_tensors() + p._scale_tensors() + p._metadata_tensors()]

    before = cache_state()
    counters = (policy.frame_count, policy.state_count, list(policy._frame_ids))
    for stage in (lambda check: policy.update_text("stop now", check),
                  lambda check: policy.update_vision(policy.prepare_frames([frames[1][0]]), check=check),
                  lambda check: policy.action_tick(frames[1][1], check)):
        budget = iter([True, False])  # stop at the second budget check of each stage
        with pytest.raises(StageAborted):
            stage(lambda fraction: next(budget))
        assert all(torch.equal(a, b) for a, b in zip(before, cache_state()))
        assert (policy.frame_count, policy.state_count, policy._frame_ids) == counters


def test_stale_states_survive_an_aborted_tick_and_the_next_tick_recomputes_them():
    """After a vision commit the stored states are stale until the next tick recomputes them in its block; a tick
    stopped at a budget check changes nothing, and the following one still equals the reference."""
    config = preset("tiny").replace(vision_frames=1, state_slots=3)
    policy = MultiRatePolicy(build_vla(config, seed=4), CacheConfig.exact())
    reference = ReferencePolicy(build_vla(config, seed=4))
    policy.update_text("go")
    steps = list(frames_and_states(4, seed=6))
    for frame, state in steps[:3]:
        policy.update_vision(policy.prepare_frames([frame]))
        policy.action_tick(state)
        reference.step([frame], "go", state)
    frame, state = steps[3]
    policy.update_vision(policy.prepare_frames([frame]))
    assert policy._states_stale
    ring = [t.clone() for t in policy.action.storage_tensors()]
    budget = iter([True, False])
    with pytest.raises(StageAborted):
        policy.action_tick(state, lambda fraction: next(budget))
    assert policy._states_stale and all(torch.equal(a, b) for a, b in zip(ring, policy.action.storage_tensors()))
    ours, theirs = policy.action_tick(state), reference.step([frame], "go", state)
    assert not policy._states_stale
    assert (ours.logits - theirs.logits).abs().max().item() <= 1e-4
    assert_same_bins(ours, theirs, 1e-4)  # other kernels than the reference's: equal bins but at a near tie


def test_partial_refresh_of_every_token_equals_full_refresh():
    config = preset("tiny").replace(vision_frames=1)
    full = MultiRatePolicy(build_vla(config, seed=2), CacheConfig.exact())
    partial = MultiRatePolicy(build_vla(config, seed=2), CacheConfig.exact())
    every = [torch.arange(config.tokens_per_camera)]
    for policy in (full, partial):
        policy.update_text("keep lane")
    for i, (frame, state) in enumerate(frames_and_states(5, seed=3)):
        images = full.prepare_frames([frame])
        update = partial.update_vision(images, every)
        assert update.full == (i == 0) and update.tokens_refreshed == config.tokens_per_frame
        full.update_vision(images)
        a, b = partial.action_tick(state), full.action_tick(state)
        assert (a.logits - b.logits).abs().max().item() <= 1e-4
        assert_same_bins(a, b, 1e-4)  # other row counts through the matmuls: equal bins but at a near tie


def test_static_scene_reuses_everything_and_keeps_outputs():
    config = preset("tiny").replace(vision_frames=1, state_slots=1)  # one state slot: every tick sees one state
    policy = MultiRatePolicy(build_vla(config, seed=2), CacheConfig())
    policy.update_text("keep lane")
    frame, state = next(frames_and_states(1))
    images = policy.prepare_frames([frame])
    policy.update_vision(images, [torch.arange(config.tokens_per_camera)])
    first = policy.action_tick(state)
    for _ in range(3):
        update = policy.update_vision(images, [torch.zeros(0, dtype=torch.long)])
        assert update.tokens_refreshed == 0 and update.reuse_ratio == 1.0 and not update.full
        again = policy.action_tick(state)
        assert torch.equal(again.logits, first.logits)


def test_drift_thresholds_from_the_reuse_config_recompute_more_tokens():
    from vla_node.runtime.reuse import ReuseConfig

    config = preset("tiny").replace(vision_frames=1, image_size=64)  # 16 tokens a frame
    # any drift at all; no shared-drift sample, so that only the gate's token and the drifted ones are recomputed
    reuse = ReuseConfig(tower_drift_threshold=1e-6, decoder_drift_threshold=1e-6, shared_drift_samples=0)
    gated = MultiRatePolicy(build_vla(config, seed=2), CacheConfig(), reuse=reuse)
    plain = MultiRatePolicy(build_vla(config, seed=2), CacheConfig(), reuse=ReuseConfig(shared_drift_samples=0))
    assert gated.tower_cache.drift_threshold == 1e-6 and gated._frame_tokens.drift_threshold == 1e-6
    frames = [frame for frame, _ in frames_and_states(2, seed=4)]
    one = [torch.tensor([0])]
    for policy in (gated, plain):
        policy.update_text("keep lane")
        policy.update_vision(policy.prepare_frames([frames[0]]))
    assert plain.update_vision(plain.prepare_frames([frames[1]]), one).tokens_refreshed == 1
    # token 0 changed; with a near-zero drift threshold every token it influences is recomputed too
    assert gated.update_vision(gated.prepare_frames([frames[1]]), one).tokens_refreshed > 1
