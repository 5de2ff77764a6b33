"""MCAP-aware mutations of drives.

Record level (the file as `magic, [opcode u8, length u64, body]..., magic`): records dropped, repeated, swapped,
bodies scrambled, lying lengths, fixed fields (times, sizes, counts, offsets, ids, CRCs) set to interesting
values, truncation at and between records; inside an uncompressed chunk, its messages' fields too, with the CRC
recomputed half the time so the damage reaches the decoders behind it.

Rewrite level: the drive read back with the mcap library and written again with its writer after a message-level
change (payload maps and JPEGs mutated, stamps out of order, messages dropped or repeated, topics, encodings,
schemas and the profile swapped), under random writer options (compression, chunk size, no chunks, no statistics,
no summary), so a damaged drive is still a well-formed MCAP and the readers' own checks are exercised.
"""

from __future__ import annotations

import io
import random
import struct
import zlib

import msgpack
from mcap.reader import NonSeekingReader
from mcap.writer import CompressionType, IndexType, Writer

from vla_node.fuzz.jpeg import mutate_jpeg, segments, set_size
from vla_node.fuzz.mutate import INTERESTING_INTS, havoc
from vla_node.fuzz.values import mutate_msgpack, pick

MAGIC = b"\x89MCAP0\r\n"
# opcode -> fixed-position numeric fields of its body: (offset, struct format)
FIELDS = {
    0x02: ((0, "<Q"), (8, "<Q"), (16, "<I")),  # footer: summary start, summary offset start, summary CRC
    0x03: ((0, "<H"),),  # schema id
    0x04: ((0, "<H"), (2, "<H")),  # channel id, schema id
    0x05: ((0, "<H"), (2, "<I"), (6, "<Q"), (14, "<Q")),  # message: channel, sequence, log time, publish time
    0x06: ((0, "<Q"), (8, "<Q"), (16, "<Q"), (24, "<I")),  # chunk: start, end, uncompressed size, CRC
    0x07: ((0, "<H"),),  # message index: channel
    0x08: ((0, "<Q"), (8, "<Q"), (16, "<Q"), (24, "<Q")),  # chunk index: start, end, chunk offset, chunk length
    0x0B: ((0, "<Q"), (8, "<H"), (10, "<I"), (22, "<I"), (26, "<Q"), (34, "<Q")),  # statistics
    0x0E: ((0, "<B"), (1, "<Q"), (9, "<Q")),  # summary offset: group opcode, start, length
}
TOPICS = ("frame/front", "frame/side", "frame/", "frame/a/b", "instruction", "state", "action", "/camera/image_raw",
          "/cam/front/compressed", "")
ENCODINGS = ("msgpack", "cdr", "json", "protobuf", "")
PROFILES = ("vla-node", "ros2", "", "x")
ROS_VALUES = {
    "height": (0, 1, 2, 3, 60000, 2**32 - 1, 16384, 16385),
    "width": (0, 1, 2, 3, 60000, 2**32 - 1, 16384, 16385),
    "step": (0, 1, 3, 5, 2**31, 2**32 - 1),
    "encoding": ("rgb8", "bgr8", "mono8", "rgba8", "bgra8", "mono16", "yuv422", "", "RGB8", "jpeg"),
    "format": ("jpeg", "png", "jpg", "compressedDepth png", "rgb8; jpeg compressed bgr8", "", "bmp"),
    "is_bigendian": (0, 1, 255),
}


# ---------------------------------------------------------------- record level


def split_records(data: bytes) -> list[tuple[int, bytes]] | None:
    """[(opcode, body)] between the magics, or None when the framing does not hold."""
    if not (data.startswith(MAGIC) and data.endswith(MAGIC)):
        return None
    out, i, end = [], len(MAGIC), len(data) - len(MAGIC)
    while i < end:
        if i + 9 > end:
            return None
        opcode, length = data[i], struct.unpack_from("<Q", data, i + 1)[0]
        if i + 9 + length > end:
            return None
        out.append((opcode, data[i + 9:i + 9 + length]))
        i += 9 + length
    return out


def join_records(records: list[tuple[int, bytes]]) -> bytes:
    return MAGIC + b"".join(bytes([op]) + struct.pack("<Q", len(body)) + body for op, body in records) + MAGIC


def _numeric(rng: random.Random, body: bytes, fields: tuple) -> bytes:
    offset, fmt = fields[rng.randrange(len(fields))]
    size = struct.calcsize(fmt)
    if offset + size > len(body):
        return body
    old = struct.unpack_from(fmt, body, offset)[0]
    value = rng.choice((old + 1, old - 1, old * 2, old // 2, 0, rng.choice(INTERESTING_INTS),
                        rng.getrandbits(size * 8)))
    buf = bytearray(body)
    struct.pack_into(fmt, buf, offset, value % (1 << (8 * size)))
    return bytes(buf)


def _chunk_records_span(body: bytes) -> tuple[int, int] | None:
    """(start, end) of an uncompressed chunk's inner records in its body."""
    if len(body) < 32:
        return None
    clen = struct.unpack_from("<I", body, 28)[0]
    if body[32:32 + clen] != b"" or len(body) < 40:
        return None
    start = 32 + clen + 8
    return start, min(len(body), start + struct.unpack_from("<Q", body, 32 + clen)[0])


def _mutate_chunk(rng: random.Random, body: bytes) -> bytes:
    """A message inside an uncompressed chunk changed in place; the chunk CRC recomputed half the time."""
    span = _chunk_records_span(body)
    if span is None:
        return _numeric(rng, body, FIELDS[0x06])
    start, end = span
    inner = bytearray(body[start:end])
    records, i = [], 0
    while i + 9 <= len(inner):
        length = struct.unpack_from("<Q", inner, i + 1)[0]
        if i + 9 + length > len(inner):
            break
        records.append((i, inner[i], length))
        i += 9 + length
    messages = [r for r in records if r[1] == 0x05]
    if messages:
        at, _, length = messages[rng.randrange(len(messages))]
        record_body = bytes(inner[at + 9:at + 9 + length])
        if rng.random() < 0.5:
            record_body = _numeric(rng, record_body, FIELDS[0x05])
        else:  # the payload scrambled in place (same length)
            data = bytearray(record_body)
            for _ in range(rng.randint(1, 4)):
                if len(data) > 22:
                    data[rng.randrange(22, len(data))] = rng.randrange(256)
            record_body = bytes(data)
        inner[at + 9:at + 9 + length] = record_body
    buf = bytearray(body)
    buf[start:end] = inner
    if rng.random() < 0.5:
        struct.pack_into("<I", buf, 24, zlib.crc32(bytes(inner)))
    return bytes(buf)


def mutate_records(data: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    records = split_records(data)
    if not records:
        return havoc(data, rng, others)
    op = rng.randrange(10)
    i = rng.randrange(len(records))
    opcode, body = records[i]
    if op == 0:
        del records[i]
    elif op == 1:
        records.insert(rng.randrange(len(records) + 1), records[i])
    elif op == 2:
        j = rng.randrange(len(records))
        records[i], records[j] = records[j], records[i]
    elif op in (3, 4) and opcode in FIELDS:
        records[i] = (opcode, _numeric(rng, body, FIELDS[opcode]))
    elif op in (5, 6):
        chunks = [k for k, (o, _) in enumerate(records) if o == 0x06]
        if chunks:
            k = pick(rng, tuple(chunks))
            records[k] = (0x06, _mutate_chunk(rng, records[k][1]))
    elif op == 7:  # a record whose length field lies
        out = join_records(records)
        offsets, at = [], len(MAGIC)
        for _, b in records:
            offsets.append(at)
            at += 9 + len(b)
        buf = bytearray(out)
        at = offsets[i]
        struct.pack_into("<Q", buf, at + 1, pick(rng, (0, 1, len(body) - 1, len(body) + 1, 2**63, 2**64 - 1)) % 2**64)
        return bytes(buf)
    elif op == 8:  # truncated at a record boundary or inside one
        out = join_records(records)
        return out[:rng.randrange(len(out))]
    else:
        records[i] = (opcode, havoc(body, rng))
    return join_records(records)


# ---------------------------------------------------------------- rewrite level


def _read(data: bytes):
    reader = NonSeekingReader(io.BytesIO(data), validate_crcs=False)
    header = reader.get_header() if hasattr(reader, "get_header") else None
    items = list(reader.iter_messages())
    return header, items


def _mutate_native_payload(data: bytes, rng: random.Random) -> bytes:
    """A native message: its map mutated, or for a JPEG frame the JPEG (header kept or synced to its size)."""
    try:
        m = msgpack.unpackb(data, raw=False)
    except Exception:  # noqa: BLE001
        m = None
    if isinstance(m, dict) and m.get("encoding") == "jpeg" and isinstance(m.get("data"), bytes) and rng.random() < 0.6:
        jpeg = mutate_jpeg(m["data"], rng)
        if rng.random() < 0.5 and segments(jpeg):
            from vla_node.wire.protocol import jpeg_size

            size = jpeg_size(jpeg)
            if size is not None:
                m["height"], m["width"] = size
        elif rng.random() < 0.3:
            jpeg = set_size(jpeg, m.get("height", 0) if isinstance(m.get("height"), int) else 0,
                            m.get("width", 0) if isinstance(m.get("width"), int) else 0)
        m["data"] = jpeg
        return msgpack.packb(m, use_bin_type=True)
    return mutate_msgpack(data, rng)


def _ros_dict(msg) -> dict:
    stamp = msg.header.stamp
    out = {"header": {"stamp": {"sec": stamp.sec, "nanosec": stamp.nanosec}, "frame_id": msg.header.frame_id},
           "data": bytes(msg.data)}
    for name in ("height", "width", "encoding", "is_bigendian", "step", "format"):
        if hasattr(msg, name):
            out[name] = getattr(msg, name)
    return out


def _rewrite_ros2(data: bytes, rng: random.Random) -> bytes:
    from mcap_ros2.decoder import DecoderFactory
    from mcap_ros2.writer import Writer as Ros2Writer

    factory = DecoderFactory()
    reader = NonSeekingReader(io.BytesIO(data), decoder_factories=(factory,))
    items = list(reader.iter_decoded_messages())
    out = io.BytesIO()
    writer = Ros2Writer(out, chunk_size=rng.choice((256, 1 << 20)),
                        compression=rng.choice((CompressionType.NONE, CompressionType.ZSTD, CompressionType.LZ4)))
    schemas = {}
    victim = rng.randrange(len(items)) if items else -1
    times = [m.log_time for _, _, m, _ in items]
    if rng.random() < 0.3:
        rng.shuffle(times)
    for k, (schema, channel, message, decoded) in enumerate(items):
        if schema is None:
            continue
        if schema.id not in schemas:
            schemas[schema.id] = writer.register_msgdef(schema.name, schema.data.decode())
        msg = _ros_dict(decoded)
        if k == victim:
            name = rng.choice([n for n in ROS_VALUES if n in msg] + ["data"])
            if name == "data":
                msg["data"] = pick(rng, (b"", msg["data"][: len(msg["data"]) // 2], havoc(msg["data"], rng),
                                         mutate_jpeg(msg["data"], rng), _png_claiming(msg["data"], rng)))
            else:
                msg[name] = pick(rng, ROS_VALUES[name])
        topic = channel.topic if rng.random() < 0.9 else pick(rng, TOPICS) or "/x"
        writer.write_message(topic, schemas[schema.id], msg, log_time=times[k], publish_time=times[k])
    writer.finish()
    return out.getvalue()


def _png_claiming(data: bytes, rng: random.Random) -> bytes:
    """A PNG whose IHDR claims another size (an input that is no PNG is returned as is)."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n") or len(data) < 24:
        return data
    buf = bytearray(data)
    struct.pack_into(">II", buf, 16, pick(rng, (60000, 16385, 16384, 0, 1)), pick(rng, (60000, 16385, 16384, 0, 1)))
    return bytes(buf)


def _rewrite_native(data: bytes, rng: random.Random) -> bytes:
    header, items = _read(data)
    profile = header.profile if header is not None else "vla-node"
    op = rng.randrange(8)
    if op == 0 and items:  # a payload mutated
        k = rng.randrange(len(items))
        schema, channel, message = items[k]
        message.data = _mutate_native_payload(message.data, rng)
    elif op == 1 and items:  # stamps out of order
        times = [m.log_time for _, _, m in items]
        if rng.random() < 0.5:
            rng.shuffle(times)
        else:
            times.reverse()
        for (_, _, m), t in zip(items, times):
            m.log_time = m.publish_time = t
    elif op == 2 and items:
        k = rng.randrange(len(items))
        items[k][2].log_time = pick(rng, (0, 1, 2**63, 2**64 - 1, items[k][2].log_time + 1))
    elif op == 3 and items:
        k = rng.randrange(len(items))
        if rng.random() < 0.5:
            del items[k]
        else:
            items.insert(k, items[k])
    elif op == 4:
        profile = pick(rng, PROFILES)
    out = io.BytesIO()
    writer = Writer(out, chunk_size=rng.choice((64, 4096, 1 << 20)),
                    compression=rng.choice((CompressionType.NONE, CompressionType.ZSTD, CompressionType.LZ4)),
                    index_types=rng.choice((IndexType.ALL, IndexType.NONE)), use_chunking=rng.random() < 0.8,
                    use_statistics=rng.random() < 0.8, use_summary_offsets=rng.random() < 0.8,
                    repeat_channels=rng.random() < 0.8, enable_crcs=rng.random() < 0.9)
    writer.start(profile=profile, library="fuzz")
    channel_ids: dict[int, int] = {}
    swap = rng.randrange(len(items)) if items and op in (5, 6, 7) else -1
    for k, (schema, channel, message) in enumerate(items):
        if channel.id not in channel_ids or k == swap:
            topic, encoding, schema_id = channel.topic, channel.message_encoding, 0
            if k == swap:
                if op == 5:
                    topic = pick(rng, TOPICS)
                elif op == 6:
                    encoding = pick(rng, ENCODINGS)
                else:
                    schema_id = writer.register_schema(
                        pick(rng, ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage", "x")),
                        pick(rng, ("ros2msg", "jsonschema", "")), pick(rng, (b"", b"uint8 x", b"\xff")))
            channel_ids[channel.id] = writer.register_channel(topic, encoding, schema_id, dict(channel.metadata))
        writer.add_message(channel_ids[channel.id], message.log_time % 2**64, message.data,
                           message.publish_time % 2**64, message.sequence)
    writer.finish()
    return out.getvalue()


def mutate_mcap(data: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    """One MCAP-aware mutation: a rewrite (40%), a record-level change (45%) or byte havoc."""
    roll = rng.random()
    if roll < 0.4:
        try:
            if b"ros2" in data[:64]:
                return _rewrite_ros2(data, rng)
            return _rewrite_native(data, rng)
        except Exception:  # noqa: BLE001 - the input is already too damaged to read back: damage it further
            return mutate_records(data, rng, others)
    if roll < 0.85:
        return mutate_records(data, rng, others)
    return havoc(data, rng, others)
