"""Video decoding with PyAV: real clips against their manifest, resampling, resizing, still images, errors."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from helpers.clips import write_mp4
from helpers.paths import DRIVES_DIR
from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.drives.video import (
    DriveError,
    JpegEncoder,
    decode_image,
    decode_video,
    jpeg_size,
    probe_video,
    resampled_count,
)

DRIVES = DRIVES_DIR


@pytest.fixture(scope="module")
def synthetic_mp4(tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    config = SyntheticDriveConfig(width=160, height=96, fps=25.0, seconds=1.2, seed=2)
    frames = [rgb for _, rgb in synthetic_frames(config)]
    path = tmp_path_factory.mktemp("video") / "synthetic.mp4"
    write_mp4(path, frames)
    return path, frames


# ---- any machine: a clip written here -------------------------------------------------------------------
def test_probe_and_decode_a_written_mp4(synthetic_mp4):
    path, source = synthetic_mp4
    info = probe_video(path)
    assert (info.width, info.height, info.frames, info.codec) == (160, 96, 30, "h264")
    assert info.fps == 25.0 and info.duration_s == pytest.approx(1.2)
    decoded = list(decode_video(path))
    assert [s for s, _ in decoded] == [k * 40_000_000 for k in range(30)]
    for (_, rgb), original in zip(decoded, source):
        assert rgb.shape == (96, 160, 3) and rgb.dtype == np.uint8
        assert np.abs(rgb.astype(np.int16) - original).mean() < 4  # lossy H.264 at crf 18
    # every yielded array is its own, writable
    decoded[0][1][0, 0] = 0
    assert decoded[0][1].flags.writeable
def test_resampling_picks_the_frame_at_or_before_each_tick(synthetic_mp4):
    path, _ = synthetic_mp4
    source = [rgb for _, rgb in decode_video(path)]
    for fps in (10.0, 7.5, 60.0):
        out = list(decode_video(path, fps=fps))
        assert len(out) == resampled_count(1.2, fps) == math.ceil(1.2 * fps - 1e-9)
        for k, (stamp_ns, rgb) in enumerate(out):
            assert stamp_ns == round(k * 1e9 / fps)
            expected = source[math.floor(Fraction(k) / Fraction(fps) * 25)]  # latest source frame <= tick
            assert np.array_equal(rgb, expected), (fps, k)
    repeated = list(decode_video(path, fps=50.0))
    assert np.array_equal(repeated[0][1], repeated[1][1]) and repeated[0][1] is not repeated[1][1]
def test_a_variable_rate_clip_resamples_to_its_count_and_spans_its_stamps(tmp_path):
    """Frames at 0, 0.1, 0.2, 0.3 and 1.0 s: the last one lasts to the stream's end, so resampling gives the
    count resampled_count promises (the convert progress total), and the drive spans first to last stamp."""
    from vla_node.drives.open import open_drive

    path = tmp_path / "vfr.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.time_base, stream.codec_context.max_b_frames = Fraction(1, 10), 0
        for pts in (0, 1, 2, 3, 10):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), pts * 20, np.uint8), format="rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 10)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    info = probe_video(path)
    stamps = [stamp for stamp, _ in decode_video(path)]
    assert stamps[-1] == 1_000_000_000 and info.span_s == pytest.approx(1.0)
    assert sum(1 for _ in decode_video(path, fps=10.0)) == resampled_count(info.duration_s, 10.0)
    assert open_drive(path).duration_ns == stamps[-1] - stamps[0]


def test_resize_and_max_frames(synthetic_mp4):
    path, _ = synthetic_mp4
    out = list(decode_video(path, size=(80, 48), max_frames=5))
    assert len(out) == 5 and all(rgb.shape == (48, 80, 3) for _, rgb in out)
    assert len(list(decode_video(path, fps=10.0, max_frames=3))) == 3
    assert list(decode_video(path, max_frames=0)) == []
    with pytest.raises(ValueError, match=r"size = \(0, 48\)"):
        decode_video(path, size=(0, 48))
    with pytest.raises(ValueError, match="fps = -1"):
        decode_video(path, fps=-1)
    with pytest.raises(ValueError, match="max_frames = -2"):
        decode_video(path, max_frames=-2)
def test_missing_non_video_and_audio_only_files_raise_one_line_drive_errors(tmp_path):
    missing = tmp_path / "nope.mp4"
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 50)
    audio = tmp_path / "tone.wav"
    with av.open(str(audio), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        samples = (np.sin(np.arange(8000) / 5) * 3000).astype(np.int16)[None, :]  # (1 channel, 8000)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    cases = {missing: "no such file", text: "not a video", audio: "no video stream", tmp_path: "not a regular file"}
    for path, problem in cases.items():
        for call in (lambda: probe_video(path), lambda: decode_video(path)):  # raised at the call
            with pytest.raises(DriveError) as err:
                call()
            message = str(err.value)
            assert message.startswith(f"{path}: ") and problem in message and "\n" not in message
def test_jpeg_encoder_round_trip_size_and_quality():
    rgb = next(synthetic_frames(SyntheticDriveConfig(width=176, height=99, seconds=1.0, seed=4)))[1]
    best, small = JpegEncoder(2).encode(rgb), JpegEncoder(20).encode(rgb)
    assert jpeg_size(best) == (99, 176)
    assert len(small) < len(best)
    for data, bound in ((best, 3.0), (small, 8.0)):
        back = decode_image(data, "jpeg")
        assert back.shape == rgb.shape and np.abs(back.astype(np.int16) - rgb).mean() < bound
    encoder = JpegEncoder(3)  # one encoder, two sizes
    assert jpeg_size(encoder.encode(rgb)) == (99, 176)
    assert jpeg_size(encoder.encode(np.zeros((32, 48, 3), np.uint8))) == (32, 48)
    with pytest.raises(ValueError, match="qscale = 1"):
        JpegEncoder(1)
    with pytest.raises(ValueError, match="not a JPEG"):
        jpeg_size(b"\x89PNG\r\n\x1a\n" + bytes(20))
    with pytest.raises(ValueError, match="undecodable jpeg"):
        decode_image(b"\xff\xd8\xff" + bytes(40), "jpeg")
def test_png_decodes_exactly():
    rgb = np.random.default_rng(0).integers(0, 256, (21, 34, 3), dtype=np.uint8)
    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = 34, 21, "rgb24", Fraction(1, 25)
    data = bytes(ctx.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24"))[0])
    assert np.array_equal(decode_image(data, "png"), rgb)


# ---- the real clips (skipped where /work/shared/data/drives is absent) -------------------------------------






