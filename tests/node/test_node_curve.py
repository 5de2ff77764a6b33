"""CURVE on a running node (its own process): a client without an allowed key gets nothing through in either
direction (no actions, no health, its frames never processed); the allowed client works."""

from __future__ import annotations

import pytest

from helpers.node_harness import PATIENT_LAUNCH, running_node
from vla_node.wire.keys import create_keys


def curve_launch(tmp_path, keys_dir) -> str:
    """tests/launch/tiny_patient.toml with [transport] curve_keys_dir added to its [transport] table."""
    text = PATIENT_LAUNCH.read_text()
    assert text.count("[transport]\n") == 1
    path = tmp_path / "curve.toml"
    path.write_text(text.replace("[transport]\n", f"[transport]\ncurve_keys_dir = {str(keys_dir)!r}\n"))
    return path


def try_without_access(node, seconds: float, **client_kwargs) -> tuple[int, int]:
    """Bind a client the node will not admit, publish frames at 10 Hz for `seconds`: (actions, health
    messages) it received."""
    client = node.connect(handshake_s=None, **client_kwargs)
    with pytest.raises(TimeoutError):
        client.wait_for_node(1.0)
    actions, _ = node.stream(seconds)
    health = node.queued_health()
    return len(actions), len(health)


def allowed_client_works(node, keys_dir, refused_frames: set[int], handshake_s: float) -> None:
    node.connect(handshake_s=handshake_s, curve_keys_dir=str(keys_dir))
    health = node.health()
    assert health["frames_processed"] == 0 and health["cameras"]["front"]["received"] == 0, health
    assert health["rejected"] == 0, health  # refused at the CURVE handshake, before any message
    node.warm_up()
    seq, action = node.send_and_wait_fresh()
    assert action["frame_seq"] == seq and seq not in refused_frames
    actions, _ = node.stream(1.0)
    fresh = {a.msg["frame_seq"] for a in actions if a.msg["status"] == "fresh"}
    assert fresh and not fresh & refused_frames, (fresh, len(refused_frames))


def test_curve_refuses_a_key_not_allowed_then_admits_the_allowed_one(tmp_path):
    keys = create_keys(tmp_path / "keys")
    intruder = create_keys(tmp_path / "intruder")  # a valid key pair, not in keys/authorized_clients/
    with running_node(curve_launch(tmp_path, tmp_path / "keys"), tmp_path, handshake_s=None) as node:
        node.process.wait_log(node.process.SOCKETS_OPEN)  # the node's sockets exist: it is the one refusing
        got = try_without_access(node, 3.0, client_secret_key=intruder.client_secret,
                                 server_public_key=keys.server_public)
        assert got == (0, 0), f"a client with a key not allowed received (actions, health) = {got}"
        allowed_client_works(node, tmp_path / "keys", set(node.sent), handshake_s=60.0)


def test_curve_refuses_a_plaintext_client_then_admits_the_allowed_one(tmp_path):
    """A plaintext peer that binds the frame and command addresses can make libzmq 4.3.5 give up the node's
    connections there (a handshake protocol error); the node connects them again (tests/node/test_transport.py
    test_a_failed_curve_handshake_does_not_cut_the_node_off makes that failure happen every time)."""
    create_keys(tmp_path / "keys")
    with running_node(curve_launch(tmp_path, tmp_path / "keys"), tmp_path, handshake_s=None) as node:
        node.process.wait_log(node.process.SOCKETS_OPEN)
        got = try_without_access(node, 1.5)  # no CURVE at all
        assert got == (0, 0), f"a client without CURVE received (actions, health) = {got}"
        # the node notices the connections libzmq gave up and connects them again: allow a loaded machine time
        allowed_client_works(node, tmp_path / "keys", set(node.sent), handshake_s=15.0)
