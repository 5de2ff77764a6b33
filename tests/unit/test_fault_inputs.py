"""Faults in what reaches the node, without sockets: stamps that jump back or far forward, NaN/Inf in the state,
oversized frames refused before any decoding, and a second camera whose view died (no decision on it)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import av
import numpy as np
import pytest

from helpers.fault_helpers import two_camera_launch
from vla_node.config import load_launch
from vla_node.node.ingest import Ingest
from vla_node.node.pipeline import Pipeline
from vla_node.sched.broker import TickStatus
from vla_node.wire import protocol
from vla_node.wire.codec import pack
from vla_node.wire.protocol import CameraSpec, Frame, ProtocolError, ProtocolLimits, encode_frame, encode_jpeg

IMAGE = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
NOW = 10**12


def make(**limits) -> Ingest:
    return Ingest([CameraSpec("front", 64, 48)], ProtocolLimits(**limits), state_dim=4, max_text_bytes=10)


def add(ingest: Ingest, *frames: list, now: int = NOW) -> None:
    ingest.add_frames({b"frame/front": (list(frames), 0)}, now)


def test_a_frame_stamped_before_its_cameras_last_accepted_one_is_stale_and_never_replaces_it():
    ingest = make()
    add(ingest, encode_frame("front", 1, NOW - 100, IMAGE))
    (first,) = ingest.take()
    add(ingest, encode_frame("front", 2, NOW - 10**10, IMAGE))  # the camera's clock jumped 10 s back
    add(ingest, encode_frame("front", 3, NOW - 100, IMAGE))  # the same stamp again (a duplicate)
    assert not ingest.ready() and ingest.current["front"] is first
    assert ingest.rejects == {"stale_frame": 2}
    # in one drain: the newest is stale, the one before it is newer than the last accepted: that one is kept
    add(ingest, encode_frame("front", 4, NOW - 50, IMAGE), encode_frame("front", 5, NOW - 10**9, IMAGE))
    (frame,) = ingest.take()
    assert frame.seq == 4 and ingest.rejects == {"stale_frame": 3}
    add(ingest, encode_frame("front", 6, NOW + 10**10, IMAGE))  # 10 s ahead: another clock
    assert not ingest.ready() and ingest.rejects == {"stale_frame": 3, "future_stamp": 1}
    health = ingest.health(NOW, 1.0, 10**9, 1.0)
    assert health["cameras"]["front"]["received"] == 2 and health["rejected"] == 4


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e39])
def test_a_non_finite_state_is_rejected_and_the_last_valid_one_stays(value):
    ingest = make()
    ingest.add_commands([[b"state", pack({"v": 1, "seq": 1, "stamp_ns": NOW - 10, "values": [0.5] * 4})]], NOW)
    bad = [b"state", pack({"v": 1, "seq": 2, "stamp_ns": NOW - 5, "values": [value, 0.0, 0.0, 0.0]})]
    ingest.add_commands([bad], NOW)
    assert ingest.rejects == {"non_finite": 1} and ingest.commands == 1
    assert ingest.state.tolist() == [0.5] * 4 and np.isfinite(ingest.state).all()


def header(height: int, width: int, encoding: str) -> bytes:
    return pack({"v": 1, "seq": 1, "stamp_ns": NOW, "camera": "front", "encoding": encoding, "height": height,
                 "width": width})


def sof_says(jpeg: bytes, height: int, width: int) -> bytes:
    data = bytearray(jpeg)
    sof = next(i for i in range(2, len(data) - 9) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC1, 0xC2))
    data[sof + 5:sof + 9] = bytes([height >> 8, height & 0xFF, width >> 8, width & 0xFF])
    return bytes(data)


def test_oversized_frames_are_refused_from_their_header_before_any_decoding(monkeypatch):
    """The camera allows 64x48 and the JPEG limit is 1000 bytes: each case is refused from the header's sizes or the
    JPEG's start-of-frame segment; the decoder is never reached and nothing is allocated for the pixels."""
    jpeg = encode_jpeg(np.zeros((48, 64, 3), np.uint8))
    decoded = []

    class CodecContext:  # the JPEG decoder, counted
        @staticmethod
        def create(*args):
            decoded.append(args)
            return av.CodecContext.create(*args)

    monkeypatch.setattr(protocol, "av", SimpleNamespace(CodecContext=CodecContext, Packet=av.Packet,
                                                        FFmpegError=av.FFmpegError))
    cameras, limits = {"front": CameraSpec("front", 64, 48)}, ProtocolLimits(max_jpeg_bytes=1000)
    assert len(jpeg) <= 1000
    cases = {
        "too_big_image": [[b"frame/front", header(49, 64, "rgb8"), bytes(49 * 64 * 3)],
                          [b"frame/front", header(48, 65, "jpeg"), jpeg],
                          [b"frame/front", header(10**6, 10**6, "rgb8"), b""]],  # would be 3 TB of pixels
        "too_large": [[b"frame/front", header(48, 64, "jpeg"), bytes(1001)]],
        "bad_size": [[b"frame/front", header(48, 64, "jpeg"), sof_says(jpeg, 4000, 6000)],
                     [b"frame/front", header(48, 64, "rgb8"), bytes(48 * 64 * 3 + 1)]],
    }
    for reason, messages in cases.items():
        for parts in messages:
            with pytest.raises(ProtocolError) as e:
                protocol.decode_frame(parts, cameras, limits)
            assert e.value.reason == reason, (reason, e.value)
    assert decoded == []
    protocol.decode_frame([b"frame/front", header(48, 64, "jpeg"), jpeg], cameras, limits)
    assert len(decoded) == 1  # a valid JPEG does reach the decoder


class Clock:
    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        return self.now


def camera_frame(camera: str, seq: int, stamp_ns: int) -> Frame:
    rgb = np.full((48, 64, 3), 40 + seq % 7, np.uint8)
    return Frame(camera, seq, stamp_ns, "rgb8", 48, 64, rgb)


def test_no_decision_is_made_on_a_second_cameras_dead_view_and_it_counts(tmp_path):
    clock = Clock()
    config = load_launch(two_camera_launch(tmp_path))
    pipeline = Pipeline(config, clock, warm_up_rounds=1)
    timeout = int(config.health.camera_timeout_ms * 1e6)
    plan = pipeline.process([camera_frame("front", 0, clock.now), camera_frame("rear", 1, clock.now)], None, None)
    assert plan is not None and pipeline.broker.next(clock.now).status is TickStatus.FRESH
    rear = camera_frame("rear", 3, clock.now)
    clock.now += timeout  # the rear view exactly as old as the camera timeout: still alive
    assert pipeline.process([camera_frame("front", 2, clock.now), rear], None, None) is not None
    assert pipeline.broker.next(clock.now).status is TickStatus.FRESH
    clock.now += 1  # older than the timeout: dead
    assert pipeline.process([camera_frame("front", 4, clock.now), rear], None, None) is None
    out = pipeline.broker.next(clock.now)
    assert out.status is TickStatus.FALLBACK and out.level == pipeline.fallback_level > 0
    assert pipeline.frames_stale_view == 1 and pipeline.frames_skipped == 1 and pipeline.frames_processed == 2
    # back: a new rear frame, and the next front frame decides again
    clock.now += 100_000_000
    plan = pipeline.process([camera_frame("front", 5, clock.now), camera_frame("rear", 6, clock.now)], None, None)
    assert plan is not None and pipeline.broker.next(clock.now).status is TickStatus.FRESH
