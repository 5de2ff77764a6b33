"""Helpers shared by the replay, record and demo tests: a real tiny node process, a stand-in node built from the
node's own transport (real ZeroMQ sockets), and small drives of every kind written on the spot."""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import zmq
from mcap_ros2.writer import Writer as Ros2Writer

from vla_node.config import load_launch
from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.drives.video import JpegEncoder
from vla_node.fuzz.corpus import ROS_COMPRESSED_DEF as COMPRESSED_DEF
from vla_node.fuzz.corpus import ROS_IMAGE_DEF as IMAGE_DEF
from vla_node.node.process import NodeProcess, private_addresses
from vla_node.wire.codec import CodecError
from vla_node.wire.protocol import CameraSpec, ProtocolError, decode_command, decode_frame, encode_action, encode_health
from vla_node.wire.transport import NodeTransport

TESTS = Path(__file__).resolve().parents[1]
TINY_LAUNCH = TESTS / "launch" / "tiny.toml"


def crc(rgb: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(rgb).tobytes())


def start_tiny_node(log_path: Path) -> tuple[NodeProcess, dict[str, str]]:
    """`vla-node run --launch tests/launch/tiny.toml` on private ipc addresses; (process, addresses)."""
    addresses = private_addresses()
    transport = dataclasses.replace(load_launch(TINY_LAUNCH).transport, **addresses)
    return NodeProcess(TINY_LAUNCH, transport, log_path), addresses


# ---- a stand-in node over real sockets --------------------------------------------------------------------


@dataclasses.dataclass
class Received:
    camera: str
    seq: int
    stamp_ns: int
    encoding: str
    shape: tuple[int, ...]
    crc: int  # of the decoded pixels (Frame.rgb)
    payload_crc: int  # of the payload bytes as they came off the wire
    arrival_ns: int


class EchoNode(threading.Thread):
    """The node's transport (NodeTransport: SUBs connect to the client's XPUBs, PUBs bind) driven by a loop
    that decodes every frame exactly as the node's ingest does (protocol.decode_frame), keeps the crc32 of its
    pixels, and answers it at once with a fresh action naming it. Between frames it publishes a fallback
    action every 20 ms (the handshake needs one) and health every 0.2 s. answer=False never answers frames."""

    def __init__(self, addresses: dict[str, str], cameras=("front",), answer: bool = True) -> None:
        super().__init__(name="echo-node", daemon=True)
        transport = load_launch(TINY_LAUNCH).transport
        self.config = dataclasses.replace(transport, rcv_hwm=10_000, **addresses)
        self.cameras = {name: CameraSpec(name, 4096, 4096) for name in cameras}
        self.answer = answer
        self.frames: list[Received] = []
        self.commands: list = []
        self.rejects: list[str] = []
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with NodeTransport(self.config) as transport:
                self.ready.set()
                self._loop(transport)
        except BaseException as e:  # reported by stop()
            self.error = e
            self.ready.set()

    def _loop(self, transport: NodeTransport) -> None:
        seq = 0
        next_tick = next_health = time.monotonic_ns()
        while not self.stop_event.is_set():
            transport.poll(5)
            now = time.monotonic_ns()
            for parts in transport.drain_commands():
                try:
                    self.commands.append(decode_command(parts))
                except (ProtocolError, CodecError) as e:
                    self.rejects.append(str(e))
            while True:
                try:  # every frame, not the newest: the test checks each one
                    parts = transport.frames_sub.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                arrival = time.monotonic_ns()
                try:
                    frame = decode_frame(parts, self.cameras)
                except (ProtocolError, CodecError) as e:
                    self.rejects.append(str(e))
                    continue
                self.frames.append(Received(frame.camera, frame.seq, frame.stamp_ns, frame.encoding,
                                            frame.rgb.shape, crc(frame.rgb), zlib.crc32(parts[2].buffer),
                                            arrival))
                if self.answer:
                    transport.publish_action(self._action(seq, "fresh", frame.seq, frame.stamp_ns))
                    seq += 1
            if now >= next_tick:
                transport.publish_action(self._action(seq, "fallback", None, None))
                seq += 1
                next_tick = now + 20_000_000
            if now >= next_health:
                transport.publish_health(encode_health(
                    {"model": "echo", "backend": "none", "kv_bytes": {"text": 1, "vision": 2, "action": 3},
                     "frames_processed": len(self.frames)}))
                next_health = now + 200_000_000

    @staticmethod
    def _action(seq: int, status: str, frame_seq, frame_stamp_ns) -> list[bytes]:
        return encode_action(seq=seq, stamp_ns=time.monotonic_ns(), frame_seq=frame_seq,
                             frame_stamp_ns=frame_stamp_ns, status=status, level=0, action=[0.0, 0.0],
                             chunk=[], timing_ms={"total": 0.1}, reuse_ratio=0.5 if status == "fresh" else None)

    def __enter__(self) -> "EchoNode":
        self.start()
        self.ready.wait(10)
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.join(10)
        if self.error is not None:
            raise self.error


# ---- small drives ---------------------------------------------------------------------------------------

T0 = 1_700_000_000_000_000_000


def road_frames(count: int, width: int = 160, height: int = 120, fps: float = 10.0) -> list[np.ndarray]:
    config = SyntheticDriveConfig(width=width, height=height, fps=fps, seconds=count / fps + 1, seed=3)
    return [rgb for _, rgb in synthetic_frames(config)][:count]


def write_ros2_bag(path: Path, frames: list[np.ndarray], compressed: bool, topic: str = "/camera/image_raw",
                   fps: float = 10.0, encoding: str = "rgb8") -> None:
    """A ROS 2 bag of sensor_msgs/msg/Image (rgb8 pixels, labelled `encoding`) or CompressedImage (jpeg)."""
    with open(path, "wb") as f:
        writer = Ros2Writer(f)
        schema = writer.register_msgdef("sensor_msgs/msg/CompressedImage" if compressed else "sensor_msgs/msg/Image",
                                        COMPRESSED_DEF if compressed else IMAGE_DEF)
        encoder = JpegEncoder(2)
        for i, rgb in enumerate(frames):
            stamp = T0 + int(i * 1e9 / fps)
            header = {"stamp": {"sec": stamp // 10**9, "nanosec": stamp % 10**9}, "frame_id": "camera"}
            if compressed:
                msg = {"header": header, "format": "jpeg", "data": encoder.encode(rgb)}
            else:
                height, width = rgb.shape[:2]
                msg = {"header": header, "height": height, "width": width, "encoding": encoding, "is_bigendian": 0,
                       "step": width * 3, "data": rgb.tobytes()}
            writer.write_message(topic, schema, msg, log_time=stamp, publish_time=stamp)
        writer.finish()


def write_mp4(path: Path, frames: list[np.ndarray], fps: int = 10) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def mp4_pixels(path: Path, limit: int | None = None) -> list[np.ndarray]:
    """The video's frames decoded straight with PyAV (rgb24), the oracle for pixel exactness."""
    out = []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            out.append(frame.to_ndarray(format="rgb24"))
            if limit is not None and len(out) == limit:
                break
    return out
