"""Small inputs for the fuzzing regression tests: drives written with the mcap library's own writers and then
patched at one field, the way the fuzzer damaged them; a tiny checkpoint directory as files."""

from __future__ import annotations

import io
import struct
import tempfile
from pathlib import Path

import msgpack
from mcap.writer import CompressionType, Writer

from vla_node.fuzz.corpus import ROS_COMPRESSED_DEF, ROS_IMAGE_DEF, T0, jpeg
from vla_node.fuzz.mcap_mutate import join_records, split_records


def frame_message(seq: int, stamp: int, encoding: str = "rgb8", payload: bytes | None = None,
                  size: tuple[int, int] = (2, 2)) -> bytes:
    data = bytes(size[0] * size[1] * 3) if payload is None else payload
    return msgpack.packb({"v": 1, "seq": seq, "stamp_ns": stamp, "camera": "front", "encoding": encoding,
                          "height": size[0], "width": size[1], "data": data}, use_bin_type=True)


def native_drive(messages: list[tuple[int, bytes]], chunk_size: int = 1 << 20) -> bytes:
    """A native drive of frame/front messages [(log time, msgpack map)], one chunk each when chunk_size is small."""
    out = io.BytesIO()
    writer = Writer(out, chunk_size=chunk_size, compression=CompressionType.NONE)
    writer.start(profile="vla-node", library="test")
    channel = writer.register_channel("frame/front", "msgpack", 0)
    for k, (log_time, data) in enumerate(messages):
        writer.add_message(channel, log_time, data, log_time, k)
    writer.finish()
    return out.getvalue()


def three_frames(chunk_size: int = 1 << 20) -> bytes:
    return native_drive([(T0 + i * 100_000_000, frame_message(i, T0 + i * 100_000_000)) for i in range(3)], chunk_size)


def patch_field(data: bytes, opcode: int, offset: int, fmt: str, value: int, which: int = 0) -> bytes:
    """The MCAP with field (offset, struct fmt) of its `which`-th record of `opcode` set to value."""
    records = split_records(data)
    positions = [i for i, (op, _) in enumerate(records) if op == opcode]
    i = positions[which]
    body = bytearray(records[i][1])
    struct.pack_into(fmt, body, offset, value)
    records[i] = (opcode, bytes(body))
    return join_records(records)


STATISTICS, CHUNK_INDEX = 0x0B, 0x08
STATS_START, STATS_END = 26, 34  # message_start_time, message_end_time in a Statistics record


def ros2_compressed_without_format() -> bytes:
    """A ROS 2 bag whose sensor_msgs/msg/CompressedImage schema lacks the `format` field."""
    from mcap_ros2.writer import Writer as Ros2Writer

    out = io.BytesIO()
    writer = Ros2Writer(out)
    schema = writer.register_msgdef("sensor_msgs/msg/CompressedImage",
                                    ROS_COMPRESSED_DEF.replace("string format\n", ""))
    header = {"stamp": {"sec": 1, "nanosec": 0}, "frame_id": "cam"}
    writer.write_message("/cam/front", schema, {"header": header, "data": jpeg(8, 8)}, log_time=T0, publish_time=T0)
    writer.finish()
    return out.getvalue()


def ros2_image(encoding: str, height: int, width: int, data: bytes, compressed_format: str | None = None) -> bytes:
    """A one-message ROS 2 bag: a raw sensor_msgs/msg/Image, or a CompressedImage when compressed_format is given."""
    from mcap_ros2.writer import Writer as Ros2Writer

    out = io.BytesIO()
    writer = Ros2Writer(out)
    header = {"stamp": {"sec": 1, "nanosec": 0}, "frame_id": "cam"}
    if compressed_format is None:
        schema = writer.register_msgdef("sensor_msgs/msg/Image", ROS_IMAGE_DEF)
        msg = {"header": header, "height": height, "width": width, "encoding": encoding, "is_bigendian": 0,
               "step": width * {"mono8": 1}.get(encoding, 3), "data": data}
    else:
        schema = writer.register_msgdef("sensor_msgs/msg/CompressedImage", ROS_COMPRESSED_DEF)
        msg = {"header": header, "format": compressed_format, "data": data}
    writer.write_message("/cam/front", schema, msg, log_time=T0, publish_time=T0)
    writer.finish()
    return out.getvalue()


def foxglove_compressed(image_format: str) -> bytes:
    """A native drive of one foxglove.CompressedImage frame in `image_format` (a JPEG's bytes whatever it says), on
    the schema foxglove-sdk defines, as the node's recorder writes jpeg frames."""
    from foxglove.messages import CompressedImage, Timestamp

    from vla_node.drives.foxglove import image_schema

    out = io.BytesIO()
    writer = Writer(out, compression=CompressionType.NONE)
    writer.start(profile="vla-node", library="test")
    schema = writer.register_schema(*image_schema("foxglove.CompressedImage"))
    channel = writer.register_channel("frame/front", "protobuf", schema)
    message = CompressedImage(timestamp=Timestamp(sec=1, nsec=0), frame_id="front", data=jpeg(8, 8),
                              format=image_format)
    writer.add_message(channel, T0, message.encode(), T0, 0)
    writer.finish()
    return out.getvalue()


def tiny_checkpoint_files() -> dict[str, bytes]:
    from vla_node.model.checkpoint import save_checkpoint
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla

    with tempfile.TemporaryDirectory() as tmp:
        root = save_checkpoint(build_vla(preset("tiny"), seed=0), Path(tmp) / "ckpt")
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

