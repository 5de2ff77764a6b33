"""Drives in: `open_drive` reads a native vla-node MCAP drive, a ROS 2 MCAP bag, or a video file, and gives
one `DriveReader` interface over them. `DriveWriter` writes native drives.

    with DriveWriter("run.mcap") as w:
        w.add_frame("front", seq, stamp_ns, "rgb8", 480, 640, rgb.tobytes())
    drive = open_drive("run.mcap")
    for frame in drive.frames():      # DriveFrame(camera, seq, stamp_ns, encoding, height, width, payload)
        pixels = frame.rgb()          # HxWx3 uint8

Every failure to read (missing file, corrupt or truncated MCAP, unknown topic, unsupported encoding, empty
drive) is a `DriveError` with a one-line message naming the path and the problem.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from vla_node.drives.common import (
    DriveFrame,
    DriveInfo,
    DriveMessage,
    DriveReader,
    drive_error,
    is_mcap,
    read_mcap_index,
)
from vla_node.drives.native import NATIVE_PROFILE, DriveWriter, NativeDriveReader
from vla_node.drives.ros2 import Ros2DriveReader, camera_name, image_topics
from vla_node.drives.video import DriveError, decode_video, probe_video

__all__ = [
    "DriveError",
    "DriveFrame",
    "DriveInfo",
    "DriveMessage",
    "DriveReader",
    "DriveWriter",
    "open_drive",
    "VIDEO_CAMERA",
]

VIDEO_CAMERA = "front"  # the camera name a video file's frames carry


class VideoDriveReader(DriveReader):
    """A video file as a one-camera drive at its own rate (resample with video.decode_video or convert)."""

    kind = "video"

    def __init__(self, path: Path) -> None:
        self.video = probe_video(path)
        # first to last frame's stamp (a variable-rate clip's too)
        super().__init__(path, (VIDEO_CAMERA,), self.video.frames, round(self.video.span_s * 1e9))

    def frames(self) -> Iterator[DriveFrame]:
        for seq, (stamp_ns, rgb) in enumerate(decode_video(self.path)):
            height, width = rgb.shape[:2]
            yield DriveFrame(VIDEO_CAMERA, seq, stamp_ns, "rgb8", height, width, rgb.tobytes())

    def info(self) -> DriveInfo:
        return DriveInfo(
            path=str(self.path),
            kind=self.kind,
            profile="",  # not an MCAP file
            cameras=self.cameras,
            topics={VIDEO_CAMERA: "frame/" + VIDEO_CAMERA},
            frame_count=self.frame_count,
            duration_s=self.duration_ns / 1e9,
            sizes={VIDEO_CAMERA: (self.video.width, self.video.height)},
            source_encodings={VIDEO_CAMERA: self.video.codec},
            other_topics={},
        )


def _select(path: Path, available: list[str], topic: str | None, aliases: dict[str, str]) -> list[str]:
    """All image topics, or the one `topic` names: exactly, up to a leading '/', or by its camera name
    (aliases: topic -> camera name)."""
    if not available:
        return []
    if topic is None:
        return available
    for candidate in (topic, "/" + topic.lstrip("/"), topic.lstrip("/")):
        if candidate in available:
            return [candidate]
    matches = [t for t in available if aliases.get(t) == topic]
    if len(matches) == 1:
        return matches
    if len(matches) > 1:
        raise drive_error(path, f"camera name {topic!r} matches several topics {matches}; pass the full topic")
    raise drive_error(path, f"no image topic {topic!r}; available: {available}")


def open_drive(path: os.PathLike | str, topic: str | None = None) -> DriveReader:
    """Open a drive for reading. `topic` selects one camera: a topic ("frame/front", "/cam/image_raw")
    or a camera name ("front"); None reads every camera of the drive."""
    p = Path(path)
    if not p.exists():
        raise drive_error(path, "no such file")
    if not p.is_file():
        raise drive_error(path, "not a regular file")
    if not is_mcap(p):
        try:
            reader = VideoDriveReader(p)
        except DriveError as e:
            raise drive_error(path, f"not a drive: neither an MCAP file nor a video "
                                    f"({str(e).removeprefix(f'{path}: ')})") from e
        _select(p, ["frame/" + VIDEO_CAMERA], topic, {"frame/" + VIDEO_CAMERA: VIDEO_CAMERA})
        return reader
    index = read_mcap_index(p)
    native = NativeDriveReader.frame_topics(index)
    ros2 = image_topics(index)
    if native and (index.profile == NATIVE_PROFILE or not ros2):
        chosen = _select(p, native, topic, {t: t.split("/", 1)[1] for t in native})
        return NativeDriveReader(p, index, tuple(t.split("/", 1)[1] for t in chosen))
    if ros2:
        chosen = _select(p, ros2, topic, {t: camera_name(t) for t in ros2})
        return Ros2DriveReader(p, index, chosen)
    counts = index.topic_counts()
    if not counts or sum(counts.values()) == 0:
        raise drive_error(path, f"empty drive: MCAP (profile {index.profile!r}) holds no messages")
    found = {ch.topic: f"{ch.message_encoding}/{index.schema_name(ch) or '-'}" for ch in index.channels.values()}
    raise drive_error(path, f"no image topics (profile {index.profile!r}, topics {found}); expected "
                            f"frame/<camera> msgpack channels or sensor_msgs/msg/Image|CompressedImage cdr channels")
