"""The fuzz targets: one function per decoder of outside input, `run(data, scratch) -> Outcome`, checking the
contract of contract.py on top of what each decoder promises about the values it returns.

    codec       wire.codec.unpack                      CodecError (reason in CODEC_REASONS)
    frame       wire.protocol.decode_frame             ProtocolError (reason in REJECT_REASONS)
    command     wire.protocol.decode_command           ProtocolError
    action      wire.protocol.decode_action            ProtocolError
    health      wire.protocol.decode_health            ProtocolError
    drive       drives.open.open_drive + reading it    DriveError naming the file (or the frame, for pixels)
    launch      config.load_launch                     ConfigError naming the file (CheckpointError for its checkpoint)
    checkpoint  model.checkpoint.load_checkpoint       CheckpointError naming the directory

`data` is the input in the target's format (inputs.py); `scratch` an empty folder the target may write to.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from vla_node.fuzz import corpus
from vla_node.fuzz.checkpoint_mutate import mutate_checkpoint
from vla_node.fuzz.contract import ACCEPTED, Outcome, check_call, invalid, short_reason
from vla_node.fuzz.inputs import unpack_parts, unpack_tree, write_tree
from vla_node.fuzz.mcap_mutate import mutate_mcap
from vla_node.fuzz.mutate import havoc
from vla_node.fuzz.values import mutate_msgpack, mutate_toml
from vla_node.fuzz.wire_mutate import mutate_message
from vla_node.validate import INT64_MAX, INT64_MIN
from vla_node.wire.codec import ALLOWED_DTYPES, CODEC_REASONS, CodecError, CodecLimits, unpack
from vla_node.wire.protocol import (
    ACTION_STATUSES,
    REJECT_REASONS,
    CameraSpec,
    Frame,
    Instruction,
    ProtocolError,
    ProtocolLimits,
    State,
    decode_action,
    decode_command,
    decode_frame,
    decode_health,
    jpeg_size,
)

Mutator = Callable[[bytes, Any, list], bytes]


@dataclass(frozen=True)
class Target:
    """A decoder under fuzzing: how to run one input, its seeds, how to mutate, and its limits per input."""

    name: str
    run: Callable[[bytes, Path], Outcome]
    seeds: Callable[[], corpus.Seeds]
    mutate: Mutator
    deadline_s: float = 5.0  # one input taking longer is a hang
    memory_mb: int = 256  # one input growing the worker's peak memory by more is a failure
    max_bytes: int = 1 << 20  # mutated inputs are cut to this

    @property
    def ref(self) -> str:
        """module:function of `run`, which the worker imports."""
        return f"{self.run.__module__}:{self.run.__name__}"


# ---------------------------------------------------------------- wire


CODEC_SMALL = CodecLimits(max_bytes=4096, max_str_len=256, max_bin_len=1024, max_array_len=16, max_map_len=16)
CAMERAS = {"front": CameraSpec("front"), "side": CameraSpec("side", max_width=64, max_height=48)}
PROTOCOL_LIMITS = ProtocolLimits()
_UINT64 = 2**64


def _protocol_reason(e: ProtocolError) -> str:
    if e.reason not in REJECT_REASONS or not e.detail:
        raise invalid(f"ProtocolError reason {e.reason!r} detail {e.detail!r}: expected a listed reason and a detail",
                      "protocol_reason")
    return e.reason


def _codec_reason(e: CodecError) -> str:
    if e.reason not in CODEC_REASONS:
        raise invalid(f"CodecError reason {e.reason!r}: expected one of CODEC_REASONS", "codec_reason")
    return e.reason


def _check_decoded(value: Any) -> None:
    """Only the types unpack promises, read-only allowed-dtype arrays, str/bytes map keys (walked, no recursion)."""
    stack, seen = [value], 0
    while stack:
        node = stack.pop()
        seen += 1
        if isinstance(node, dict):
            for k, v in node.items():
                if type(k) not in (str, bytes):
                    raise invalid(f"decoded map key of type {type(k).__name__}", "codec_key")
                stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, np.ndarray):
            if node.dtype.str not in ALLOWED_DTYPES or node.flags.writeable:
                raise invalid(f"decoded ndarray {node.dtype.str} writeable={node.flags.writeable}", "codec_array")
        elif not (node is None or type(node) in (bool, int, float, str, bytes, msgpack.Timestamp)):
            raise invalid(f"decoded value of type {type(node).__name__}", "codec_type")


def run_codec(data: bytes, scratch: Path) -> Outcome:
    small = check_call(lambda: unpack(data, CODEC_SMALL), (CodecError,), _codec_reason, _check_decoded)
    outcome = check_call(lambda: unpack(data), (CodecError,), _codec_reason, _check_decoded)
    if small.accepted and not outcome.accepted:
        raise invalid(f"accepted under the small limits, rejected under the defaults ({outcome.reason})",
                      "codec_limits")
    return outcome


def _uint(value: Any, what: str) -> None:
    if type(value) is not int or not 0 <= value < _UINT64:
        raise invalid(f"{what} = {value!r}: expected an unsigned 64-bit integer", what)


def _check_frame(frame: Any) -> None:
    if not isinstance(frame, Frame):
        raise invalid(f"decode_frame returned {type(frame).__name__}", "frame_type")
    spec = CAMERAS.get(frame.camera)
    if spec is None:
        raise invalid(f"frame of camera {frame.camera!r}, which is not configured", "frame_camera")
    _uint(frame.seq, "frame seq")
    _uint(frame.stamp_ns, "frame stamp_ns")
    if not (1 <= frame.height <= spec.max_height and 1 <= frame.width <= spec.max_width):
        raise invalid(f"frame {frame.height}x{frame.width} beyond camera {spec.name}'s maximum", "frame_size")
    rgb = frame.rgb
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.shape == (frame.height, frame.width, 3)):
        raise invalid(f"frame pixels {getattr(rgb, 'dtype', None)} {getattr(rgb, 'shape', None)} for "
                      f"{frame.height}x{frame.width}", "frame_pixels")
    if rgb.flags.writeable:
        raise invalid("frame pixels are writeable: expected read-only", "frame_writeable")


def run_frame(data: bytes, scratch: Path) -> Outcome:
    parts = unpack_parts(data)
    return check_call(lambda: decode_frame(parts, CAMERAS, PROTOCOL_LIMITS), (ProtocolError,), _protocol_reason,
                      _check_frame)


def _finite_list(values: Any, what: str, dims: int | None = None) -> None:
    if type(values) is not list or not all(type(x) in (int, float) and math.isfinite(x) for x in values):
        raise invalid(f"{what} = {values!r:.80}: expected a list of finite numbers", what)
    if dims is not None and len(values) != dims:
        raise invalid(f"{what} of {len(values)} values: expected {dims}", what)


def _check_command(msg: Any) -> None:
    if isinstance(msg, Instruction):
        _uint(msg.seq, "instruction seq")
        _uint(msg.stamp_ns, "instruction stamp_ns")
        if type(msg.text) is not str or not 1 <= len(msg.text) <= PROTOCOL_LIMITS.max_text_chars:
            raise invalid(f"instruction text {msg.text!r:.80}", "instruction_text")
    elif isinstance(msg, State):
        _uint(msg.seq, "state seq")
        _uint(msg.stamp_ns, "state stamp_ns")
        v = msg.values
        if not (isinstance(v, np.ndarray) and v.dtype == np.float32 and v.ndim == 1
                and 1 <= v.size <= PROTOCOL_LIMITS.max_state_values and np.isfinite(v).all()):
            raise invalid(f"state values {v!r:.80}", "state_values")
    else:
        raise invalid(f"decode_command returned {type(msg).__name__}", "command_type")


def run_command(data: bytes, scratch: Path) -> Outcome:
    parts = unpack_parts(data)
    return check_call(lambda: decode_command(parts, PROTOCOL_LIMITS), (ProtocolError,), _protocol_reason,
                      _check_command)


def _check_action(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise invalid(f"decode_action returned {type(msg).__name__}", "action_type")
    _uint(msg["seq"], "action seq")
    _uint(msg["stamp_ns"], "action stamp_ns")
    if msg["status"] not in ACTION_STATUSES:
        raise invalid(f"action status {msg['status']!r}", "action_status")
    _finite_list(msg["action"], "action action")
    if not msg["action"]:
        raise invalid("action action = []", "action_empty")
    if type(msg["chunk"]) is not list:
        raise invalid("action chunk is not a list", "action_chunk")
    for row in msg["chunk"]:
        _finite_list(row, "action chunk row", len(msg["action"]))


def run_action(data: bytes, scratch: Path) -> Outcome:
    parts = unpack_parts(data)
    return check_call(lambda: decode_action(parts, PROTOCOL_LIMITS), (ProtocolError,), _protocol_reason,
                      _check_action)


def _check_health(msg: Any) -> None:
    if not isinstance(msg, dict) or msg.get("v") != 1:
        raise invalid(f"decode_health returned {msg!r:.80}", "health_type")
    _uint(msg["stamp_ns"], "health stamp_ns")


def run_health(data: bytes, scratch: Path) -> Outcome:
    parts = unpack_parts(data)
    return check_call(lambda: decode_health(parts, PROTOCOL_LIMITS), (ProtocolError,), _protocol_reason,
                      _check_health)


# ---------------------------------------------------------------- drives

MAX_FRAMES = 64  # frames read from a fuzzed drive
DECODE_FRAMES = 4  # of which the pixels are decoded
MAX_MESSAGES = 256
MAX_SIDE = 16384  # drives.native.MAX_SIDE: the drive readers' largest image side


def _check_drive_frames(reader: Any, frames: list) -> None:
    last = None
    for f in frames:
        where = f"frame {f.camera}#{f.seq}"
        if f.camera not in reader.cameras:
            raise invalid(f"{where} of a camera the reader does not list {list(reader.cameras)}", "drive_camera")
        if f.encoding not in ("rgb8", "jpeg"):
            raise invalid(f"{where} encoding {f.encoding!r}", "drive_encoding")
        if not (type(f.height) is int and type(f.width) is int and 1 <= f.height <= MAX_SIDE
                and 1 <= f.width <= MAX_SIDE):
            raise invalid(f"{where} size {f.width}x{f.height}: expected sides in 1..{MAX_SIDE}", "drive_size")
        if type(f.seq) is not int or f.seq < 0 or type(f.stamp_ns) is not int or f.stamp_ns < 0:
            raise invalid(f"{where} seq {f.seq!r} stamp_ns {f.stamp_ns!r}: expected non-negative", "drive_stamp")
        if last is not None and f.stamp_ns < last:
            raise invalid(f"{where} at {f.stamp_ns} ns after a frame at {last} ns: expected time order", "drive_order")
        last = f.stamp_ns
        if not isinstance(f.payload, bytes):
            raise invalid(f"{where} payload of type {type(f.payload).__name__}", "drive_payload")
        if f.encoding == "rgb8" and len(f.payload) != f.height * f.width * 3:
            raise invalid(f"{where} rgb8 payload of {len(f.payload)} bytes for {f.width}x{f.height}", "drive_payload")
        if f.encoding == "jpeg" and jpeg_size(f.payload) != (f.height, f.width):
            raise invalid(f"{where} JPEG of size {jpeg_size(f.payload)} for {f.width}x{f.height}", "drive_jpeg")


def _read_drive(path: Path, frames_out: list) -> None:
    from vla_node.drives.open import open_drive

    reader = open_drive(path)
    if type(reader.frame_count) is not int or reader.frame_count < 1 or reader.duration_ns < 0:
        raise invalid(f"reader with {reader.frame_count!r} frames over {reader.duration_ns!r} ns", "drive_counts")
    frames = list(islice(reader.frames(), MAX_FRAMES))
    _check_drive_frames(reader, frames)
    for message in islice(reader.messages(), MAX_MESSAGES):
        if not (isinstance(message.header, dict) and isinstance(message.topic, str) and message.stamp_ns >= 0):
            raise invalid(f"drive message {message!r:.80}", "drive_message")
    reader.info().to_dict()
    frames_out.extend(frames)


def _check_pixels(frame: Any) -> Callable[[Any], None]:
    def check(rgb: Any) -> None:
        if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.shape == (frame.height, frame.width, 3)):
            raise invalid(f"frame {frame.camera}#{frame.seq} pixels {getattr(rgb, 'shape', None)} for "
                          f"{frame.width}x{frame.height}", "drive_pixels")
    return check


def run_drive(data: bytes, scratch: Path) -> Outcome:
    from vla_node.drives.open import DriveError

    path = scratch / "drive.mcap"
    path.write_bytes(data)
    prefix = f"{path}: "
    frames: list = []
    outcome = check_call(lambda: _read_drive(path, frames), (DriveError,),
                         lambda e: short_reason(str(e), prefix), lambda _: None, prefix)
    if not outcome.accepted:
        return outcome
    for frame in frames[:DECODE_FRAMES]:
        pixels = check_call(frame.rgb, (DriveError,),  # "frame <camera>#<seq>: <problem>"
                            lambda e: "frame pixels: " + short_reason(str(e).partition(": ")[2]),
                            _check_pixels(frame), "frame ")
        if not pixels.accepted:
            return pixels
    return ACCEPTED


# ---------------------------------------------------------------- launch files


def _check_config(config: Any) -> None:
    """A NodeConfig whose every number is finite and fits 64 bits (walked, no recursion)."""
    from vla_node.config import NodeConfig

    if not isinstance(config, NodeConfig):
        raise invalid(f"load_launch returned {type(config).__name__}", "launch_type")
    stack = [("", config)]
    while stack:
        key, value = stack.pop()
        if dataclasses.is_dataclass(value):
            stack.extend((f"{key}.{f.name}".lstrip("."), getattr(value, f.name)) for f in dataclasses.fields(value))
        elif isinstance(value, (tuple, list)):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise invalid(f"launch value {key} = {value!r} accepted: expected a finite number", f"launch_nan:{key}")
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise invalid(f"launch value {key} of {value.bit_length()} bits accepted", f"launch_int:{key}")


def run_launch(data: bytes, scratch: Path) -> Outcome:
    from vla_node.config import load_launch
    from vla_node.model.checkpoint import CheckpointError
    from vla_node.validate import ConfigError

    path = scratch / "launch.toml"
    path.write_bytes(data)
    prefix = f"{path}: "

    # a ConfigError names the launch file; a CheckpointError (model.checkpoint is no checkpoint) names that folder
    return check_call(lambda: load_launch(path), (ConfigError, CheckpointError),
                      lambda e: short_reason(str(e), prefix) if isinstance(e, ConfigError) else "checkpoint",
                      _check_config, lambda e: prefix if isinstance(e, ConfigError) else "")


# ---------------------------------------------------------------- checkpoints


def _check_model(model: Any) -> None:
    import torch

    from vla_node.model.vla import VLA

    if not isinstance(model, VLA):
        raise invalid(f"load_checkpoint returned {type(model).__name__}", "checkpoint_type")
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise invalid(f"checkpoint tensor {name!r} holds NaN or infinity and was accepted", "checkpoint_nan")


def run_checkpoint(data: bytes, scratch: Path) -> Outcome:
    from vla_node.model.checkpoint import CheckpointError, load_checkpoint

    root = write_tree(unpack_tree(data), scratch / "ckpt")
    prefix = str(root)
    return check_call(lambda: load_checkpoint(root), (CheckpointError,),
                      lambda e: short_reason(str(e), prefix, segments=2), _check_model, prefix)


# ---------------------------------------------------------------- the registry


def _wire(seeds: Callable[[], corpus.Seeds]) -> dict:
    return dict(seeds=seeds, mutate=mutate_message, deadline_s=5.0, memory_mb=256, max_bytes=1 << 20)


def mutate_codec(data: bytes, rng: Any, others: list) -> bytes:
    """Value-level msgpack changes most of the time, byte havoc the rest."""
    return (mutate_msgpack if rng.random() < 0.6 else havoc)(data, rng, others)


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("codec", run_codec, corpus.codec_seeds, mutate_codec, deadline_s=5.0, memory_mb=256, max_bytes=1 << 16),
    Target("frame", run_frame, **_wire(corpus.frame_seeds)),
    Target("command", run_command, **_wire(corpus.command_seeds)),
    Target("action", run_action, **_wire(corpus.action_seeds)),
    Target("health", run_health, **_wire(corpus.health_seeds)),
    Target("drive", run_drive, corpus.drive_seeds, mutate_mcap, deadline_s=20.0, memory_mb=2048, max_bytes=1 << 20),
    Target("launch", run_launch, corpus.launch_seeds, mutate_toml, deadline_s=10.0, memory_mb=256, max_bytes=1 << 18),
    Target("checkpoint", run_checkpoint, corpus.checkpoint_seeds, mutate_checkpoint, deadline_s=20.0,
           memory_mb=512, max_bytes=4 << 20),
)}


def target(name: str) -> Target:
    from vla_node.validate import choose

    return choose("--target", name, TARGETS)
