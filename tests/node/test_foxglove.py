"""Foxglove: a replay's recording (--record-out) holds only channels Foxglove shows without plugins (every message
validated against its schema), with a layout whose topics are in it, and replays again; `vla-node view` streams the
same channels live to a client of Foxglove's WebSocket protocol (foxglove.sdk.v1), written here from its spec."""

from __future__ import annotations

import base64
import json
import struct
import threading
import time

import pytest
from websockets.sync.client import connect

from helpers.drive_checks import native_drive
from helpers.foxglove_checks import SchemaCheck, check_recording, layout_topics
from helpers.node_harness import TINY_LAUNCH, running_node
from helpers.node_helpers import road_frames
from vla_node.drives.open import open_drive
from vla_node.drives.replay import replay
from vla_node.drives.view import view

CHANNELS = {"frame/front", "instruction", "state", "action", "chunk", "timing", "health"}
# the protocol's name in foxglove-sdk (ws-protocol's spec calls its first version foxglove.websocket.v1)
SUBPROTOCOLS = ["foxglove.sdk.v1", "foxglove.websocket.v1"]


@pytest.mark.timeout(300)
def test_a_replays_recording_is_valid_foxglove_and_replays_again(tmp_path):
    commands = [(0, "instruction", {"text": "keep lane"}), (100_000_000, "state", {"values": [1.0, 0.0, 5.0, 0.0]})]
    drive = native_drive(tmp_path / "drive.mcap", road_frames(20, 96, 64), fps=10.0, commands=commands)
    recording = tmp_path / "recorded.mcap"
    replay(drive, TINY_LAUNCH, out_dir=tmp_path / "out", progress=False, record_out=recording)
    counts = check_recording(recording)
    assert set(counts) == CHANNELS, counts
    assert counts["frame/front"] == 20 and counts["chunk"] == counts["timing"] == counts["action"] > 20, counts
    layout = json.loads(recording.with_suffix(".layout.json").read_text())
    assert layout_topics(layout) <= set(counts), (layout_topics(layout), counts)
    again = open_drive(recording)
    frames = list(again.frames())
    assert [f.seq for f in frames] == list(range(20)) and frames[0].width == 96 and frames[0].encoding == "rgb8"
    assert [(f.seq, f.rgb().tobytes()) for f in frames] == [(f.seq, f.rgb().tobytes()) for f in open_drive(drive).frames()]


class FoxgloveClient(threading.Thread):
    """Subscribes to every channel the server advertises; keeps each message decoded and validated per topic."""

    def __init__(self, port: int, seconds: float) -> None:
        super().__init__(daemon=True)
        self.port, self.seconds = port, seconds
        self.server_info: dict | None = None
        self.channels: dict[int, dict] = {}
        self.messages: dict[str, list] = {}
        self.error: BaseException | None = None
        self.subprotocol: str | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:
            self.error = e

    def _run(self) -> None:
        subscriptions: dict[int, tuple[str, SchemaCheck]] = {}
        with connect(f"ws://127.0.0.1:{self.port}", subprotocols=SUBPROTOCOLS, max_size=None) as ws:
            self.subprotocol = ws.subprotocol
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:
                try:
                    data = ws.recv(timeout=0.2)
                except TimeoutError:
                    continue
                if isinstance(data, str):
                    op = json.loads(data)
                    if op["op"] == "serverInfo":
                        self.server_info = op
                    elif op["op"] == "advertise":
                        new = []
                        for ch in op["channels"]:
                            self.channels[ch["id"]] = ch
                            schema = base64.b64decode(ch["schema"]) if ch["encoding"] == "protobuf" else \
                                ch["schema"].encode()
                            sub_id = len(subscriptions)
                            subscriptions[sub_id] = (ch["topic"], SchemaCheck(ch["schemaName"], ch.get(
                                "schemaEncoding") or {"json": "jsonschema"}.get(ch["encoding"], ch["encoding"]), schema))
                            new.append({"id": sub_id, "channelId": ch["id"]})
                        ws.send(json.dumps({"op": "subscribe", "subscriptions": new}))
                    continue
                assert data[0] == 0x01, data[:1]  # message data: opcode, subscription id, receive stamp, payload
                sub_id, _stamp = struct.unpack_from("<IQ", data, 1)
                topic, check = subscriptions[sub_id]
                self.messages.setdefault(topic, []).append(check.check(data[13:]))


@pytest.mark.timeout(180)
def test_view_streams_the_recordings_channels_live(tmp_path):
    with running_node(TINY_LAUNCH, tmp_path) as node:
        node.warm_up()
        addresses = {k: getattr(node.process.addresses, k) for k in ("frames", "commands", "actions", "health")}
        ports, stop = [], threading.Event()
        viewer = threading.Thread(target=view, args=(TINY_LAUNCH, 0, addresses), kwargs=dict(
            layout_out=tmp_path / "live.layout.json", stop_event=stop, on_started=ports.append, progress=False))
        viewer.start()
        try:
            deadline = time.monotonic() + 10
            while not ports and time.monotonic() < deadline:
                time.sleep(0.05)
            client = FoxgloveClient(ports[0], seconds=4.0)
            client.start()
            time.sleep(0.5)  # the viewer's SUBs join the client's and the node's publishers
            node.client.send_instruction(1, time.monotonic_ns(), "keep lane")
            node.stream(3.0)
            client.join(10)
        finally:
            stop.set()
            viewer.join(10)
    assert client.error is None, client.error
    assert client.subprotocol in SUBPROTOCOLS and client.server_info and client.server_info["name"] == "vla-node"
    topics = {ch["topic"]: ch for ch in client.channels.values()}
    assert {"frame/front", "action", "chunk", "timing", "health", "instruction"} <= set(topics), topics.keys()
    assert topics["frame/front"]["encoding"] == "protobuf" and topics["frame/front"]["schemaName"] == "foxglove.RawImage"
    assert topics["action"]["encoding"] == "json"
    frames, actions = client.messages["frame/front"], client.messages["action"]
    assert len(frames) >= 10 and frames[-1].frame_id == "front", len(frames)
    assert len(actions) >= 50 and {a["status"] for a in actions} >= {"fresh"}, len(actions)
    assert client.messages["health"] and client.messages["timing"]
    assert layout_topics(json.loads((tmp_path / "live.layout.json").read_text())) <= set(topics)
