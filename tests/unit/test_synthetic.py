"""The synthetic drive: deterministic, mostly static between frames, hard cuts where it says."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from vla_node.drives.synthetic import (
    CUT_SPACING_S,
    SyntheticDrive,
    SyntheticDriveConfig,
    scene_cut_indices,
    synthetic_frames,
)
from vla_node.validate import ConfigError, from_dict

SMALL = SyntheticDriveConfig(width=160, height=120, fps=10.0, seconds=25.0, seed=7)


def digest(config: SyntheticDriveConfig) -> str:
    h = hashlib.sha256()
    for stamp_ns, rgb in synthetic_frames(config):
        h.update(stamp_ns.to_bytes(8, "little"))
        h.update(rgb.tobytes())
    return h.hexdigest()


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def changed_patch_fraction(a: np.ndarray, b: np.ndarray, patch: int = 16, threshold: float = 8.0) -> float:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16)).mean(axis=2)  # (H, W)
    h, w = (d.shape[0] // patch) * patch, (d.shape[1] // patch) * patch
    per_patch = d[:h, :w].reshape(h // patch, patch, w // patch, patch).mean(axis=(1, 3))  # (H/p, W/p)
    return float((per_patch > threshold).mean())


def test_frames_have_the_configured_shape_stamps_and_count():
    frames = list(synthetic_frames(SMALL))
    assert len(frames) == SMALL.frame_count == 250
    assert [s for s, _ in frames[:4]] == [0, 100_000_000, 200_000_000, 300_000_000]
    assert frames[-1][0] == 249 * 100_000_000
    for _, rgb in frames[:3]:
        assert rgb.shape == (120, 160, 3) and rgb.dtype == np.uint8 and rgb.flags.c_contiguous
    # not a flat image: sky, road and roadside differ
    assert frames[0][1].std() > 20


def test_same_seed_gives_identical_frames_and_other_seeds_differ():
    a, b = digest(SMALL), digest(SMALL)
    assert a == b
    other = SyntheticDriveConfig(width=160, height=120, fps=10.0, seconds=25.0, seed=8)
    assert digest(other) != a
    first_a = next(synthetic_frames(SMALL))[1]
    first_other = next(synthetic_frames(other))[1]
    assert mean_abs_diff(first_a, first_other) > 5  # a different drive, not a tiny perturbation


def test_frames_are_hash_stable_across_processes():
    config = SyntheticDriveConfig(width=96, height=64, fps=10.0, seconds=12.0, seed=3, noise_std=1.5)
    code = (
        "import hashlib\n"
        "from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames\n"
        f"c = {config!r}\n"
        "h = hashlib.sha256()\n"
        "for s, f in synthetic_frames(c):\n"
        "    h.update(s.to_bytes(8, 'little')); h.update(f.tobytes())\n"
        "print(h.hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == digest(config)


def test_random_access_render_matches_the_stream():
    drive = SyntheticDrive(SMALL)
    stream = [rgb for _, rgb in drive.frames()]
    fresh = SyntheticDrive(SMALL)
    for i in (200, 3, SMALL.frame_count - 1, 0, 117):  # out of order, across scenes
        assert np.array_equal(fresh.render(i), stream[i])
    with pytest.raises(IndexError):
        fresh.render(SMALL.frame_count)


def test_scene_cuts_are_seeded_and_spaced_8_to_12_seconds():
    config = SyntheticDriveConfig(width=64, height=48, fps=20.0, seconds=120.0, seed=11)
    cuts = scene_cut_indices(config)
    assert cuts == scene_cut_indices(config) == SyntheticDrive(config).scene_cut_indices
    assert cuts != scene_cut_indices(dataclass_replace(config, seed=12))
    low, high = CUT_SPACING_S
    assert low * config.fps <= cuts[0] <= high * config.fps + 1
    gaps = np.diff(cuts)
    assert len(cuts) >= 9 and gaps.min() >= low * config.fps - 1 and gaps.max() <= high * config.fps + 1
    assert all(0 < c < config.frame_count for c in cuts)


def dataclass_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuts_change_the_whole_frame_while_ordinary_frames_change_little(seed):
    config = SyntheticDriveConfig(width=192, height=144, fps=10.0, seconds=30.0, seed=seed)
    frames = [rgb for _, rgb in synthetic_frames(config)]
    cuts = set(scene_cut_indices(config))
    assert len(cuts) >= 2
    cut_mad = [mean_abs_diff(frames[i], frames[i - 1]) for i in sorted(cuts)]
    cut_patches = [changed_patch_fraction(frames[i], frames[i - 1]) for i in sorted(cuts)]
    ordinary = [i for i in range(1, len(frames)) if i not in cuts]
    mad = np.array([mean_abs_diff(frames[i], frames[i - 1]) for i in ordinary])
    patches = np.array([changed_patch_fraction(frames[i], frames[i - 1]) for i in ordinary])
    # a cut is unmistakable ...
    assert min(cut_mad) > 15, cut_mad
    assert min(cut_patches) > 0.6, cut_patches
    assert min(cut_mad) > mad.max()
    # ... while ordinary frames differ little: most patches stay under the reuse threshold
    assert np.percentile(mad, 90) < 6, np.percentile(mad, 90)
    assert np.median(patches) < 0.1 and patches.max() < 0.35, (np.median(patches), patches.max())
    # yet the scene moves: markings, posts and vehicles change something every frame
    assert (mad > 0).all()


def test_noise_makes_static_patches_differ_slightly_without_breaking_determinism():
    config = SyntheticDriveConfig(width=128, height=96, fps=10.0, seconds=2.0, seed=5, noise_std=2.0)
    clean = dataclass_replace(config, noise_std=0.0)
    noisy = [rgb for _, rgb in synthetic_frames(config)]
    plain = [rgb for _, rgb in synthetic_frames(clean)]
    sky = (slice(0, 20), slice(None))  # rows of sky: static apart from the noise
    assert np.array_equal(plain[1][sky], plain[2][sky]) or mean_abs_diff(plain[1][sky], plain[2][sky]) < 1.5
    assert 0.5 < mean_abs_diff(noisy[1][sky], noisy[2][sky]) < 5
    assert 0.5 < mean_abs_diff(noisy[1], plain[1]) < 5
    assert digest(config) == digest(config)


def test_brightness_dips_in_a_tunnel_like_period():
    # find a scene with a tunnel and check its middle is darker than its start
    for seed in range(20):
        drive = SyntheticDrive(SyntheticDriveConfig(width=64, height=48, fps=10.0, seconds=9.0, seed=seed))
        scene = drive._scene(0)
        if scene.tunnel is None:
            continue
        start, length = scene.tunnel
        middle = int((start + length / 2) * 10)
        if middle >= drive.frame_count or (drive.scene_cut_indices and middle >= drive.scene_cut_indices[0]):
            continue
        assert drive.render(middle).mean() < 0.75 * drive.render(0).mean()
        return
    pytest.fail("no seed in 0..19 has a tunnel in its first scene")


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"width": 16}, "width"),
        ({"height": 640.5}, "height"),
        ({"fps": 0}, "fps"),
        ({"seconds": -1}, "seconds"),
        ({"seed": -3}, "seed"),
        ({"noise_std": 99}, "noise_std"),
    ],
)
def test_config_errors_name_the_key_and_the_value(changes, key):
    with pytest.raises(ConfigError, match=rf"^{key} = "):
        SyntheticDriveConfig(**changes)


def test_config_loads_from_a_toml_table_with_did_you_mean():
    config = from_dict(SyntheticDriveConfig, {"width": 320, "height": 240, "seed": 4}, "synthetic")
    assert (config.width, config.height, config.seed) == (320, 240, 4)
    with pytest.raises(ConfigError, match="did you mean 'seed'"):
        from_dict(SyntheticDriveConfig, {"sed": 4}, "synthetic")
