"""The publisher's side in one process: the link's framing, the publisher handling the worker's messages, and its
health. The publisher must not import torch (its process starts in a fraction of a second and holds little memory),
and nothing reaches it but link messages: a frame's figures travel with its chunk."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest

from helpers.paths import TEST_LAUNCH_DIR
from vla_node.config import load_launch
from vla_node.node.publisher import Publisher, PublisherSpec
from vla_node.node.publisher_link import MAX_MESSAGE_BYTES, LinkClosed, MessageReader, encode
from vla_node.sched.broker import TickStatus
from vla_node.sched.clock import ControlClock


def test_the_publisher_process_imports_no_torch():
    code = "import sys, vla_node.node.publisher; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_messages_fed_in_any_pieces_come_out_whole_and_in_order():
    stream = b"".join(encode({"t": "status", "n": n, "a": np.arange(n, dtype=np.float32)}) for n in range(5))
    reader, got = MessageReader(), []
    for cut in range(0, len(stream), 7):  # 7-byte pieces split headers and bodies alike
        got += reader.feed(stream[cut:cut + 7])
    assert [m["n"] for m in got] == list(range(5)) and got[3]["a"].tolist() == [0.0, 1.0, 2.0]
    assert reader.buffer == bytearray()
    with pytest.raises(LinkClosed):
        reader.feed(b"")


def test_an_oversized_message_is_refused_on_both_sides():
    with pytest.raises(ValueError, match="expected at most"):
        encode({"t": "status", "blob": b"x" * (MAX_MESSAGE_BYTES + 1)})
    with pytest.raises(ValueError, match="expected at most"):
        MessageReader().feed((MAX_MESSAGE_BYTES + 1).to_bytes(4, "little") + b"x")


def spec_for(launch: str = "tiny.toml") -> PublisherSpec:
    config = load_launch(TEST_LAUNCH_DIR / launch)
    c = config.model.model_config()
    return PublisherSpec.for_node(config, config.scheduler.broker(c.action_horizon, c.action_dims), 0)


def publisher() -> Publisher:
    """A Publisher on one end of a socket pair, without sockets of its own (its transport a stand-in)."""
    ours, theirs = socket.socketpair()
    pub = Publisher(spec_for(), theirs, transport=SimpleNamespace(publish_dropped=0))
    pub.worker_end = ours
    return pub


def test_the_spec_survives_the_hello_message():
    spec = spec_for()
    assert PublisherSpec(**{k: v for k, v in MessageReader().feed(encode({"t": "hello", **asdict(spec)}))[0].items()
                            if k != "t"}) == spec


def test_a_frames_figures_travel_with_its_chunk_over_the_link():
    pub = publisher()
    h, d = pub.spec.horizon, pub.spec.dim
    chunk = np.arange(h * d, dtype=np.float32).reshape(h, d)  # (H, D)
    pub.worker_end.sendall(encode({"t": "offer", "chunk": chunk, "frame_seq": 7, "frame_stamp_ns": 1_000,
                                   "produced_ns": 2_000, "level": 1, "timing_ms": {"vision": 3.0},
                                   "deadline_ns": 10**12, "tokens_refreshed": 42, "reuse_ratio": 0.75}))
    pub.read_link(1.0)
    out = pub.broker.next(2_000)
    assert out.status is TickStatus.FRESH and out.action.tolist() == chunk[0].tolist()
    assert (out.frame_seq, out.level, out.tokens_refreshed, out.reuse_ratio) == (7, 1, 42, 0.75)
    pub.worker_end.sendall(encode({"t": "withdraw", "level": 5}) + encode({"t": "stop", "reason": "signal 2"}))
    pub.read_link(1.0)
    assert pub.broker.next(3_000).status is TickStatus.FALLBACK and pub.stop_reason == "signal 2"
    pub.worker_end.sendall(encode({"t": "bogus"}))
    with pytest.raises(ValueError, match="'bogus'"):
        pub.read_link(1.0)
    pub.worker_end.close()
    with pytest.raises(LinkClosed):
        pub.read_link(1.0)


def test_figures_of_a_stalled_worker_say_no_camera_is_alive():
    """The worker's posted figures, and once they are older than a health period (the worker's posting cadence)
    and the camera timeout every camera not alive (a stalled worker learns of no frame); the publisher's own
    figures and the static ones beside them."""
    pub = publisher()
    pub.static = {"backend": "torch"}
    camera = {"alive": True, "rate_ok": True, "rate_hz": 10.0}
    pub.broker.post_status({"level": 2, "cameras": {"front": camera}, "reconnects": 1, "rss_bytes": 5}, 10**9)
    clock = ControlClock(20_000_000, 0)
    fresh = pub.health(1_100_000_000, clock)
    assert fresh["level"] == 2 and fresh["cameras"]["front"]["alive"] and fresh["transport"]["reconnects"] == 1
    assert fresh["worker_age_ms"] == 100.0 and fresh["backend"] == "torch" and fresh["rss_bytes"] == 5
    assert fresh["publisher_rss_bytes"] > 0
    # the worker posts once a health period on a phase of its own: figures a period old are its latest, not stale
    # (judged on the camera timeout alone, a health message just before the next post said every camera dead)
    spec = pub.spec
    assert spec.health_period_ns >= spec.camera_timeout_ns, spec  # the launch files' case: period 0.5-1 s, 500 ms
    due = pub.health(10**9 + spec.health_period_ns + spec.camera_timeout_ns, clock)
    assert due["cameras"]["front"]["alive"], due
    stale = pub.health(10**9 + spec.health_period_ns + spec.camera_timeout_ns + 1, clock)
    assert stale["cameras"]["front"] == {"alive": False, "rate_ok": False, "rate_hz": 10.0}
    assert camera["alive"]  # the posted figures themselves are not changed
    assert pub._level(None) == 2 and pub._level(0) == 0
