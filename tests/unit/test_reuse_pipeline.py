"""The reuse gate driving the multi-rate policy (the node's convention), against full refresh and the reference;
and `bench reuse` end to end on a small synthetic video and a native drive."""

import json

import numpy as np
import pytest
import torch

from helpers.clips import write_mp4
from helpers.numerics import assert_same_bins
from vla_node.bench import reuse as bench_reuse
from vla_node.bench.reuse import GatedPolicy, gate_tokens, load_frames, logit_rel_err
from vla_node.drives.open import DriveWriter
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reference import ReferencePolicy
from vla_node.runtime.reuse import ReuseConfig
from vla_node.validate import ConfigError

INSTRUCTION = "keep lane"
# tiny, but 64 px frames: a 4 x 4 grid of 16 px patches, so that some patches change and others do not
CONFIG = preset("tiny").replace(image_size=64, vision_frames=1)
CACHES = {"exact": CacheConfig.exact, "default": CacheConfig}


def moving_band(n, seed=0, size=64):
    """n frames of a fixed random picture with a band of new noise moving down it (some patches change)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    for i in range(n):
        frame = base.copy()
        top = (i * 11) % (size - 12)
        frame[top : top + 12] = rng.integers(0, 256, (12, size, 3), dtype=np.uint8)
        yield frame


def states(n, dim, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.5, size=dim).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_threshold_zero_through_the_gate_equals_full_refresh(cache):
    model = build_vla(CONFIG, seed=3)
    gated = GatedPolicy(MultiRatePolicy(model, CACHES[cache]()), ReuseConfig(threshold=0.0))
    full = MultiRatePolicy(model, CACHES[cache]())
    reference = ReferencePolicy(model)
    for policy in (gated.policy, full):
        policy.update_text(INSTRUCTION)
    frames = list(moving_band(6))
    for i, (frame, state) in enumerate(zip(frames, states(6, CONFIG.state_dim))):
        images = frame[None]  # [S, S, 3] -> [1, S, S, 3]
        update, plans = gated.update_vision(images)
        assert plans[0].full and update.tokens_refreshed == CONFIG.tokens_per_frame and update.reuse_ratio == 0.0
        full.update_vision(images)
        ours, theirs = gated.policy.action_tick(state), full.action_tick(state)
        assert torch.equal(ours.logits, theirs.logits), i  # the same code path: bit for bit
        np.testing.assert_array_equal(ours.bins, theirs.bins)
        if cache == "exact":
            ref = reference.step([frame], INSTRUCTION, state)
            assert (ours.logits - ref.logits).abs().max().item() <= 1e-4, i
            assert_same_bins(ours, ref, 1e-4)  # other kernels than the reference's: equal but at a near tie


def test_partial_path_with_the_gates_token_order_equals_full_refresh():
    """The gate's refresh list, most-changed first (not row-major) and a strict subset: the changed patches only.
    With drift gates at any move (and no shared sample) the partial recompute must still equal a full refresh, and
    the tower's first layer runs the listed tokens only."""
    model = build_vla(CONFIG, seed=4)
    exact = ReuseConfig(tower_drift_threshold=1e-12, decoder_drift_threshold=1e-12, shared_drift_samples=0)
    partial = MultiRatePolicy(model, CacheConfig.exact(), reuse=exact)
    full = MultiRatePolicy(model, CacheConfig.exact())
    gate = GatedPolicy(partial, ReuseConfig(threshold=0.0)).gates[0]
    for policy in (partial, full):
        policy.update_text(INSTRUCTION)
    reordered = partial_runs = 0
    query_rows = []
    hook = model.vision.encoder.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, i, o: query_rows.append(i[0].shape[-2]))
    previous = None
    try:
        for i, (frame, state) in enumerate(zip(moving_band(5, seed=2), states(5, CONFIG.state_dim))):
            images = frame[None]
            plan = gate.plan(frame)
            tokens = torch.from_numpy(plan.refresh.copy())
            if previous is not None:  # the changed patches, in the gate's order
                patch = CONFIG.patch_size
                grid = CONFIG.image_size // patch
                diff = np.abs(frame.astype(np.int16) - previous.astype(np.int16))
                changed = set(np.flatnonzero(diff.reshape(grid, patch, grid, patch, 3).sum(axis=(1, 3, 4))).tolist())
                tokens = torch.tensor([t for t in tokens.tolist() if t in changed], dtype=torch.long)
                reordered += not torch.equal(tokens, tokens.sort().values)
            query_rows.clear()
            update = partial.update_vision(images, [tokens])
            gate.commit(plan, frame)
            assert update.full == (i == 0)
            if i > 0 and len(tokens) < CONFIG.tokens_per_camera:
                partial_runs += 1
                assert query_rows == [len(tokens)], query_rows
            full.update_vision(images)
            a, b = partial.action_tick(state), full.action_tick(state)
            assert (a.logits - b.logits).abs().max().item() <= 1e-4, i
            assert_same_bins(a, b, 1e-4)  # a subset of rows through the matmuls: equal but at a near tie
            previous = frame
    finally:
        hook.remove()
    assert partial_runs >= 3 and reordered >= 1  # a subset, in the gate's order, not row-major


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_static_scene_reuses_everything_then_a_scene_cut_refreshes_everything(cache):
    config = CONFIG.replace(state_slots=1)  # one state slot: every tick sees just the current state
    model = build_vla(config, seed=5)
    gated = GatedPolicy(MultiRatePolicy(model, CACHES[cache]()), ReuseConfig(threshold=8.0))
    reference = ReferencePolicy(model)
    gated.policy.update_text(INSTRUCTION)
    state = states(1, config.state_dim)[0]
    rng = np.random.default_rng(7)
    still = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    first = None
    for i in range(4):
        update, plans = gated.update_vision(still[None].copy())
        chunk = gated.policy.action_tick(state)
        if i == 0:
            assert update.full and update.reuse_ratio == 0.0
            first = chunk
            continue
        assert update.reuse_ratio == 1.0 and update.tokens_refreshed == 0 and not update.full
        assert not plans[0].scene_cut and plans[0].refresh.size == 0
        assert torch.equal(chunk.logits, first.logits), i
        np.testing.assert_array_equal(chunk.bins, first.bins)

    cut = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)  # a totally different picture
    update, plans = gated.update_vision(cut[None])
    assert plans[0].scene_cut and plans[0].full
    assert update.full and update.tokens_refreshed == config.tokens_per_frame and update.reuse_ratio == 0.0
    after = gated.policy.action_tick(state)
    assert not torch.equal(after.logits, first.logits)
    if cache == "exact":  # the cut frame is computed from scratch: it equals the reference on that frame
        ref = reference.step([cut], INSTRUCTION, state)
        assert (after.logits - ref.logits).abs().max().item() <= 1e-4
        assert_same_bins(after, ref, 1e-4)  # other kernels than the reference's: equal but at a near tie


def test_gate_tokens_follow_the_nodes_convention():
    gated = GatedPolicy(MultiRatePolicy(build_vla(CONFIG, seed=0)), ReuseConfig(threshold=8.0))
    gate = gated.gates[0]
    frames = list(moving_band(2))
    first = gate.plan(frames[0])
    assert gate_tokens([first], CONFIG.tokens_per_camera) == ([None], False)  # a full plan: tokens=None
    gate.commit(first, frames[0])
    second = gate.plan(frames[1])
    tokens, scene_cut = gate_tokens([second], CONFIG.tokens_per_camera)
    assert not scene_cut and 0 < tokens[0].numel() < CONFIG.tokens_per_camera
    assert tokens[0].tolist() == second.refresh.tolist()


def test_logit_rel_err():
    theirs = torch.tensor([[3.0, 4.0]])
    assert logit_rel_err(theirs, theirs) == 0.0
    assert logit_rel_err(torch.tensor([[3.0, 4.5]]), theirs) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------- bench reuse


def flicker(n, width=96, height=64, seed=3):
    """A still, smooth picture with a block of noise flickering in its top-left corner (one changing patch)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    still = np.stack([(x * 2) % 256, (y * 3) % 256, ((x + y) * 2) % 256], axis=-1).astype(np.uint8)
    for _ in range(n):
        frame = still.copy()
        frame[:24, :36] = rng.integers(0, 256, (24, 36, 3), dtype=np.uint8)
        yield frame


KEYS = {"reuse_ratio_mean", "reuse_ratio_p10", "vision_update_speedup", "logit_rel_err", "logit_rel_err_max",
        "top1_agreement", "action_dev_pct_mean", "action_dev_pct_max"}


def test_bench_reuse_end_to_end_on_a_synthetic_video(tmp_path):
    clip = tmp_path / "flicker.mp4"
    write_mp4(clip, list(flicker(15)))
    out = tmp_path / "reuse.json"
    results = bench_reuse.run([str(clip)], thresholds=(0, 8), rates=("native", 10), max_frames=5, preset="tiny",
                              json_path=str(out), cache="exact", pixel_floor=True, progress=False,
                              shared_drift_samples=0, max_age=0)  # the tiny preset has 4 tokens: a sample is all
    assert json.loads(out.read_text()) == results
    assert list(results) == ["flicker.mp4"]
    settings = results["flicker.mp4"]
    assert sorted(settings) == ["t0@10fps", "t0@native", "t8@10fps", "t8@native"]
    for name, row in settings.items():
        assert KEYS <= set(row), name
        assert row["shared_drift_samples"] == 0 and row["max_age"] == 0
        assert row["frames"] == 5 and np.isfinite(row["vision_update_speedup"]) and row["vision_update_speedup"] > 0
        assert 0.0 <= row["reuse_ratio_p10"] <= row["reuse_ratio_mean"] <= 1.0
    for rate in ("native", "10fps"):
        exact = settings[f"t0@{rate}"]  # nothing reused, all fp32: the reference itself
        assert exact["reuse_ratio_mean"] == 0.0 and exact["logit_rel_err_max"] <= 1e-5
        assert exact["top1_agreement"] == 1.0 and exact["action_dev_pct_max"] == 0.0
        assert exact["reuse_only_logit_rel_err_max"] == 0.0
        assert exact["pixel_floor_logit_rel_err_max"] == 0.0  # the gate holds the true frame
        reused = settings[f"t8@{rate}"]
        assert reused["reuse_ratio_mean"] == 0.75  # 3 of the 4 patches of the tiny preset's 32 px frames are still
        assert reused["logit_rel_err_max"] > 1e-5  # the still patches' tokens keep their stale context
        assert 0.0 < reused["pixel_floor_logit_rel_err_max"] < reused["logit_rel_err_max"]  # codec noise only
        assert reused["logit_rel_err"] == pytest.approx(reused["reuse_only_logit_rel_err"], rel=1e-3, abs=1e-6)


def test_load_frames_from_a_native_drive_resamples_like_a_camera(tmp_path):
    path = tmp_path / "drive.mcap"
    frames = [np.full((48, 64, 3), 10 * i, np.uint8) for i in range(10)]  # 25 Hz: stamps 0, 40, ..., 360 ms
    with DriveWriter(path) as writer:
        for i, rgb in enumerate(frames):
            writer.add_frame("front", i, i * 40_000_000, "rgb8", 48, 64, rgb.tobytes())
    native = load_frames(path, "native", None, 32)
    assert [f[0, 0, 0] for f in native] == [10 * i for i in range(10)] and native[0].shape == (32, 32, 3)
    assert all(f.flags.c_contiguous and f.flags.writeable for f in native)  # as the node's stacked frames lie
    # ticks 0, 100, 200, 300 ms show the latest frame at or before them: 0, 2 (80 ms), 5 (200 ms), 7 (280 ms)
    assert [f[0, 0, 0] for f in load_frames(path, 10, None, 32)] == [0, 20, 50, 70]
    assert len(load_frames(path, "native", 3, 32)) == 3
    with pytest.raises(ValueError, match="expected at least 2"):
        load_frames(path, "native", 1, 32)


def test_run_rejects_bad_arguments(tmp_path):
    for kwargs, key in (({"thresholds": (-1,)}, "thresholds"), ({"rates": ("fast",)}, "rates"),
                        ({"max_frames": 1}, "max_frames"), ({"cache": "int4"}, "cache")):
        with pytest.raises(ConfigError, match=key):
            bench_reuse.run([str(tmp_path / "x.mp4")], preset="tiny", progress=False, **kwargs)
