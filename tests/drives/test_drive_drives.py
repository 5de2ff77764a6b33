"""Drives: native MCAP write/read, ROS 2 bags, video files, conversion, errors, and the progress bar."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers.paths import DRIVES_DIR
from vla_node.drives.convert import ConvertSummary, convert_video
from vla_node.drives.open import open_drive
from vla_node.drives.video import decode_video

DRIVES = DRIVES_DIR


# ---- native drives ------------------------------------------------------------------------------------


# ---- ROS 2 bags ---------------------------------------------------------------------------------------


# ---- corrupt, truncated, empty, foreign ------------------------------------------------------------------


# ---- video files and conversion --------------------------------------------------------------------------


def real_clip(name: str) -> Path:
    path = DRIVES / name
    if not path.is_file():
        pytest.skip(f"real drive {path} is absent (set VLA_NODE_DRIVES to the folder of the dashcam clips)")
    return path
def test_convert_real_clip_reads_back_equal_to_decoding_the_mp4(tmp_path, capsys):
    video = real_clip("day_freeway_two_cars.mp4")
    out = tmp_path / "two_cars.mcap"
    summary = convert_video(video, out, size=(160, 90), max_frames=20)
    assert summary == ConvertSummary(frames=20, duration_s=0.76, bytes=out.stat().st_size)
    err = capsys.readouterr().err
    assert "convert day_freeway_two_cars.mp4" in err and "20/20 frames" in err
    reference = list(decode_video(video, size=(160, 90), max_frames=20))
    drive = open_drive(out)
    frames = list(drive.frames())
    assert len(frames) == 20 and drive.cameras == ("front",)
    for frame, (stamp_ns, rgb) in zip(frames, reference):
        assert frame.stamp_ns == stamp_ns and frame.encoding == "rgb8"
        assert np.array_equal(frame.rgb(), rgb)
    assert not (tmp_path / "two_cars.mcap.part").exists()
def test_convert_real_clip_to_jpeg_at_10_fps(tmp_path, capsys):
    video = real_clip("day_freeway_two_cars.mp4")
    out = tmp_path / "two_cars_jpeg.mcap"
    summary = convert_video(video, out, fps=10.0, size=(128, 72), encoding="jpeg", camera="dash", progress=False,
                            jpeg_qscale=2)
    assert summary.frames == 16 and summary.duration_s == pytest.approx(1.5)
    assert capsys.readouterr().err == ""
    reference = [rgb for _, rgb in decode_video(video, fps=10.0, size=(128, 72))]
    drive = open_drive(out)
    assert drive.cameras == ("dash",)
    for frame, rgb in zip(drive.frames(), reference):
        assert frame.encoding == "jpeg" and (frame.height, frame.width) == (72, 128)
        assert np.abs(frame.rgb().astype(np.int16) - rgb).mean() < 4
def test_open_drive_reads_a_video_file_directly():
    video = real_clip("day_freeway_two_cars.mp4")
    drive = open_drive(video)
    assert drive.kind == "video" and drive.cameras == ("front",) and drive.frame_count == 38
    assert drive.duration_ns == 37 * 40_000_000
    first = next(drive.frames())
    assert (first.height, first.width, first.stamp_ns) == (720, 1280, 0)
    assert list(drive.commands()) == []


# ---- progress bar -----------------------------------------------------------------------------------------










