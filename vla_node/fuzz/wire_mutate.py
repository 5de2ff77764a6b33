"""Mutations of multipart wire messages (inputs.pack_parts): parts dropped, added, repeated, swapped or
re-topicked; the header map's fields changed (values.mutate_msgpack); the payload's JPEG damaged (jpeg.py) with the
header's size kept or made to match the JPEG's own claim, so the decoder gets past its size checks."""

from __future__ import annotations

import random

import msgpack

from vla_node.fuzz.inputs import pack_parts, unpack_parts
from vla_node.fuzz.jpeg import mutate_jpeg, set_size
from vla_node.fuzz.mutate import havoc
from vla_node.fuzz.values import mutate_msgpack, pick
from vla_node.wire.protocol import jpeg_size

TOPICS = (b"frame/front", b"frame/side", b"frame/rear", b"frame/", b"frame/front\x00", b"frame/\xff\xfe", b"frame",
          b"frame/" + b"a" * 100, b"instruction", b"state", b"action", b"health", b"", b"\x00" * 8, b"Frame/front")


def _sync_size(parts: list[bytes], rng: random.Random) -> list[bytes]:
    """The header's height/width set to what its payload claims (JPEG SOF) or the other way round."""
    if len(parts) < 3:
        return parts
    try:
        header = msgpack.unpackb(parts[1], raw=False)
    except Exception:  # noqa: BLE001
        return parts
    if not isinstance(header, dict):
        return parts
    size = jpeg_size(parts[2]) if parts[2][:2] == b"\xff\xd8" else None
    if size is not None and rng.random() < 0.7:
        header["height"], header["width"] = size
        header.setdefault("encoding", "jpeg")
        parts[1] = msgpack.packb(header, use_bin_type=True)
    elif isinstance(header.get("height"), int) and isinstance(header.get("width"), int):
        h, w = header["height"], header["width"]
        if size is not None:
            parts[2] = set_size(parts[2], h, w)
        elif 0 < h * w <= 1 << 16:
            parts[2] = rng.randbytes(h * w * 3 + pick(rng, (0, 0, 0, 1, -1)))
    return parts


def mutate_message(data: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    parts = unpack_parts(data)
    op = rng.randrange(16)
    if op == 0 and parts:
        del parts[rng.randrange(len(parts))]
    elif op == 1:
        parts.insert(rng.randrange(len(parts) + 1), pick(rng, (b"", b"\x80", parts[0] if parts else b"x")))
    elif op == 2 and len(parts) > 1:
        i, j = rng.sample(range(len(parts)), 2)
        parts[i], parts[j] = parts[j], parts[i]
    elif op == 3 and parts:
        parts[0] = pick(rng, TOPICS)
    elif 4 <= op <= 8 and len(parts) > 1:
        parts[1] = mutate_msgpack(parts[1], rng)
    elif 9 <= op <= 11 and len(parts) > 2:
        parts[2] = mutate_jpeg(parts[2], rng) if parts[2][:2] == b"\xff\xd8" else havoc(parts[2], rng)
    elif 9 <= op <= 11 and parts:  # a two-part message: its map
        parts[-1] = mutate_msgpack(parts[-1], rng)
    elif op == 12:
        parts = _sync_size(parts, rng)
    elif op == 13 and parts:
        i = rng.randrange(len(parts))
        parts[i] = havoc(parts[i], rng, [p for o in others[:4] for p in unpack_parts(o)])
    elif op == 14 and parts and others:  # a part taken from another message
        other = unpack_parts(pick(rng, tuple(others)))
        parts[rng.randrange(len(parts))] = pick(rng, tuple(other))
    elif op == 15 and rng.random() < 0.3:  # the container itself: one odd part
        return havoc(data, rng, others)
    elif parts:
        i = rng.randrange(len(parts))
        parts[i] = havoc(parts[i], rng)
    return pack_parts(parts[:8])
