"""Ingest without sockets: latest valid frame wins, every reject and drop is counted."""

import numpy as np
import pytest

from vla_node.codec import pack
from vla_node.ingest import Ingest
from vla_node.protocol import CameraSpec, ProtocolLimits, encode_frame, encode_instruction, encode_state

pytestmark = pytest.mark.unit
IMAGE = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)


def make() -> Ingest:
    return Ingest([CameraSpec("front", 64, 64)], ProtocolLimits(), state_dim=4, max_text_bytes=10)


def test_newest_valid_frame_wins_and_older_ones_count_as_dropped():
    ingest = make()
    group = [encode_frame("front", seq, seq, IMAGE) for seq in range(5)]
    ingest.add_frames({b"frame/front": (group[-3:], 2)}, now_ns=1)
    assert ingest.ready()
    (frame,) = ingest.take()
    assert frame.seq == 4 and not ingest.ready()
    health = ingest.health(2, 1.0, 10**9, 1.0)
    assert health["frames_dropped"] == 4 and health["cameras"]["front"]["received"] == 5


def test_a_bad_newest_message_falls_back_to_the_older_valid_one():
    ingest = make()
    good = encode_frame("front", 7, 7, IMAGE)
    truncated = [b"frame/front", pack({"v": 1})[:-1], b""]
    wrong_size = [b"frame/front", good[1], b"\x00" * 5]
    ingest.add_frames({b"frame/front": ([good, truncated, wrong_size], 0)}, now_ns=1)
    (frame,) = ingest.take()
    assert frame.seq == 7
    rejects = ingest.health(2, 1.0, 10**9, 1.0)["rejects"]
    assert sum(rejects.values()) == 2 and "bad_size" in rejects


def test_commands_keep_the_newest_instruction_and_check_state_and_length():
    ingest = make()
    ingest.add_commands([encode_instruction(2, 2, "go left"), encode_instruction(1, 1, "go right"),
                         encode_instruction(3, 3, "x" * 11), encode_state(4, 4, [1.0, 2.0]),
                         encode_state(5, 5, [1.0, 2.0, 3.0, 4.0])])
    assert ingest.instruction == "go left"
    assert ingest.state.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert ingest.rejects == {"instruction_too_long": 1, "bad_state_dim": 1}
