"""Seed inputs for every fuzz target, built in code and deterministic (same bytes on every run and machine).

Each seed is (name, bytes) in the target's input format (see inputs.py): a valid message or file of every kind the
decoder accepts, plus a few that sit just past a limit, so that mutations start close to every branch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tempfile
from pathlib import Path

import msgpack
import numpy as np

from vla_node.fuzz.inputs import pack_parts, pack_tree
from vla_node.wire.codec import pack
from vla_node.wire.protocol import encode_action, encode_frame, encode_health, encode_instruction, encode_state

Seeds = list[tuple[str, bytes]]
T0 = 1_700_000_000_000_000_000  # a plausible capture stamp (ns)


def image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A deterministic HxWx3 uint8 gradient with some texture."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 7 + seed) % 256, (y * 5 + 3 * seed) % 256, ((x ^ y) * 11 + seed) % 256], axis=-1)
    return rgb.astype(np.uint8)  # (H, W, 3)


@functools.lru_cache(maxsize=None)
def jpeg(height: int, width: int, seed: int = 0) -> bytes:
    from vla_node.wire.protocol import encode_jpeg

    return encode_jpeg(image(height, width, seed), qscale=4)


@functools.lru_cache(maxsize=None)
def png(height: int, width: int, seed: int = 0) -> bytes:
    from fractions import Fraction

    import av

    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = width, height, "rgb24", Fraction(1, 25)
    return bytes(ctx.encode(av.VideoFrame.from_ndarray(image(height, width, seed), format="rgb24"))[0])


def _parts(parts) -> bytes:
    return pack_parts([bytes(p) for p in parts])


# ---------------------------------------------------------------- wire


def codec_seeds() -> Seeds:
    arrays = {dtype: np.arange(6).astype(dtype).reshape(2, 3) for dtype in
              ("bool", "int8", "uint8", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8")}
    values = {
        "map": {"v": 1, "seq": 7, "stamp_ns": T0, "camera": "front", "encoding": "rgb8", "height": 2, "width": 2},
        "nested": {"a": [1, 2.5, None, True, "x", b"\x00\xff"], "b": {"c": [[1.0, 2.0], [3.0, 4.0]]}},
        "arrays": {k: v for k, v in arrays.items()},
        "scalars": [0, -1, 2**64 - 1, -(2**63), 1.5, math.inf, "\u00e9", b""],
        "empty": [np.zeros((0, 3), np.float32), {}, [], ""],
        "observation": {"image": image(4, 4), "state": np.ones(4, np.float32), "prompt": "keep the lane"},
    }
    seeds = [(name, pack(value)) for name, value in values.items()]
    seeds.append(("timestamp", msgpack.packb(msgpack.Timestamp(1, 2))))
    seeds.append(("deep", b"\x91" * 200 + b"\xc0"))
    return seeds


@functools.lru_cache(maxsize=None)
def lossless_jpeg(height: int, width: int) -> bytes:
    """A lossless (SOF3) JPEG from FFmpeg's ljpeg encoder."""
    from fractions import Fraction

    import av

    ctx = av.CodecContext.create("ljpeg", "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = width, height, "bgr24", Fraction(1, 25)
    frame = av.VideoFrame.from_ndarray(image(height, width), format="rgb24").reformat(format="bgr24")
    return bytes(ctx.encode(frame)[0])


def frame_seeds() -> Seeds:
    from vla_node.fuzz.jpeg import flat_jpeg

    odd_jpegs = {"jpeg_gray": flat_jpeg(1), "jpeg_cmyk": flat_jpeg(4, adobe=0), "jpeg_12bit": flat_jpeg(3, 12, 0xC1),
                 "jpeg_progressive_gray": flat_jpeg(1, sof=0xC2, size=(16, 24)), "jpeg_lossless": lossless_jpeg(8, 12)}
    return [(name, _parts(encode_frame("front", 7, T0, data, "jpeg"))) for name, data in odd_jpegs.items()] + [
        ("rgb8", _parts(encode_frame("front", 1, T0, image(4, 6)))),
        ("bgr8", _parts(encode_frame("side", 2, T0 + 1, image(3, 2, 1), "bgr8"))),
        ("jpeg", _parts(encode_frame("front", 3, T0 + 2, jpeg(16, 16), "jpeg"))),
        ("jpeg_odd", _parts(encode_frame("side", 4, T0 + 3, jpeg(17, 33, 2), "jpeg"))),
        ("jpeg_side_max", _parts(encode_frame("side", 5, T0 + 4, jpeg(48, 64, 3), "jpeg"))),
        ("jpeg_1x1", _parts(encode_frame("front", 0, 0, jpeg(1, 1), "jpeg"))),
        ("rgb8_max_seq", _parts(encode_frame("front", 2**64 - 1, 2**64 - 1, image(1, 1)))),
        ("jpeg_claims_huge", _parts(encode_frame("front", 6, T0, jpeg(8, 8), "jpeg", height=60000, width=60000))),
    ]


def command_seeds() -> Seeds:
    return [
        ("instruction", _parts(encode_instruction(1, T0, "keep the lane and follow traffic"))),
        ("instruction_unicode", _parts(encode_instruction(2, T0, "\u00fcberhole den LKW \u2192 links \U0001f697"))),
        ("state", _parts(encode_state(3, T0, [0.5, -1.0, 2.0, 0.0]))),
        ("state_one", _parts(encode_state(2**64 - 1, 0, [3.0e38]))),
    ]


def action_seeds() -> Seeds:
    base = dict(seq=1, stamp_ns=T0, frame_seq=9, frame_stamp_ns=T0 - 5, status="fresh", level=0,
                action=[0.1, -0.2], chunk=[[0.1, -0.2], [0.3, 0.4]], timing_ms={"total": 12.5, "vision": 3})
    return [
        ("fresh", _parts(encode_action(**base))),
        ("fallback_before_frames", _parts(encode_action(**{**base, "status": "fallback", "frame_seq": None,
                                                             "frame_stamp_ns": None, "chunk": []}))),
        ("chunk_named_level", _parts(encode_action(**{**base, "status": "chunk", "level": "skip_vision"},
                                                   tokens_refreshed=12, reuse_ratio=0.8))),
    ]


def health_seeds() -> Seeds:
    return [
        ("health", _parts(encode_health({"rates": {"front": 10.0}, "drops": {"bad_jpeg": 1}, "level": 0,
                                         "memory": {"rss_mb": 512.5}}, stamp_ns=T0))),
        ("health_empty", _parts(encode_health({}, stamp_ns=0))),
    ]


# ---------------------------------------------------------------- drives


def _native(path: Path, compression: str, frames, commands=True, chunk_size: int = 1024) -> None:
    from vla_node.drives.native import DriveWriter

    with DriveWriter(path, compression=compression, chunk_size=chunk_size) as writer:
        for camera, seq, stamp, encoding, payload, (height, width) in frames:
            writer.add_frame(camera, seq, stamp, encoding, height, width, payload)
        if commands:
            writer.add_message("instruction", T0, {"v": 1, "seq": 0, "stamp_ns": T0, "text": "keep the lane"})
            writer.add_message("state", T0 + 10, {"v": 1, "seq": 0, "stamp_ns": T0 + 10, "values": [0.0, 1.0]})
            writer.add_message("action", T0 + 20, {"v": 1, "seq": 0, "status": "fresh", "action": [0.0, 0.0]})


def _raw_mcap(path: Path, channels, messages, profile: str = "vla-node", compression: str = "none") -> None:
    """An MCAP written with the mcap library's own writer: channels [(topic, encoding, schema (name, encoding, data)
    or None)], messages [(channel index, log_time, data)] in the order given."""
    from mcap.writer import CompressionType, Writer

    kinds = {"none": CompressionType.NONE, "zstd": CompressionType.ZSTD, "lz4": CompressionType.LZ4}
    with open(path, "wb") as f:
        writer = Writer(f, chunk_size=512, compression=kinds[compression])
        writer.start(profile=profile, library="vla-node fuzz corpus")
        ids = []
        for topic, encoding, schema in channels:
            schema_id = writer.register_schema(*schema) if schema is not None else 0
            ids.append(writer.register_channel(topic, encoding, schema_id))
        for k, (index, log_time, data) in enumerate(messages):
            writer.add_message(ids[index], log_time, data, log_time, k)
        writer.finish()


ROS_IMAGE_DEF = """std_msgs/Header header
uint32 height
uint32 width
string encoding
uint8 is_bigendian
uint32 step
uint8[] data
================================================================================
MSG: std_msgs/Header
builtin_interfaces/Time stamp
string frame_id
================================================================================
MSG: builtin_interfaces/Time
int32 sec
uint32 nanosec"""
ROS_COMPRESSED_DEF = ROS_IMAGE_DEF.replace("uint32 height\nuint32 width\nstring encoding\nuint8 is_bigendian\n"
                                           "uint32 step\nuint8[] data", "string format\nuint8[] data")


def _ros2(path: Path, images) -> None:
    """A ROS 2 bag: images [(topic, "jpeg" | "png" | raw encoding, rgb, row padding)]."""
    from mcap_ros2.writer import Writer as Ros2Writer

    with open(path, "wb") as f:
        writer = Ros2Writer(f, chunk_size=512)
        raw = writer.register_msgdef("sensor_msgs/msg/Image", ROS_IMAGE_DEF)
        compressed = writer.register_msgdef("sensor_msgs/msg/CompressedImage", ROS_COMPRESSED_DEF)
        for i, (topic, encoding, rgb, pad) in enumerate(images):
            stamp = T0 + i * 50_000_000
            header = {"stamp": {"sec": stamp // 10**9, "nanosec": stamp % 10**9}, "frame_id": topic}
            height, width = rgb.shape[:2]
            if encoding in ("jpeg", "png"):
                data = jpeg(height, width, i) if encoding == "jpeg" else png(height, width, i)
                writer.write_message(topic, compressed, {"header": header, "format": encoding, "data": data},
                                     log_time=stamp, publish_time=stamp)
                continue
            channels = {"mono8": 1, "rgba8": 4, "bgra8": 4}.get(encoding, 3)
            pixels = np.concatenate([rgb, rgb[:, :, :1]], axis=2)[:, :, :channels]  # (H, W, C)
            rows = np.zeros((height, width * channels + pad), np.uint8)
            rows[:, : width * channels] = pixels.reshape(height, width * channels)
            msg = {"header": header, "height": height, "width": width, "encoding": encoding, "is_bigendian": 0,
                   "step": width * channels + pad, "data": rows.tobytes()}
            writer.write_message(topic, raw, msg, log_time=stamp, publish_time=stamp)
        writer.finish()


def drive_seeds() -> Seeds:
    from vla_node.fuzz.jpeg import flat_jpeg

    frame = functools.partial(msgpack.packb, use_bin_type=True)
    odd = [flat_jpeg(4, adobe=0), flat_jpeg(3, 12, 0xC1), lossless_jpeg(8, 8)]
    header = {"v": 1, "seq": 0, "stamp_ns": T0, "camera": "front", "encoding": "rgb8", "height": 2, "width": 2,
              "data": bytes(12)}
    builders = {
        "native_rgb8": lambda p: _native(p, "none", [("front", i, T0 + i * 10**8, "rgb8", image(4, 4, i).tobytes(),
                                                      (4, 4)) for i in range(3)]),
        "native_two_cameras_zstd": lambda p: _native(p, "zstd", [
            (cam, i, T0 + i * 10**8 + k, "bgr8" if k else "rgb8", image(3, 5, i).tobytes(), (3, 5))
            for i in range(2) for k, cam in enumerate(("front", "side"))]),
        "native_jpeg_lz4": lambda p: _native(p, "lz4", [("front", i, T0 + i * 10**8, "jpeg", jpeg(16, 24, i), (16, 24))
                                                        for i in range(2)]),
        "native_odd_jpegs": lambda p: _native(p, "none", [("front", i, T0 + i, "jpeg", data, (8, 8))
                                                          for i, data in enumerate(odd)], False),
        "native_frames_only": lambda p: _native(p, "none", [("front", 0, T0, "rgb8", bytes(3), (1, 1))], False),
        "out_of_order_stamps": lambda p: _raw_mcap(p, [("frame/front", "msgpack", None)], [
            (0, T0 + 200, frame({**header, "seq": 2})), (0, T0, frame(header)),
            (0, T0 + 100, frame({**header, "seq": 1}))]),
        "wrong_schema": lambda p: _raw_mcap(p, [("frame/front", "json", ("sensor_msgs/msg/Image", "ros2msg", b"x")),
                                                ("/camera/image_raw", "cdr", ("sensor_msgs/msg/Image", "ros2msg",
                                                                              ROS_IMAGE_DEF.encode()))],
                                            [(0, T0, frame(header)), (1, T0 + 1, b"\x00\x01\x00\x00" + bytes(40))]),
        "native_commands_only": lambda p: _raw_mcap(p, [("instruction", "msgpack", None)],
                                                    [(0, T0, frame({"v": 1, "text": "x"}))]),
        "ros2_raw": lambda p: _ros2(p, [("/cam/front/image_raw", enc, image(3, 4, i), pad)
                                        for i, (enc, pad) in enumerate((("rgb8", 3), ("bgr8", 0), ("mono8", 5),
                                                                        ("rgba8", 0), ("bgra8", 1)))]),
        "ros2_compressed": lambda p: _ros2(p, [("/cam/left", "jpeg", image(8, 8), 0),
                                               ("/cam/right", "png", image(4, 6, 1), 0),
                                               ("/cam/left", "jpeg", image(8, 8, 2), 0)]),
        "ros2_long_row": lambda p: _ros2(p, [("/cam/wide/image_raw", "mono8", image(1, 16384), 5)]),
    }
    seeds = []
    with tempfile.TemporaryDirectory(prefix="vla-fuzz-corpus-") as tmp:
        for name, build in builders.items():
            path = Path(tmp) / f"{name}.mcap"
            build(path)
            seeds.append((name, path.read_bytes()))
    return seeds


# ---------------------------------------------------------------- launch files


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__}")


def _toml_table(name: str, obj, lines: list[str]) -> None:
    lines.append(f"[{name}]")
    nested = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f"{name}.{f.name}", value))
        elif value is not None:
            lines.append(f"{f.name} = {_toml_value(value)}")
    lines.append("")
    for sub, value in nested:
        _toml_table(sub, value, lines)


def launch_toml(config=None) -> str:
    """Every key of a NodeConfig (default: the defaults) as a TOML launch file; None values are left out."""
    from vla_node.config import NodeConfig

    config = NodeConfig() if config is None else config
    lines = ["# every key of the launch file, at its default (vla-node fuzz corpus)", ""]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            _toml_table(f.name, value, lines)
        else:
            for item in value:  # [[cameras]]
                lines.append(f"[[{f.name}]]")
                lines += [f"{g.name} = {_toml_value(getattr(item, g.name))}" for g in dataclasses.fields(item)]
                lines.append("")
    return "\n".join(lines)


OPTIONALS_TOML = """[model]
preset = "tiny"
vision_frames = 2
fallback = ["torch"]
threads = 0

[cache.vision]
policy = "fifo"
capacity_tokens = 8
hot_tokens = 4
merge_layer = 1

[reuse]
max_refresh = 3
tower_drift_threshold = 2.5
layer_budget = 1.5

[scheduler]
chunk_max_age_ms = 100.0
fallback_action = [0.0, -0.5]
fallback_hold = [true, false]
smaller_preset = "tiny"

[[cameras]]
name = "front"
max_width = 640
max_height = 480

[realtime]
cpu_affinity = [0]
worker_nice = 5
"""


def launch_seeds() -> Seeds:
    return [("defaults", launch_toml().encode()), ("optionals", OPTIONALS_TOML.encode()), ("empty", b""),
            ("tiny", b'[model]\npreset = "tiny"\nseed = 3\n')]


# ---------------------------------------------------------------- checkpoints


def _read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def checkpoint_seeds() -> Seeds:
    from vla_node.model.checkpoint import save_checkpoint
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla

    with tempfile.TemporaryDirectory(prefix="vla-fuzz-corpus-") as tmp:
        files = _read_tree(save_checkpoint(build_vla(preset("tiny"), seed=0), Path(tmp) / "ckpt"))
        flow = _read_tree(save_checkpoint(build_vla(preset("tiny", "flow"), seed=0), Path(tmp) / "flow"))
    meta = json.loads(files["vla.json"])
    two_frames = dict(files, **{"vla.json": json.dumps({**meta, "model": {**meta["model"], "vision_frames": 2}})
                                .encode()})
    extra = dict(files, **{"README.md": b"a checkpoint", "decoder/generation_config.json": b"{}"})
    return [("tiny", pack_tree(files)), ("tiny_two_frames", pack_tree(two_frames)),
            ("tiny_extra_files", pack_tree(extra)), ("tiny_flow", pack_tree(flow))]
