"""Bad input to a running node (its own process, real sockets): every malformed message is counted in health's
`rejects` under its reason, the node keeps publishing, and the next valid frame makes a fresh action."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from helpers.node_harness import PATIENT_LAUNCH, running_node
from vla_node.config import load_launch
from vla_node.wire.codec import pack
from vla_node.wire.protocol import REJECT_REASONS, encode_frame

STATE_DIM = load_launch(PATIENT_LAUNCH).model.model_config().state_dim
H, W = 48, 64


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_node(PATIENT_LAUNCH, tmp_path_factory.mktemp("bad-input")) as node:
        node.warm_up()  # the pipeline is warm and frames flow
        yield node


def frame_header(**changes) -> dict:
    header = {"v": 1, "seq": 1, "stamp_ns": time.monotonic_ns(), "camera": "front", "encoding": "rgb8",
              "height": H, "width": W}
    header.update(changes)
    return header


def pixels(height: int = H, width: int = W) -> bytes:
    return bytes(height * width * 3)


# name -> (parts, sent on the command socket?, reject reason)
CASES = {
    "truncated_msgpack": (lambda: [b"frame/front", pack(frame_header())[:-5], pixels()], False, "bad_msgpack"),
    "payload_wrong_size": (lambda: [b"frame/front", pack(frame_header()), pixels()[:-3]], False, "bad_size"),
    "unknown_encoding": (lambda: [b"frame/front", pack(frame_header(encoding="yuv420")), pixels()], False,
                         "bad_encoding"),
    "oversized_header": (lambda: [b"frame/front", pack(frame_header(note="x" * 5000)), pixels()], False,
                         "too_large"),  # limits.max_header_bytes = 4096
    "unknown_camera": (lambda: encode_frame("unknown", 1, time.monotonic_ns(), np.zeros((H, W, 3), np.uint8)),
                       False, "unknown_camera"),
    "nan_in_state": (lambda: [b"state", pack({"v": 1, "seq": 1, "stamp_ns": time.monotonic_ns(),
                                              "values": [math.nan] + [0.0] * (STATE_DIM - 1)})], True,
                     "non_finite"),
    "state_wrong_dim": (lambda: [b"state", pack({"v": 1, "seq": 2, "stamp_ns": time.monotonic_ns(),
                                                 "values": [0.0] * (STATE_DIM + 1)})], True, "bad_state_dim"),
    # 'instruction' is subscribed as a prefix: this topic passes ZeroMQ's filter and reaches the decoder
    "unknown_command_topic": (lambda: [b"instructions", pack({"v": 1, "seq": 1, "stamp_ns": 1, "text": "x"})], True,
                              "unknown_topic"),
    "wrong_part_count": (lambda: [b"frame/front", pack(frame_header())], False, "bad_parts"),
    # stamps are the host's CLOCK_MONOTONIC: one 10 s ahead is another clock's, its age unknowable
    "stamp_from_the_future": (lambda: [b"frame/front", pack(frame_header(stamp_ns=time.monotonic_ns() + 10**10)),
                                       pixels()], False, "future_stamp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_message_is_counted_and_the_next_frame_is_processed(node, case):
    make, commands, reason = CASES[case]
    before = node.health()
    node.client.send_parts(make(), commands=commands)
    # wait until the node has counted it, so that the valid frame below does not share its drain
    after = node.health(until=lambda h: h["rejected"] > before["rejected"])
    assert after["rejected"] == before["rejected"] + 1, (before["rejects"], after["rejects"])
    assert after["rejects"].get(reason, 0) == before["rejects"].get(reason, 0) + 1, after["rejects"]
    seq, action = node.send_and_wait_fresh()
    assert action["frame_seq"] == seq
    node.check_alive()


def test_topic_the_node_does_not_subscribe_never_reaches_it(node):
    """ZeroMQ filters on the publisher's side: a topic outside the node's subscriptions (b'frame/' on the frame
    socket, b'instruction' and b'state' on the command socket) is dropped by the client's own XPUB. The node
    cannot observe it at all: no reject, no received frame, no command; only that nothing changed."""
    before = node.health()
    node.client.send_parts([b"video/front", pack(frame_header()), pixels()])
    node.client.send_parts([b"frames/front", pack(frame_header()), pixels()])  # not b'frame/'
    node.client.send_parts([b"steer", pack({"v": 1, "seq": 1, "stamp_ns": 1, "values": [1.0]})], commands=True)
    node.client.send_parts([b"", b"\xc1"], commands=True)
    seq, _ = node.send_and_wait_fresh()
    after = node.health(until=lambda h: h["cameras"]["front"]["last_seq"] == seq)
    assert after["rejected"] == before["rejected"], after["rejects"]
    assert after["cameras"]["front"]["received"] == before["cameras"]["front"]["received"] + 1
    assert after["commands"] == before["commands"]


def garbage(rng: np.random.Generator, i: int) -> tuple[list[bytes], bool]:
    """One of several kinds of junk, on the frame or the command socket."""
    junk = rng.bytes(int(rng.integers(0, 64)))
    kind = i % 6
    if kind == 0:
        return [b"frame/front", junk, junk], False  # header not msgpack (or not a map)
    if kind == 1:
        return [b"frame/front"] + [junk] * int(rng.choice([1, 3, 4])), False  # wrong part count or junk
    if kind == 2:
        return [b"frame/" + rng.bytes(4).hex().encode(), junk, junk], False  # unknown camera
    if kind == 3:
        return [b"state", junk], True
    if kind == 4:
        return [b"instruction", pack({"v": 2, "seq": 1, "stamp_ns": 1, "text": "x"})], True  # bad version
    return [b"state_" + junk[:3], junk], True  # subscribed prefix, unknown topic


def test_burst_of_1000_garbage_messages(node):
    """Every message that reaches the node is accounted for: rejected with a reason, or (frames only) dropped
    unread in the same drain behind newer messages of the same topic (the node decodes the newest few per topic,
    newest first, until one is valid)."""
    rng = np.random.default_rng(7)
    before = node.health()
    sent = 0
    for batch in range(20):  # paced in batches of 50 so that no queue reaches its high-water mark
        for j in range(50):
            parts, commands = garbage(rng, batch * 50 + j)
            node.client.send_parts(parts, commands=commands)
            sent += 1
        time.sleep(0.01)
        node.drain_actions()

    def accounted(h: dict) -> int:
        return (h["rejected"] - before["rejected"]
                + h["drops"]["superseded_in_queue"] - before["drops"]["superseded_in_queue"]
                + h["drops"]["discarded_in_bad_burst"] - before["drops"]["discarded_in_bad_burst"])

    after = node.health(until=lambda h: accounted(h) >= sent, timeout_s=10.0)
    assert accounted(after) == sent, (after["rejects"], after["drops"])
    reasons = {r: n - before["rejects"].get(r, 0) for r, n in after["rejects"].items()
               if n > before["rejects"].get(r, 0)}
    print(f"1,000 garbage messages: rejected by reason {reasons}, dropped unread in the drain "
          f"{after['drops']['discarded_in_bad_burst'] - before['drops']['discarded_in_bad_burst']}")
    assert set(reasons) <= set(REJECT_REASONS), reasons
    assert {"bad_msgpack", "bad_parts", "unknown_camera", "bad_version", "unknown_topic"} <= set(reasons), reasons
    assert after["cameras"]["front"]["received"] == before["cameras"]["front"]["received"]
    node.check_alive("after 1,000 garbage messages")
    seq, action = node.send_and_wait_fresh()
    assert action["frame_seq"] == seq
