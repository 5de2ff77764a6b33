"""Video decoding with PyAV: real clips against their manifest, resampling, resizing, still images, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers.clips import clip, manifest
from helpers.paths import DRIVES_DIR
from vla_node.drives.video import (
    decode_video,
    probe_video,
)

DRIVES = DRIVES_DIR


CLIPS = manifest()
needs_clips = pytest.mark.skipif(
    not CLIPS, reason=f"real drives absent: no manifest.json in {DRIVES} (set VLA_NODE_DRIVES)"
)
CLIP_IDS = [e["file"] for e in CLIPS] or ["none"]
SHORT = next((e for e in CLIPS if e["file"] == "day_freeway_two_cars.mp4"), CLIPS[0] if CLIPS else None)


# ---- any machine: a clip written here -------------------------------------------------------------------


# ---- the real clips (skipped where /work/shared/data/drives is absent) -------------------------------------
@needs_clips
@pytest.mark.parametrize("entry", CLIPS or [None], ids=CLIP_IDS)
def test_real_clip_probe_and_full_decode_match_the_manifest(entry):
    path = clip(entry)
    info = probe_video(path)
    assert (info.width, info.height, info.frames, info.codec) == (entry["width"], entry["height"], entry["frames"],
                                                                  entry["codec"])
    assert info.fps == pytest.approx(entry["fps"]) and info.duration_s == pytest.approx(entry["duration_s"])
    count, last = 0, -1
    period_ns = round(1e9 / entry["fps"])
    for stamp_ns, rgb in decode_video(path):
        assert rgb.shape == (entry["height"], entry["width"], 3)
        assert stamp_ns == count * period_ns and stamp_ns > last
        last = stamp_ns
        count += 1
    assert count == entry["frames"]
@needs_clips
@pytest.mark.parametrize("entry", CLIPS or [None], ids=CLIP_IDS)
def test_real_clip_resampled_to_10_fps_has_the_expected_count(entry):
    path = clip(entry)
    out = [(s, rgb.shape) for s, rgb in decode_video(path, fps=10.0, size=(96, 54))]
    assert len(out) == math.ceil(entry["duration_s"] * 10 - 1e-9)  # 89, 16 and 40 frames
    assert [s for s, _ in out] == [k * 100_000_000 for k in range(len(out))]
    assert {shape for _, shape in out} == {(54, 96, 3)}
@needs_clips
def test_real_clip_resampled_frames_are_source_frames():
    path = clip(SHORT)
    source = [rgb for _, rgb in decode_video(path, size=(128, 72))]
    resampled = [rgb for _, rgb in decode_video(path, fps=10.0, size=(128, 72))]
    for k, rgb in enumerate(resampled):
        assert np.array_equal(rgb, source[(k * 25) // 10])
