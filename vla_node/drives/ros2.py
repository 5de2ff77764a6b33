"""ROS 2 bags in MCAP (profile "ros2", message encoding "cdr"): camera frames from sensor_msgs/msg/Image
(rgb8, bgr8, mono8, rgba8, bgra8; row `step` honoured) and sensor_msgs/msg/CompressedImage (jpeg kept as
JPEG, png decoded to rgb8), decoded with mcap_ros2's DecoderFactory, no ROS installation needed.

Camera name = the last component of the topic; stamps are the bag's log times relative to its first
message (header.stamp may be on another clock, e.g. simulation time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
from mcap.well_known import MessageEncoding
from mcap_ros2.decoder import DecoderFactory

from vla_node.drives.common import (
    MAX_SIDE,
    DriveFrame,
    McapDriveReader,
    McapIndex,
    drive_error,
    iter_mcap,
    jpeg_dims,
)
from vla_node.drives.video import decode_image
from vla_node.validate import show

IMAGE_SCHEMAS = ("sensor_msgs/msg/Image", "sensor_msgs/Image")
COMPRESSED_SCHEMAS = ("sensor_msgs/msg/CompressedImage", "sensor_msgs/CompressedImage")
# encoding -> (bytes per pixel, channel order that gives RGB)
RAW_ENCODINGS: dict[str, tuple[int, tuple[int, ...]]] = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, (0, 0, 0)),
}


def image_topics(index: McapIndex) -> list[str]:
    return sorted({ch.topic for ch in index.channels.values()
                   if ch.message_encoding == MessageEncoding.CDR
                   and index.schema_name(ch) in IMAGE_SCHEMAS + COMPRESSED_SCHEMAS})


def camera_name(topic: str) -> str:
    parts = [p for p in topic.split("/") if p]
    return parts[-1] if parts else topic


def _check_size(where: str, height: int, width: int) -> None:
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise ValueError(f"{where}: image size {width}x{height}, expected sides in 1..{MAX_SIDE}")


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a PNG's IHDR chunk, or None when `data` does not start like a PNG."""
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")


def _raw_image(msg: Any, where: str) -> tuple[str, int, int, bytes]:
    encoding = str(msg.encoding).lower()
    if encoding not in RAW_ENCODINGS:
        raise ValueError(f"{where}: unsupported image encoding {show(msg.encoding)}, "
                         f"expected one of {sorted(RAW_ENCODINGS)}")
    pixel_bytes, order = RAW_ENCODINGS[encoding]
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    _check_size(where, height, width)
    if step < width * pixel_bytes:
        raise ValueError(f"{where}: step {step} < width*{pixel_bytes} = {width * pixel_bytes} for {encoding}")
    data = msg.data
    need = (height - 1) * step + width * pixel_bytes
    if len(data) < need:
        raise ValueError(f"{where}: {len(data)} data bytes, expected at least {need} "
                         f"for {encoding} {width}x{height} step {step}")
    flat = np.frombuffer(data, np.uint8, count=need)
    rows = np.lib.stride_tricks.as_strided(flat, shape=(height, width * pixel_bytes), strides=(step, 1))  # (H, W*C)
    pixels = rows.reshape(height, width, pixel_bytes)  # (H, W, C)
    if encoding == "rgb8":
        return "rgb8", height, width, pixels.tobytes()
    return "rgb8", height, width, np.ascontiguousarray(pixels[:, :, list(order)]).tobytes()


def _compressed_image(msg: Any, where: str) -> tuple[str, int, int, bytes]:
    fmt = str(msg.format).lower()
    data = bytes(msg.data)
    if "compresseddepth" in fmt:
        raise ValueError(f"{where}: unsupported image format {show(msg.format)} (depth), expected jpeg or png")
    if "jpeg" in fmt or "jpg" in fmt:
        try:
            height, width = jpeg_dims(data)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        _check_size(where, height, width)
        return "jpeg", height, width, data
    if "png" in fmt:
        size = _png_size(data)
        if size is None:
            raise ValueError(f"{where}: not a PNG (no signature and IHDR chunk)")
        _check_size(where, *size)  # before the decoder allocates what the header claims
        rgb = decode_image(data, "png")
        return "rgb8", rgb.shape[0], rgb.shape[1], rgb.tobytes()
    raise ValueError(f"{where}: unsupported image format {show(msg.format)}, expected jpeg or png")


class Ros2DriveReader(McapDriveReader):
    kind = "ros2"

    def __init__(self, path: Path, index: McapIndex, topics: list[str]) -> None:
        self.index = index
        self.topics = {camera_name(t): t for t in topics}
        if len(self.topics) != len(topics):
            raise drive_error(path, f"image topics {topics} share a camera name (last topic component); "
                                    f"open one of them with topic=...")
        self._compressed = {t for t in topics if index.schema_name(self._channel(t)) in COMPRESSED_SCHEMAS}
        counts = index.topic_counts()
        frame_count = sum(counts.get(t, 0) for t in topics)
        if frame_count == 0:
            raise drive_error(path, f"empty drive: no image messages on {topics}")
        super().__init__(path, tuple(self.topics), frame_count, index.end_ns - index.start_ns)
        self._first = {camera: self._first_frame(camera) for camera in self.topics}  # (frame, source encoding)

    def _channel(self, topic: str):
        return next(ch for ch in self.index.channels.values() if ch.topic == topic)

    def _first_frame(self, camera: str) -> tuple[DriveFrame, str]:
        for item in self._frames([self.topics[camera]]):
            return item
        raise drive_error(self.path, f"empty drive: no image messages on {self.topics[camera]!r}")

    def _frames(self, topics: list[str]) -> Iterator[tuple[DriveFrame, str]]:
        seqs = {t: 0 for t in topics}
        for _schema, channel, message, msg in iter_mcap(self.path, topics, (DecoderFactory(),)):
            topic = channel.topic
            where = f"{topic!r} at log time {message.log_time}"
            try:
                if topic in self._compressed:
                    source = str(msg.format)
                    encoding, height, width, payload = _compressed_image(msg, where)
                else:
                    source = str(msg.encoding)
                    encoding, height, width, payload = _raw_image(msg, where)
            except ValueError as e:
                raise drive_error(self.path, e) from e
            except (AttributeError, TypeError) as e:  # a schema whose fields are not sensor_msgs' (missing, mistyped)
                raise drive_error(self.path, f"{where}: not a {self.index.schema_name(channel) or 'known'} message "
                                             f"({type(e).__name__}: {e})") from e
            seq = seqs[topic]
            seqs[topic] = seq + 1
            stamp_ns = self.index.relative_ns(self.path, topic, message.log_time)
            yield DriveFrame(camera_name(topic), seq, stamp_ns, encoding, height, width,
                             payload), source
