"""vla_node.wire.protocol: v1 round trips, every reject reason from a crafted message, fuzzing."""

from __future__ import annotations

import math
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vla_node.validate import ConfigError
from vla_node.wire.codec import pack
from vla_node.wire.protocol import (
    PROTOCOL_VERSION,
    REJECT_REASONS,
    CameraSpec,
    Frame,
    Instruction,
    ProtocolError,
    ProtocolLimits,
    State,
    decode_action,
    decode_command,
    decode_frame,
    decode_health,
    encode_action,
    encode_frame,
    encode_health,
    encode_instruction,
    encode_jpeg,
    encode_state,
    jpeg_size,
)

CAMERAS = {"front": CameraSpec("front", max_width=128, max_height=96), "wrist": CameraSpec("wrist")}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def smooth_image(height: int = 48, width: int = 64) -> np.ndarray:
    """A gradient image that JPEG reproduces closely; (H, W, 3) uint8."""
    y = np.linspace(0, 255, height)[:, None]
    x = np.linspace(0, 255, width)[None, :]
    return np.stack([np.broadcast_to(x, (height, width)), np.broadcast_to(y, (height, width)),
                     np.full((height, width), 90.0)], axis=-1).astype(np.uint8)


IMAGE = smooth_image()
JPEG = encode_jpeg(IMAGE)


def frame_header(**changes: Any) -> dict:
    header = {"v": 1, "seq": 3, "stamp_ns": 1_000, "camera": "front", "encoding": "rgb8", "height": 48, "width": 64}
    header.update(changes)
    return {k: v for k, v in header.items() if v is not DROP}


DROP = object()


def frame_parts(topic: bytes = b"frame/front", payload: Any = None, **changes: Any) -> list:
    header = frame_header(**changes)
    if payload is None:
        payload = JPEG if header.get("encoding") == "jpeg" else IMAGE.tobytes()
    return [topic, pack(header), payload]


def command_parts(topic: bytes, **fields: Any) -> list:
    msg = {"v": 1, "seq": 1, "stamp_ns": 2}
    msg.update(fields)
    return [topic, pack({k: v for k, v in msg.items() if v is not DROP})]


def action_fields(**changes: Any) -> dict:
    fields = dict(seq=5, stamp_ns=9, frame_seq=3, frame_stamp_ns=1_000, status="fresh", level=0,
                  action=[0.1, -0.2], chunk=[[0.1, -0.2], [0.3, 0.4]], timing_ms={"vision": 1.5, "decode": 2.0})
    fields.update(changes)
    return fields


def raw_action(**changes: Any) -> list:
    msg = {"v": 1, **action_fields()}
    msg.update(changes)
    return [b"action", pack({k: v for k, v in msg.items() if v is not DROP})]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8"])
def test_raw_frame_round_trip(encoding: str) -> None:
    sent = IMAGE[:, :, ::-1] if encoding == "bgr8" else IMAGE
    frame = decode_frame(encode_frame("front", 7, 123_456, sent, encoding), CAMERAS)
    assert isinstance(frame, Frame)
    assert (frame.camera, frame.seq, frame.stamp_ns, frame.encoding, frame.height, frame.width) == (
        "front", 7, 123_456, encoding, 48, 64)
    assert frame.rgb.shape == (48, 64, 3) and frame.rgb.dtype == np.uint8
    assert frame.rgb.flags.c_contiguous and not frame.rgb.flags.writeable
    np.testing.assert_array_equal(frame.rgb, IMAGE)


def test_rgb8_frame_is_a_zero_copy_view_of_the_payload() -> None:
    image = IMAGE.copy()
    parts = encode_frame("front", 1, 1, image)
    frame = decode_frame(parts, CAMERAS)
    assert np.shares_memory(frame.rgb, image)


@pytest.mark.parametrize("as_bytes", [True, False])
def test_jpeg_frame_round_trip(as_bytes: bool) -> None:
    parts = encode_frame("front", 2, 5, JPEG if as_bytes else IMAGE, "jpeg")
    assert bytes(parts[2][:2]) == b"\xff\xd8"
    frame = decode_frame(parts, CAMERAS)
    assert (frame.encoding, frame.height, frame.width) == ("jpeg", 48, 64)
    assert np.abs(frame.rgb.astype(int) - IMAGE).mean() < 3.0
    assert not frame.rgb.flags.writeable


def test_jpeg_odd_size_and_jpeg_size() -> None:
    odd = smooth_image(31, 45)
    data = encode_jpeg(odd, qscale=1)
    assert jpeg_size(data) == (31, 45)
    frame = decode_frame(encode_frame("wrist", 1, 1, data, "jpeg"), CAMERAS)
    assert frame.rgb.shape == (31, 45, 3)
    assert jpeg_size(b"not a jpeg") is None and jpeg_size(b"") is None


def test_instruction_round_trip() -> None:
    command = decode_command(encode_instruction(4, 77, "pick up the red cube ✓"))
    assert command == Instruction(4, 77, "pick up the red cube ✓")


def test_state_round_trip() -> None:
    command = decode_command(encode_state(5, 88, np.array([0.5, -1.25, 3.0])))
    assert isinstance(command, State) and (command.seq, command.stamp_ns) == (5, 88)
    assert command.values.dtype == np.float32
    np.testing.assert_array_equal(command.values, [0.5, -1.25, 3.0])
    ints = decode_command(command_parts(b"state", values=[1, 2, 3]))
    np.testing.assert_array_equal(ints.values, [1.0, 2.0, 3.0])


def test_action_round_trip_with_numpy_inputs_and_extra_keys() -> None:
    chunk = np.arange(8, dtype=np.float32).reshape(4, 2) / 8
    parts = encode_action(**action_fields(action=chunk[0], chunk=chunk, timing_ms={"total": np.float32(3.5)}),
                          tokens_refreshed=12, reuse_ratio=np.float32(0.75))
    msg = decode_action(parts)
    assert msg["v"] == PROTOCOL_VERSION and msg["seq"] == 5 and msg["status"] == "fresh"
    assert msg["action"] == [0.0, 0.125] and msg["chunk"] == chunk.tolist()
    assert msg["timing_ms"] == {"total": 3.5}
    assert msg["tokens_refreshed"] == 12 and msg["reuse_ratio"] == 0.75


def test_fallback_action_without_a_frame() -> None:
    parts = encode_action(**action_fields(status="fallback", frame_seq=None, frame_stamp_ns=None, chunk=[], level=5))
    msg = decode_action(parts)
    assert msg["frame_seq"] is None and msg["frame_stamp_ns"] is None and msg["chunk"] == []


def test_health_round_trip() -> None:
    msg = decode_health(encode_health({"rates": {"frames_hz": 29.5}, "drops": {"bad_size": 2}, "level": 1}, stamp_ns=42))
    assert msg == {"v": 1, "stamp_ns": 42, "rates": {"frames_hz": 29.5}, "drops": {"bad_size": 2}, "level": 1}
    assert decode_health(encode_health({}))["stamp_ns"] > 0


def test_decoders_accept_memoryviews() -> None:
    parts = [memoryview(bytes(p)) for p in encode_frame("front", 1, 1, IMAGE)]
    assert decode_frame(parts, CAMERAS).seq == 1


# ---------------------------------------------------------------- every reject reason

TINY = ProtocolLimits(max_header_bytes=200, max_command_bytes=200, max_text_chars=10, max_state_values=4, max_jpeg_bytes=100)
_SOS = JPEG.index(b"\xff\xda")
_SOF = next(JPEG.index(m) for m in (b"\xff\xc0", b"\xff\xc2"))
# The same JPEG with its start-of-frame claiming 60000 x 60000: must be refused before decoding.
BOMB = JPEG[: _SOF + 5] + (60000).to_bytes(2, "big") * 2 + JPEG[_SOF + 9:]


def frame(parts: list, limits: ProtocolLimits = ProtocolLimits()) -> Callable[[], object]:
    return lambda: decode_frame(parts, CAMERAS, limits)


def command(parts: list, limits: ProtocolLimits = ProtocolLimits()) -> Callable[[], object]:
    return lambda: decode_command(parts, limits)


def action(parts: list) -> Callable[[], object]:
    return lambda: decode_action(parts)


REJECTS: list[tuple[str, str, Callable[[], object]]] = [
    ("bad_parts", "frame with 2 parts", frame(frame_parts()[:2])),
    ("bad_parts", "frame with 4 parts", frame(frame_parts() + [b""])),
    ("bad_parts", "payload not bytes", frame(frame_parts(payload=12345))),
    ("bad_parts", "command with 3 parts", command(command_parts(b"instruction", text="go") + [b""])),
    ("bad_parts", "action with 1 part", action([b"action"])),
    ("bad_parts", "health with 3 parts", lambda: decode_health(encode_health({}) + [b""])),
    ("unknown_topic", "frame topic", frame(frame_parts(topic=b"image/front"))),
    ("unknown_topic", "command topic", command(command_parts(b"stop"))),
    ("unknown_topic", "command prefix", command(command_parts(b"instructions", text="go"))),
    ("unknown_topic", "health topic", lambda: decode_health([b"healthy", pack({"v": 1, "stamp_ns": 1})])),
    ("unknown_topic", "action topic", action([b"actions", raw_action()[1]])),
    ("too_large", "header", frame(frame_parts(camera="x" * 300), TINY)),
    ("too_large", "jpeg payload", frame(frame_parts(encoding="jpeg"), TINY)),
    ("too_large", "instruction text", command(command_parts(b"instruction", text="x" * 11), TINY)),
    ("too_large", "state values", command(command_parts(b"state", values=[1.0] * 5), TINY)),
    ("too_large", "command bytes", command(command_parts(b"instruction", text="x" * 300), TINY)),
    ("bad_msgpack", "header reserved byte", frame([b"frame/front", b"\xc1", IMAGE.tobytes()])),
    ("bad_msgpack", "header truncated", frame([b"frame/front", pack(frame_header())[:-3], IMAGE.tobytes()])),
    ("bad_msgpack", "state trailing bytes", command([b"state", command_parts(b"state", values=[1.0])[1] + b"\x00"])),
    ("bad_msgpack", "int map key", command([b"instruction", msgpack.packb({1: 2})])),
    ("bad_version", "v = 2", frame(frame_parts(v=2))),
    ("bad_version", "no v", frame(frame_parts(v=DROP))),
    ("bad_version", "v = '1'", command(command_parts(b"instruction", v="1", text="go"))),
    ("bad_version", "v = true", action(raw_action(v=True))),
    ("bad_version", "health v = 0", lambda: decode_health([b"health", pack({"v": 0, "stamp_ns": 1})])),
    ("missing_field", "frame seq", frame(frame_parts(seq=DROP))),
    ("missing_field", "instruction text", command(command_parts(b"instruction"))),
    ("missing_field", "action chunk", action(raw_action(chunk=DROP))),
    ("missing_field", "health stamp", lambda: decode_health([b"health", pack({"v": 1})])),
    ("unknown_field", "frame exposure", frame(frame_parts(exposure_us=100))),
    ("unknown_field", "state extra", command(command_parts(b"state", values=[1.0], extra=1))),
    ("bad_field", "header is a list", frame([b"frame/front", pack([1, 2]), IMAGE.tobytes()])),
    ("bad_field", "negative seq", frame(frame_parts(seq=-1))),
    ("bad_field", "float stamp", frame(frame_parts(stamp_ns=1.5))),
    ("bad_field", "bool seq", frame(frame_parts(seq=True))),
    ("bad_field", "zero height", frame(frame_parts(height=0, payload=b""))),
    ("bad_field", "str width", frame(frame_parts(width="64"))),
    ("bad_field", "camera differs from topic", frame(frame_parts(camera="wrist"))),
    ("bad_field", "camera is an array", frame(frame_parts(camera=np.zeros(2, np.uint8)))),
    ("bad_field", "empty text", command(command_parts(b"instruction", text=""))),
    ("bad_field", "text not str", command(command_parts(b"instruction", text=b"go"))),
    ("bad_field", "values not a list", command(command_parts(b"state", values="1,2"))),
    ("bad_field", "bool value", command(command_parts(b"state", values=[True]))),
    ("bad_field", "no values", command(command_parts(b"state", values=[]))),
    ("bad_field", "ndarray values", command(command_parts(b"state", values=np.ones(2, np.float32)))),
    ("bad_field", "action status", action(raw_action(status="late"))),
    ("bad_field", "fresh without frame", action(raw_action(frame_seq=None, frame_stamp_ns=None))),
    ("bad_field", "half nil frame", action(raw_action(status="fallback", frame_seq=None))),
    ("bad_field", "chunk row length", action(raw_action(chunk=[[0.1, 0.2, 0.3]]))),
    ("bad_field", "negative level", action(raw_action(level=-1))),
    ("bad_field", "timing not numbers", action(raw_action(timing_ms={"vision": "fast"}))),
    ("bad_field", "empty action", action(raw_action(action=[], chunk=[]))),
    ("bad_field", "health stamp", lambda: decode_health([b"health", pack({"v": 1, "stamp_ns": -5})])),
    ("unknown_camera", "rear", frame(frame_parts(topic=b"frame/rear", camera="rear"))),
    ("unknown_camera", "non-ascii topic", frame(frame_parts(topic=b"frame/\xff\xfe"))),
    ("unknown_camera", "empty camera", frame(frame_parts(topic=b"frame/"))),
    ("bad_encoding", "yuv420", frame(frame_parts(encoding="yuv420"))),
    ("bad_encoding", "int", frame(frame_parts(encoding=3))),
    ("bad_size", "raw payload short", frame(frame_parts(payload=IMAGE.tobytes()[:-1]))),
    ("bad_size", "raw payload long", frame(frame_parts(payload=IMAGE.tobytes() + b"\x00"))),
    ("bad_size", "bgr8 of another size", frame(frame_parts(encoding="bgr8", height=47))),
    ("bad_size", "jpeg header says otherwise", frame(frame_parts(encoding="jpeg", height=40))),
    ("bad_size", "jpeg bomb", frame(frame_parts(encoding="jpeg", payload=BOMB))),
    ("too_big_image", "height", frame(frame_parts(height=97, payload=b""))),
    ("too_big_image", "width", frame(frame_parts(width=129, payload=b""))),
    ("non_finite", "nan state", command(command_parts(b"state", values=[1.0, math.nan]))),
    ("non_finite", "inf state", command(command_parts(b"state", values=[-math.inf]))),
    ("non_finite", "beyond float32", command(command_parts(b"state", values=[1e39]))),
    ("non_finite", "nan action", action(raw_action(action=[math.nan, 0.0]))),
    ("non_finite", "inf chunk", action(raw_action(chunk=[[0.0, math.inf]]))),
    ("bad_jpeg", "not a jpeg", frame(frame_parts(encoding="jpeg", payload=b"\x89PNG\r\n\x1a\n" + b"\x00" * 64))),
    ("bad_jpeg", "empty", frame(frame_parts(encoding="jpeg", payload=b""))),
    ("bad_jpeg", "no scan", frame(frame_parts(encoding="jpeg", payload=JPEG[:_SOS]))),
]


@pytest.mark.parametrize("reason, case, decode", REJECTS, ids=[f"{r}-{c}" for r, c, _ in REJECTS])
def test_reject(reason: str, case: str, decode: Callable[[], object]) -> None:
    with pytest.raises(ProtocolError) as info:
        decode()
    assert info.value.reason == reason, f"{case}: {info.value}"
    assert isinstance(info.value, ValueError)


def test_every_reject_reason_is_produced_by_a_crafted_message() -> None:
    assert {reason for reason, _, _ in REJECTS} == set(REJECT_REASONS)


def test_reject_messages_name_the_problem() -> None:
    with pytest.raises(ProtocolError, match=r"bad_size: rgb8 payload of 9215 bytes: expected 48\*64\*3 = 9216"):
        decode_frame(frame_parts(payload=IMAGE.tobytes()[:-1]), CAMERAS)
    with pytest.raises(ProtocolError, match=r"unknown_camera.*\['front', 'wrist'\]"):
        decode_frame(frame_parts(topic=b"frame/rear"), CAMERAS)


# ---------------------------------------------------------------- encoders and specs


def test_encoder_errors() -> None:
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        encode_frame("front", 1, 1, IMAGE.astype(np.float32))
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        encode_frame("front", 1, 1, IMAGE[:, :, 0])
    with pytest.raises(ConfigError, match="camera = 'a/b'"):
        encode_frame("a/b", 1, 1, IMAGE)
    with pytest.raises(ConfigError, match="encoding = 'png'"):
        encode_frame("front", 1, 1, IMAGE, "png")
    with pytest.raises(ValueError, match="not a JPEG"):
        encode_frame("front", 1, 1, b"xx", "jpeg")
    with pytest.raises(ConfigError, match="status = 'late'"):
        encode_action(**action_fields(status="late"))
    with pytest.raises(ConfigError, match="chunk"):
        encode_action(**action_fields(chunk=[[1.0, 2.0, 3.0]]))
    with pytest.raises(ConfigError, match="'stamp_ns'"):
        encode_health({"stamp_ns": 1})
    with pytest.raises(ConfigError, match="text"):
        encode_instruction(1, 1, "")
    with pytest.raises(ConfigError, match="values"):
        encode_state(1, 1, [[1.0]])


def test_camera_spec_and_limits_validation() -> None:
    assert CameraSpec("cam_0.left-1").topic == b"frame/cam_0.left-1"
    with pytest.raises(ConfigError, match="name = 'front/left'"):
        CameraSpec("front/left")
    with pytest.raises(ConfigError, match="max_width = 0"):
        CameraSpec("front", max_width=0)
    with pytest.raises(ConfigError, match="max_jpeg_bytes = -1"):
        ProtocolLimits(max_jpeg_bytes=-1)


# ---------------------------------------------------------------- fuzz

field_values = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12) | st.lists(st.floats() | st.integers(-5, 5), max_size=4)
    | st.sampled_from(["rgb8", "bgr8", "jpeg", "front", "fresh", "fallback"])
    | st.sampled_from([np.zeros(2, np.float32), np.array(["front"]), np.ones((1, 2), np.uint8)]).map(
        lambda a: a if a.dtype.kind != "U" else np.frombuffer(b"front", np.uint8))
)
keys = st.sampled_from(["v", "seq", "stamp_ns", "camera", "encoding", "height", "width", "text", "values",
                        "status", "frame_seq", "frame_stamp_ns", "level", "action", "chunk", "timing_ms", "zz"])
topics = st.sampled_from([b"frame/front", b"frame/wrist", b"frame/x", b"instruction", b"state", b"action",
                          b"health", b""]) | st.binary(max_size=12)


@st.composite
def messages(draw: st.DrawFn) -> list:
    base = draw(st.sampled_from([frame_header(), {"v": 1, "seq": 1, "stamp_ns": 2, "text": "go"},
                                 {"v": 1, "seq": 1, "stamp_ns": 2, "values": [1.0]},
                                 {"v": 1, **action_fields()}, {"v": 1, "stamp_ns": 3}]))
    body = {**base, **draw(st.dictionaries(keys, field_values, max_size=4))}
    for key in draw(st.lists(keys, max_size=2)):
        body.pop(key, None)
    header = pack(body)
    if draw(st.booleans()):
        header = draw(st.binary(max_size=40)) if draw(st.booleans()) else header[: draw(st.integers(0, len(header)))]
    payload = draw(st.sampled_from([IMAGE.tobytes(), JPEG, JPEG[:100], b"", BOMB])) if draw(st.booleans()) else draw(st.binary(max_size=64))
    parts = [draw(topics), header, payload]
    return parts[: draw(st.integers(0, 3))] if draw(st.integers(0, 9)) == 0 else parts


@FUZZ
@given(messages())
def test_garbage_only_raises_protocol_error(parts: list) -> None:
    for decode in (lambda p: decode_frame(p, CAMERAS), decode_command, decode_action, decode_health):
        for candidate in (parts, parts[:2]):
            try:
                decode(candidate)
            except ProtocolError as e:
                assert e.reason in REJECT_REASONS
