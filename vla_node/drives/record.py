"""Record a running node's traffic into a native drive.

    summary = record("launch/cpu.toml", "run.mcap", duration_s=60)

Four SUB sockets connect to the launch file's addresses (each may be overridden): the frame publisher's
(camera driver or replay) frames and commands, and the node's actions and health. The receive loop only
receives and hands the parts to a bounded queue; a writer thread validates each message
against wire protocol v1 and writes it with DriveWriter (frames as sent, JPEG stays JPEG; the rest as their
header maps). A full queue drops the message and counts it, so a slow disk never stalls the receive loop.
Recording ends after duration_s, on Ctrl-C (SIGINT) or SIGTERM, or when stop_event is set; the drive is
finished (MCAP summary written) in every case and a summary is printed. When the drive cannot be written on (the
disk full: ENOSPC, EFBIG past a file size limit, EDQUOT) the recording stops: the file is cut at the end of its
last complete record and ended there (DataEnd and a footer without summary, which readers read linearly), so that
everything written before the failure reads back; the summary says so and record() raises RecordingStopped.

The drive replays with `vla_node.drives.replay.replay`: its frames and commands are sent again, the recorded
actions and health stay in the file for comparison.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import queue
import signal
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import zmq
from mcap.data_stream import RecordBuilder
from mcap.opcode import Opcode
from mcap.reader import make_reader
from mcap.records import DataEnd, Footer

from vla_node.drives.common import MCAP_MAGIC
from vla_node.drives.foxglove import layout
from vla_node.drives.open import DriveError, DriveWriter
from vla_node.progress import Progress
from vla_node.validate import ConfigError, is_number, require
from vla_node.wire.codec import CodecError, unpack
from vla_node.wire.protocol import (
    ACTION_TOPIC,
    COMMAND_TOPICS,
    ENCODINGS,
    FRAME_TOPIC_PREFIX,
    HEALTH_TOPIC,
    PROTOCOL_VERSION,
    ProtocolError,
    ProtocolLimits,
    decode_action,
    decode_command,
    decode_health,
    jpeg_size,
)

if TYPE_CHECKING:
    from vla_node.config import NodeConfig
    from vla_node.wire.transport import TransportConfig

ADDRESS_KEYS = ("frames", "commands", "actions", "health")
QUEUE_SIZE = 256  # messages between the receive loop and the writer (about 8 s of 30 Hz frames)
FRAME_KEYS = frozenset({"v", "seq", "stamp_ns", "camera", "encoding", "height", "width"})
_STOP = object()
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_RECORD_HEAD = struct.Struct("<BQ")  # an MCAP record's opcode and body length


@dataclasses.dataclass(frozen=True)
class RecordSummary:
    """What a recording wrote: message counts per kind, drops (queue full) and rejects (malformed) per kind."""

    path: Path
    duration_s: float
    written: Mapping[str, int]  # frames, commands, actions, health
    dropped: Mapping[str, int]
    rejected: Mapping[str, int]
    first_reject: str | None
    bytes: int
    stopped: str | None = None  # why the recording ended early (the disk full), and what the drive holds

    def line(self) -> str:
        w = self.written
        text = (f"recorded {w.get('frames', 0)} frames, {w.get('commands', 0)} commands, {w.get('actions', 0)} "
                f"actions, {w.get('health', 0)} health messages in {self.duration_s:.1f} s to {self.path} "
                f"({self.bytes / 1e6:.1f} MB)")
        if any(self.dropped.values()):
            text += f"; dropped (writer behind): {dict(self.dropped)}"
        if any(self.rejected.values()):
            text += f"; rejected (malformed): {dict(self.rejected)}, first: {self.first_reject}"
        if self.stopped:
            text += f"; STOPPED EARLY: {self.stopped}"
        return text


class RecordingStopped(DriveError):
    """The drive could not be written on (the disk full): the recording stopped early, the drive keeps what was
    written before (it reads back) and `summary` says what it holds."""

    def __init__(self, message: str, summary: RecordSummary) -> None:
        super().__init__(message)
        self.summary = summary


def _frame_fields(parts: list[bytes], limits: ProtocolLimits) -> dict[str, Any]:
    """Validate a frame message's topic, header and payload size without decoding the pixels."""
    if len(parts) != 3:
        raise ProtocolError("bad_parts", f"frame has {len(parts)} parts: expected 3 [topic, header, payload]")
    topic, header_bytes, payload = parts
    try:
        header = unpack(header_bytes, limits.header_codec)
    except CodecError as e:
        raise ProtocolError("bad_msgpack", f"frame header: {e}") from None
    if type(header) is not dict or set(header) != FRAME_KEYS or header["v"] != PROTOCOL_VERSION:
        raise ProtocolError("bad_field", f"frame header {header!r:.120}: expected v{PROTOCOL_VERSION} keys "
                                         f"{sorted(FRAME_KEYS)}")
    camera = header["camera"]
    if type(camera) is not str or topic != FRAME_TOPIC_PREFIX + camera.encode():
        raise ProtocolError("bad_field", f"frame header camera = {camera!r}: topic is {topic[:80]!r}")
    for key in ("seq", "stamp_ns", "height", "width"):
        if type(header[key]) is not int or header[key] < 0:
            raise ProtocolError("bad_field", f"frame header {key} = {header[key]!r}: expected an integer >= 0")
    if header["encoding"] not in ENCODINGS:
        raise ProtocolError("bad_encoding", f"encoding = {header['encoding']!r}: expected one of {list(ENCODINGS)}")
    if header["encoding"] == "jpeg":
        if len(payload) > limits.max_jpeg_bytes or jpeg_size(payload) != (header["height"], header["width"]):
            raise ProtocolError("bad_size", f"JPEG of {len(payload)} bytes is not a {header['width']}x"
                                            f"{header['height']} JPEG of at most {limits.max_jpeg_bytes} bytes")
    return header


class DriveSink(threading.Thread):
    """The writer thread: queue -> validation -> DriveWriter. Malformed messages are counted per kind; a disk that
    takes no more (DISK_FULL) stops the thread with the drive cut at its last complete record (`stopped` says
    so); any other failure stops the thread and is re-raised by the recorder."""

    def __init__(self, path: Path | None, limits: ProtocolLimits, queue_size: int, writer: Any = None) -> None:
        """path: the drive to write; or None with `writer`, an object with DriveWriter's add_frame, add_message and
        close (vla-node view's live channels)."""
        super().__init__(name="vla-record-writer", daemon=True)
        self.path, self.limits = path, limits
        self.items: queue.Queue = queue.Queue(queue_size)
        self.written: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.first_reject: str | None = None
        self.error: BaseException | None = None
        self.stopped: str | None = None
        self.writer = writer if path is None else DriveWriter(path)  # opened here: a bad path fails at once

    def run(self) -> None:
        full: OSError | None = None
        ends: list[int] = []
        try:
            while True:
                item = self.items.get()
                if item is _STOP:
                    return
                kind, parts = item
                try:
                    self._write(kind, parts)
                    self.written[kind] += 1
                except (ProtocolError, CodecError) as e:
                    self.rejected[kind] += 1
                    self.first_reject = self.first_reject or f"{kind}: {e}"
        except OSError as e:
            if e.errno not in DISK_FULL or self.path is None:
                self.error = e
                return
            full, ends = e, record_ends(self.path)  # before anything else is written after the failure
        except BaseException as e:  # re-raised by record()
            self.error = e
        finally:
            self._close(full, ends)

    def _close(self, full: OSError | None, ends: list[int]) -> None:
        """Finish the drive; when the disk is (or becomes, at finishing) full, end it at its last complete record."""
        try:
            self.writer.close()
        except OSError as e:
            if e.errno not in DISK_FULL or self.error is not None or self.path is None:
                self.error = self.error or e
                return
            full, ends = full or e, ends or record_ends(self.path)
        if full is None:
            return
        try:
            kept = end_drive_at(self.path, ends)
        except OSError as e:
            self.error = DriveError(f"{self.path}: the disk is full ({full}) and the drive could not be ended "
                                    f"readably ({e}); it holds no readable message")
            return
        handed = sum(self.written.values())
        self.written = kept_messages(self.path)
        lost = handed - sum(self.written.values())
        self.stopped = (f"disk full ({full}) after {kept / 1e6:.1f} MB: the drive is cut at its last complete record "
                        f"and reads back with every message written before it; {lost} message(s) received after "
                        "it are not in it")

    def _write(self, kind: str, parts: list[bytes]) -> None:
        w, limits = self.writer, self.limits
        if kind == "frames":
            h = _frame_fields(parts, limits)
            try:
                w.add_frame(h["camera"], h["seq"], h["stamp_ns"], h["encoding"], h["height"], h["width"], parts[2])
            except ValueError as e:  # payload size, camera name: the writer's own checks
                raise ProtocolError("bad_size", str(e)) from None
        elif kind == "commands":
            command = decode_command(parts, limits)  # validates; the map is stored exactly as sent
            w.add_message(bytes(parts[0]).decode(), command.stamp_ns, unpack(parts[1], limits.command_codec))
        elif kind == "actions":
            msg = decode_action(parts, limits)
            w.add_message("action", msg["stamp_ns"], msg)
        else:
            msg = decode_health(parts, limits)
            w.add_message("health", msg["stamp_ns"], msg)


def record_ends(path: Path) -> list[int]:
    """The end offset of every complete top-level MCAP record of `path`, up to its first partial record (a write
    that failed halfway) or its DataEnd (the summary section after it is dropped too); [] without MCAP magic."""
    ends: list[int] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(len(MCAP_MAGIC)) != MCAP_MAGIC:
            return ends
        offset = len(MCAP_MAGIC)
        while offset + _RECORD_HEAD.size <= size:
            f.seek(offset)
            opcode, length = _RECORD_HEAD.unpack(f.read(_RECORD_HEAD.size))
            end = offset + _RECORD_HEAD.size + length
            if opcode in (Opcode.DATA_END, Opcode.FOOTER) or end > size:
                break
            ends.append(end)
            offset = end
    return ends


def _ending() -> bytes:
    """DataEnd (no data CRC) and a footer without summary, then the closing magic: readers then read linearly."""
    builder = RecordBuilder()
    DataEnd(data_section_crc=0).write(builder)
    Footer(summary_start=0, summary_offset_start=0, summary_crc=0).write(builder)
    return builder.end() + MCAP_MAGIC


def end_drive_at(path: Path, ends: list[int]) -> int:
    """Cut `path` at the last of `ends` (record_ends) and end it there; where the ending does not fit (the disk
    still full), at the record before, and so on. Returns the size kept; OSError when not even the header fits.
    Unbuffered: a write that failed leaves nothing queued for the next try."""
    ending = _ending()
    failure: OSError = OSError(errno.EINVAL, f"{path}: no complete MCAP header")
    fd = os.open(path, os.O_RDWR)
    try:
        for end in reversed(ends):
            os.ftruncate(fd, end)
            try:
                written = os.pwrite(fd, ending, end)
                if written == len(ending):
                    os.fsync(fd)
                    return end + written
                failure = OSError(errno.ENOSPC, f"{path}: {written} of the ending's {len(ending)} bytes written")
            except OSError as e:
                failure = e
        raise failure
    finally:
        os.close(fd)


def kept_messages(path: Path) -> Counter[str]:
    """Messages per kind (frames, commands, actions, health) that `path` holds, read with the mcap library."""
    kinds = {"instruction": "commands", "state": "commands", "action": "actions", "health": "health"}
    counts: Counter[str] = Counter()
    with open(path, "rb") as f:
        for _, channel, _ in make_reader(f).iter_messages(log_time_order=False):
            counts["frames" if channel.topic.startswith("frame/") else kinds.get(channel.topic, channel.topic)] += 1
    return counts


def _open_sub(ctx: zmq.Context, config: NodeConfig, address: str, topics: tuple[bytes, ...]) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, max(config.transport.rcv_hwm, 256))
    sock.setsockopt(zmq.MAXMSGSIZE, config.transport.max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 20)  # join a publisher that starts later quickly: its first frames count
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(address)
    return sock


def record(
    launch: os.PathLike | str | None = None,
    out: os.PathLike | str = "record.mcap",
    duration_s: float | None = None,
    addresses: Mapping[str, str] | None = None,
    *,
    stop_event: threading.Event | None = None,
    queue_size: int = QUEUE_SIZE,
    progress: bool = True,
) -> RecordSummary:
    """Record frames, commands, actions and health at the launch file's addresses (default launch/cpu.toml;
    `addresses` overrides any of frames/commands/actions/health) into the native drive `out` until duration_s,
    Ctrl-C/SIGTERM or stop_event. Refuses to overwrite an existing file (FileExistsError). When the disk is full the
    recording stops, the drive keeps what was written (cut at its last complete record) and RecordingStopped says so
    (its `summary` is the one printed)."""
    require(duration_s is None or (is_number(duration_s, finite=False)
                                   and math.isfinite(duration_s) and duration_s > 0), "duration_s",
            duration_s, "a finite number of seconds > 0, or unset to record until Ctrl-C")
    require(isinstance(queue_size, int) and queue_size >= 1, "queue_size", queue_size, "an integer >= 1")
    from vla_node.config import default_launch, load_launch

    config = load_launch(launch if launch is not None else default_launch())
    overrides = dict(addresses or {})
    unknown = sorted(set(overrides) - set(ADDRESS_KEYS))
    require(not unknown, "addresses", unknown, f"keys among {list(ADDRESS_KEYS)}")
    transport = dataclasses.replace(config.transport, **overrides)
    if transport.curve_keys_dir is not None:
        raise ConfigError("record: transport.curve_keys_dir is set, and recording encrypted (CURVE) traffic is "
                          "not supported yet; record on a launch file without curve_keys_dir")
    path = Path(out)
    if path.exists():
        raise FileExistsError(f"{path} exists: remove it or choose another --out")
    path.parent.mkdir(parents=True, exist_ok=True)

    layout_path = path.with_suffix(".layout.json")
    layout_path.write_text(json.dumps(layout([c.name for c in config.cameras]), indent=1))  # Foxglove's layout
    start = time.monotonic()
    sink, dropped = listen(config, transport, lambda: DriveSink(path, config.limits, queue_size), f"to {path}",
                           duration_s, stop_event, progress)
    summary = RecordSummary(path=path, duration_s=time.monotonic() - start, written=dict(sink.written),
                            dropped={k: dropped[k] for k in ADDRESS_KEYS}, rejected=dict(sink.rejected),
                            first_reject=sink.first_reject, bytes=path.stat().st_size, stopped=sink.stopped)
    print(summary.line(), flush=True)
    if sink.stopped:
        raise RecordingStopped(f"{path}: recording stopped early: {sink.stopped}", summary)
    return summary


class BackgroundRecording(threading.Thread):
    """record() in a thread of its own (a replay's --record-out), started at construction, until finish()."""

    def __init__(self, launch: os.PathLike | str, out: os.PathLike | str, addresses: Mapping[str, str]) -> None:
        super().__init__(name="vla-record", daemon=True)
        self.launch, self.out, self.addresses = launch, Path(out), dict(addresses)
        self.stop_event = threading.Event()
        self.summary: RecordSummary | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.summary = record(self.launch, self.out, None, self.addresses, stop_event=self.stop_event,
                                  progress=False)
        except BaseException as e:  # raised by finish()
            self.error = e

    def finish(self) -> RecordSummary:
        """Stop recording, wait for the drive to be finished; its summary (or the recording's error, raised)."""
        self.stop_event.set()
        self.join()
        if self.error is not None:
            raise self.error
        return self.summary


def listen(config: NodeConfig, transport: TransportConfig, make_sink: Callable[[], DriveSink], where: str,
           duration_s: float | None, stop_event: threading.Event | None, progress: bool
           ) -> tuple[DriveSink, Counter[str]]:
    """SUBs at the four addresses into a sink until duration_s, Ctrl-C/SIGTERM or stop_event: (the finished sink,
    messages dropped per kind because its queue was full). Re-raises the sink's error."""
    stop = stop_event if stop_event is not None else threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    ctx = zmq.Context()
    sockets: list[tuple[zmq.Socket, str]] = []
    sink: DriveSink | None = None
    dropped: Counter[str] = Counter()
    start = time.monotonic()
    try:
        sockets = [
            (_open_sub(ctx, config, transport.frames, (FRAME_TOPIC_PREFIX,)), "frames"),
            (_open_sub(ctx, config, transport.commands, COMMAND_TOPICS), "commands"),
            (_open_sub(ctx, config, transport.actions, (ACTION_TOPIC,)), "actions"),
            (_open_sub(ctx, config, transport.health, (HEALTH_TOPIC,)), "health"),
        ]
        sink = make_sink()
        sink.start()
        print(f"listening to {transport.frames} (frames), {transport.commands} (commands), {transport.actions} "
              f"(actions), {transport.health} (health) {where}"
              + (f" for {duration_s:g} s" if duration_s else " until Ctrl-C"), flush=True)
        _receive(sockets, sink, stop, dropped, start + duration_s if duration_s else None, progress)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for sock, _ in sockets:
            sock.close(linger=0)
        if sockets:  # all four opened; else a Ctrl-C may have left one made but untracked, on which term would
            ctx.term()  # wait for ever: the context is left to the collector (wire.transport.Client.close)
        if sink is not None:
            _stop_sink(sink)
    if sink.error is not None:
        raise sink.error
    return sink, dropped


def _stop_sink(sink: DriveSink) -> None:
    """Tell the writer to finish and wait for it; a writer that stopped by itself (the disk full) may leave its
    queue full, so the stop is never waited for on a thread that is gone."""
    while sink.is_alive():
        try:
            sink.items.put(_STOP, timeout=0.1)
            break
        except queue.Full:
            continue
    sink.join()


def _receive(sockets: list[tuple[zmq.Socket, str]], sink: DriveSink, stop: threading.Event,
             dropped: Counter[str], end: float | None, progress: bool) -> None:
    """The receive loop: nothing but receive, hand over, count. Ctrl-C ends it like stop."""
    poller = zmq.Poller()
    for sock, _ in sockets:
        poller.register(sock, zmq.POLLIN)
    kinds = dict(sockets)
    items = sink.items
    with Progress(None, "record", unit="frames", enabled=progress) as bar:
        try:
            while not stop.is_set() and sink.is_alive():
                left_ms = 100 if end is None else int((end - time.monotonic()) * 1000)
                if left_ms <= 0:
                    return
                for sock, _ in poller.poll(min(left_ms, 100)):
                    kind = kinds[sock]
                    for _ in range(100):
                        try:
                            parts = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            items.put_nowait((kind, parts))
                        except queue.Full:
                            dropped[kind] += 1
                        if kind == "frames":
                            bar.update(1)
        except KeyboardInterrupt:
            print("\nstopping (Ctrl-C)", flush=True)
