"""The action tick decoded in its frame's vision pass (update_vision with the ego state) against the two stages."""

import copy

import numpy as np
import pytest
import torch

from helpers.model_checks import frames_and_states
from helpers.numerics import assert_same_bins, assert_within, bf16_ulp
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy, StageAborted
from vla_node.runtime.reference import ReferencePolicy
from vla_node.runtime.reuse import ReuseConfig

INT8_TEXT = CacheConfig(text_dtype="int8", vision=VisionMemoryConfig(storage_dtype="fp32"))  # float vision: exact
FLOAT_VISION = CacheConfig(vision=VisionMemoryConfig(storage_dtype="bf16"))


# 16 tokens per camera, so that a partial update recomputes some of them (the reuse gate's, a drift sample)
SIXTEEN = preset("tiny").replace(image_size=64)
REUSE = {"shared drift": ReuseConfig(shared_drift_samples=2),
         "attend all + drift gates": ReuseConfig(shared_drift_samples=0, decoder_drift_threshold=0.05,
                                                  tower_drift_threshold=0.05)}


def twins(cache, config=SIXTEEN, dtype=torch.float32, reuse=REUSE["shared drift"]):
    model = build_vla(config, seed=3)
    return (MultiRatePolicy(copy.deepcopy(model), cache, dtype, reuse=reuse),
            MultiRatePolicy(copy.deepcopy(model), cache, dtype, reuse=reuse))


def storage(policy):
    return [t.clone() for p in (policy.text, *policy.vision.partitions, policy.action)
            for t in p._data_tensors() + p._scale_tensors() + p._metadata_tensors()]


def run_both(fused, separate, steps=6):
    """Frames through both policies: full refreshes and partial ones, one ordinary tick after each; yields
    (partial, fused chunk, separate chunk) of every step."""
    for policy in (fused, separate):
        policy.update_text("follow the lane")
    for i, (frame, state) in enumerate(frames_and_states(steps)):
        images = fused.prepare_frames([frame])
        tokens = None if i % 2 == 0 else [torch.tensor([0, 3, 9])]
        update = fused.update_vision(images, tokens, state=state)
        assert update.chunk is not None, i
        assert separate.update_vision(images, tokens).chunk is None  # no state: the tick is the caller's
        if tokens is not None:  # some rows recomputed, not all
            assert 0 < fused._frame_tokens.staged_rows[0] < SIXTEEN.tokens_per_camera
        yield tokens is not None, update.chunk, separate.action_tick(state)
        yield tokens is not None, fused.action_tick(-state), separate.action_tick(-state)


# The fused tick's rows join its frame's matmuls (T + tick rows), the separate stages run T rows, then the tick's:
# the BLAS may pick its kernel by the row count, so the two agree to float rounding, not bit for bit. At these
# logits (|logit| < 1: at most 6e-8 an fp32 step) a few steps a layer are < 1e-6 (measured with other summation
# orders: 7e-7 at most); a frame's K/V stored in bf16 may also land on the neighbouring bf16 value (at most 2^-7
# relative), which moves the logits by about 1e-6 (estimated): 1e-5 holds both.
TICK_ATOL = 1e-5


def assert_same_storage(fused, separate):
    """The two caches agree: float tensors to the rounding of their dtype (bf16: one step of the largest magnitude,
    where a value rounded from slightly different fp32 ones lands on a neighbour; fp32: TICK_ATOL), the rest
    (codes, positions, counts) exactly."""
    for x, y in zip(storage(fused), storage(separate)):
        if y.dtype == torch.bfloat16:
            assert_within(x.float(), y.float(), bf16_ulp(y), "bf16 storage")
        elif y.dtype.is_floating_point:
            assert_within(x, y, TICK_ATOL, f"{y.dtype} storage")
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("reuse", list(REUSE.values()), ids=list(REUSE))
@pytest.mark.parametrize("cache", [CacheConfig.exact(), FLOAT_VISION, INT8_TEXT], ids=["fp32", "bf16", "int8-text"])
def test_with_float_vision_storage_the_fused_tick_equals_update_then_tick(cache, reuse):
    """To float rounding, after a full refresh and a partial one (a layer's matmul over the frame's rows plus the
    tick's may round differently than over the frame's rows alone: TICK_ATOL)."""
    fused, separate = twins(cache, reuse=reuse)
    for _, a, b in run_both(fused, separate):
        assert_within(a.logits, b.logits, TICK_ATOL, "logits")
        assert_same_bins(a, b, TICK_ATOL)
    assert_same_storage(fused, separate)  # the same cache after all that, the states' K/V included
    assert (fused.frame_count, fused.state_count) == (separate.frame_count, separate.state_count)


def test_with_int8_vision_storage_the_fused_tick_sees_the_frame_before_quantization():
    """INT8 (the default): the fused tick attends to the frame's K/V as computed, the separate one to them
    dequantized; the stored frame is the same and the actions agree."""
    fused, separate = twins(CacheConfig(text_dtype="fp32", action_dtype="fp32"))
    exact = MultiRatePolicy(build_vla(preset("tiny"), seed=3), CacheConfig.exact())
    exact.update_text("follow the lane")
    diffs = []
    for step, (_, a, b) in enumerate(run_both(fused, separate)):
        diffs.append((a.logits - b.logits).abs().max().item())
        assert diffs[-1] <= 5e-3, step
        assert_same_bins(a, b, 5e-3)
    assert max(diffs[::2]) > 0  # the fused ticks differ (the ordinary ticks after them barely)
    # the same stored frame, up to the rounding of its K/V: computed over the frame's rows plus the tick's (fused)
    # or the frame's alone, a K/V on the edge between two int8 codes may take the neighbouring one
    for name in ("k", "v"):
        codes = [getattr(p, name).int() for p in (fused.vision.partitions[0], separate.vision.partitions[0])]
        assert int((codes[0] - codes[1]).abs().max()) <= 1, name


def test_the_fused_tick_equals_the_reference_step():
    config = preset("tiny").replace(state_slots=2)
    policy = MultiRatePolicy(build_vla(config, seed=5), CacheConfig.exact())
    reference = ReferencePolicy(build_vla(config, seed=5))
    policy.update_text("follow the lane")
    for frame, state in frames_and_states(5):
        ours = policy.update_vision(policy.prepare_frames([frame]), state=state).chunk
        theirs = reference.step([frame], "follow the lane", state)
        assert (ours.logits - theirs.logits).abs().max().item() <= 1e-4
        assert_same_bins(ours, theirs, 1e-4)


@pytest.mark.parametrize("why", ["window", "autoregressive", "no prefix buffer", "h2o"])
def test_where_the_tick_cannot_join_the_frame_the_update_leaves_it_to_the_caller(why):
    config, cache = preset("tiny"), CacheConfig()
    if why == "window":
        config = config.replace(vision_frames=2)
    elif why == "autoregressive":
        config = config.replace(action_decode="autoregressive")
    elif why == "no prefix buffer":
        cache = CacheConfig(tick_prefix=False)
    else:
        cache = CacheConfig(vision=VisionMemoryConfig(policy="h2o"))
    policy = MultiRatePolicy(build_vla(config, seed=1), cache)
    policy.update_text("go")
    frame, state = next(frames_and_states(1))
    assert policy.update_vision(policy.prepare_frames([frame]), state=state).chunk is None
    assert policy.state_count == 0


@pytest.mark.parametrize("decode", ["parallel", "autoregressive"])
def test_a_tick_run_without_committing_changes_nothing_and_equals_the_next_tick(decode):
    """commit=False (the node's timing run of the action stage, after a frame whose tick ran in its pass): the chunk
    the committed tick then gives, and nothing changed: a twin that never ran it gives the same chunks, bit for
    bit. Timed after a frame's commit (stored states stale: the fused block) and after a tick (the plain block)."""
    timed, plain = twins(CacheConfig(text_dtype="fp32", action_dtype="fp32"),
                         SIXTEEN.replace(action_decode=decode))
    for policy in (timed, plain):
        policy.update_text("follow the lane")
    for i, (frame, state) in enumerate(frames_and_states(4)):
        images = timed.prepare_frames([frame])
        tokens = None if i % 2 == 0 else [torch.tensor([0, 3, 9])]
        for policy in (timed, plain):
            update = policy.update_vision(images, tokens, state=state)
            if update.chunk is None:  # autoregressive: the tick is the caller's
                policy.action_tick(state)
        for tick_state in (state, -state):
            before, prefix = storage(timed), prefix_part(timed._prefix)
            counts = (timed.frame_count, timed.state_count)
            dry = timed.action_tick(tick_state, commit=False)
            assert all(torch.equal(x, y) for x, y in zip(before, storage(timed)))
            assert all(torch.equal(x, y) for x, y in zip(prefix, prefix_part(timed._prefix)))
            assert (timed.frame_count, timed.state_count) == counts
            committed, expected = timed.action_tick(tick_state), plain.action_tick(tick_state)
            for chunk in (dry, committed):
                assert torch.equal(chunk.logits, expected.logits) and np.array_equal(chunk.bins, expected.bins)


def test_a_flow_tick_always_commits():
    policy = MultiRatePolicy(build_vla(preset("tiny").replace(action_head="flow", flow_steps=2), seed=1),
                             CacheConfig())
    policy.update_text("go")
    frame, state = next(frames_and_states(1))
    policy.update_vision(policy.prepare_frames([frame]))
    with pytest.raises(ValueError, match="commit=False"):
        policy.action_tick(state, commit=False)
    assert policy.state_count == 0


def test_a_bad_state_is_refused_before_anything_runs():
    policy = MultiRatePolicy(build_vla(preset("tiny"), seed=1), CacheConfig())
    policy.update_text("go")
    frame, _ = next(frames_and_states(1))
    before = storage(policy)
    with pytest.raises(ValueError, match="state"):
        policy.update_vision(policy.prepare_frames([frame]), state=np.zeros(3, np.float32))
    assert policy.frame_count == 0 and all(torch.equal(x, y) for x, y in zip(before, storage(policy)))


def prefix_part(buffer):
    """The prefix buffer's text and vision part (behind it: the per-tick state ring and block, scratch)."""
    n = buffer.prefix_tokens
    return [buffer.k[:, :, :n].clone(), buffer.v[:, :, :n].clone(), buffer.bias[:, :n].clone()]


def test_an_update_that_fails_before_its_pass_leaves_the_prefix_buffer_as_it_was():
    """On an empty vision memory the prefix buffer masks every vision slot: a failed update must not unmask them."""
    policy = MultiRatePolicy(build_vla(preset("tiny"), seed=1), CacheConfig())
    policy.update_text("go")
    frame, state = next(frames_and_states(1))
    before = prefix_part(policy._prefix)
    with pytest.raises(RuntimeError):  # not [C, S, S, 3]: refused after the state was taken
        policy.update_vision(policy.prepare_frames([frame])[0], state=state)
    assert all(torch.equal(x, y) for x, y in zip(before, prefix_part(policy._prefix)))
    assert torch.isneginf(policy._prefix.bias[0, policy.text.capacity : policy._prefix.prefix_tokens]).all()


@pytest.mark.parametrize("stop_at", [0.25, 0.6, 0.8])  # in the tower; after one and two of three decoder layers
def test_a_stopped_fused_stage_leaves_cache_prefix_and_states_as_they_were(stop_at):
    fused, separate = twins(CacheConfig(text_dtype="fp32", action_dtype="fp32"), preset("tiny").replace(num_layers=3))
    steps = list(frames_and_states(3))
    for policy in (fused, separate):
        policy.update_text("follow the lane")
        policy.update_vision(policy.prepare_frames([steps[0][0]]), state=steps[0][1])
        policy.action_tick(steps[0][1])
    before = storage(fused)
    prefix = prefix_part(fused._prefix)
    with pytest.raises(StageAborted):  # the decoder (the second half) wrote the frame into the prefix buffer
        fused.update_vision(fused.prepare_frames([steps[1][0]]), check=lambda f: f < stop_at, state=steps[1][1])
    assert all(torch.equal(x, y) for x, y in zip(before, storage(fused)))
    assert all(torch.equal(x, y) for x, y in zip(prefix, prefix_part(fused._prefix)))
    assert (fused.frame_count, fused.state_count) == (1, 2)
    # and it goes on exactly as a policy that never saw the stopped frame
    a = fused.update_vision(fused.prepare_frames([steps[2][0]]), state=steps[2][1]).chunk
    b = separate.update_vision(separate.prepare_frames([steps[2][0]]), state=steps[2][1]).chunk
    assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("fails", ["to_values", "non-finite state K/V"])
def test_a_failure_after_the_pass_and_before_the_commit_leaves_everything_as_it_was(fails, monkeypatch):
    fused, separate = twins(CacheConfig(text_dtype="fp32", action_dtype="fp32"))
    steps = list(frames_and_states(3))
    for policy in (fused, separate):
        policy.update_text("follow the lane")
        policy.update_vision(policy.prepare_frames([steps[0][0]]), state=steps[0][1])
    before = storage(fused)
    with monkeypatch.context() as patch:
        if fails == "to_values":
            patch.setattr(fused.bins, "to_values", lambda bins: (_ for _ in ()).throw(RuntimeError("to_values")))
        else:  # the tick's K/V checked before the frame is committed
            patch.setattr(fused, "_tick_bins", lambda hidden: (fused._stage_k.fill_(float("nan")),
                                                                np.zeros((4, 2), np.int64))[1])
        with pytest.raises((RuntimeError, ValueError)):
            fused.update_vision(fused.prepare_frames([steps[1][0]]), state=steps[1][1])
    assert all(torch.equal(x, y) for x, y in zip(before, storage(fused)))
    assert (fused.frame_count, fused.state_count) == (1, 1)
    a = fused.update_vision(fused.prepare_frames([steps[2][0]]), state=steps[2][1]).chunk  # goes on as if never
    b = separate.update_vision(separate.prepare_frames([steps[2][0]]), state=steps[2][1]).chunk
    assert torch.equal(a.logits, b.logits)
