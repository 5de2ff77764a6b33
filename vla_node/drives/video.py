"""Video and still-image decoding with PyAV: mp4 -> RGB frames at a chosen rate and size, JPEG/PNG bytes
<-> RGB arrays. The only module that imports `av`.

Stamps are integer nanoseconds from the first decoded frame (the stream's presentation time, edit lists
honoured). Resampling to a requested rate picks, for each output tick k/fps, the latest source frame at or
before the tick (drop or repeat, never blend); a source frame is shown until the next one starts, so a
clip of duration D gives ceil(D * fps) output frames.
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import av
import numpy as np

from vla_node.validate import ConfigError, is_int

NS_PER_S = 1_000_000_000
RESIZE_INTERPOLATION = "AREA"  # one fixed filter so every path that resizes gives identical pixels


class DriveError(Exception):
    """A drive or video cannot be read: the one-line message names the path and the problem.

    Raised by video.py and drive.py (re-exported there); callers catch this one type."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def _drive_error(path: os.PathLike | str, problem: str) -> DriveError:
    return DriveError(f"{path}: {one_line(problem)}")


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """What a video file holds; `frames` counts decodable frames (edit lists honoured); `span_s` runs from the first
    frame's stamp to the last's (duration_s less the last frame's display time)."""

    width: int
    height: int
    fps: float
    frames: int
    duration_s: float
    codec: str
    span_s: float = 0.0


def _check_size(size: tuple[int, int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    ok = (
        isinstance(size, (tuple, list))
        and len(size) == 2
        and all(is_int(v) and 0 < v <= 16384 for v in size)
    )
    if not ok:
        raise ConfigError(f"size = {size!r}: expected (width, height), two integers in 1..16384")
    return int(size[0]), int(size[1])


def _check_fps(fps: float | None) -> float | None:
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (0 < fps <= 1000) or not math.isfinite(fps):
        raise ConfigError(f"fps = {fps!r}: expected a number in (0, 1000] or None for the source rate")
    return float(fps)


def _open_container(path: os.PathLike | str) -> av.container.InputContainer:
    p = Path(path)
    if not p.exists():
        raise _drive_error(path, "no such file")
    if not p.is_file():
        raise _drive_error(path, "not a regular file")
    try:
        return av.open(str(p), mode="r")
    except av.error.FFmpegError as e:
        raise _drive_error(path, f"not a video PyAV can open ({type(e).__name__}: {e})") from e


def _video_stream(container: av.container.InputContainer, path: os.PathLike | str) -> av.video.stream.VideoStream:
    if not container.streams.video:
        kinds = [s.type for s in container.streams] or ["none"]
        container.close()
        raise _drive_error(path, f"has no video stream (streams: {', '.join(kinds)})")
    return container.streams.video[0]


def _frame_period(stream: av.video.stream.VideoStream) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0:
        return Fraction(1, 25)  # containers without a rate: assume the common dashcam rate
    return 1 / Fraction(rate)


def probe_video(path: os.PathLike | str) -> VideoInfo:
    """Size, rate, frame count, duration and codec of the first video stream (demuxes, does not decode)."""
    container = _open_container(path)
    try:
        stream = _video_stream(container, path)
        ctx = stream.codec_context
        period = _frame_period(stream)
        frames = 0
        first_pts = last_pts = None
        try:
            for packet in container.demux(stream):
                if packet.size > 0 and packet.pts is not None and not packet.is_discard:
                    frames += 1
                    first_pts = packet.pts if first_pts is None else min(first_pts, packet.pts)
                    last_pts = packet.pts if last_pts is None else max(last_pts, packet.pts)
        except av.error.FFmpegError as e:
            raise _drive_error(path, f"corrupt video stream ({type(e).__name__}: {e})") from e
        if frames == 0:
            raise _drive_error(path, "video stream holds no frames")
        if stream.duration is not None and stream.time_base is not None:
            duration = float(stream.duration * stream.time_base)
        else:
            duration = float(frames * period)
        return VideoInfo(
            width=int(ctx.width),
            height=int(ctx.height),
            fps=float(1 / period),
            frames=frames,
            duration_s=duration,
            codec=str(ctx.name),
            span_s=float((last_pts - first_pts) * (stream.time_base or 0) or (frames - 1) * period),
        )
    finally:
        container.close()


def _to_rgb(frame: av.VideoFrame, size: tuple[int, int] | None) -> np.ndarray:
    if size is None or (frame.width, frame.height) == size:
        return frame.to_ndarray(format="rgb24")
    return frame.reformat(
        width=size[0], height=size[1], format="rgb24", interpolation=RESIZE_INTERPOLATION
    ).to_ndarray()


def _decoded(container, stream, path) -> Iterator[tuple[int, av.VideoFrame]]:
    """(stamp_ns from the first frame, frame) in presentation order; FFmpeg errors become DriveError."""
    time_base = stream.time_base or Fraction(1, NS_PER_S)
    period = _frame_period(stream)
    first_pts = None
    count = 0
    frames = container.decode(stream)
    while True:
        try:
            frame = next(frames)
        except StopIteration:
            return
        except av.error.FFmpegError as e:
            raise _drive_error(path, f"corrupt video stream after {count} frames ({type(e).__name__}: {e})") from e
        if frame.pts is None:  # no timestamps: assume the nominal rate
            stamp_ns = round(count * period * NS_PER_S)
        else:
            if first_pts is None:
                first_pts = frame.pts
            stamp_ns = round((frame.pts - first_pts) * time_base * NS_PER_S)
        count += 1
        yield stamp_ns, frame


def decode_video(
    path: os.PathLike | str,
    fps: float | None = None,
    size: tuple[int, int] | None = None,
    max_frames: int | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """An iterator of (stamp_ns, rgb HxWx3 uint8) over the first video stream of `path`.

    fps: None keeps every source frame with its own stamp; a number resamples to ticks k/fps (stamps are
    the ticks), each showing the latest source frame at or before it. size: (width, height) to resize to.
    max_frames: stop after that many output frames. Each yielded array is new and writable.

    Arguments and the file are checked here, before iteration: a missing file, a non-video or a file
    without a video stream raise DriveError at the call; corrupt data later raises DriveError mid-stream."""
    fps = _check_fps(fps)
    size = _check_size(size)
    if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 0):
        raise ValueError(f"max_frames = {max_frames!r}: expected a non-negative integer or None")
    container = _open_container(path)
    stream = _video_stream(container, path)
    stream.thread_type = "AUTO"
    return _decode_frames(container, stream, path, fps, size, max_frames)


def _decode_frames(
    container, stream, path, fps: float | None, size: tuple[int, int] | None, max_frames: int | None
) -> Iterator[tuple[int, np.ndarray]]:
    try:
        if max_frames == 0:
            return
        emitted = 0
        if fps is None:
            for stamp_ns, frame in _decoded(container, stream, path):
                yield stamp_ns, _to_rgb(frame, size)
                emitted += 1
                if emitted == max_frames:
                    return
            return
        yield from _resampled(container, stream, path, fps, size, max_frames)
    finally:
        container.close()


def _resampled(
    container, stream, path, fps: float, size: tuple[int, int] | None, max_frames: int | None
) -> Iterator[tuple[int, np.ndarray]]:
    """Ticks k/fps; the frame shown at a tick is the latest with stamp <= tick; the last frame lasts until the
    stream's end (its duration), or one nominal frame period where the stream has no duration: so a clip of
    duration D gives ceil(D * fps) frames, as resampled_count says."""
    tick_period = Fraction(fps).limit_denominator(1_000_000)
    emitted = 0
    held: av.VideoFrame | None = None
    held_stamp = 0
    held_rgb: np.ndarray | None = None

    def tick_ns(k: int) -> int:
        return round(Fraction(k * NS_PER_S) / tick_period)

    def emit_held() -> np.ndarray:
        nonlocal held_rgb
        if held_rgb is None:
            held_rgb = _to_rgb(held, size)
            return held_rgb
        return held_rgb.copy()  # a repeated frame: every yielded array is its own

    for stamp_ns, frame in _decoded(container, stream, path):
        if held is not None:
            while tick_ns(emitted) < stamp_ns:
                yield tick_ns(emitted), emit_held()
                emitted += 1
                if emitted == max_frames:
                    return
        held, held_stamp, held_rgb = frame, stamp_ns, None
    if held is None:
        raise _drive_error(path, "video stream holds no frames")
    end_ns = held_stamp + round(_frame_period(stream) * NS_PER_S)
    if stream.duration is not None and stream.time_base is not None:  # the stream's end, as probe_video's duration
        end_ns = round(stream.duration * stream.time_base * NS_PER_S)  # (a variable-rate clip's last frame is longer)
    while tick_ns(emitted) < end_ns:
        yield tick_ns(emitted), emit_held()
        emitted += 1
        if emitted == max_frames:
            return


def resampled_count(duration_s: float, fps: float) -> int:
    """Frames decode_video gives for a clip of `duration_s` resampled to `fps` (ceil(duration * fps))."""
    return math.ceil(duration_s * fps - 1e-9)


# ---- still images -------------------------------------------------------------------------------------

_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(height, width) from a JPEG's start-of-frame header without decoding; ValueError if there is none."""
    view = memoryview(data)
    if len(view) < 4 or view[0] != 0xFF or view[1] != 0xD8:
        raise ValueError("not a JPEG (no SOI marker)")
    i = 2
    n = len(view)
    while i + 4 <= n:
        if view[i] != 0xFF:
            raise ValueError(f"not a JPEG (bad marker at byte {i})")
        marker = view[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # standalone markers
            i += 2
            continue
        length = (view[i + 2] << 8) | view[i + 3]
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                break
            height = (view[i + 5] << 8) | view[i + 6]
            width = (view[i + 7] << 8) | view[i + 8]
            if height == 0 or width == 0:
                raise ValueError(f"JPEG declares a {width}x{height} image")
            return height, width
        if marker == 0xDA:  # start of scan before any frame header
            break
        i += 2 + length
    raise ValueError("JPEG has no start-of-frame header")


def decode_image(data: bytes, codec: str) -> np.ndarray:
    """Decode one still image (codec "jpeg" or "png") to RGB HxWx3 uint8; ValueError on bad data."""
    names = {"jpeg": "mjpeg", "png": "png"}
    if codec not in names:
        raise ValueError(f"codec = {codec!r}: expected one of {sorted(names)}")
    ctx = av.CodecContext.create(names[codec], "r")
    try:
        frames = ctx.decode(av.Packet(bytes(data))) + ctx.decode(None)
    except av.error.FFmpegError as e:
        raise ValueError(f"undecodable {codec} image ({type(e).__name__}: {one_line(e)})") from e
    if len(frames) != 1:
        raise ValueError(f"undecodable {codec} image ({len(frames)} frames decoded, expected 1)")
    return frames[0].to_ndarray(format="rgb24")


class JpegEncoder:
    """RGB HxWx3 uint8 -> JPEG bytes with FFmpeg's mjpeg encoder at a fixed quantiser.

    qscale: 2 (best) .. 31 (smallest), FFmpeg's `-q:v`. One encoder serves one frame size; a new size
    reopens it."""

    def __init__(self, qscale: int = 3) -> None:
        if isinstance(qscale, bool) or not isinstance(qscale, int) or not 2 <= qscale <= 31:
            raise ValueError(f"qscale = {qscale!r}: expected an integer in 2..31 (lower is better quality)")
        self.qscale = qscale
        self._ctx = None
        self._shape: tuple[int, int] | None = None

    def _open(self, height: int, width: int) -> None:
        ctx = av.CodecContext.create("mjpeg", "w")
        ctx.width = width
        ctx.height = height
        ctx.pix_fmt = "yuvj420p"
        ctx.time_base = Fraction(1, 25)
        ctx.qmin = self.qscale
        ctx.qmax = self.qscale
        ctx.open()
        self._ctx = ctx
        self._shape = (height, width)

    def encode(self, rgb: np.ndarray) -> bytes:
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ValueError(f"rgb: expected an HxWx3 uint8 array, got {rgb.dtype} {rgb.shape}")
        height, width = rgb.shape[:2]
        if self._shape != (height, width):
            self._open(height, width)
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24").reformat(format="yuvj420p")
        packets = self._ctx.encode(frame)
        if len(packets) != 1:  # mjpeg is intra-only: one packet per frame
            raise RuntimeError(f"mjpeg encoder returned {len(packets)} packets for one frame, expected 1")
        return bytes(packets[0])
