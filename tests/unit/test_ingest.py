"""Ingest without sockets: latest valid frame wins, every reject and drop is counted."""

import numpy as np

from vla_node.node.ingest import FUTURE_TOLERANCE_NS, Ingest
from vla_node.wire.codec import pack
from vla_node.wire.protocol import CameraSpec, ProtocolLimits, encode_frame, encode_instruction, encode_state

IMAGE = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)


def make() -> Ingest:
    return Ingest([CameraSpec("front", 64, 64)], ProtocolLimits(), state_dim=4, max_text_bytes=10)


def test_newest_valid_frame_wins_and_older_ones_count_as_dropped():
    ingest = make()
    group = [encode_frame("front", seq, seq, IMAGE) for seq in range(5)]
    ingest.add_frames({b"frame/front": (group[-3:], 2)}, now_ns=10)
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
    ingest.add_frames({b"frame/front": ([good, truncated, wrong_size], 0)}, now_ns=10)
    (frame,) = ingest.take()
    assert frame.seq == 7
    rejects = ingest.health(2, 1.0, 10**9, 1.0)["rejects"]
    assert sum(rejects.values()) == 2 and "bad_size" in rejects


def test_commands_keep_the_newest_instruction_and_check_state_and_length():
    ingest = make()
    ingest.add_commands([encode_instruction(2, 2, "go left"), encode_instruction(1, 1, "go right"),
                         encode_instruction(3, 3, "x" * 11), encode_state(4, 4, [1.0, 2.0]),
                         encode_state(5, 5, [1.0, 2.0, 3.0, 4.0])], now_ns=10)
    assert ingest.instruction == "go left"
    assert ingest.state.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert ingest.rejects == {"stale_command": 1, "instruction_too_long": 1, "bad_state_dim": 1}
    assert ingest.commands == 2


def test_commands_are_ordered_by_stamp_so_a_restarted_client_or_a_huge_seq_cannot_freeze_them():
    ingest = make()
    now = 10**12
    ingest.add_commands([encode_instruction(2**64 - 1, now - 1000, "hostile"), encode_state(2**64 - 1, now - 1000,
                                                                                               [9.0] * 4)], now)
    # the client restarts: its seq counts from 0 again, its stamps (the host's monotonic clock) keep growing
    ingest.add_commands([encode_instruction(0, now - 500, "stop"), encode_state(0, now - 500, [0.0] * 4)], now)
    assert ingest.instruction == "stop" and ingest.state.tolist() == [0.0] * 4
    # older stamps arriving late are counted and dropped, the same stamp too unless its seq is higher
    ingest.add_commands([encode_instruction(5, now - 800, "late"), encode_state(6, now - 500, [1.0] * 4),
                         encode_state(1, now - 500, [2.0] * 4)], now)
    assert ingest.instruction == "stop" and ingest.state.tolist() == [1.0] * 4
    assert ingest.rejects == {"stale_command": 2}


def test_a_stamp_from_the_future_is_another_clock_and_is_rejected():
    ingest = make()
    now = 10**12
    past, future = encode_frame("front", 1, now - 10**6, IMAGE), encode_frame("front", 2, now + 10**9, IMAGE)
    ingest.add_frames({b"frame/front": ([past, future], 0)}, now)
    (frame,) = ingest.take()
    assert frame.seq == 1  # the newest is from the future: the older valid one is kept
    ingest.add_commands([encode_instruction(1, now + 10**9, "from the future")], now)
    assert ingest.instruction is None
    assert ingest.rejects == {"future_stamp": 2}
    # within the tolerance (a message stamped just after the drain's clock reading) it is accepted
    ingest.add_commands([encode_instruction(2, now + FUTURE_TOLERANCE_NS, "now")], now)
    assert ingest.instruction == "now"
