"""ZeroMQ sockets of the node and of its clients (the only module besides node.py that touches sockets).

Topology (publishers bind, subscribers connect):

    Client XPUB  --bind frames-->    <--connect SUB--  NodeTransport   (frame/<camera>)
    Client XPUB  --bind commands-->  <--connect SUB--  NodeTransport   (instruction, state)
    Client SUB   --connect actions-->   <--bind PUB--  NodeTransport   (action, every control tick)
    Client SUB   --connect health-->    <--bind PUB--  NodeTransport   (health, about 1 Hz)

Latest-frame semantics come from draining with NOBLOCK and keeping the newest message per topic
(ZMQ_CONFLATE would drop multipart headers). Sends never block: a PUB at its high-water mark drops.

CURVE (when curve_keys_dir is set, layout of vla_node.wire.keys): every node socket is a CURVE *server*,
including the two SUBs that connect to the client's XPUBs; a ZAP handler (zmq.auth ThreadAuthenticator
on the node's context) admits only the public keys in <curve_keys_dir>/authorized_clients/. Every client
socket is a CURVE client holding the client secret key and the server public key. CURVE roles are
independent of bind/connect in libzmq, so this works in both directions (tests/node/test_transport.py).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Collection

import zmq
from zmq.auth.thread import ThreadAuthenticator

from vla_node.validate import require
from vla_node.wire.keys import key_paths, load_public, load_secret_pair
from vla_node.wire.protocol import (
    ACTION_TOPIC,
    COMMAND_TOPICS,
    DEFAULT_PROTOCOL_LIMITS,
    FRAME_TOPIC_PREFIX,
    HEALTH_TOPIC,
    ProtocolError,
    ProtocolLimits,
    decode_action,
    decode_health,
    encode_frame,
    encode_instruction,
    encode_state,
)

log = logging.getLogger(__name__)

_SCHEMES = ("tcp", "ipc", "inproc")
_ADDRESS_KEYS = ("frames", "commands", "actions", "health")


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # '*', an interface name or a host name
        return False


def _check_address(key: str, address: Any, allow_non_loopback: bool) -> None:
    require(isinstance(address, str), key, address, "a string like 'tcp://127.0.0.1:5560' or 'ipc://@name'")
    scheme, sep, rest = address.partition("://")
    require(sep == "://" and scheme in _SCHEMES and rest != "", key, address,
            "tcp://HOST:PORT, ipc://PATH (ipc://@name for the abstract namespace) or inproc://NAME")
    if scheme != "tcp":
        return
    host, colon, port = rest.rpartition(":")
    require(colon == ":" and host != "" and ";" not in rest and port.isdigit() and 1 <= int(port) <= 65535,
            key, address, "tcp://HOST:PORT with a port in [1, 65535]")
    require(allow_non_loopback or is_loopback_host(host), key, address,
            "a loopback address (127.0.0.1, localhost, [::1]) or ipc://; "
            "set allow_non_loopback = true to bind or connect beyond this host")


@dataclass(frozen=True)
class TransportConfig:
    """Addresses and socket limits. frames/commands: where the node's SUBs connect (the client binds there);
    actions/health: where the node's PUBs bind."""

    frames: str = "tcp://127.0.0.1:5560"
    commands: str = "tcp://127.0.0.1:5561"
    actions: str = "tcp://127.0.0.1:5562"
    health: str = "tcp://127.0.0.1:5563"
    rcv_hwm: int = 64  # messages queued per input socket before the newest are dropped
    snd_hwm: int = 256  # messages queued per subscriber before the newest are dropped
    max_message_bytes: int = 64 * 1024 * 1024  # ZMQ_MAXMSGSIZE: a peer sending a larger part is disconnected
    allow_non_loopback: bool = False
    curve_keys_dir: str | None = None

    def __post_init__(self) -> None:
        require(type(self.allow_non_loopback) is bool, "allow_non_loopback", self.allow_non_loopback, "true or false")
        for key in _ADDRESS_KEYS:
            _check_address(key, getattr(self, key), self.allow_non_loopback)
        seen: dict[str, str] = {}
        for key in _ADDRESS_KEYS:
            address = getattr(self, key)
            require(address not in seen, key, address, f"an address different from {seen.get(address)} = {address!r}")
            seen[address] = key
        for key in ("rcv_hwm", "snd_hwm"):
            value = getattr(self, key)
            require(type(value) is int and 1 <= value <= 1_000_000, key, value, "an integer in [1, 1000000]")
        require(type(self.max_message_bytes) is int and self.max_message_bytes >= 1024,
                "max_message_bytes", self.max_message_bytes, "an integer >= 1024")
        require(self.curve_keys_dir is None or (isinstance(self.curve_keys_dir, str) and self.curve_keys_dir != ""),
                "curve_keys_dir", self.curve_keys_dir, "a directory path (see `vla-node keys --out DIR`) or unset")


# The monitor event after which libzmq 4.3 gives a connecting socket's session up for good: its handshake failed
# with a protocol error (e.g. a plaintext peer bound the address and our CURVE side saw its NULL greeting first).
# NodeTransport then connects the socket again. Not after the other failures, which libzmq retries by itself: when
# the peer hangs up first (HANDSHAKE_FAILED_NO_DETAIL), or when ZAP refuses a key (HANDSHAKE_FAILED_AUTH; tearing
# a connection down while its ZAP request is in flight aborts libzmq 4.3.5: "Transport endpoint is not connected
# (src/zap_client.cpp:50)").
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
OTHER_TOPICS = b"frame/"  # drain_frame_messages' one group for the topics of cameras not configured
GIVEN_UP_AFTER_NS = 500_000_000  # disconnected this long without a retry: libzmq gave the endpoint up
RECONNECT_AFTER_NS = 100_000_000  # at most one reconnect per socket per 100 ms (libzmq's own reconnect interval)
# ZMQ_HANDSHAKE_IVL: a connection whose handshake (CURVE's ZAP round included) has not finished by then is dropped,
# and a connecting socket tries again (libzmq's default, 30 s, let one stalled handshake cut a node off that long)
HANDSHAKE_TIMEOUT_MS = 5_000
# what the last monitor event says of a watched input connection (the node's health shows it per socket)
_LINK_STATES = {
    zmq.EVENT_CONNECT_RETRIED: "retrying (nobody bound there)",
    zmq.EVENT_CONNECTED: "handshaking",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "connected",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (the peer hung up or timed out)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol: a peer without CURVE?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused (the peer's key is not allowed)",
    zmq.EVENT_DISCONNECTED: "disconnected",
}


def _configure(sock: zmq.Socket, config: TransportConfig, address: str) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, config.rcv_hwm)
    sock.setsockopt(zmq.SNDHWM, config.snd_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def _bind(sock: zmq.Socket, address: str, who: str) -> None:
    """Bind; an ipc socket file is then made owner-only (0600): no other local user can connect to it. (An
    abstract ipc name, ipc://@name, has no file: any local process may connect; use CURVE to admit only keys.)"""
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind {address!r}: {e} (is another {who} running there?)") from e
    path = address.removeprefix("ipc://")
    if address.startswith("ipc://") and not path.startswith("@"):
        os.chmod(path, 0o600)


class _HandshakeWatch:
    """A connecting socket and a monitor of its failed handshakes; heal() connects it again when one failed."""

    def __init__(self, sock: zmq.Socket, address: str) -> None:
        self.sock, self.address = sock, address
        mask = 0
        for event in _LINK_STATES:
            mask |= event
        self.monitor = sock.get_monitor_socket(mask)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.state = "connecting"  # _LINK_STATES' words for the last event
        self.failed = False
        self.dropped_ns: int | None = None  # disconnected at, with no retry or connection seen since
        self.next_ns = 0  # no reconnect before this (monotonic ns)

    def heal(self, now_ns: int) -> bool:
        """Read the monitor's events; True when the socket was connected again."""
        while self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # no exception per call in the node's loop
            event = int.from_bytes(self.monitor.recv_multipart()[0][:2], "little")  # [event id + value, endpoint]
            self.state = _LINK_STATES.get(event, self.state)
            if event == _HANDSHAKE_FAILED:
                self.failed = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.dropped_ns = now_ns
            elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_CONNECT_RETRIED):  # connected again, or libzmq retrying
                self.dropped_ns = None                                        # by itself (a peer that went away)
        if self.dropped_ns is not None and now_ns - self.dropped_ns >= GIVEN_UP_AFTER_NS:
            self.failed, self.dropped_ns = True, None  # a protocol error (a part past ZMQ_MAXMSGSIZE): no retry
        if not self.failed or now_ns < self.next_ns:
            return False
        try:
            self.sock.disconnect(self.address)
        except zmq.ZMQError:
            pass  # already gone
        self.sock.connect(self.address)
        self.failed, self.next_ns = False, now_ns + RECONNECT_AFTER_NS
        return True

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)


class NodeTransport:
    """The node's four sockets: frame and command SUBs (connect), action and health PUBs (bind). The node's
    worker process opens the input side (`outputs=False`), its publisher process the output side (`inputs=False`).
    `also_from`: the frame and command addresses of a second client the SUBs connect to as well.

    Call poll() or drain_*() every tick, even when idle: after a client restarts (or fails CURVE
    authentication once) libzmq re-sends the SUB's subscriptions only when the owning thread touches the
    socket, so a node that never touches its SUBs would never see the new client's frames."""

    def __init__(self, config: TransportConfig, ctx: zmq.Context | None = None, *, inputs: bool = True,
                 outputs: bool = True, also_from: tuple[str, str] | None = None) -> None:
        self.config = config
        self._owns_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        self._auth: ThreadAuthenticator | None = None
        self._sockets: list[zmq.Socket] = []
        self.publish_dropped = 0  # sends refused with EAGAIN (never expected from PUB, counted if they happen)
        self.reconnects = 0  # SUBs connected again after a failed CURVE handshake
        self._watched: list[_HandshakeWatch] = []
        try:
            curve = self._start_curve() if config.curve_keys_dir else None
            if outputs:  # bound first: an address in use fails before the SUBs connect anywhere
                self.actions_pub = self._open(zmq.PUB, config.actions, curve, bind=True)
                self.health_pub = self._open(zmq.PUB, config.health, curve, bind=True)
            if inputs:
                self.frames_sub = self._open(zmq.SUB, config.frames, curve, bind=False)
                self.frames_sub.setsockopt(zmq.SUBSCRIBE, FRAME_TOPIC_PREFIX)
                self.commands_sub = self._open(zmq.SUB, config.commands, curve, bind=False)
                for topic in COMMAND_TOPICS:
                    self.commands_sub.setsockopt(zmq.SUBSCRIBE, topic)
                if also_from is not None:  # (frames, commands) of a second client in this process (openpi's server)
                    self.frames_sub.connect(also_from[0])
                    self.commands_sub.connect(also_from[1])
        except BaseException:
            self.close(terminate=False)
            raise
        self._poller = zmq.Poller()
        if inputs:
            self._poller.register(self.frames_sub, zmq.POLLIN)
            self._poller.register(self.commands_sub, zmq.POLLIN)
            log.info("node transport: frames <- %s, commands <- %s, curve %s", config.frames, config.commands,
                     "on" if curve else "off")
        if outputs:
            log.info("node transport: actions -> %s, health -> %s, curve %s", config.actions, config.health,
                     "on" if curve else "off")

    def _start_curve(self) -> tuple[bytes, bytes]:
        keys_dir = self.config.curve_keys_dir
        paths = key_paths(keys_dir)
        missing = [str(p) for p in (paths.server_secret, paths.authorized_clients) if not p.exists()]
        require(not missing, "curve_keys_dir", keys_dir,
                f"a keys directory holding server.key_secret and authorized_clients/ (missing {missing}; "
                "create one with `vla-node keys --out DIR`)")
        allowed = [n for n in os.listdir(paths.authorized_clients) if n.endswith(".key")]
        require(bool(allowed), "curve_keys_dir", keys_dir, f"at least one client *.key in {paths.authorized_clients}")
        pair = load_secret_pair(paths.server_secret)
        self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger(__name__ + ".zap"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(paths.authorized_clients))
        return pair

    def _open(self, kind: int, address: str, curve: tuple[bytes, bytes] | None, bind: bool) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        self._sockets.append(sock)
        _configure(sock, self.config, address)
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey = curve
            sock.curve_server = True
        if bind:
            _bind(sock, address, "node")
        else:  # monitored before it connects: a peer bound there already may fail the handshake at once, and
            # libzmq gives that connection up after the one event a later monitor would miss (the SUB cut off)
            self._watched.append(_HandshakeWatch(sock, address))
            sock.connect(address)
        return sock

    def poll(self, timeout_ms: int) -> bool:
        """Wait up to timeout_ms for a frame or command; True when one of them is readable. With CURVE, also
        connects again a SUB whose handshake failed (libzmq 4.3.5 gives such a connection up for good, so a
        plaintext peer that once bound the address would cut the node off until a restart)."""
        ready = bool(self._poller.poll(timeout_ms))
        if self._watched:
            now = time.monotonic_ns()
            for watched in self._watched:
                if watched.heal(now):
                    self.reconnects += 1
                    log.warning("the connection to %s failed (a CURVE handshake, or a message past "
                                "max_message_bytes): connected again", watched.address)
        return ready

    def input_links(self) -> dict[str, str]:
        """What the last event says of each input connection, by address key: {'frames': 'connected', ...}."""
        return dict(zip(("frames", "commands"), (watched.state for watched in self._watched)))

    def drain_frame_messages(self, topics: Collection[bytes] | None = None, max_messages: int = 1000, keep: int = 3
                             ) -> dict[bytes, tuple[list[list[zmq.Frame]], int]]:
        """Receive every queued frame message (at most max_messages) without blocking, grouped by topic:
        {topic: (the newest `keep` messages oldest first as [topic, header, payload] zmq.Frames, number of
        older ones discarded unread)}. Parts are unvalidated; the node validates the newest first and falls
        back to an older one when the newest is bad. Keeping a few per group bounds memory during a burst;
        with `topics` (the configured cameras' topics) every other topic shares one group, OTHER_TOPICS, so
        that a flood of distinct unknown topics holds no more than `keep` messages either."""
        groups: dict[bytes, tuple[collections.deque, list[int]]] = {}
        sock = self.frames_sub
        for _ in range(max_messages):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            topic = parts[0].bytes
            if topics is not None and topic not in topics:
                topic = OTHER_TOPICS
            kept, discarded = groups.setdefault(topic, (collections.deque(maxlen=keep), [0]))
            if len(kept) == keep:
                discarded[0] += 1
            kept.append(parts)
        return {topic: (list(kept), discarded[0]) for topic, (kept, discarded) in groups.items()}

    def drain_frames(self, max_messages: int = 1000) -> tuple[dict[bytes, list[zmq.Frame]], int]:
        """Like drain_frame_messages, keeping only the newest per topic: ({topic: parts}, number of older
        ones dropped)."""
        groups = self.drain_frame_messages(max_messages=max_messages, keep=1)
        return {topic: kept[-1] for topic, (kept, _) in groups.items()}, sum(n for _, n in groups.values())

    def drain_commands(self, max_messages: int = 1000) -> list[list[bytes]]:
        """Every queued command message (at most max_messages), oldest first, unvalidated."""
        commands = []
        sock = self.commands_sub
        for _ in range(max_messages):
            try:
                commands.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return commands

    def _send(self, sock: zmq.Socket, parts: list) -> None:
        try:
            sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.publish_dropped += 1

    def publish_action(self, parts: list) -> None:
        self._send(self.actions_pub, parts)

    def publish_health(self, parts: list) -> None:
        self._send(self.health_pub, parts)

    def close(self, linger_ms: int = 0, terminate: bool = True) -> None:
        """Close every socket; `linger_ms`: how long queued messages may still go out (the last health message);
        terminate=False: an owned context is left to the garbage collector (see Client.close)."""
        for watched in self._watched:
            watched.close()
        self._watched = []
        for sock in self._sockets:
            sock.close(linger=linger_ms)
        self._sockets = []
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._owns_ctx:
            if terminate:
                self.ctx.destroy(linger=linger_ms)
            self._owns_ctx = False

    def __enter__(self) -> NodeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """The other end of a node (tests, replay, integrators): binds the frame and command XPUBs, connects
    SUBs to the node's action and health PUBs. With CURVE it uses the client secret key and the server
    public key (defaults: client.key_secret and server.key in config.curve_keys_dir)."""

    def __init__(
        self, config: TransportConfig, ctx: zmq.Context | None = None, *,
        client_secret_key: str | os.PathLike | None = None, server_public_key: str | os.PathLike | None = None,
        limits: ProtocolLimits = DEFAULT_PROTOCOL_LIMITS, publish: bool = True,
    ) -> None:
        self.config = config
        self.limits = limits
        self._owns_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        self._sockets: list[zmq.Socket] = []
        self._frame_subscribed = False
        self._command_subscriptions: set[bytes] = set()
        try:
            curve = self._curve_keys(client_secret_key, server_public_key)
            if publish:  # publish=False: a listener of the node's actions and health only (metrics, monitors)
                self.frames_pub = self._open(zmq.XPUB, config.frames, curve, bind=True)
                self.commands_pub = self._open(zmq.XPUB, config.commands, curve, bind=True)
            self.actions_sub = self._open(zmq.SUB, config.actions, curve, bind=False)
            self.actions_sub.setsockopt(zmq.SUBSCRIBE, ACTION_TOPIC)
            self.health_sub = self._open(zmq.SUB, config.health, curve, bind=False)
            self.health_sub.setsockopt(zmq.SUBSCRIBE, HEALTH_TOPIC)
        except BaseException:
            self.close(terminate=False)
            raise

    def _curve_keys(self, secret_file: Any, server_file: Any) -> tuple[bytes, bytes, bytes] | None:
        if self.config.curve_keys_dir is None and secret_file is None and server_file is None:
            return None
        paths = key_paths(self.config.curve_keys_dir) if self.config.curve_keys_dir else None
        secret_file = secret_file if secret_file is not None else (paths.client_secret if paths else None)
        server_file = server_file if server_file is not None else (paths.server_public if paths else None)
        if secret_file is None or server_file is None:
            raise ValueError("CURVE client needs both client_secret_key and server_public_key (or curve_keys_dir)")
        public, secret = load_secret_pair(secret_file)
        return public, secret, load_public(server_file)

    def _open(self, kind: int, address: str, curve: tuple[bytes, bytes, bytes] | None, bind: bool) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        self._sockets.append(sock)
        _configure(sock, self.config, address)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass every subscription, so a restarted node is seen
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
        if bind:
            _bind(sock, address, "client")
        else:
            sock.connect(address)
        return sock

    def _read_subscriptions(self) -> None:
        for sock, is_frames in ((self.frames_pub, True), (self.commands_pub, False)):
            while True:
                try:
                    event = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if not event or event[0] not in (0, 1):
                    continue
                subscribed, topic = event[0] == 1, event[1:]
                if is_frames:
                    if topic == FRAME_TOPIC_PREFIX:
                        self._frame_subscribed = subscribed
                elif subscribed:
                    self._command_subscriptions.add(topic)
                else:
                    self._command_subscriptions.discard(topic)

    def wait_for_node(self, timeout_s: float = 10.0) -> None:
        """Handshake: return once the node's SUBs have subscribed at both XPUBs (b'\\x01frame/',
        b'\\x01instruction', b'\\x01state') and one valid action has arrived; TimeoutError otherwise.
        Actions received here are consumed."""
        deadline = time.monotonic_ns() + int(timeout_s * 1e9)
        poller = zmq.Poller()
        for sock in (self.frames_pub, self.commands_pub, self.actions_sub):
            poller.register(sock, zmq.POLLIN)
        action_seen = False
        last_error: ProtocolError | None = None
        while True:
            self._read_subscriptions()
            commands_ok = self._command_subscriptions.issuperset(COMMAND_TOPICS)
            if self._frame_subscribed and commands_ok and action_seen:
                return
            left_ms = (deadline - time.monotonic_ns()) // 1_000_000
            if left_ms <= 0:
                raise TimeoutError(
                    f"no node answered within {timeout_s} s: frame subscription at {self.config.frames} "
                    f"{'seen' if self._frame_subscribed else 'missing'}, command subscriptions at "
                    f"{self.config.commands} {'seen' if commands_ok else 'missing'}, action from "
                    f"{self.config.actions} {'received' if action_seen else 'missing'}"
                    + (f" (last action rejected: {last_error})" if last_error else "")
                    + ("; check the CURVE keys on both sides" if self.config.curve_keys_dir else "")
                )
            poller.poll(min(left_ms, 100))
            while not action_seen:
                try:
                    parts = self.actions_sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    decode_action(parts, self.limits)
                    action_seen = True
                except ProtocolError as e:
                    last_error = e

    def send_frame(
        self, camera: str, seq: int, stamp_ns: int, image: Any, encoding: str = "rgb8",
        *, height: int | None = None, width: int | None = None,
    ) -> None:
        """Publish one frame (see protocol.encode_frame); never blocks. The image is copied at send."""
        parts = encode_frame(camera, seq, stamp_ns, image, encoding, height=height, width=width)
        self.frames_pub.send_multipart(parts, flags=zmq.NOBLOCK)

    def send_parts(self, parts: list, commands: bool = False) -> None:
        """Publish pre-encoded (or deliberately malformed) parts on the frame or the command XPUB."""
        (self.commands_pub if commands else self.frames_pub).send_multipart(parts, flags=zmq.NOBLOCK)

    def send_instruction(self, seq: int, stamp_ns: int, text: str) -> None:
        self.commands_pub.send_multipart(encode_instruction(seq, stamp_ns, text), flags=zmq.NOBLOCK)

    def send_state(self, seq: int, stamp_ns: int, values: Any) -> None:
        self.commands_pub.send_multipart(encode_state(seq, stamp_ns, values), flags=zmq.NOBLOCK)

    def _recv(self, sock: zmq.Socket, timeout_ms: int) -> list[bytes] | None:
        if sock.poll(timeout_ms, zmq.POLLIN) == 0:
            return None
        return sock.recv_multipart(zmq.NOBLOCK)

    def recv_action(self, timeout_ms: int) -> dict | None:
        """The next action message (validated map), or None when none arrives within timeout_ms.
        A malformed one raises ProtocolError."""
        parts = self._recv(self.actions_sub, timeout_ms)
        return None if parts is None else decode_action(parts, self.limits)

    def recv_health(self, timeout_ms: int) -> dict | None:
        """The next health message (validated map), or None when none arrives within timeout_ms."""
        parts = self._recv(self.health_sub, timeout_ms)
        return None if parts is None else decode_health(parts, self.limits)

    def close(self, terminate: bool = True) -> None:
        """Close every socket and terminate an owned context. terminate=False, when __init__ failed: the context
        is left to the garbage collector, as term would wait for ever on a socket that a Ctrl-C left made but
        untracked (its KeyboardInterrupt raised inside pyzmq's Context.socket, before the context lists it: not
        even destroy closes it); it ends when that socket is collected, or with the process."""
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []
        if self._owns_ctx:
            if terminate:
                self.ctx.destroy(linger=0)
            self._owns_ctx = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
