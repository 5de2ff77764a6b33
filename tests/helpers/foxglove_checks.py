"""What Foxglove would see: every message of a recording (or of a live channel) decoded and validated against the
schema its channel names: protobuf with the message's own FileDescriptorSet (google.protobuf), JSON with its JSON
schema (jsonschema)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from jsonschema.validators import validator_for
from mcap.reader import make_reader


class SchemaCheck:
    """Validates messages of one schema (name, encoding, data), caching the decoder."""

    def __init__(self, name: str, encoding: str, data: bytes) -> None:
        self.name, self.encoding = name, encoding
        if encoding == "protobuf":
            pool = descriptor_pool.DescriptorPool()
            for file in descriptor_pb2.FileDescriptorSet.FromString(data).file:
                pool.Add(file)
            self.cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        elif encoding == "jsonschema":
            schema = json.loads(data)
            self.validator = validator_for(schema)(schema)
            self.validator.check_schema(schema)
        else:
            raise AssertionError(f"schema {name}: encoding {encoding!r}, expected protobuf or jsonschema")

    def check(self, data: bytes):
        """The decoded message, valid for its schema (AssertionError otherwise)."""
        if self.encoding == "jsonschema":
            message = json.loads(data)
            errors = list(self.validator.iter_errors(message))
            assert not errors, f"{self.name}: {errors[0].message} in {str(message)[:300]}"
            return message
        message = self.cls.FromString(data)
        if self.name == "foxglove.RawImage":
            assert message.encoding in ("rgb8", "bgr8") and message.step == message.width * 3, message.encoding
            assert len(message.data) == message.height * message.step > 0 and message.frame_id
        elif self.name == "foxglove.CompressedImage":
            assert message.format == "jpeg" and message.data[:2] == b"\xff\xd8" and message.frame_id
        return message


def check_recording(path: Path) -> Counter[str]:
    """Messages per topic of an MCAP recording, each validated against its channel's schema."""
    counts: Counter[str] = Counter()
    checks: dict[int, SchemaCheck] = {}
    with open(path, "rb") as f:
        for schema, channel, message in make_reader(f, validate_crcs=True).iter_messages():
            assert schema is not None, f"{channel.topic}: no schema (Foxglove could not show it)"
            expected = {"protobuf": "protobuf", "json": "jsonschema"}.get(channel.message_encoding)
            assert schema.encoding == expected, (channel.topic, channel.message_encoding, schema.encoding)
            check = checks.get(schema.id) or checks.setdefault(schema.id, SchemaCheck(schema.name, schema.encoding,
                                                                                      schema.data))
            check.check(message.data)
            counts[channel.topic] += 1
    return counts


def layout_topics(layout: dict) -> set[str]:
    """The topics a Foxglove layout's panels name (image topic, plot paths, table topic)."""
    topics = set()
    for config in layout["configById"].values():
        if "imageMode" in config:
            topics.add(config["imageMode"]["imageTopic"])
        for path in config.get("paths", []):
            topics.add(path["value"].split(".", 1)[0])
        if "topicPath" in config:
            topics.add(config["topicPath"])
    return topics
