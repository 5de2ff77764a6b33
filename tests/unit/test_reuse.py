"""Vision-token reuse gate: drift against the last refreshed version, forced and scene-cut refreshes, the cap,
transactional commits, and measured redundancy on real dashcam drives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.oracles import measure_redundancy
from vla_node.runtime.reuse import ReuseConfig, ReuseGate, ReusePlan
from vla_node.validate import ConfigError, from_dict

SIZE = 64
PATCH = 16
GRID = SIZE // PATCH  # 4 x 4 = 16 patches


def noise_frame(seed: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def patch_view(rgb: np.ndarray, index: int, patch: int = PATCH) -> np.ndarray:
    row, col = divmod(index, rgb.shape[1] // patch)
    return rgb[row * patch:(row + 1) * patch, col * patch:(col + 1) * patch]


def step(gate: ReuseGate, rgb: np.ndarray, **overrides) -> ReusePlan:
    plan = gate.plan(rgb, **overrides)
    gate.commit(plan, rgb)
    return plan


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"threshold": -1.0}, "reuse.threshold"),
        ({"threshold": float("nan")}, "reuse.threshold"),
        ({"threshold": True}, "reuse.threshold"),
        ({"full_refresh_every": -2}, "reuse.full_refresh_every"),
        ({"full_refresh_every": 2.5}, "reuse.full_refresh_every"),
        ({"scene_cut_fraction": 1.5}, "reuse.scene_cut_fraction"),
        ({"scene_cut_threshold": 0.0}, "reuse.scene_cut_threshold"),
        ({"scene_cut_threshold": 300.0}, "reuse.scene_cut_threshold"),
        ({"max_refresh": 0}, "reuse.max_refresh"),
        ({"max_refresh": 3.0}, "reuse.max_refresh"),
    ],
)
def test_config_rejects_bad_values_naming_key_and_value(kwargs, key):
    with pytest.raises(ConfigError) as error:
        ReuseConfig(**kwargs)
    message = str(error.value)
    assert message.startswith(key) and repr(next(iter(kwargs.values()))) in message and "expected" in message
def test_config_from_toml_table():
    config = from_dict(ReuseConfig, {"threshold": 6, "full_refresh_every": 30, "max_refresh": 64}, "reuse")
    assert config == ReuseConfig(threshold=6.0, full_refresh_every=30, max_refresh=64)
    with pytest.raises(ConfigError, match="did you mean 'threshold'"):
        from_dict(ReuseConfig, {"treshold": 6}, "reuse")
def test_gate_rejects_bad_geometry_and_frames():
    with pytest.raises(ConfigError, match="divisible by patch_size = 16"):
        ReuseGate(ReuseConfig(), 100, 16)
    gate = ReuseGate(ReuseConfig(), (32, 64), 16)
    assert gate.grid == (2, 4) and gate.num_patches == 8
    with pytest.raises(ValueError, match=r"rgb = uint8\[64, 64, 3\]: expected uint8\[32, 64, 3\]"):
        gate.plan(noise_frame(0))
    with pytest.raises(ValueError, match=r"rgb = float32"):
        gate.plan(np.zeros((32, 64, 3), np.float32))
    with pytest.raises(ConfigError, match="max_refresh = -1"):
        gate.plan(np.zeros((32, 64, 3), np.uint8), max_refresh=-1)


# ---------------------------------------------------------------------------------------------- decisions
def test_threshold_zero_refreshes_everything_every_frame():
    gate = ReuseGate(ReuseConfig(threshold=0.0), SIZE, PATCH)
    frame = noise_frame(1)
    for _ in range(4):  # the same frame again: drift 0 still reaches threshold 0
        plan = step(gate, frame)
        assert plan.full and plan.reuse_ratio == 0.0
        assert sorted(plan.refresh.tolist()) == list(range(GRID * GRID))
def test_identical_frame_is_fully_reused_after_the_first():
    gate = ReuseGate(ReuseConfig(), SIZE, PATCH)
    frame = noise_frame(2)
    first = step(gate, frame)
    assert first.full and first.forced and first.reuse_ratio == 0.0 and np.isinf(first.drift).all()
    for _ in range(5):
        plan = step(gate, frame.copy())
        assert plan.refresh.size == 0 and plan.reuse_ratio == 1.0 and not plan.full
        assert not plan.drift.any()
    assert gate.frames_since_full == 5
def test_slow_drift_accumulates_against_last_refreshed_version():
    """Each frame brightens one patch by 3 (below the threshold 8 frame to frame); it is refreshed on the frame
    where its drift from the last refreshed version reaches 8, i.e. every third frame."""
    gate = ReuseGate(ReuseConfig(threshold=8.0, max_age=0), SIZE, PATCH)
    frame = np.full((SIZE, SIZE, 3), 100, np.uint8)
    step(gate, frame)
    target = 5
    refreshed_at, drifts = [], []
    for t in range(1, 10):
        frame = frame.copy()
        patch_view(frame, target)[...] += 3
        plan = step(gate, frame)
        drifts.append(float(plan.drift[target]))
        assert set(plan.refresh.tolist()) <= {target}
        if plan.refresh.size:
            refreshed_at.append(t)
    assert drifts == [3, 6, 9, 3, 6, 9, 3, 6, 9]
    assert refreshed_at == [3, 6, 9]
    # the reference holds the patch as last refreshed, not as last seen
    frame = frame.copy()
    patch_view(frame, target)[...] += 3
    gate.commit(gate.plan(frame), frame)
    assert (patch_view(gate.reference, target) == 100 + 27).all()
def test_forced_full_refresh_every_n_frames():
    gate = ReuseGate(ReuseConfig(full_refresh_every=3), SIZE, PATCH)
    frame = noise_frame(3)
    fulls = [step(gate, frame).full for _ in range(10)]
    assert fulls == [True, False, False, True, False, False, True, False, False, True]
    never = ReuseGate(ReuseConfig(full_refresh_every=0), SIZE, PATCH)
    assert [step(never, frame).full for _ in range(6)] == [True] + [False] * 5
def test_scene_cut_forces_full_refresh():
    gate = ReuseGate(ReuseConfig(threshold=200.0, scene_cut_fraction=0.5, scene_cut_threshold=40.0), SIZE, PATCH)
    step(gate, noise_frame(4))
    plan = step(gate, noise_frame(5))  # a totally different frame: every patch drifts ~85, under threshold 200
    assert plan.scene_cut and plan.full and not plan.forced and plan.reuse_ratio == 0.0
    assert (gate.reference == noise_frame(5)).all()
    assert gate.frames_since_full == 0
    # half the patches changed is not more than half: no scene cut, nothing past threshold 200
    half = noise_frame(5)
    half[: SIZE // 2] = noise_frame(6)[: SIZE // 2]
    plan = step(gate, half)
    assert not plan.scene_cut and plan.refresh.size == 0
def test_cap_keeps_most_changed_patches_first():
    gate = ReuseGate(ReuseConfig(threshold=4.0, max_age=0), SIZE, PATCH)
    base = np.full((SIZE, SIZE, 3), 50, np.uint8)
    step(gate, base)
    changed = base.copy()
    deltas = {2: 10, 7: 40, 11: 25, 14: 5, 0: 3}  # patch 0 stays under the threshold
    for index, delta in deltas.items():
        patch_view(changed, index)[...] += delta
    uncapped = gate.plan(changed)
    assert uncapped.refresh.tolist() == [7, 11, 2, 14]
    capped = gate.plan(changed, max_refresh=2)
    assert capped.refresh.tolist() == [7, 11] and capped.reuse_ratio == 1 - 2 / 16
    config_capped = ReuseGate(ReuseConfig(threshold=4.0, max_refresh=3, max_age=0), SIZE, PATCH)
    step(config_capped, base)
    assert config_capped.plan(changed).refresh.tolist() == [7, 11, 2]
    # commit copies only the refreshed patches: the others keep drifting and come first next time
    gate.commit(capped, changed)
    assert (patch_view(gate.reference, 7) == 90).all() and (patch_view(gate.reference, 2) == 50).all()
    assert gate.plan(changed).refresh.tolist() == [2, 14]
def test_capped_scene_cut_completes_on_following_frames():
    gate = ReuseGate(ReuseConfig(max_age=0, scene_cut_fraction=0.5, scene_cut_threshold=40.0), SIZE, PATCH)
    step(gate, noise_frame(7))
    new = noise_frame(8)
    first = step(gate, new, max_refresh=6)
    assert first.scene_cut and not first.full and first.refresh.size == 6
    second = step(gate, new, max_refresh=6)  # 10 patches still drift ~85: still more than half
    assert second.scene_cut and second.refresh.size == 6
    assert not set(first.refresh.tolist()) & set(second.refresh.tolist())
    third = step(gate, new, max_refresh=6)  # 4 patches left: no longer a cut, but past the threshold
    assert not third.scene_cut and third.refresh.size == 4
    assert (gate.reference == new).all()
def test_first_frame_ignores_cap_and_threshold_override_applies():
    gate = ReuseGate(ReuseConfig(threshold=8.0, max_refresh=2), SIZE, PATCH)
    plan = step(gate, noise_frame(9))
    assert plan.full and plan.refresh.size == 16  # nothing cached yet: every token must be computed
    brighter = noise_frame(9)
    np.add(brighter, 10, out=brighter, where=brighter < 240)
    assert gate.plan(brighter, max_refresh=16).refresh.size == 16
    assert gate.plan(brighter, threshold=20.0, max_refresh=16).refresh.size == 0
    assert gate.plan(brighter).refresh.size == 2
def test_plan_does_not_mutate_and_stale_plans_are_refused():
    gate = ReuseGate(ReuseConfig(full_refresh_every=4), SIZE, PATCH)
    a, b = noise_frame(10), noise_frame(11)
    step(gate, a)
    before = gate.reference.copy()
    abandoned = gate.plan(b)
    again = gate.plan(b)
    assert (gate.reference == before).all() and gate.frames_since_full == 0 and gate.has_reference
    assert np.array_equal(abandoned.drift, again.drift) and np.array_equal(abandoned.refresh, again.refresh)
    # a plan is immutable
    with pytest.raises(ValueError):
        abandoned.refresh[0] = 3
    # the worker gave up on frame b: the gate is exactly as before, the next frame plans against a
    plan = gate.plan(a)
    assert plan.refresh.size == 0
    gate.commit(plan, a)
    with pytest.raises(ValueError, match="stale or foreign plan"):
        gate.commit(abandoned, b)
    with pytest.raises(ValueError, match="stale or foreign plan"):
        gate.commit(plan, a)  # twice
    other = ReuseGate(ReuseConfig(), SIZE, PATCH)
    with pytest.raises(ValueError, match="stale or foreign plan"):
        other.commit(gate.plan(a), a)
def test_reset_makes_the_next_frame_full():
    gate = ReuseGate(ReuseConfig(), SIZE, PATCH)
    frame = noise_frame(12)
    step(gate, frame)
    stale = gate.plan(frame)
    gate.reset()
    assert not gate.has_reference and not gate.reference.any()
    with pytest.raises(ValueError, match="stale"):
        gate.commit(stale, frame)
    plan = step(gate, frame)
    assert plan.full and plan.forced
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    patch=st.sampled_from([1, 2, 4, 8]),
    grid=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    threshold=st.floats(0.0, 120.0),
    cap=st.none() | st.integers(0, 30),
)
def test_drift_and_reference_match_a_direct_computation(seed, patch, grid, threshold, cap):
    rng = np.random.default_rng(seed)
    height, width = grid[0] * patch, grid[1] * patch
    gate = ReuseGate(ReuseConfig(threshold=threshold, max_age=0, scene_cut_fraction=1.0), (height, width), patch)
    reference = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    step(gate, reference)
    for _ in range(3):
        frame = np.clip(reference.astype(np.int16) + rng.integers(-90, 91, reference.shape), 0, 255).astype(np.uint8)
        plan = step(gate, frame, max_refresh=cap)
        diff = np.abs(frame.astype(np.int32) - reference.astype(np.int32))
        # (H, W, 3) -> (rows, P, cols, P, 3) -> mean per patch -> (rows * cols,)
        expected = diff.reshape(grid[0], patch, grid[1], patch, 3).mean(axis=(1, 3, 4)).reshape(-1)
        np.testing.assert_allclose(plan.drift, expected, rtol=1e-5, atol=1e-4)
        surely = np.count_nonzero(expected >= threshold + 1e-3)  # float32 rounding may decide the borderline
        maybe = np.count_nonzero(expected >= threshold - 1e-3)
        limit = gate.num_patches if cap is None else cap
        assert min(limit, surely) <= plan.refresh.size <= min(limit, maybe)
        assert np.all(np.diff(plan.drift[plan.refresh]) <= 0)
        for index in range(gate.num_patches):
            if index in plan.refresh:
                patch_view(reference, index, patch)[...] = patch_view(frame, index, patch)
        assert (gate.reference == reference).all()
def test_measure_redundancy_on_synthetic_frames():
    frame = noise_frame(13)
    moved = frame.copy()
    patch_view(moved, 0)[...] = 255 - patch_view(moved, 0)
    result = measure_redundancy([frame, frame, moved, moved], ReuseConfig(), SIZE, PATCH)
    assert result["frames"] == 3
    assert result["mean"] == pytest.approx((1 + 15 / 16 + 1) / 3)
    assert result["min"] == 15 / 16 and result["scene_cuts"] == 0 and result["full_refreshes"] == 0
    with pytest.raises(ValueError, match="fewer than 2"):
        measure_redundancy([frame], ReuseConfig(), SIZE, PATCH)


# ---------------------------------------------------------------------------------------------- real drives


def test_max_age_refreshes_the_patches_reused_longest_only_while_the_frame_changes():
    """With max_age 4 over 16 patches, each changing frame also refreshes the ceil(16 / 4) = 4 patches reused
    longest (ties in row-major order); a still frame reuses everything and ages nothing."""
    gate = ReuseGate(ReuseConfig(threshold=8.0, max_age=4), SIZE, PATCH)
    frame = np.full((SIZE, SIZE, 3), 100, np.uint8)
    step(gate, frame)
    frame = frame.copy()
    patch_view(frame, 9)[...] += 50
    plan = step(gate, frame)
    assert plan.refresh.tolist() == [9]  # after a full refresh nothing has been reused yet
    patch_view(frame, 9)[...] += 50
    plan = step(gate, frame)
    assert plan.refresh.tolist() == [9, 0, 1, 2, 3] and plan.reuse_ratio == 1 - 5 / 16
    still = step(gate, frame)
    assert still.refresh.size == 0 and still.reuse_ratio == 1.0
    patch_view(frame, 9)[...] += 50
    plan = step(gate, frame)
    assert plan.refresh.tolist() == [9, 4, 5, 6, 7]  # 4..15 are two changing frames old, 0..3 one
    patch_view(frame, 9)[...] += 50
    capped = gate.plan(frame, max_refresh=2)  # the cap keeps the most changed first, then the oldest (8, 10.. at 3)
    assert capped.refresh.tolist() == [9, 8]
