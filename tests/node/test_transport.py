"""vla_node.wire.transport and vla_node.wire.keys over real ZeroMQ sockets (ipc abstract names and tcp loopback)."""

from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq

from helpers.node_harness import REPO_ROOT
from vla_node.validate import ConfigError, from_dict
from vla_node.wire.codec import CodecError, pack
from vla_node.wire.keys import create_keys, key_paths
from vla_node.wire.protocol import (
    CameraSpec,
    Instruction,
    ProtocolError,
    State,
    decode_command,
    decode_frame,
    encode_action,
    encode_health,
)
from vla_node.wire.transport import HANDSHAKE_TIMEOUT_MS, OTHER_TOPICS, Client, NodeTransport, TransportConfig

CAMERAS = {"front": CameraSpec("front"), "wrist": CameraSpec("wrist")}
IMAGE = (np.arange(24 * 32 * 3) % 251).astype(np.uint8).reshape(24, 32, 3)  # (H, W, 3)


def ipc_config(**changes: object) -> TransportConfig:
    tag = uuid.uuid4().hex[:12]
    return TransportConfig(frames=f"ipc://@vla-test-{tag}-frames", commands=f"ipc://@vla-test-{tag}-commands",
                           actions=f"ipc://@vla-test-{tag}-actions", health=f"ipc://@vla-test-{tag}-health",
                           **changes)


def tick_action(seq: int = 0) -> list[bytes]:
    return encode_action(seq=seq, stamp_ns=time.monotonic_ns(), frame_seq=None, frame_stamp_ns=None,
                         status="fallback", level=0, action=[0.0, 0.0], chunk=[], timing_ms={"total": 0.1})


def handshake(node: NodeTransport, client: Client, timeout_s: float = 10.0) -> None:
    """Play the node's part (poll the inputs and publish an action every tick) until the client's
    wait_for_node succeeds."""
    deadline = time.monotonic() + timeout_s
    while True:
        node.poll(0)
        node.publish_action(tick_action())
        try:
            client.wait_for_node(0.05)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def wait_readable(node: NodeTransport, settle_s: float = 0.3) -> None:
    assert node.poll(5000), "nothing arrived at the node within 5 s"
    time.sleep(settle_s)  # let the rest of a burst land


@pytest.fixture
def pair():
    config = ipc_config(rcv_hwm=1000, snd_hwm=1000)
    node = NodeTransport(config)
    client = Client(config)
    try:
        handshake(node, client)
        yield node, client
    finally:
        client.close()
        node.close()


# ---------------------------------------------------------------- config


def test_defaults_are_loopback_tcp() -> None:
    config = TransportConfig()
    assert config.frames == "tcp://127.0.0.1:5560" and config.actions == "tcp://127.0.0.1:5562"
    assert config.allow_non_loopback is False and config.curve_keys_dir is None


@pytest.mark.parametrize(
    "key, address",
    [("actions", "tcp://*:5562"), ("health", "tcp://0.0.0.0:5563"), ("frames", "tcp://192.168.1.20:5560"),
     ("commands", "tcp://eth0:5561"), ("actions", "tcp://[::]:5562"), ("health", "tcp://robot.local:5563")],
)
def test_non_loopback_refused_without_opt_in(key: str, address: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key} = '{address.replace('*', '[*]').replace('[::]', '.::.')}'.*allow_non_loopback"):
        TransportConfig(**{key: address})
    assert getattr(TransportConfig(**{key: address}, allow_non_loopback=True), key) == address


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:6000", "tcp://127.0.0.2:6000", "tcp://localhost:6000",
                                     "tcp://[::1]:6000", "ipc:///tmp/vla.sock", "ipc://@vla", "inproc://vla"])
def test_local_addresses_accepted(address: str) -> None:
    assert TransportConfig(actions=address).actions == address


@pytest.mark.parametrize("address", ["127.0.0.1:5562", "udp://127.0.0.1:5562", "tcp://127.0.0.1", "tcp://127.0.0.1:0",
                                     "tcp://127.0.0.1:99999", "tcp://127.0.0.1:*", "ipc://", 5562])
def test_malformed_addresses_refused(address: object) -> None:
    with pytest.raises(ConfigError, match="^actions = "):
        TransportConfig(actions=address)


def test_other_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="^health = 'tcp://127.0.0.1:5562'.*actions"):
        TransportConfig(health="tcp://127.0.0.1:5562")
    with pytest.raises(ConfigError, match="^rcv_hwm = 0"):
        TransportConfig(rcv_hwm=0)
    with pytest.raises(ConfigError, match="^max_message_bytes = 10"):
        TransportConfig(max_message_bytes=10)
    with pytest.raises(ConfigError, match="^curve_keys_dir = ''"):
        TransportConfig(curve_keys_dir="")


def test_from_toml_table_prefixes_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^transport\.actions = 'tcp://\*:5562'"):
        from_dict(TransportConfig, {"actions": "tcp://*:5562"}, "transport")
    config = from_dict(TransportConfig, {"actions": "tcp://*:5562", "allow_non_loopback": True}, "transport")
    assert config.actions == "tcp://*:5562"


# ---------------------------------------------------------------- round trips over sockets


def test_every_message_round_trips(pair) -> None:
    node, client = pair
    client.send_frame("front", 1, 111, IMAGE)
    client.send_frame("wrist", 2, 222, IMAGE[:, :, ::-1], "bgr8")
    client.send_frame("front", 3, 333, IMAGE, "jpeg")
    client.send_instruction(4, 444, "open the gripper")
    client.send_state(5, 555, [0.25, -1.0])
    wait_readable(node)
    latest, dropped = node.drain_frames()
    assert set(latest) == {b"frame/front", b"frame/wrist"} and dropped == 1
    front = decode_frame(latest[b"frame/front"], CAMERAS)
    assert (front.seq, front.stamp_ns, front.encoding) == (3, 333, "jpeg")
    assert np.abs(front.rgb.astype(int) - IMAGE).mean() < 12  # JPEG of a noisy test pattern
    wrist = decode_frame(latest[b"frame/wrist"], CAMERAS)
    assert (wrist.seq, wrist.encoding) == (2, "bgr8")
    np.testing.assert_array_equal(wrist.rgb, IMAGE)
    commands = [decode_command(parts) for parts in node.drain_commands()]
    assert commands[0] == Instruction(4, 444, "open the gripper")
    assert isinstance(commands[1], State) and commands[1].values.tolist() == [0.25, -1.0]

    node.publish_action(encode_action(seq=9, stamp_ns=999, frame_seq=3, frame_stamp_ns=333, status="fresh", level=1,
                                      action=[0.5, 0.5], chunk=[[0.5, 0.5]], timing_ms={"decode": 4.0}, reuse_ratio=0.5))
    action = client.recv_action(2000)
    while action is not None and action["status"] == "fallback":  # handshake ticks still in flight
        action = client.recv_action(2000)
    assert action is not None and action["seq"] == 9 and action["frame_seq"] == 3 and action["reuse_ratio"] == 0.5
    node.publish_health(encode_health({"level": 1, "drops": {"bad_size": 0}}, stamp_ns=1234))
    health = client.recv_health(2000)
    assert health == {"v": 1, "stamp_ns": 1234, "level": 1, "drops": {"bad_size": 0}}
    assert client.recv_health(50) is None


def test_rgb8_frame_decodes_from_zmq_frames(pair) -> None:
    node, client = pair
    client.send_frame("front", 1, 1, IMAGE)
    wait_readable(node, 0.05)
    latest, _ = node.drain_frames()
    parts = latest[b"frame/front"]
    assert all(isinstance(p, zmq.Frame) for p in parts)
    frame = decode_frame(parts, CAMERAS)
    np.testing.assert_array_equal(frame.rgb, IMAGE)
    assert not frame.rgb.flags.writeable


def test_burst_of_100_frames_drains_to_the_newest_per_camera(pair) -> None:
    node, client = pair
    for seq in range(100):
        client.send_frame("front", seq, seq, IMAGE)
        client.send_frame("wrist", 1000 + seq, seq, IMAGE)
    wait_readable(node)
    latest, dropped = node.drain_frames()
    assert dropped == 198
    assert decode_frame(latest[b"frame/front"], CAMERAS).seq == 99
    assert decode_frame(latest[b"frame/wrist"], CAMERAS).seq == 1099
    assert node.drain_frames() == ({}, 0)
    assert not node.poll(0)


def test_drain_is_bounded_per_call(pair) -> None:
    node, client = pair
    for seq in range(30):
        client.send_frame("front", seq, seq, IMAGE)
    wait_readable(node)
    first, dropped_first = node.drain_frames(max_messages=10)
    assert decode_frame(first[b"frame/front"], CAMERAS).seq == 9 and dropped_first == 9
    rest, dropped_rest = node.drain_frames()
    assert decode_frame(rest[b"frame/front"], CAMERAS).seq == 29 and dropped_rest == 19


def test_topics_of_cameras_not_configured_share_one_bounded_group(pair) -> None:
    """A flood of distinct unknown camera topics must not keep `keep` messages each until the drain ends."""
    node, client = pair
    for seq in range(60):
        client.send_parts([f"frame/junk{seq}".encode(), pack({"v": 1}), b"x" * 1000])
    client.send_frame("front", 7, 7, IMAGE)
    wait_readable(node)
    groups = node.drain_frame_messages({b"frame/front", b"frame/wrist"}, keep=3)
    assert set(groups) == {b"frame/front", OTHER_TOPICS}
    kept, discarded = groups[OTHER_TOPICS]
    assert len(kept) == 3 and discarded == 57  # the newest three unknown ones are decoded (and rejected)
    assert [bytes(m[0].bytes) for m in kept] == [b"frame/junk57", b"frame/junk58", b"frame/junk59"]
    assert decode_frame(groups[b"frame/front"][0][-1], CAMERAS).seq == 7


def test_commands_drain_all_in_order(pair) -> None:
    node, client = pair
    for seq in range(20):
        if seq % 2:
            client.send_state(seq, seq, [float(seq)])
        else:
            client.send_instruction(seq, seq, f"step {seq}")
    wait_readable(node)
    commands = [decode_command(parts) for parts in node.drain_commands()]
    assert [c.seq for c in commands] == list(range(20))
    assert [type(c).__name__ for c in commands[:2]] == ["Instruction", "State"]
    assert node.drain_commands() == []


def test_garbage_bursts_only_raise_protocol_errors_and_the_node_keeps_working(pair) -> None:
    node, client = pair
    rng = random.Random(7)
    for i in range(200):
        parts = [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(1, 5))]
        if i % 2:
            parts[0] = b"frame/" + rng.choice([b"front", b"wrist", b"", rng.randbytes(5)])
            client.send_parts(parts)
        else:
            parts[0] = rng.choice([b"instruction", b"state", b"statex"])
            client.send_parts(parts, commands=True)
    client.send_parts([b"frame/front", pack({"v": 1, "seq": 1}), b""])  # valid msgpack, wrong content
    wait_readable(node)
    latest, dropped = node.drain_frames()
    commands = node.drain_commands()
    assert len(latest) + dropped == 101 and len(commands) == 100
    for parts in list(latest.values()) + commands:
        decode = (lambda p: decode_frame(p, CAMERAS)) if bytes(parts[0]).startswith(b"frame/") else decode_command
        with pytest.raises(ProtocolError):
            decode(parts)
    client.send_frame("front", 5, 5, IMAGE)
    client.send_instruction(6, 6, "still alive")
    wait_readable(node)
    latest, _ = node.drain_frames()
    assert decode_frame(latest[b"frame/front"], CAMERAS).seq == 5
    assert decode_command(node.drain_commands()[0]).text == "still alive"


def test_a_restarted_client_reaches_the_same_node() -> None:
    config = ipc_config()
    with NodeTransport(config) as node:
        for generation in range(3):
            with Client(config) as client:
                handshake(node, client)
                client.send_frame("front", generation, generation, IMAGE)
                wait_readable(node, 0.05)
                latest, _ = node.drain_frames()
                assert decode_frame(latest[b"frame/front"], CAMERAS).seq == generation


def test_oversized_message_part_is_refused_by_maxmsgsize() -> None:
    config = ipc_config(max_message_bytes=4096)
    with NodeTransport(config) as node, Client(config) as client:
        handshake(node, client)
        client.send_frame("front", 1, 1, np.zeros((64, 64, 3), np.uint8))  # 12 KiB payload > 4 KiB
        assert not node.poll(300)
        assert node.drain_frames() == ({}, 0)


def test_publishing_never_blocks_on_a_subscriber_that_does_not_read() -> None:
    config = ipc_config(snd_hwm=4, rcv_hwm=4)
    with NodeTransport(config) as node, Client(config) as client:
        handshake(node, client)
        for seq in range(2000):  # would block forever if sends blocked at the high-water mark
            node.publish_action(tick_action(seq))
            node.publish_health(encode_health({"seq": seq}))
        assert client.recv_action(1000) is not None


def test_wait_for_node_times_out_with_a_clear_message() -> None:
    with Client(ipc_config()) as client:
        with pytest.raises(TimeoutError, match="frame subscription .* missing.*action .* missing"):
            client.wait_for_node(0.2)


def test_second_binder_on_the_same_address_fails() -> None:
    config = ipc_config()
    with NodeTransport(config):
        with pytest.raises(OSError, match="cannot bind"):
            NodeTransport(config)


INTERRUPT_IN_SOCKET = """
import sys, zmq
from vla_node.config import NodeConfig
from vla_node.drives.record import listen
from vla_node.wire.transport import Client, NodeTransport, TransportConfig
assert hasattr(zmq.Context, "_add_socket"), f"pyzmq {zmq.__version__}: Context._add_socket is gone, find the new window"
side, which, addresses = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
made = 0

def ctrl_c_between_making_and_listing(frame, event, arg):  # as a KeyboardInterrupt lands between two bytecodes
    global made
    if event == "call" and frame.f_code.co_name == "_add_socket":
        made += 1
        if made == which:
            sys.settrace(None)
            raise KeyboardInterrupt
    return None

config = TransportConfig(*addresses)
sys.settrace(ctrl_c_between_making_and_listing)
try:
    if side == "record":  # vla-node record's four SUBs
        listen(NodeConfig(), config, lambda: None, "", 1.0, None, False)
    else:
        Client(config) if side == "client" else NodeTransport(config)
except KeyboardInterrupt:
    print(f"interrupted at socket {made}")
"""


@pytest.mark.parametrize("side", ["client", "node", "record"])
@pytest.mark.parametrize("which", [1, 2, 3, 4])
def test_a_ctrl_c_while_a_socket_is_made_raises_at_once(side: str, which: int) -> None:
    """pyzmq's Context.socket makes the socket, then lists it in its context: a Ctrl-C between the two leaves a
    socket that not even destroy closes, and terminating the context would wait on it for ever (a fleet shard hung
    so). The client, the node's transport and `vla-node record`'s listener close what they made and leave the
    context to the collector."""
    c = ipc_config()
    try:
        run = subprocess.run([sys.executable, "-c", INTERRUPT_IN_SOCKET, side, str(which), c.frames, c.commands,
                              c.actions, c.health], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{side}: still running 60 s after a Ctrl-C while its socket {which} was made (a context's term "
                    "waiting on a socket it does not list?)")
    assert run.returncode == 0 and run.stdout.strip() == f"interrupted at socket {which}", run.stdout + run.stderr


def test_ipc_socket_files_are_owner_only(tmp_path: Path) -> None:
    """Both ends' bound ipc files are 0600 whatever the umask: no other local user connects to them."""
    paths = {key: tmp_path / key for key in ("frames", "commands", "actions", "health")}
    config = TransportConfig(**{key: f"ipc://{path}" for key, path in paths.items()})
    previous = os.umask(0)  # the most permissive umask: files would be created 0777
    try:
        with NodeTransport(config), Client(config):
            modes = {key: stat.S_IMODE(path.stat().st_mode) for key, path in paths.items()}
    finally:
        os.umask(previous)
    assert modes == dict.fromkeys(paths, 0o600)


def free_tcp_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_tcp_loopback_round_trip() -> None:
    frames, commands, actions, health = free_tcp_ports(4)
    config = TransportConfig(frames=f"tcp://127.0.0.1:{frames}", commands=f"tcp://127.0.0.1:{commands}",
                             actions=f"tcp://127.0.0.1:{actions}", health=f"tcp://127.0.0.1:{health}")
    with NodeTransport(config) as node, Client(config) as client:
        handshake(node, client)
        client.send_frame("wrist", 8, 8, IMAGE)
        wait_readable(node, 0.05)
        latest, _ = node.drain_frames()
        assert decode_frame(latest[b"frame/wrist"], CAMERAS).seq == 8


# ---------------------------------------------------------------- CURVE


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    create_keys(tmp_path / "keys")
    return tmp_path / "keys"


def test_create_keys_layout_and_refusal_to_overwrite(keys_dir: Path) -> None:
    paths = key_paths(keys_dir)
    for p in (paths.server_public, paths.server_secret, paths.client_public, paths.client_secret):
        assert p.is_file()
    assert stat.S_IMODE(paths.server_secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.client_secret.stat().st_mode) == 0o600
    assert (paths.authorized_clients / "client.key").read_bytes() == paths.client_public.read_bytes()
    before = paths.server_secret.read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        create_keys(keys_dir)
    assert paths.server_secret.read_bytes() == before


def test_curve_with_an_allowed_client_works_both_directions(keys_dir: Path) -> None:
    config = ipc_config(curve_keys_dir=str(keys_dir))
    with NodeTransport(config) as node, Client(config) as client:
        handshake(node, client)  # client SUB <- node PUB (actions) and node SUB -> client XPUB (subscriptions)
        client.send_frame("front", 1, 1, IMAGE)
        client.send_instruction(2, 2, "encrypted")
        wait_readable(node)
        latest, _ = node.drain_frames()
        np.testing.assert_array_equal(decode_frame(latest[b"frame/front"], CAMERAS).rgb, IMAGE)
        assert decode_command(node.drain_commands()[0]).text == "encrypted"


def test_curve_tcp_loopback_works(keys_dir: Path) -> None:
    ports = free_tcp_ports(4)
    config = TransportConfig(*(f"tcp://127.0.0.1:{p}" for p in ports), curve_keys_dir=str(keys_dir))
    with NodeTransport(config) as node, Client(config) as client:
        handshake(node, client)
        node.publish_health(encode_health({"ok": True}))
        assert client.recv_health(2000)["ok"] is True


def test_curve_refuses_a_client_whose_key_is_not_allowed(keys_dir: Path, tmp_path: Path) -> None:
    stranger = create_keys(tmp_path / "stranger")
    config = ipc_config(curve_keys_dir=str(keys_dir))
    with NodeTransport(config) as node, Client(config, client_secret_key=stranger.client_secret,
                                               server_public_key=key_paths(keys_dir).server_public) as client:
        for _ in range(5):
            node.publish_action(tick_action())
            client.send_frame("front", 1, 1, IMAGE)
            client.send_instruction(1, 1, "let me in")
            time.sleep(0.05)
        with pytest.raises(TimeoutError, match="frame subscription .* missing.*CURVE"):
            client.wait_for_node(0.3)
        assert node.drain_frames() == ({}, 0) and node.drain_commands() == []
        assert client.recv_action(50) is None
        client.close()
        with Client(config) as allowed:  # the same node admits the allowed key at the same addresses
            handshake(node, allowed)


def test_curve_refuses_a_plaintext_client(keys_dir: Path) -> None:
    config = ipc_config(curve_keys_dir=str(keys_dir))
    plain = TransportConfig(config.frames, config.commands, config.actions, config.health)
    with NodeTransport(config) as node, Client(plain) as client:
        for _ in range(5):
            node.publish_action(tick_action())
            client.send_frame("front", 1, 1, IMAGE)
            time.sleep(0.05)
        with pytest.raises(TimeoutError):
            client.wait_for_node(0.3)
        assert node.drain_frames() == ({}, 0)


class NullGreeter:
    """A TCP listener that answers every connection with a ZMTP 3.0 greeting for the NULL mechanism (a plaintext
    ZeroMQ peer) and keeps it open: a CURVE peer that connects sees the mechanism mismatch itself, every time."""

    GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.05)
        self.peers: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                peer, _ = self.listener.accept()
            except TimeoutError:
                continue
            peer.sendall(self.GREETING)
            self.peers.append(peer)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in (*self.peers, self.listener):
            s.close()


def test_a_failed_curve_handshake_does_not_cut_the_node_off(keys_dir: Path) -> None:
    """libzmq 4.3.5 gives a connecting socket up for good once its handshake failed with a protocol error (here: a
    plaintext peer's NULL greeting). The node's transport connects it again, so the allowed client that binds next
    gets through."""
    ports = free_tcp_ports(4)
    config = TransportConfig(*(f"tcp://127.0.0.1:{p}" for p in ports), curve_keys_dir=str(keys_dir))
    assert len(NullGreeter.GREETING) == 64
    with NodeTransport(config) as node:
        greeters = [NullGreeter(ports[0]), NullGreeter(ports[1])]  # the frame and command addresses
        try:
            deadline = time.monotonic() + 10.0
            while node.reconnects < 2 and time.monotonic() < deadline:  # both SUBs met the plaintext peer
                node.poll(10)
        finally:
            for greeter in greeters:
                greeter.close()
        assert node.reconnects >= 2, "the node's SUBs never reported the failed handshakes"
        with Client(config) as allowed:
            handshake(node, allowed)
            allowed.send_frame("front", 7, 7, IMAGE)
            wait_readable(node)
            latest, _ = node.drain_frames()
            assert decode_frame(latest[b"frame/front"], CAMERAS).seq == 7
            node.poll(0)
            assert node.input_links() == {"frames": "connected", "commands": "connected"}


def test_a_stalled_handshake_is_dropped_and_tried_again(keys_dir: Path) -> None:
    """A peer that accepts the node's connection and never greets holds it in its handshake: after
    HANDSHAKE_TIMEOUT_MS the node drops it and connects again (libzmq's default would wait 30 s), and health's
    input_links say what each input connection last did."""
    ports = free_tcp_ports(4)
    config = TransportConfig(*(f"tcp://127.0.0.1:{p}" for p in ports), curve_keys_dir=str(keys_dir))
    silent = socket.create_server(("127.0.0.1", ports[0]))  # the frame address; the command one has nobody
    silent.settimeout(0.05)
    accepted: list[tuple[float, socket.socket]] = []
    try:
        with NodeTransport(config) as node:
            deadline = time.monotonic() + 3 * HANDSHAKE_TIMEOUT_MS / 1000
            while len(accepted) < 2 and time.monotonic() < deadline:
                node.poll(10)
                try:
                    accepted.append((time.monotonic(), silent.accept()[0]))
                except TimeoutError:
                    continue
            links = node.input_links()
            assert links["commands"] == "retrying (nobody bound there)", links
        assert len(accepted) == 2, f"the node did not connect again within {3 * HANDSHAKE_TIMEOUT_MS} ms"
        gap_s = accepted[1][0] - accepted[0][0]
        assert HANDSHAKE_TIMEOUT_MS / 1000 - 0.5 <= gap_s <= 2 * HANDSHAKE_TIMEOUT_MS / 1000, gap_s
        first = accepted[0][1]
        first.settimeout(1.0)
        assert first.recv(1 << 16) != b"" and first.recv(1 << 16) == b""  # the node's greeting, then it hung up
    finally:
        for _, peer in accepted:
            peer.close()
        silent.close()


def test_curve_missing_keys_is_a_config_error(tmp_path: Path) -> None:
    config = ipc_config(curve_keys_dir=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="^curve_keys_dir = .*server.key_secret"):
        NodeTransport(config)
    with pytest.raises(FileNotFoundError, match="client.key_secret"):
        Client(config)


def test_codec_errors_never_escape_protocol_decoding() -> None:
    # A node drops bad messages by catching ProtocolError only: a CodecError must never leak out.
    with pytest.raises(ProtocolError) as info:
        decode_command([b"state", b"\xc1"])
    assert not isinstance(info.value, CodecError) and info.value.reason == "bad_msgpack"
