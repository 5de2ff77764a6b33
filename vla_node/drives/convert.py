"""Turn footage into native drives: a video file (`convert_video`) or a synthetic drive (`convert_synthetic`).

Frames keep their stamps from 0 (the video's presentation times, or the resampled ticks), sequence numbers
from 0, raw RGB (`rgb8`) or JPEG from FFmpeg's mjpeg encoder (`jpeg`). The drive is written next to its
destination and renamed into place when complete, so a failed conversion leaves no half drive behind.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from vla_node.drives.native import DriveWriter
from vla_node.drives.synthetic import SyntheticDrive, SyntheticDriveConfig
from vla_node.drives.video import JpegEncoder, decode_video, probe_video, resampled_count
from vla_node.progress import Progress

ENCODINGS = ("rgb8", "jpeg")


@dataclasses.dataclass(frozen=True)
class ConvertSummary:
    """What a conversion wrote: frame count, the span from first to last stamp, and the drive's size."""

    frames: int
    duration_s: float
    bytes: int


def _write_drive(
    frames: Iterator[tuple[int, np.ndarray]],
    out: os.PathLike | str,
    *,
    total: int | None,
    label: str,
    encoding: str,
    camera: str,
    progress: bool,
    jpeg_qscale: int,
    compression: str,
    metadata: dict[str, str],
) -> ConvertSummary:
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding = {encoding!r}: expected one of {list(ENCODINGS)}")
    encoder = JpegEncoder(jpeg_qscale) if encoding == "jpeg" else None
    out = Path(out)
    partial = out.with_name(out.name + ".part")
    count, first_ns, last_ns = 0, 0, 0
    try:
        with DriveWriter(partial, compression=compression) as writer, \
                Progress(total, label, enabled=progress) as bar:
            writer.add_metadata("vla-node.source", {**metadata, "encoding": encoding, "camera": camera})
            for stamp_ns, rgb in frames:
                height, width = rgb.shape[:2]
                payload = encoder.encode(rgb) if encoder is not None else rgb.tobytes()
                writer.add_frame(camera, count, stamp_ns, encoding, height, width, payload)
                if count == 0:
                    first_ns = stamp_ns
                last_ns = stamp_ns
                count += 1
                bar.update(1)
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return ConvertSummary(frames=count, duration_s=(last_ns - first_ns) / 1e9, bytes=out.stat().st_size)


def convert_video(
    video: os.PathLike | str,
    out: os.PathLike | str,
    fps: float | None = None,
    size: tuple[int, int] | None = None,
    encoding: str = "rgb8",
    camera: str = "front",
    progress: bool = True,
    *,
    jpeg_qscale: int = 3,
    max_frames: int | None = None,
    compression: str = "zstd",
) -> ConvertSummary:
    """Convert a video file into a native drive at `out`.

    fps: resample (None keeps the source rate); size: (width, height); encoding: "rgb8" or "jpeg";
    jpeg_qscale: 2 (best) .. 31 (FFmpeg -q:v); max_frames: stop early; progress: a bar on stderr.
    Raises DriveError when the video cannot be read."""
    info = probe_video(video)
    total = info.frames if fps is None else resampled_count(info.duration_s, fps)
    if max_frames is not None:
        total = min(total, max_frames)
    metadata = {"video": Path(video).name, "source_fps": f"{info.fps:g}", "source_size": f"{info.width}x{info.height}",
                "fps": "source" if fps is None else f"{fps:g}",
                "size": "source" if size is None else f"{size[0]}x{size[1]}"}
    frames = decode_video(video, fps=fps, size=size, max_frames=max_frames)
    return _write_drive(frames, out, total=total, label=f"convert {Path(video).name}", encoding=encoding,
                        camera=camera, progress=progress, jpeg_qscale=jpeg_qscale, compression=compression,
                        metadata=metadata)


def convert_synthetic(
    config: SyntheticDriveConfig,
    out: os.PathLike | str,
    encoding: str = "rgb8",
    camera: str = "front",
    progress: bool = True,
    *,
    jpeg_qscale: int = 3,
    compression: str = "zstd",
) -> ConvertSummary:
    """Write the synthetic drive `config` describes as a native drive at `out` (demos without footage)."""
    drive = SyntheticDrive(config)
    metadata = {"synthetic": repr(config),
                "scene_cut_indices": ",".join(str(i) for i in drive.scene_cut_indices)}
    return _write_drive(drive.frames(), out, total=drive.frame_count, label="synthetic drive", encoding=encoding,
                        camera=camera, progress=progress, jpeg_qscale=jpeg_qscale, compression=compression,
                        metadata=metadata)
