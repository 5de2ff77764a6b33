"""The reuse caches (vision tower and decoder frame tokens): exact where they must be, staged, and really reusing."""

import numpy as np
import pytest
import torch

from helpers.numerics import assert_within, fp32_tolerance
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla, to_pixels
from vla_node.runtime.policy import MultiRatePolicy, StageAborted
from vla_node.runtime.vision_cache import FrameTokenCache, VisionTokenCache, shared_sample, shift_reused

CONFIG = preset("tiny").replace(image_size=64, vision_frames=1, state_slots=1)  # 16 tokens per frame


def moving(n, seed=0):
    """A still picture with a bright bar walking down it (a few patches change each frame)."""
    rng = np.random.default_rng(seed)
    still = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    for i in range(n):
        frame = still.copy()
        frame[(i * 9) % 56 : (i * 9) % 56 + 8] = 255
        yield frame


def changed_tokens(a, b, patch=16):
    """Tokens (row-major patches) whose pixels differ between a and b."""
    grid = a.shape[0] // patch
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16)).reshape(grid, patch, grid, patch, 3).sum(axis=(1, 3, 4))
    return torch.from_numpy(np.flatnonzero(diff.reshape(-1)))


@torch.inference_mode()
def test_tower_cache_full_refresh_equals_the_tower_and_drift_zero_tracks_it():
    model = build_vla(CONFIG, seed=1)
    frames = list(moving(4))
    exact = VisionTokenCache(model.vision, 1, drift_threshold=0.0)  # every drifted token is recomputed
    for i, frame in enumerate(frames):
        pixels = to_pixels(frame[None])  # [1, 3, S, S]
        tokens = None if i == 0 else changed_tokens(frames[i - 1], frame)
        assert tokens is None or 0 < tokens.numel() < CONFIG.tokens_per_camera
        out = exact.refresh(0, pixels[0], tokens).clone()
        exact.commit()
        torch.testing.assert_close(out, model.vision(pixels)[0], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_tower_cache_reuses_outputs_of_an_unchanged_frame_bit_for_bit_and_stages():
    """Nothing recomputed: the outputs are the cached ones, bit for bit (a copy); some rows recomputed on the same
    frame: the same values to float rounding; a refresh is staged until its commit, which applies it exactly."""
    model = build_vla(CONFIG, seed=1)
    cache = VisionTokenCache(model.vision, 1)
    frame_a, frame_b = list(moving(2))
    pixels_a, pixels_b = to_pixels(frame_a[None])[0], to_pixels(frame_b[None])[0]
    first = cache.refresh(0, pixels_a, None).clone()
    cache.commit()
    again = cache.refresh(0, pixels_a, torch.zeros(0, dtype=torch.long))
    assert torch.equal(again, first) and cache.recomputed_tokens(0) == 0
    cache.commit()
    same = cache.refresh(0, pixels_a, torch.arange(0, CONFIG.tokens_per_camera, 3))  # recompute a third, unchanged
    # a third of the rows through each layer's matmuls against all of them: the BLAS may pick another kernel for
    # the row count (it does on an AMX Xeon), so the same frame agrees to a few fp32 steps a layer, not bit for bit
    assert_within(same, first, fp32_tolerance(first, CONFIG.vision_layers), "a third recomputed")
    cache.discard()
    before = cache.out.clone()
    moved = cache.refresh(0, pixels_b, changed_tokens(frame_a, frame_b)).clone()
    assert torch.equal(cache.out, before)  # staged only
    cache.discard()
    assert torch.equal(cache.out, before)
    assert not torch.allclose(moved, before)  # the changed tokens' outputs move ...
    cache.refresh(0, pixels_b, changed_tokens(frame_a, frame_b))
    cache.commit()
    assert torch.equal(cache.out[0], moved)  # ... and a commit applies exactly what was staged


def test_partial_decoder_run_with_drift_zero_equals_full_refresh():
    """Drift threshold 0 (and no shared-drift sample, which at 16 tokens would cover them all): every token whose
    input moved is recomputed at every layer, so the partial path must equal a full refresh; the tower's first
    layer's queries run for the gate's tokens only."""
    from vla_node.runtime.reuse import ReuseConfig

    model = build_vla(CONFIG, seed=2)
    exact = ReuseConfig(tower_drift_threshold=1e-12, decoder_drift_threshold=1e-12,  # any move
                        shared_drift_samples=0)
    partial = MultiRatePolicy(model, CacheConfig.exact(), reuse=exact)
    full = MultiRatePolicy(model, CacheConfig.exact())
    for policy in (partial, full):
        policy.update_text("keep lane")
    frames = list(moving(5, seed=3))
    state = np.zeros(CONFIG.state_dim, np.float32)
    query_rows = []  # rows through the first tower layer's and the first decoder layer's q_proj
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: query_rows.append(i[0].shape[-2]))
             for layer in (model.vision.encoder.layers[0], model.decoder.model.layers[0])]
    try:
        for i, frame in enumerate(frames):
            images = frame[None]
            tokens = None if i == 0 else [changed_tokens(frames[i - 1], frame)]
            query_rows.clear()
            update = partial.update_vision(images, tokens)
            assert update.full == (i == 0)
            if i > 0:  # the tower's partial path ran (every decoder input moves with the tower's attention, so
                # the decoder recomputes all 16: its partial path is the next test's)
                assert query_rows == [tokens[0].numel(), 16] and tokens[0].numel() < 16, query_rows
            full.update_vision(images)
            a, b = partial.action_tick(state), full.action_tick(state)
            assert (a.logits - b.logits).abs().max().item() <= 1e-4, i
    finally:
        for hook in hooks:
            hook.remove()


@torch.inference_mode()
def test_frame_token_cache_partial_run_equals_a_full_run_with_drift_zero():
    """The decoder's partial path itself: inputs moved only in some rows; with drift threshold 0 the first layer
    recomputes just those rows (their queries by index), and every staged K/V and query equals a full run's."""
    from vla_node.kv.attention import Segment

    model = build_vla(CONFIG, seed=2)
    layers, rope, c = model.decoder.model.layers, model.decoder.rope, CONFIG
    T, gen = c.tokens_per_frame, torch.Generator().manual_seed(0)
    k_text = torch.randn(c.num_layers, c.num_kv_heads, 5, c.head_dim, generator=gen)
    v_text = torch.randn(c.num_layers, c.num_kv_heads, 5, c.head_dim, generator=gen)
    text = lambda layer: Segment(k_text[layer], v_text[layer], None)  # noqa: E731
    positions = torch.tensor(c.vision_positions(0))
    x1 = torch.randn(T, c.hidden_size, generator=gen)
    rows = torch.tensor([1, 6, 11])
    x2 = x1.clone()
    x2[rows] += torch.randn(len(rows), c.hidden_size, generator=gen)
    cache = FrameTokenCache(layers, rope, T, drift_threshold=0.0)
    cache.run(x1, positions, None, text, "go")
    cache.commit()
    seen = []  # rows through the first layer's q_proj: the partial path recomputes the moved ones only
    hook = layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    try:
        cache.run(x2, positions, rows, text, "go")
    finally:
        hook.remove()
    assert seen == [len(rows)]
    fresh = FrameTokenCache(layers, rope, T)
    fresh.run(x2, positions, None, text, "go")
    torch.testing.assert_close(cache.staged_k, fresh.staged_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.staged_v, fresh.staged_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache._stage["q"], fresh._stage["q"], atol=1e-5, rtol=1e-5)


def test_partial_update_without_shared_drift_reuses_and_moves_every_tokens_kv():
    """No drift gate, no shared drift: only the gate's tokens run Q/K/V and the MLP; the result differs from a full
    refresh but every token's K/V moved with its context."""
    from vla_node.runtime.reuse import ReuseConfig

    model = build_vla(CONFIG, seed=4)
    partial = MultiRatePolicy(model, CacheConfig.exact(), reuse=ReuseConfig(shared_drift_samples=0))
    full = MultiRatePolicy(model, CacheConfig.exact())
    for policy in (partial, full):
        policy.update_text("keep lane")
    frames = list(moving(3, seed=5))
    partial.update_vision(frames[0][None])
    full.update_vision(frames[0][None])
    vision_k_before = partial.vision.partitions[0].k.clone()
    tokens = changed_tokens(frames[0], frames[1])
    update = partial.update_vision(frames[1][None], [tokens])
    assert not update.full and update.tokens_refreshed == tokens.numel() < CONFIG.tokens_per_frame
    assert partial._frame_tokens.staged_rows == [tokens.numel()] * (CONFIG.num_layers - 1)  # the last: K/V only
    unchanged = torch.ones(CONFIG.tokens_per_frame, dtype=torch.bool)
    unchanged[tokens] = False
    slots = partial._token_slots[unchanged]
    k_after = partial.vision.partitions[0].k
    assert not torch.equal(k_after[:, :, slots], vision_k_before[:, :, slots])  # reused tokens' K/V follow context


def test_text_change_makes_the_next_vision_update_full_and_exact():
    model = build_vla(CONFIG, seed=6)
    partial = MultiRatePolicy(model, CacheConfig.exact())
    full = MultiRatePolicy(model, CacheConfig.exact())
    frames = list(moving(3, seed=7))
    state = np.zeros(CONFIG.state_dim, np.float32)
    for policy in (partial, full):
        policy.update_text("keep lane")
        policy.update_vision(frames[0][None])
    partial.update_vision(frames[1][None], [changed_tokens(frames[0], frames[1])])
    full.update_vision(frames[1][None])
    for policy in (partial, full):
        policy.update_text("merge left")
    update = partial.update_vision(frames[2][None], [changed_tokens(frames[1], frames[2])])
    assert update.full  # the frame cache was computed against the old instruction
    full.update_vision(frames[2][None])
    a, b = partial.action_tick(state), full.action_tick(state)
    assert (a.logits - b.logits).abs().max().item() <= 1e-4


def test_aborted_partial_update_leaves_both_caches_as_they_were():
    model = build_vla(CONFIG, seed=8)
    policy = MultiRatePolicy(model, CacheConfig())
    policy.update_text("keep lane")
    frames = list(moving(2, seed=9))
    policy.update_vision(frames[0][None])
    frame_cache = policy._frame_tokens
    snapshot = [t.clone() for t in (policy.tower_cache.out, policy.tower_cache.mlp_out, frame_cache.k,
                                    frame_cache.mlp_out, policy.vision.partitions[0].k)]
    checks = iter([True, False])  # stop inside the tower ... then inside the decoder on a second try
    with pytest.raises(StageAborted, match="vision layer 1"):
        policy.update_vision(frames[1][None], [changed_tokens(frames[0], frames[1])], check=lambda f: next(checks))
    checks = iter([True] * (CONFIG.vision_layers + 1) + [True, False])  # the tower's layers, its end, a layer
    with pytest.raises(StageAborted, match="decoder layer 1"):
        policy.update_vision(frames[1][None], [changed_tokens(frames[0], frames[1])], check=lambda f: next(checks))
    after = [policy.tower_cache.out, policy.tower_cache.mlp_out, frame_cache.k, frame_cache.mlp_out,
             policy.vision.partitions[0].k]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after))


def test_layer_budget_adds_the_most_drifted_rows_never_unmoved_ones():
    from vla_node.runtime.vision_cache import drifted_rows

    x_ref = torch.ones(6, 4)
    x = x_ref.clone()
    x[1] += 0.5  # drift 0.5
    x[3] += 2.0  # drift 2.0
    x[4] += 1.0  # drift 1.0
    mask = torch.zeros(6, dtype=torch.bool)
    base = torch.tensor([0])
    assert drifted_rows(x, x_ref, base, None, mask).tolist() == [0]  # no threshold, no budget: the gate's only
    assert drifted_rows(x, x_ref, base, None, mask, budget=2.0).tolist() == [0, 3]  # 2 rows: the most drifted
    assert drifted_rows(x, x_ref, base, None, mask, budget=3.0).tolist() == [0, 3, 4]
    assert drifted_rows(x, x_ref, base, None, mask, budget=6.0).tolist() == [0, 1, 3, 4]  # 2, 5: not moved
    assert drifted_rows(x, x_ref, base, 0.75, mask).tolist() == [0, 3, 4]  # threshold alone
    assert drifted_rows(x, x_ref, base, 0.75, mask, budget=4.0).tolist() == [0, 1, 3, 4]  # threshold, then top-up
    assert drifted_rows(x, x_ref, None, None, mask, budget=2.0).tolist() == list(range(6))  # full: every row
    x_ref[5], x[2] = 0.0, 0.0  # row 5 moves away from zero (infinite relative drift), row 2 drops to zero (1)
    assert drifted_rows(x, x_ref, base, 0.75, mask).tolist() == [0, 2, 3, 4, 5]


def test_layer_budget_recomputes_more_tokens_per_layer_and_nothing_on_a_still_frame():
    from vla_node.runtime.reuse import ReuseConfig
    from vla_node.validate import ConfigError

    model = build_vla(CONFIG, seed=4)
    budget = MultiRatePolicy(model, CacheConfig.exact(), reuse=ReuseConfig(layer_budget=3.0))
    assert budget.tower_cache.layer_budget == budget._frame_tokens.layer_budget == 3.0
    budget.update_text("keep lane")
    frames = list(moving(2, seed=5))
    budget.update_vision(frames[0][None])
    tokens = changed_tokens(frames[0], frames[1])
    update = budget.update_vision(frames[1][None], [tokens])
    assert tokens.numel() < update.tokens_refreshed <= 3 * tokens.numel()
    assert all(tokens.numel() < rows <= 3 * tokens.numel() for rows in budget._frame_tokens.staged_rows)
    before = budget.action_tick(np.zeros(CONFIG.state_dim, np.float32)).logits
    still = budget.update_vision(frames[1][None], [torch.zeros(0, dtype=torch.long)])
    assert still.tokens_refreshed == 0
    assert torch.equal(budget.action_tick(np.zeros(CONFIG.state_dim, np.float32)).logits, before)
    with pytest.raises(ConfigError, match=r"reuse.layer_budget = 0.5: expected unset \(off\) or a multiple >= 1"):
        ReuseConfig(layer_budget=0.5)


def test_shared_sample_takes_evenly_spaced_reused_tokens():
    mask = torch.zeros(10, dtype=torch.bool)
    rows, sample = shared_sample(torch.tensor([1, 4]), 3, mask)
    assert sample.tolist() == [0, 6, 9]  # places 0, 3.5 -> 4, 7 of the 8 reused tokens [0, 2, 3, 5, 6, 7, 8, 9]
    assert rows.tolist() == [0, 1, 4, 6, 9]
    rows, sample = shared_sample(torch.tensor([1, 4]), 20, mask)  # more asked than reused: every token
    assert rows.tolist() == list(range(10)) and sample.numel() == 8
    rows, sample = shared_sample(torch.tensor([1, 4]), 0, mask)
    assert rows.tolist() == [1, 4] and sample.numel() == 0


def test_shift_reused_moves_reused_tokens_by_the_sampled_mean_change():
    old = torch.arange(12.0).reshape(6, 2)  # [T=6, W=2]
    rows, sample = torch.tensor([1, 2, 4]), torch.tensor([2, 4])  # 1 recomputed by the gate, 2 and 4 sampled
    new = torch.tensor([[100.0, 100.0], [5.0, 7.0], [11.0, 10.0]])  # rows' fresh values: sample changes (+1,+2), (+3,+1)
    out = torch.empty_like(old)
    shift_reused(out, old, new, rows, sample, 0)
    expected = old + torch.tensor([2.0, 1.5])  # the mean change of the sample
    expected[rows] = new
    assert torch.equal(out, expected)
    shift_reused(out, old, new, rows, sample[:0], 0)  # no sample: the old values, the rows' new ones
    expected = old.clone()
    expected[rows] = new
    assert torch.equal(out, expected)


def test_shared_drift_recomputes_a_sample_and_moves_the_reused_tokens():
    """A partial update with shared drift recomputes the gate's tokens plus the sample in every layer (counted as
    refreshed); the reused tokens' K/V and outputs move; a still frame stays bit for bit."""
    from vla_node.runtime.reuse import ReuseConfig

    model = build_vla(CONFIG, seed=4)
    policy = MultiRatePolicy(model, CacheConfig.exact(), reuse=ReuseConfig(shared_drift_samples=2))
    assert policy.tower_cache.shared_drift_samples == policy._frame_tokens.shared_drift_samples == 2
    policy.update_text("keep lane")
    frames = list(moving(2, seed=5))
    policy.update_vision(frames[0][None])
    tokens = changed_tokens(frames[0], frames[1])
    assert tokens.numel() + 2 < CONFIG.tokens_per_frame
    out_before = policy.tower_cache.out[0].clone()  # [T, W]
    update = policy.update_vision(frames[1][None], [tokens])
    reused = torch.tensor([t for t in range(CONFIG.tokens_per_camera) if t not in set(tokens.tolist())])
    moved = (policy.tower_cache.out[0][reused] != out_before[reused]).any(dim=-1)  # [reused]
    assert moved.all(), moved  # every reused token moved by the sample's shared change, not just the sample
    assert update.tokens_refreshed == tokens.numel() + 2
    assert policy._frame_tokens.staged_rows == [tokens.numel() + 2] * (CONFIG.num_layers - 1)
    state = np.zeros(CONFIG.state_dim, np.float32)
    before = policy.action_tick(state).logits
    assert torch.isfinite(before).all()
    still = policy.update_vision(frames[1][None], [torch.zeros(0, dtype=torch.long)])
    assert still.tokens_refreshed == 0
    assert torch.equal(policy.action_tick(state).logits, before)
