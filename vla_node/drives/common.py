"""What every drive reader shares: the frame and message records, the reader interface, and MCAP access
that turns any failure of the mcap library into a one-line DriveError naming the file.

Readers hold no open file: each iteration opens its own handle, so a reader can be iterated again or by
two consumers at once.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from mcap.reader import NonSeekingReader, make_reader
from mcap.records import Channel, Schema

from vla_node.drives.video import DriveError, decode_image, one_line
from vla_node.wire.protocol import jpeg_size

MCAP_MAGIC = b"\x89MCAP0\r\n"
MAX_SIDE = 16384  # the largest image side any drive reader accepts (checked before decoding or copying pixels)


def drive_error(path: os.PathLike | str, problem: object) -> DriveError:
    return DriveError(f"{path}: {one_line(problem)}")


def jpeg_dims(data: bytes) -> tuple[int, int]:
    """(height, width) of a JPEG by the same start-of-frame scan the node applies to a received frame
    (wire.protocol.jpeg_size), so a drive never holds a JPEG the node would refuse for its markers; ValueError
    when there is none or it declares an empty image."""
    size = jpeg_size(data)
    if size is None:
        raise ValueError("not a JPEG (no start-of-frame segment before the first scan)")
    if 0 in size:
        raise ValueError(f"JPEG declares a {size[1]}x{size[0]} image")
    return size


@dataclasses.dataclass(frozen=True, slots=True)
class DriveFrame:
    """One camera frame from a drive. stamp_ns is relative to the drive's first message.

    encoding "rgb8": payload is height*width*3 bytes, rows packed; "jpeg": payload is a JPEG file."""

    camera: str
    seq: int
    stamp_ns: int
    encoding: str
    height: int
    width: int
    payload: bytes

    def rgb(self) -> np.ndarray:
        """Pixels as HxWx3 uint8: a read-only view of the payload for rgb8, a new array for jpeg."""
        if self.encoding == "rgb8":
            return np.frombuffer(self.payload, np.uint8).reshape(self.height, self.width, 3)  # (H, W, 3)
        try:
            rgb = decode_image(self.payload, "jpeg")
        except ValueError as e:
            raise DriveError(f"frame {self.camera}#{self.seq}: {one_line(e)}") from e
        if rgb.shape[:2] != (self.height, self.width):
            raise DriveError(
                f"frame {self.camera}#{self.seq}: JPEG decodes to {rgb.shape[1]}x{rgb.shape[0]}, "
                f"header says {self.width}x{self.height}"
            )
        return rgb


@dataclasses.dataclass(frozen=True, slots=True)
class DriveMessage:
    """A non-frame message of a native drive (instruction, state, action, health): its wire header map."""

    topic: str
    stamp_ns: int
    header: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DriveInfo:
    """What a drive holds. duration_s spans the first to the last message; sizes are (width, height) of
    each camera's first frame; source_encodings are as stored (before conversion to rgb8/jpeg)."""

    path: str
    kind: str  # "native" | "ros2" | "video"
    profile: str
    cameras: tuple[str, ...]
    topics: dict[str, str]  # camera -> topic it is read from
    frame_count: int
    duration_s: float
    sizes: dict[str, tuple[int, int]]
    source_encodings: dict[str, str]
    other_topics: dict[str, int]  # topic -> message count, for everything that is not a selected camera

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DriveReader:
    """A drive opened by `open_drive`: cameras, frame_count, duration_ns, info(), frames(), commands()."""

    kind = "abstract"

    def __init__(self, path: Path, cameras: tuple[str, ...], frame_count: int, duration_ns: int) -> None:
        self.path = path
        self.cameras = cameras
        self.frame_count = frame_count
        self.duration_ns = duration_ns

    def frames(self) -> Iterator[DriveFrame]:
        """Frames of the selected cameras in time order."""
        raise NotImplementedError

    def info(self) -> DriveInfo:
        raise NotImplementedError

    def messages(self, topics: Iterable[str] | None = None) -> Iterator[DriveMessage]:
        """Non-frame messages in time order (native drives only; other kinds have none)."""
        return iter(())

    def commands(self) -> Iterator[DriveMessage]:
        """The recorded `instruction` and `state` commands in time order (native drives only)."""
        return self.messages(("instruction", "state"))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.path)!r}, cameras={list(self.cameras)}, "
                f"frames={self.frame_count}, duration_s={self.duration_ns / 1e9:.3f})")


class McapDriveReader(DriveReader):
    """What the MCAP readers share: `index` (McapIndex), `topics` (camera -> topic), `_first` (camera ->
    (first frame, its stored/source encoding)) and `_frames(topics)` yielding (frame, stored encoding)."""

    index: "McapIndex"
    topics: dict[str, str]
    _first: dict[str, tuple[DriveFrame, str]]

    def _frames(self, topics: list[str]) -> Iterator[tuple[DriveFrame, str]]:
        raise NotImplementedError

    def frames(self) -> Iterator[DriveFrame]:
        return (frame for frame, _ in self._frames(sorted(self.topics.values())))

    def info(self) -> DriveInfo:
        selected = set(self.topics.values())
        return DriveInfo(
            path=str(self.path),
            kind=self.kind,
            profile=self.index.profile,
            cameras=self.cameras,
            topics=dict(self.topics),
            frame_count=self.frame_count,
            duration_s=self.duration_ns / 1e9,
            sizes={c: (f.width, f.height) for c, (f, _) in self._first.items()},
            source_encodings={c: encoding for c, (_, encoding) in self._first.items()},
            other_topics={t: n for t, n in sorted(self.index.topic_counts().items()) if t not in selected},
        )


# ---- MCAP access -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class McapIndex:
    """Channels, schemas, message counts and time span of an MCAP file (from its summary, or a scan)."""

    profile: str
    channels: dict[int, Channel]
    schemas: dict[int, Schema]
    counts: dict[int, int]  # channel id -> messages
    start_ns: int
    end_ns: int

    def topic_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for cid, ch in self.channels.items():
            out[ch.topic] = out.get(ch.topic, 0) + self.counts.get(cid, 0)
        return out

    def schema_name(self, channel: Channel) -> str:
        schema = self.schemas.get(channel.schema_id)
        return schema.name if schema is not None else ""

    def relative_ns(self, path: Path, topic: str, log_time: int) -> int:
        """A message's stamp relative to the drive's first message; a log time outside the statistics' span means
        the statistics (or the message) are corrupt: a DriveError, not a negative or out-of-range stamp."""
        if not self.start_ns <= log_time <= self.end_ns:
            raise drive_error(path, f"corrupt MCAP: message on {topic!r} at log time {log_time} outside the span "
                                    f"{self.start_ns}..{self.end_ns} its statistics give")
        return log_time - self.start_ns


def is_mcap(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MCAP_MAGIC)) == MCAP_MAGIC


def read_mcap_index(path: Path) -> McapIndex:
    """Header, summary and statistics; a file without a summary section is scanned once instead."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(size - len(MCAP_MAGIC), 0))
        if size < 2 * len(MCAP_MAGIC) or f.read() != MCAP_MAGIC:
            raise drive_error(path, f"truncated MCAP: {size} bytes without the closing magic (the recording did "
                                    f"not finish; `mcap recover` can salvage its messages)")
    try:
        with open(path, "rb") as f:
            reader = make_reader(f)
            profile = reader.get_header().profile
            try:
                summary = reader.get_summary()
            except Exception as e:  # noqa: BLE001 - any failure here means the footer is unreadable
                raise drive_error(path, f"truncated or corrupt MCAP: its footer/summary cannot be read "
                                        f"({type(e).__name__}: {e}); was the recording finished? "
                                        f"`mcap recover` can salvage its messages") from e
            if summary is not None and summary.statistics is not None:
                stats = summary.statistics
                if stats.message_start_time > stats.message_end_time:
                    raise drive_error(path, f"corrupt MCAP: its statistics span {stats.message_start_time}.."
                                            f"{stats.message_end_time} ends before it starts")
                return McapIndex(profile, dict(summary.channels), dict(summary.schemas),
                                 dict(stats.channel_message_counts), stats.message_start_time,
                                 stats.message_end_time)
    except DriveError:
        raise
    except Exception as e:  # noqa: BLE001 - the mcap library's failures become one-line DriveErrors
        raise drive_error(path, f"corrupt MCAP ({type(e).__name__}: {e})") from e
    return _scan_index(path, profile)


def _scan_index(path: Path, profile: str) -> McapIndex:
    channels: dict[int, Channel] = {}
    schemas: dict[int, Schema] = {}
    counts: dict[int, int] = {}
    start, end = None, None
    with open(path, "rb") as f:
        for schema, channel, message in guarded(path, NonSeekingReader(f).iter_messages(log_time_order=False)):
            channels[channel.id] = channel
            if schema is not None:
                schemas[schema.id] = schema
            counts[channel.id] = counts.get(channel.id, 0) + 1
            start = message.log_time if start is None else min(start, message.log_time)
            end = message.log_time if end is None else max(end, message.log_time)
    return McapIndex(profile, channels, schemas, counts, start or 0, end or 0)


def guarded(path: Path, items: Iterator[Any]) -> Iterator[Any]:
    """Re-raise anything the mcap library (or a decoder it calls) throws while producing an item as a
    DriveError naming the file; exceptions raised by the consumer of the items pass through untouched."""
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except DriveError:
            raise
        except Exception as e:  # noqa: BLE001 - library boundary: corrupt data raises many types
            raise drive_error(path, f"corrupt MCAP while reading messages ({type(e).__name__}: {e})") from e
        yield item


def in_time_order(path: Path, items: Iterator[Any]) -> Iterator[Any]:
    """The items (schema, channel, message, ...) as they come, checked to be in log-time order: the mcap reader
    orders messages by the chunk indexes' times, so a decrease means a corrupt index or chunk, not a drive whose
    stamps go backwards (those the reader sorts)."""
    last = None
    for item in items:
        log_time = item[2].log_time
        if last is not None and log_time < last:
            raise drive_error(path, f"corrupt MCAP: message at log time {log_time} read after one at {last} "
                                    f"(a chunk's or its index's time span is wrong)")
        last = log_time
        yield item


def iter_mcap(path: Path, topics: list[str], decoder_factories: tuple = ()) -> Iterator[Any]:
    """(schema, channel, message[, decoded]) in log-time order for `topics`, chunk CRCs checked."""
    with open(path, "rb") as f:
        try:
            reader = make_reader(f, validate_crcs=True, decoder_factories=decoder_factories)
        except Exception as e:  # noqa: BLE001
            raise drive_error(path, f"corrupt MCAP ({type(e).__name__}: {e})") from e
        if decoder_factories:
            items = reader.iter_decoded_messages(topics=topics, log_time_order=True)
        else:
            items = reader.iter_messages(topics=topics, log_time_order=True)
        yield from in_time_order(path, guarded(path, items))
