"""Wire protocol v1 (the README's table): message layouts, client-side encoders, node-side validation.

Messages are ZeroMQ multipart lists; every map is msgpack (vla_node.wire.codec) with str keys.

    [b"frame/<camera>", {v: 1, seq, stamp_ns, camera, encoding, height, width}, payload]
        encoding "rgb8" | "bgr8": payload is height*width*3 raw bytes, row-major HxWx3;
        encoding "jpeg": payload is one baseline/progressive JPEG of exactly height x width.
    [b"instruction", {v: 1, seq, stamp_ns, text}]
    [b"state", {v: 1, seq, stamp_ns, values: [float, ...]}]
    [b"action", {v: 1, seq, stamp_ns, frame_seq, frame_stamp_ns, status, level, action, chunk, timing_ms,
                 ...optional extra keys}]
        status "fresh" | "chunk" | "fallback"; level an int >= 0 (index in the degrade ladder, 0 = full
        quality; a str name is also accepted); action [D floats]; chunk [H x [D floats]] (H may be 0);
        timing_ms {stage: float}; frame_seq and frame_stamp_ns are both nil only for a fallback sent
        before any frame arrived.
    [b"health", {v: 1, stamp_ns, ...free-form...}]

seq and stamp_ns are unsigned integers; stamp_ns is CLOCK_MONOTONIC (time.monotonic_ns()) of the host.
Frame and command messages are checked strictly (unknown keys rejected); action and health messages
allow extra keys. Every problem raises ProtocolError with `reason` in REJECT_REASONS.
"""

from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Sequence

import av
import numpy as np

from vla_node.validate import require, show
from vla_node.wire.codec import CodecError, CodecLimits, pack, unpack

PROTOCOL_VERSION = 1

FRAME_TOPIC_PREFIX = b"frame/"
INSTRUCTION_TOPIC = b"instruction"
STATE_TOPIC = b"state"
ACTION_TOPIC = b"action"
HEALTH_TOPIC = b"health"
COMMAND_TOPICS = (INSTRUCTION_TOPIC, STATE_TOPIC)

ENCODINGS = ("rgb8", "bgr8", "jpeg")
ACTION_STATUSES = ("fresh", "chunk", "fallback")

REJECT_REASONS = (
    "bad_parts",  # wrong number of multipart parts, or a part that is not bytes-like
    "unknown_topic",  # topic is not one this decoder handles
    "too_large",  # header/message/JPEG/text/state longer than ProtocolLimits allow
    "bad_msgpack",  # the map is not valid msgpack (detail carries the codec reason)
    "bad_version",  # v missing, not an int, or not PROTOCOL_VERSION
    "missing_field",  # a required key is absent
    "unknown_field",  # a key that v1 does not define (frames and commands only)
    "bad_field",  # a value of the wrong type or range
    "unknown_camera",  # frame topic names a camera that is not configured
    "bad_encoding",  # frame encoding not in ENCODINGS
    "bad_size",  # payload size does not match height*width*3, or JPEG dimensions differ from the header
    "too_big_image",  # height/width above the camera's configured maximum
    "non_finite",  # NaN or inf among numbers (state values, action values)
    "bad_jpeg",  # JPEG payload that cannot be parsed or decoded
)

_CAMERA_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_UINT_MAX = 2**64
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class ProtocolError(ValueError):
    """A message that violates protocol v1; `reason` is one of REJECT_REASONS, `detail` says what and why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REJECT_REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class CameraSpec:
    """A camera the node accepts frames from (a launch file's [[cameras]]): topic b'frame/<name>', images of any
    size up to max_width x max_height (resized to the model input)."""

    name: str = "front"
    max_width: int = 1920
    max_height: int = 1080

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and _CAMERA_NAME.fullmatch(self.name) is not None,
            "name", self.name, "1-64 characters from A-Z a-z 0-9 _ . -",
        )
        for key in ("max_width", "max_height"):
            value = getattr(self, key)
            require(type(value) is int and 1 <= value <= 16384, key, value, "an integer in [1, 16384]")

    @property
    def topic(self) -> bytes:
        return FRAME_TOPIC_PREFIX + self.name.encode("ascii")


@dataclass(frozen=True)
class ProtocolLimits:
    """Size limits applied before anything is allocated for a message."""

    max_header_bytes: int = 4096  # frame header map
    max_command_bytes: int = 64 * 1024  # instruction/state map
    max_text_chars: int = 4096  # instruction text
    max_state_values: int = 1024  # state values
    max_jpeg_bytes: int = 16 * 1024 * 1024  # JPEG payload
    max_action_bytes: int = 1024 * 1024  # action/health map (client side)

    def __post_init__(self) -> None:
        for key in ("max_header_bytes", "max_command_bytes", "max_text_chars", "max_state_values",
                    "max_jpeg_bytes", "max_action_bytes"):
            value = getattr(self, key)
            require(type(value) is int and value >= 1, key, value, "an integer >= 1")

    @functools.cached_property
    def header_codec(self) -> CodecLimits:
        n = self.max_header_bytes
        return CodecLimits(max_bytes=n, max_str_len=n, max_bin_len=n, max_array_len=64, max_map_len=64)

    @functools.cached_property
    def command_codec(self) -> CodecLimits:
        n = self.max_command_bytes
        return CodecLimits(
            max_bytes=n, max_str_len=n, max_bin_len=n, max_array_len=self.max_state_values, max_map_len=64
        )

    @functools.cached_property
    def action_codec(self) -> CodecLimits:
        n = self.max_action_bytes
        return CodecLimits(max_bytes=n, max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=4096)


DEFAULT_PROTOCOL_LIMITS = ProtocolLimits()


@dataclass(frozen=True, slots=True)
class Frame:
    """A validated camera frame. `rgb` is HxWx3 uint8 RGB and read-only: for rgb8 a zero-copy view of the
    received payload, for bgr8 and jpeg a new array. Copy it into your own buffer to keep or modify it."""

    camera: str
    seq: int
    stamp_ns: int
    encoding: str
    height: int
    width: int
    rgb: np.ndarray


@dataclass(frozen=True, slots=True)
class Instruction:
    seq: int
    stamp_ns: int
    text: str


@dataclass(frozen=True, slots=True)
class State:
    seq: int
    stamp_ns: int
    values: np.ndarray  # (N,) float32, all finite


# ---------------------------------------------------------------- field checks


def _buffer(part: Any, what: str) -> memoryview:
    """The part as a flat view of bytes (zmq.Frame, bytes, bytearray, a contiguous array's memoryview)."""
    try:
        view = memoryview(part)
    except TypeError:
        raise ProtocolError("bad_parts", f"{what} part is {type(part).__name__}: expected bytes") from None
    if not view.c_contiguous:
        raise ProtocolError("bad_parts", f"{what} part is a non-contiguous buffer: expected bytes")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _unpack_map(part: Any, limits: CodecLimits, what: str) -> dict:
    try:
        msg = unpack(_buffer(part, what), limits)
    except CodecError as e:
        reason = "too_large" if e.reason in ("too_large", "limit_exceeded") else "bad_msgpack"
        raise ProtocolError(reason, f"{what}: {e}") from None
    if type(msg) is not dict:
        raise ProtocolError("bad_field", f"{what} is a {type(msg).__name__}: expected a map")
    return msg


def _check_keys(msg: dict, required: frozenset[str], strict: bool, what: str) -> None:
    if "v" not in msg:
        raise ProtocolError("bad_version", f"{what} has no 'v': expected v = {PROTOCOL_VERSION}")
    v = msg["v"]
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"{what} v = {show(v)}: expected {PROTOCOL_VERSION}")
    missing = required.difference(msg)
    if missing:
        raise ProtocolError("missing_field", f"{what} lacks {sorted(missing)}")
    if strict and len(msg) != len(required):
        extra = [k for k in msg if k not in required]
        raise ProtocolError("unknown_field", f"{what} has unknown keys {show(extra)}: expected {sorted(required)}")


def _uint(msg: dict, key: str, what: str) -> int:
    value = msg[key]
    if type(value) is not int or not 0 <= value < _UINT_MAX:
        raise ProtocolError("bad_field", f"{what} {key} = {show(value)}: expected an unsigned integer")
    return value


def _finite_floats(values: Any, key: str, what: str) -> list:
    """A list of int/float (never bool), all finite within float32 range."""
    if type(values) is not list:
        raise ProtocolError("bad_field", f"{what} {key} is {type(values).__name__}: expected a list of numbers")
    for x in values:
        tx = type(x)
        if tx is not float and tx is not int:
            raise ProtocolError("bad_field", f"{what} {key} holds {show(x)}: expected numbers")
        if tx is float and not math.isfinite(x):
            raise ProtocolError("non_finite", f"{what} {key} holds {show(x)}: expected finite numbers")
        if abs(x) > _FLOAT32_MAX:
            raise ProtocolError("non_finite", f"{what} {key} holds {show(x)}: beyond float32 range")
    return values


# ---------------------------------------------------------------- JPEG

_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: Any) -> tuple[int, int] | None:
    """(height, width) from a JPEG's SOF segment without decoding it, or None when there is none.
    Lets the node refuse a mis-sized or oversized JPEG before the decoder allocates anything."""
    buf = memoryview(data).cast("B")
    n = len(buf)
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if buf[i] != 0xFF:
            return None
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers
            i += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or SOS before any SOF
            return None
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                return None
            return (buf[i + 5] << 8) | buf[i + 6], (buf[i + 7] << 8) | buf[i + 8]
        seg_len = (buf[i + 2] << 8) | buf[i + 3]
        if seg_len < 2:
            return None
        i += 2 + seg_len
    return None


def encode_jpeg(rgb: np.ndarray, qscale: int = 2) -> bytes:
    """JPEG bytes of an HxWx3 uint8 RGB image via PyAV's mjpeg encoder (yuvj420p).
    qscale is the JPEG quantizer scale, 1 (best) to 31 (smallest)."""
    _check_image(rgb)
    require(type(qscale) is int and 1 <= qscale <= 31, "qscale", qscale, "an integer in [1, 31]")
    height, width, _ = rgb.shape
    ctx = av.CodecContext.create("mjpeg", "w")
    ctx.width, ctx.height = width, height
    ctx.pix_fmt = "yuvj420p"
    ctx.time_base = Fraction(1, 30)
    ctx.qmin = ctx.qmax = qscale
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
    packets = ctx.encode(frame)
    if len(packets) != 1:
        raise RuntimeError(f"mjpeg encoder returned {len(packets)} packets: expected 1")
    return bytes(packets[0])


def _decode_jpeg(payload: memoryview, height: int, width: int) -> np.ndarray:
    size = jpeg_size(payload)
    if size is None:
        raise ProtocolError("bad_jpeg", "no JPEG start-of-frame segment")
    if size != (height, width):
        raise ProtocolError("bad_size", f"JPEG is {size[0]}x{size[1]}: header says {height}x{width}")
    ctx = av.CodecContext.create("mjpeg", "r")
    ctx.thread_count = 1  # decode on this thread: no helper threads, no frame delay
    try:
        frames = ctx.decode(av.Packet(payload))
    except av.FFmpegError as e:
        raise ProtocolError("bad_jpeg", f"decoder: {e}") from None
    if len(frames) != 1:
        raise ProtocolError("bad_jpeg", f"decoder returned {len(frames)} images: expected 1")
    image = frames[0]
    if (image.height, image.width) != (height, width):
        raise ProtocolError("bad_size", f"JPEG decoded to {image.height}x{image.width}: expected {height}x{width}")
    rgb = image.to_ndarray(format="rgb24")  # (H, W, 3) uint8
    rgb.flags.writeable = False
    return rgb


# ---------------------------------------------------------------- frames

_FRAME_KEYS = frozenset({"v", "seq", "stamp_ns", "camera", "encoding", "height", "width"})


def _check_image(image: Any) -> None:
    if not (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3):
        desc = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
        raise ValueError(f"image is {desc}: expected an HxWx3 uint8 array")


def encode_frame(
    camera: str, seq: int, stamp_ns: int, image: Any, encoding: str = "rgb8",
    *, height: int | None = None, width: int | None = None,
) -> list:
    """Frame message parts [topic, header, payload].

    rgb8/bgr8: `image` is an HxWx3 uint8 array in that channel order; the payload is a memoryview of it
    (no copy; a non-contiguous array is copied first). jpeg: `image` is JPEG bytes (height/width read from
    the JPEG unless given) or an HxWx3 uint8 RGB array, which is compressed with encode_jpeg."""
    require(isinstance(camera, str) and _CAMERA_NAME.fullmatch(camera) is not None,
            "camera", camera, "1-64 characters from A-Z a-z 0-9 _ . -")
    require(encoding in ENCODINGS, "encoding", encoding, f"one of {list(ENCODINGS)}")
    if encoding == "jpeg":
        payload: Any = encode_jpeg(image) if isinstance(image, np.ndarray) else bytes(image)
        if height is None or width is None:
            size = jpeg_size(payload)
            if size is None:
                raise ValueError("image is not a JPEG (no start-of-frame segment)")
            height, width = size
    else:
        _check_image(image)
        height, width = image.shape[0], image.shape[1]
        payload = memoryview(np.ascontiguousarray(image)).cast("B")  # (H*W*3,) bytes view
    header = {
        "v": PROTOCOL_VERSION, "seq": seq, "stamp_ns": stamp_ns, "camera": camera,
        "encoding": encoding, "height": height, "width": width,
    }
    return [FRAME_TOPIC_PREFIX + camera.encode("ascii"), pack(header), payload]


def decode_frame(
    parts: Sequence[Any], cameras: Mapping[str, CameraSpec], limits: ProtocolLimits = DEFAULT_PROTOCOL_LIMITS
) -> Frame:
    """Validate a received frame message against the configured cameras; raise ProtocolError otherwise."""
    if len(parts) != 3:
        raise ProtocolError("bad_parts", f"frame has {len(parts)} parts: expected 3 [topic, header, payload]")
    topic = bytes(_buffer(parts[0], "topic"))
    if not topic.startswith(FRAME_TOPIC_PREFIX):
        raise ProtocolError("unknown_topic", f"topic {topic[:80]!r}: expected b'frame/<camera>'")
    try:
        name = topic[len(FRAME_TOPIC_PREFIX):].decode("ascii")
    except UnicodeDecodeError:
        name = ""
    spec = cameras.get(name)
    if spec is None:
        raise ProtocolError("unknown_camera", f"topic {topic[:80]!r}: expected one of {sorted(cameras)}")
    header = _unpack_map(parts[1], limits.header_codec, "frame header")
    _check_keys(header, _FRAME_KEYS, True, "frame header")
    seq = _uint(header, "seq", "frame header")
    stamp_ns = _uint(header, "stamp_ns", "frame header")
    if type(header["camera"]) is not str or header["camera"] != name:
        raise ProtocolError("bad_field", f"frame header camera = {show(header['camera'])}: topic says {name!r}")
    encoding = header["encoding"]
    if type(encoding) is not str or encoding not in ENCODINGS:
        raise ProtocolError("bad_encoding", f"encoding = {show(encoding)}: expected one of {list(ENCODINGS)}")
    height, width = header["height"], header["width"]
    for key, value in (("height", height), ("width", width)):
        if type(value) is not int or value < 1:
            raise ProtocolError("bad_field", f"frame header {key} = {show(value)}: expected an integer >= 1")
    if height > spec.max_height or width > spec.max_width:
        raise ProtocolError(
            "too_big_image", f"{name}: {height}x{width}: expected at most {spec.max_height}x{spec.max_width}"
        )
    payload = _buffer(parts[2], "payload")
    if encoding == "jpeg":
        if payload.nbytes > limits.max_jpeg_bytes:
            raise ProtocolError(
                "too_large", f"JPEG of {payload.nbytes} bytes: expected at most {limits.max_jpeg_bytes}")
        rgb = _decode_jpeg(payload, height, width)
    else:
        expected = height * width * 3
        if payload.nbytes != expected:
            raise ProtocolError(
                "bad_size",
                f"{encoding} payload of {payload.nbytes} bytes: expected {height}*{width}*3 = {expected}")
        pixels = np.frombuffer(payload, dtype=np.uint8).reshape(height, width, 3)  # (H*W*3,) -> (H, W, 3)
        if encoding == "bgr8":
            pixels = np.ascontiguousarray(pixels[:, :, ::-1])  # (H, W, 3) BGR -> RGB
        pixels.flags.writeable = False
        rgb = pixels
    return Frame(name, seq, stamp_ns, encoding, height, width, rgb)


# ---------------------------------------------------------------- commands

_INSTRUCTION_KEYS = frozenset({"v", "seq", "stamp_ns", "text"})
_STATE_KEYS = frozenset({"v", "seq", "stamp_ns", "values"})


def encode_instruction(seq: int, stamp_ns: int, text: str) -> list[bytes]:
    require(isinstance(text, str) and text != "", "text", text, "a non-empty string")
    return [INSTRUCTION_TOPIC, pack({"v": PROTOCOL_VERSION, "seq": seq, "stamp_ns": stamp_ns, "text": text})]


def encode_state(seq: int, stamp_ns: int, values: Any) -> list[bytes]:
    """values: a 1-D sequence or array of numbers, sent as a list of floats."""
    array = np.asarray(values, dtype=np.float64)
    require(array.ndim == 1 and array.size >= 1, "values", values, "a non-empty 1-D sequence of numbers")
    return [STATE_TOPIC, pack({"v": PROTOCOL_VERSION, "seq": seq, "stamp_ns": stamp_ns, "values": array.tolist()})]


def decode_command(parts: Sequence[Any], limits: ProtocolLimits = DEFAULT_PROTOCOL_LIMITS) -> Instruction | State:
    """Validate an instruction or state message; raise ProtocolError otherwise."""
    if len(parts) != 2:
        raise ProtocolError("bad_parts", f"command has {len(parts)} parts: expected 2 [topic, map]")
    topic = bytes(_buffer(parts[0], "topic"))
    if topic == INSTRUCTION_TOPIC:
        msg = _unpack_map(parts[1], limits.command_codec, "instruction")
        _check_keys(msg, _INSTRUCTION_KEYS, True, "instruction")
        text = msg["text"]
        if type(text) is not str or text == "":
            raise ProtocolError("bad_field", f"instruction text = {show(text)}: expected a non-empty string")
        if len(text) > limits.max_text_chars:
            raise ProtocolError(
                "too_large",
                f"instruction text of {len(text)} characters: expected at most {limits.max_text_chars}")
        return Instruction(_uint(msg, "seq", "instruction"), _uint(msg, "stamp_ns", "instruction"), text)
    if topic == STATE_TOPIC:
        msg = _unpack_map(parts[1], limits.command_codec, "state")
        _check_keys(msg, _STATE_KEYS, True, "state")
        seq, stamp_ns = _uint(msg, "seq", "state"), _uint(msg, "stamp_ns", "state")
        values = _finite_floats(msg["values"], "values", "state")
        if not values:
            raise ProtocolError("bad_field", "state values = []: expected at least one number")
        return State(seq, stamp_ns, np.array(values, dtype=np.float32))
    raise ProtocolError("unknown_topic", f"topic {topic[:80]!r}: expected b'instruction' or b'state'")


# ---------------------------------------------------------------- actions and health

_ACTION_KEYS = frozenset(
    {"v", "seq", "stamp_ns", "frame_seq", "frame_stamp_ns", "status", "level", "action", "chunk", "timing_ms"}
)


def encode_action(
    *, seq: int, stamp_ns: int, frame_seq: int | None, frame_stamp_ns: int | None, status: str,
    level: int | str, action: Any, chunk: Any, timing_ms: Mapping[str, float], **extra: Any,
) -> list[bytes]:
    """Action message parts. action: (D,) numbers; chunk: (H, D) numbers, H may be 0; extra keys
    (e.g. tokens_refreshed, reuse_ratio) travel as given."""
    require(status in ACTION_STATUSES, "status", status, f"one of {list(ACTION_STATUSES)}")
    action_array = np.asarray(action, dtype=np.float64)
    require(action_array.ndim == 1 and action_array.size >= 1, "action", action, "a non-empty 1-D sequence")
    dims = action_array.shape[0]
    chunk_array = np.asarray(chunk, dtype=np.float64)
    if chunk_array.size == 0:
        chunk_array = chunk_array.reshape(0, dims)  # (0, D)
    require(chunk_array.ndim == 2 and chunk_array.shape[1] == dims, "chunk", chunk_array.shape, f"shape (H, {dims})")
    msg = {
        "v": PROTOCOL_VERSION, "seq": seq, "stamp_ns": stamp_ns, "frame_seq": frame_seq,
        "frame_stamp_ns": frame_stamp_ns, "status": status, "level": level, "action": action_array.tolist(),
        "chunk": chunk_array.tolist(), "timing_ms": {str(k): float(v) for k, v in timing_ms.items()},
    }
    msg.update(extra)
    return [ACTION_TOPIC, pack(msg)]


def _topic_map(parts: Sequence[Any], topic: bytes, limits: ProtocolLimits, what: str) -> dict:
    """The map of a two-part [topic, map] message from the node, after checking its shape and topic."""
    if len(parts) != 2:
        raise ProtocolError("bad_parts", f"{what} has {len(parts)} parts: expected 2 [topic, map]")
    got = bytes(_buffer(parts[0], "topic"))
    if got != topic:
        raise ProtocolError("unknown_topic", f"topic {got[:80]!r}: expected {topic!r}")
    return _unpack_map(parts[1], limits.action_codec, what)


def decode_action(parts: Sequence[Any], limits: ProtocolLimits = DEFAULT_PROTOCOL_LIMITS) -> dict:
    """Validate an action message and return its map (lists of floats; extra keys kept)."""
    msg = _topic_map(parts, ACTION_TOPIC, limits, "action")
    _check_keys(msg, _ACTION_KEYS, False, "action")
    _uint(msg, "seq", "action")
    _uint(msg, "stamp_ns", "action")
    status = msg["status"]
    if type(status) is not str or status not in ACTION_STATUSES:
        raise ProtocolError("bad_field", f"action status = {show(status)}: expected one of {list(ACTION_STATUSES)}")
    if msg["frame_seq"] is None or msg["frame_stamp_ns"] is None:
        if not (msg["frame_seq"] is None and msg["frame_stamp_ns"] is None and status == "fallback"):
            raise ProtocolError(
                "bad_field", "frame_seq/frame_stamp_ns nil: allowed only both together and with status 'fallback'"
            )
    else:
        _uint(msg, "frame_seq", "action")
        _uint(msg, "frame_stamp_ns", "action")
    level = msg["level"]
    if not ((type(level) is int and level >= 0) or type(level) is str):
        raise ProtocolError("bad_field", f"action level = {show(level)}: expected an integer >= 0 or a name")
    action = _finite_floats(msg["action"], "action", "action")
    if not action:
        raise ProtocolError("bad_field", "action action = []: expected at least one number")
    chunk = msg["chunk"]
    if type(chunk) is not list:
        raise ProtocolError("bad_field", f"action chunk is {type(chunk).__name__}: expected a list of lists")
    for row in chunk:
        _finite_floats(row, "chunk", "action")
        if len(row) != len(action):
            raise ProtocolError("bad_field", f"action chunk row of {len(row)} values: expected {len(action)}")
    timing = msg["timing_ms"]
    if type(timing) is not dict or not all(
        type(k) is str and type(v) in (int, float) for k, v in timing.items()
    ):
        raise ProtocolError("bad_field", f"action timing_ms = {show(timing)}: expected a map of stage -> ms")
    return msg


def encode_health(fields: Mapping[str, Any], stamp_ns: int | None = None) -> list[bytes]:
    """Health message parts; `fields` is free-form (str keys) and must not set v or stamp_ns.
    stamp_ns defaults to time.monotonic_ns()."""
    require("v" not in fields and "stamp_ns" not in fields, "fields", sorted(fields), "no 'v' or 'stamp_ns' key")
    msg = {"v": PROTOCOL_VERSION, "stamp_ns": time.monotonic_ns() if stamp_ns is None else stamp_ns}
    msg.update(fields)
    return [HEALTH_TOPIC, pack(msg)]


def decode_health(parts: Sequence[Any], limits: ProtocolLimits = DEFAULT_PROTOCOL_LIMITS) -> dict:
    """Validate a health message and return its map."""
    msg = _topic_map(parts, HEALTH_TOPIC, limits, "health")
    _check_keys(msg, frozenset({"v", "stamp_ns"}), False, "health")
    _uint(msg, "stamp_ns", "health")
    return msg
