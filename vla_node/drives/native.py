"""Native drives: MCAP files with profile "vla-node" whose channels mirror wire protocol v1, in schemas Foxglove
shows without plugins (drives/foxglove.py).

Channels: `frame/<camera>` (one per camera), `instruction`, `state`, and when recorded `action`, `health`, with
`chunk` and `timing` derived from each action. A frame is a foxglove.RawImage (rgb8, bgr8) or
foxglove.CompressedImage (jpeg), protobuf, its frame_id the camera and its MCAP sequence the frame's seq (mod 2^32);
every other message is its header map as JSON with a JSON schema. Log time = publish time = the message's capture
stamp in ns. Drives written before (msgpack channels without schemas: the frame header map plus `data`, the other
maps as they are) read the same.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import msgpack
import numpy as np
from mcap.well_known import MessageEncoding
from mcap.writer import CompressionType, Writer

from vla_node.drives.common import (
    MAX_SIDE,
    DriveFrame,
    DriveMessage,
    McapDriveReader,
    McapIndex,
    drive_error,
    iter_mcap,
    jpeg_dims,
)
from vla_node.drives.foxglove import (
    IMAGE_SCHEMAS,
    JSON,
    JSONSCHEMA,
    PROTOBUF,
    ImageDecoder,
    encode_image,
    encode_json,
    image_schema,
    json_messages,
    json_schema,
)
from vla_node.validate import ConfigError, show

NATIVE_PROFILE = "vla-node"
FRAME_PREFIX = "frame/"
WIRE_VERSION = 1
WIRE_ENCODINGS = ("rgb8", "bgr8", "jpeg")
COMPRESSIONS = {"zstd": CompressionType.ZSTD, "lz4": CompressionType.LZ4, "none": CompressionType.NONE}
# msgpack limits for reading: generous for frames and action chunks, bounded for untrusted files
UNPACK_LIMITS = dict(max_str_len=1 << 20, max_bin_len=MAX_SIDE * MAX_SIDE * 3, max_array_len=1 << 20,
                     max_map_len=1 << 12, max_ext_len=0)
SEQUENCE_MASK = 0xFFFFFFFF  # MCAP's sequence field is uint32


def _library() -> str:
    try:
        return f"vla-node {importlib.metadata.version('vla-node')}"
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "vla-node"


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} = {value!r}: expected an integer")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name} = {value!r}: expected an integer in {low}..{high if high is not None else 'inf'}")
    return int(value)


class DriveWriter:
    """Write a native drive. Usable as a context manager; close() (MCAP finish) also runs on an exception,
    so an interrupted recording stays a readable drive."""

    def __init__(
        self,
        path: os.PathLike | str,
        profile: str = NATIVE_PROFILE,
        compression: str = "zstd",
        chunk_size: int = 4 << 20,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ConfigError(f"compression = {compression!r}: expected one of {sorted(COMPRESSIONS)}")
        _check_int("chunk_size", chunk_size, 1024, 1 << 30)
        self.path = Path(path)
        self._file = open(self.path, "wb")
        try:
            self._writer = Writer(self._file, chunk_size=chunk_size, compression=COMPRESSIONS[compression])
            self._writer.start(profile=profile, library=_library())
        except BaseException:
            self._file.close()
            raise
        self._channels: dict[tuple[str, str], int] = {}  # (topic, schema name) -> channel id
        self._schemas: dict[str, int] = {}  # schema name -> schema id
        self._closed = False
        self.frames_written = 0
        self.messages_written = 0

    def _channel(self, topic: str, schema: tuple[str, str, bytes], message_encoding: str,
                 metadata: dict[str, str]) -> int:
        """The channel of `topic` in `schema` (name, encoding, data), registered on first use (a camera that
        switches between raw and JPEG has a channel per schema on its topic)."""
        name = schema[0]
        cid = self._channels.get((topic, name))
        if cid is None:
            sid = self._schemas.get(name)
            if sid is None:
                sid = self._schemas[name] = self._writer.register_schema(*schema)
            cid = self._channels[(topic, name)] = self._writer.register_channel(
                topic=topic, message_encoding=message_encoding, schema_id=sid, metadata=metadata)
        return cid

    def _add_json(self, topic: str, stamp_ns: int, sequence: int, message: Mapping[str, Any]) -> None:
        try:
            data = encode_json(message)
        except (TypeError, ValueError) as e:
            raise ValueError(f"header_map for {topic!r} cannot be written as JSON: {e}") from e
        name, schema = json_schema(topic)
        cid = self._channel(topic, (name, JSONSCHEMA, schema), JSON, {})
        self._writer.add_message(channel_id=cid, log_time=stamp_ns, publish_time=stamp_ns, sequence=sequence,
                                 data=data)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: drive writer is closed")

    def add_frame(self, camera: str, seq: int, stamp_ns: int, encoding: str, height: int, width: int,
                  payload: bytes | bytearray | memoryview) -> None:
        """Append one frame; payload is height*width*3 bytes for rgb8/bgr8, a JPEG for jpeg."""
        self._check_open()
        if not isinstance(camera, str) or not camera or "/" in camera:
            raise ConfigError(f"camera = {camera!r}: expected a non-empty name without '/'")
        if encoding not in WIRE_ENCODINGS:
            raise ConfigError(f"encoding = {encoding!r}: expected one of {list(WIRE_ENCODINGS)}")
        seq = _check_int("seq", seq, 0)
        stamp_ns = _check_int("stamp_ns", stamp_ns, 0, (1 << 64) - 1)
        height = _check_int("height", height, 1, MAX_SIDE)
        width = _check_int("width", width, 1, MAX_SIDE)
        data = bytes(payload)
        if encoding != "jpeg" and len(data) != height * width * 3:
            raise ValueError(f"payload: {len(data)} bytes, expected height*width*3 = {height * width * 3} "
                             f"for {encoding} {width}x{height}")
        schema_name, message = encode_image(camera, stamp_ns, encoding, height, width, data)
        cid = self._channel(FRAME_PREFIX + camera, image_schema(schema_name), PROTOBUF, {"camera": camera})
        self._writer.add_message(channel_id=cid, log_time=stamp_ns, publish_time=stamp_ns,
                                 sequence=seq & SEQUENCE_MASK, data=message)
        self.frames_written += 1

    def add_message(self, topic: str, stamp_ns: int, header_map: Mapping[str, Any]) -> None:
        """Append a command or output message (instruction, state, action, health): its header map as is
        (numpy arrays and scalars in it become plain lists and numbers); an action adds its chunk and timing
        channels' messages."""
        self._check_open()
        if not isinstance(topic, str) or not topic or topic.startswith(FRAME_PREFIX):
            raise ValueError(f"topic = {topic!r}: expected a non-frame topic such as 'instruction' "
                             f"(frames go through add_frame)")
        if not isinstance(header_map, Mapping):
            raise ValueError(f"header_map for {topic!r}: expected a map, got {type(header_map).__name__}")
        stamp_ns = _check_int("stamp_ns", stamp_ns, 0, (1 << 64) - 1)
        seq = header_map.get("seq", 0)
        sequence = int(seq) & SEQUENCE_MASK if isinstance(seq, (int, np.integer)) and not isinstance(seq, bool) else 0
        for channel_topic, message in json_messages(topic, header_map).items():
            self._add_json(channel_topic, stamp_ns, sequence, message)
        self.messages_written += 1

    def add_metadata(self, name: str, data: Mapping[str, str]) -> None:
        """A named string map stored in the drive (e.g. where it was converted from)."""
        self._check_open()
        self._writer.add_metadata(name, {str(k): str(v) for k, v in data.items()})

    def close(self) -> None:
        """Finish the MCAP (summary, footer) and close the file; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.finish()
        finally:
            self._file.close()

    def __enter__(self) -> "DriveWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- reading ---------------------------------------------------------------------------------------


def _unpack(path: Path, topic: str, log_time: int, data: bytes, encoding: str = MessageEncoding.MessagePack
            ) -> dict[str, Any]:
    """A message map from msgpack (drives written before) or JSON."""
    try:
        if encoding == JSON:
            value = json.loads(data)
        else:
            value = msgpack.unpackb(data, raw=False, strict_map_key=True, **UNPACK_LIMITS)
    except Exception as e:  # noqa: BLE001 - malformed msgpack raises ValueError subclasses, TypeError, UnicodeDecodeError, ...
        raise drive_error(path, f"message on {topic!r} at log time {log_time}: bad {encoding} "
                                f"({type(e).__name__}: {e})") from e
    if not isinstance(value, dict):
        raise drive_error(path, f"message on {topic!r} at log time {log_time}: expected a map, "
                                f"got {type(value).__name__}")
    return value


def _frame(path: Path, camera: str, topic: str, log_time: int, stamp_ns: int, m: dict[str, Any]) -> DriveFrame:
    def bad(problem: str) -> Exception:
        return drive_error(path, f"frame on {topic!r} at log time {log_time}: {problem}")

    if m.get("v") != WIRE_VERSION:
        raise bad(f"v = {show(m.get('v'))}, expected {WIRE_VERSION}")
    for key in ("seq", "stamp_ns", "height", "width"):
        value = m.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(f"{key} = {show(value)}, expected a non-negative integer")
    height, width, encoding, data = m["height"], m["width"], m.get("encoding"), m.get("data")
    if m.get("camera") != camera:
        raise bad(f"camera = {show(m.get('camera'))}, expected {show(camera)} (from the topic)")
    if encoding not in WIRE_ENCODINGS:
        raise bad(f"unsupported encoding {show(encoding)}, expected one of {list(WIRE_ENCODINGS)}")
    if not isinstance(data, bytes):
        raise bad(f"data is {type(data).__name__}, expected bytes")
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise bad(f"size {width}x{height} outside 1..{MAX_SIDE}")
    if encoding == "jpeg":
        try:
            jpeg_height, jpeg_width = jpeg_dims(data)
        except ValueError as e:
            raise bad(str(e)) from e
        if (jpeg_height, jpeg_width) != (height, width):
            raise bad(f"JPEG is {jpeg_width}x{jpeg_height}, header says {width}x{height}")
    elif len(data) != height * width * 3:
        raise bad(f"{len(data)} payload bytes, expected {height * width * 3} for {encoding} {width}x{height}")
    elif encoding == "bgr8":
        bgr = np.frombuffer(data, np.uint8).reshape(height, width, 3)  # (H, W, 3)
        data, encoding = bgr[:, :, ::-1].tobytes(), "rgb8"
    return DriveFrame(camera, m["seq"], stamp_ns, encoding, height, width, data)


class NativeDriveReader(McapDriveReader):
    kind = "native"

    def __init__(self, path: Path, index: McapIndex, cameras: tuple[str, ...]) -> None:
        self.index = index
        self.topics = {camera: FRAME_PREFIX + camera for camera in cameras}
        counts = index.topic_counts()
        frame_count = sum(counts.get(t, 0) for t in self.topics.values())
        if frame_count == 0:
            raise drive_error(path, f"empty drive: no frame messages on {sorted(self.topics.values())}")
        super().__init__(path, cameras, frame_count, index.end_ns - index.start_ns)
        self._first = {camera: self._first_frame(camera) for camera in cameras}  # (frame, stored encoding)

    @staticmethod
    def frame_topics(index: McapIndex) -> list[str]:
        return sorted({ch.topic for ch in index.channels.values() if ch.topic.startswith(FRAME_PREFIX) and (
            ch.message_encoding == MessageEncoding.MessagePack
            or (ch.message_encoding == PROTOBUF and index.schema_name(ch) in IMAGE_SCHEMAS))})

    def _first_frame(self, camera: str) -> tuple[DriveFrame, str]:
        for frame, stored_encoding in self._frames([self.topics[camera]]):
            return frame, stored_encoding
        raise drive_error(self.path, f"empty drive: no frame messages on {self.topics[camera]!r}")

    def _frames(self, topics: list[str]) -> Iterator[tuple[DriveFrame, str]]:
        decoders: dict[int, ImageDecoder] = {}
        for schema, channel, message in iter_mcap(self.path, topics):
            stamp_ns = self.index.relative_ns(self.path, channel.topic, message.log_time)
            camera = channel.topic[len(FRAME_PREFIX):]
            if channel.message_encoding == PROTOBUF:
                m = self._image(decoders, schema, channel.topic, message)
            else:
                m = _unpack(self.path, channel.topic, message.log_time, message.data)
            yield _frame(self.path, camera, channel.topic, message.log_time, stamp_ns, m), m["encoding"]

    def _image(self, decoders: dict[int, ImageDecoder], schema: Any, topic: str, message: Any) -> dict[str, Any]:
        """A Foxglove image message as the frame map _frame checks (seq from the MCAP sequence)."""
        where = f"frame on {topic!r} at log time {message.log_time}"
        if schema is None or schema.name not in IMAGE_SCHEMAS:
            raise drive_error(self.path, f"{where}: protobuf schema {show(getattr(schema, 'name', None))}, expected "
                                         f"one of {list(IMAGE_SCHEMAS)}")
        try:
            decoder = decoders.get(schema.id) or decoders.setdefault(schema.id, ImageDecoder(schema.name, schema.data))
            m = decoder.decode(message.data)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError, TypeError, KeyError on a bad schema
            raise drive_error(self.path, f"{where}: bad {schema.name} ({type(e).__name__}: {e})") from e
        if m["encoding"] == "jpeg":
            try:
                m["height"], m["width"] = jpeg_dims(m["data"])
            except ValueError as e:
                raise drive_error(self.path, f"{where}: {e}") from e
        elif schema.name == "foxglove.CompressedImage":  # png, webp, ...: the wire carries jpeg alone compressed
            raise drive_error(self.path, f"{where}: compressed image format {show(m['encoding'])}, expected 'jpeg'")
        elif m["step"] != m["width"] * 3:
            raise drive_error(self.path, f"{where}: step {m['step']}, expected width * 3 = {m['width'] * 3}")
        return {"v": WIRE_VERSION, "seq": message.sequence, **m}

    def messages(self, topics: Iterable[str] | None = None) -> Iterator[DriveMessage]:
        available = {ch.topic for ch in self.index.channels.values() if not ch.topic.startswith(FRAME_PREFIX)
                     and ch.message_encoding in (MessageEncoding.MessagePack, JSON)}
        wanted = sorted(available if topics is None else available & set(topics))
        if not wanted:
            return
        for _schema, channel, message in iter_mcap(self.path, wanted):
            stamp_ns = self.index.relative_ns(self.path, channel.topic, message.log_time)
            header = _unpack(self.path, channel.topic, message.log_time, message.data, channel.message_encoding)
            yield DriveMessage(channel.topic, stamp_ns, header)
