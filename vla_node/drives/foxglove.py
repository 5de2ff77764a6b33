"""Drives as Foxglove shows them without plugins: frames as `foxglove.RawImage` / `foxglove.CompressedImage`
(protobuf, encoded by foxglove-sdk with its own schemas), every other channel JSON with a JSON schema, and a layout
file (image, latency and action plots, health table).

Channels of a drive (and of `vla-node view`'s live server):
    frame/<camera>   foxglove.RawImage (rgb8, bgr8) or foxglove.CompressedImage (jpeg); MCAP sequence = frame seq
    instruction, state, action, health   the wire messages' maps (wire protocol v1), JSON
    chunk            an action's chunk: {frame_seq, chunk: H x D}, JSON
    timing           an action's per-stage times: {frame_seq, status, ms: {stage: ms}}, JSON
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

IMAGE_SCHEMAS = ("foxglove.RawImage", "foxglove.CompressedImage")
PROTOBUF = "protobuf"
JSON = "json"
JSONSCHEMA = "jsonschema"

_INT = {"type": "integer", "minimum": 0}
_NUMBERS = {"type": "array", "items": {"type": "number"}}
_WIRE = {"v": {"const": 1}, "seq": _INT, "stamp_ns": _INT}
JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "instruction": {"type": "object", "properties": {**_WIRE, "text": {"type": "string"}},
                    "required": ["v", "seq", "stamp_ns", "text"]},
    "state": {"type": "object", "properties": {**_WIRE, "values": _NUMBERS}, "required": ["v", "seq", "stamp_ns", "values"]},
    "action": {"type": "object", "properties": {
        **_WIRE, "frame_seq": {"type": ["integer", "null"]}, "frame_stamp_ns": {"type": ["integer", "null"]},
        "status": {"type": "string"}, "level": {"type": ["integer", "string"]}, "action": _NUMBERS,
        "chunk": {"type": "array", "items": _NUMBERS},
        "timing_ms": {"type": "object", "additionalProperties": {"type": "number"}},
        "tokens_refreshed": {"type": ["integer", "null"]}, "reuse_ratio": {"type": ["number", "null"]},
    }, "required": ["v", "seq", "stamp_ns", "frame_seq", "frame_stamp_ns", "status", "level", "action", "chunk",
                    "timing_ms"]},
    "health": {"type": "object", "properties": {
        "v": {"const": 1}, "stamp_ns": _INT, "uptime_s": {"type": "number"}, "level": {"type": "integer"},
        "frames_processed": _INT, "rejected": _INT, "cameras": {"type": "object"}, "control": {"type": "object"},
        "rss_bytes": _INT,
    }, "required": ["v", "stamp_ns", "uptime_s"]},
    "chunk": {"type": "object", "properties": {"frame_seq": {"type": ["integer", "null"]},
                                               "chunk": {"type": "array", "items": _NUMBERS}},
              "required": ["frame_seq", "chunk"]},
    "timing": {"type": "object", "properties": {
        "frame_seq": {"type": ["integer", "null"]}, "status": {"type": "string"},
        "ms": {"type": "object", "additionalProperties": {"type": "number"}}}, "required": ["frame_seq", "ms"]},
}
ANY_MAP_SCHEMA: dict[str, Any] = {"type": "object"}  # a topic without a schema of its own


def json_schema(topic: str) -> tuple[str, bytes]:
    """(schema name, JSON schema bytes) of a JSON channel."""
    schema = JSON_SCHEMAS.get(topic, ANY_MAP_SCHEMA)
    return f"vla_node.{topic.replace('/', '.')}", json.dumps({"title": topic, **schema}).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def encode_json(message: Mapping[str, Any]) -> bytes:
    """A message map as compact JSON (numpy arrays and scalars as lists and numbers; NaN refused)."""
    return json.dumps(dict(message), separators=(",", ":"), allow_nan=False, default=_plain).encode()


def json_messages(topic: str, message: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The JSON channels' messages for one message: itself on its topic, and for an action its chunk and timing on
    channels of their own (for plots)."""
    if topic != "action":
        return {topic: message}
    return {"action": message,
            "chunk": {"frame_seq": message.get("frame_seq"), "chunk": message.get("chunk", [])},
            "timing": {"frame_seq": message.get("frame_seq"), "status": message.get("status"),
                       "ms": dict(message.get("timing_ms", {}))}}


def image_schema(schema_name: str) -> tuple[str, str, bytes]:
    """(name, encoding, data) of a Foxglove image schema, as foxglove-sdk defines it."""
    from foxglove.messages import CompressedImage, RawImage

    schema = {"foxglove.RawImage": RawImage, "foxglove.CompressedImage": CompressedImage}[schema_name].get_schema()
    return schema.name, schema.encoding, bytes(schema.data)


def encode_image(camera: str, stamp_ns: int, encoding: str, height: int, width: int, data: bytes) -> tuple[str, bytes]:
    """One frame -> (schema name, protobuf bytes): rgb8/bgr8 as foxglove.RawImage, jpeg as foxglove.CompressedImage."""
    from foxglove.messages import CompressedImage, RawImage, Timestamp

    stamp = Timestamp(sec=stamp_ns // 1_000_000_000, nsec=stamp_ns % 1_000_000_000)
    if encoding == "jpeg":
        return "foxglove.CompressedImage", CompressedImage(timestamp=stamp, frame_id=camera, data=data,
                                                           format="jpeg").encode()
    return "foxglove.RawImage", RawImage(timestamp=stamp, frame_id=camera, width=width, height=height,
                                         encoding=encoding, step=width * 3, data=data).encode()


class ImageDecoder:
    """Decodes a drive's Foxglove image messages with the protobuf schema stored in the drive itself."""

    def __init__(self, schema_name: str, schema_data: bytes) -> None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        pool = descriptor_pool.DescriptorPool()
        for file in descriptor_pb2.FileDescriptorSet.FromString(schema_data).file:
            pool.Add(file)
        self.schema_name = schema_name
        self._cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(schema_name))

    def decode(self, data: bytes) -> dict[str, Any]:
        """{camera, stamp_ns, encoding, height, width, data}; height and width 0 for a compressed image (the
        caller reads them from the JPEG)."""
        m = self._cls.FromString(data)
        stamp_ns = m.timestamp.seconds * 1_000_000_000 + m.timestamp.nanos
        if self.schema_name == "foxglove.CompressedImage":
            return {"camera": m.frame_id, "stamp_ns": stamp_ns, "encoding": m.format, "height": 0, "width": 0,
                    "data": m.data}
        return {"camera": m.frame_id, "stamp_ns": stamp_ns, "encoding": m.encoding, "height": m.height,
                "width": m.width, "step": m.step, "data": m.data}


def layout(cameras: list[str]) -> dict[str, Any]:
    """A Foxglove layout for a drive or a live node: the first camera's image, plots of latency (each stage's
    time) and of the action, and health's latest message as a table (message paths start with the topic name)."""
    image = {"imageMode": {"imageTopic": f"frame/{cameras[0]}" if cameras else ""}, "cameraState": {}}
    def series(path: str, label: str) -> dict:
        return {"value": path, "enabled": True, "timestampMethod": "receiveTime", "label": label}
    latency = {"title": "latency (ms)", "paths": [series("timing.ms.total", "total"),
                                                  series("timing.ms.vision", "vision"),
                                                  series("timing.ms.action", "action"),
                                                  series("timing.ms.text", "text")],
               "showLegend": True, "xAxisVal": "timestamp"}
    action = {"title": "action", "paths": [series("action.action[0]", "action[0]"),
                                           series("action.action[1]", "action[1]"),
                                           series("action.level", "degrade level")],
              "showLegend": True, "xAxisVal": "timestamp"}
    return {
        "configById": {"Image!vla": image, "Plot!latency": latency, "Plot!action": action,
                       "Table!health": {"topicPath": "health"}},
        "globalVariables": {}, "userNodes": {}, "playbackConfig": {"speed": 1},
        "layout": {"direction": "row", "first": "Image!vla", "splitPercentage": 50, "second": {
            "direction": "column", "first": {"direction": "column", "first": "Plot!latency", "second": "Plot!action"},
            "second": "Table!health", "splitPercentage": 66}},
    }
