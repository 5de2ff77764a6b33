"""JPEG-aware mutations: the start-of-frame size claimed huge, zero or off by one, odd precisions, component
counts and frame types, segments dropped, repeated or with lying lengths, the scan truncated, or not a JPEG at all.
"""

from __future__ import annotations

import random
import struct

from vla_node.fuzz.mutate import havoc

SOF_TYPES = (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC9, 0xCA, 0xCB, 0xCD, 0xCF)
SIZES = ((60000, 60000), (0, 0), (0, 8), (8, 0), (1, 1), (65535, 65535), (16384, 16384), (16385, 1), (1080, 1920),
         (1081, 1920), (1080, 1921), (48, 64), (49, 64), (2, 2), (8, 8), (9, 8), (4, 4))
NOT_JPEG = (b"", b"\xff", b"\xff\xd8", b"\xff\xd8\xff\xd9", b"\xff\xd8\xff\xda\x00\x02", b"\x89PNG\r\n\x1a\n",
            b"GIF89a", b"\x00" * 32, b"\xff\xd8" + b"\xff" * 64, b"\xff\xd8\xff\xc0\x00\x11\x08")


def segments(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, marker, total length including the marker) of the segments before the first scan's data."""
    out = []
    i, n = 2, len(data)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:
            out.append((i, marker, 2))
            i += 2
            continue
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        out.append((i, marker, 2 + length))
        if marker == 0xDA:
            break
        i += 2 + length
    return out


def sof_offset(data: bytes) -> int | None:
    for offset, marker, _ in segments(data):
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return offset
    return None


def set_size(data: bytes, height: int, width: int) -> bytes:
    """The JPEG with its SOF claiming height x width (unchanged when it has no SOF)."""
    at = sof_offset(data)
    if at is None or at + 9 > len(data):
        return data
    buf = bytearray(data)
    buf[at + 5:at + 9] = struct.pack(">HH", height % 65536, width % 65536)
    return bytes(buf)


def mutate_jpeg(data: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    """One JPEG-aware change (or byte havoc)."""
    segs = segments(data) if data[:2] == b"\xff\xd8" else []
    at = sof_offset(data) if segs else None
    op = rng.randrange(12)
    buf = bytearray(data)
    if op <= 2 and at is not None:
        return set_size(data, *SIZES[rng.randrange(len(SIZES))])
    if op == 3 and at is not None and at + 10 <= len(buf):  # precision, component count, frame type
        field = rng.randrange(3)
        if field == 0:
            buf[at + 4] = rng.choice((0, 1, 7, 9, 12, 16, 255))
        elif field == 1:
            buf[at + 9] = rng.choice((0, 1, 2, 4, 5, 255))
        else:
            buf[at + 1] = rng.choice(SOF_TYPES)
        return bytes(buf)
    if op == 4 and segs:  # a segment dropped
        offset, _, length = segs[rng.randrange(len(segs))]
        del buf[offset:offset + length]
        return bytes(buf)
    if op == 5 and segs:  # a segment repeated
        offset, _, length = segs[rng.randrange(len(segs))]
        buf[offset:offset] = buf[offset:offset + length]
        return bytes(buf)
    if op == 6 and segs:  # a lying segment length
        offset, marker, _ = segs[rng.randrange(len(segs))]
        if offset + 4 <= len(buf) and marker not in (0x01, 0xD8) and not 0xD0 <= marker <= 0xD7:
            buf[offset + 2:offset + 4] = struct.pack(">H", rng.choice((0, 1, 2, 3, 0xFFFF, 0x8000)))
        return bytes(buf)
    if op == 7:  # truncated, most often inside the entropy-coded scan
        scan = segs[-1][0] + segs[-1][2] if segs else 0
        inside = scan < len(buf) and rng.random() < 0.7
        cut = rng.randrange(scan, len(buf) + 1) if inside else rng.randrange(len(buf) + 1)
        return bytes(buf[:cut])
    if op == 8:  # the scan's data scrambled
        scan = segs[-1][0] + segs[-1][2] if segs else 0
        for _ in range(rng.randint(1, 8)):
            if scan < len(buf):
                buf[rng.randrange(scan, len(buf))] = rng.randrange(256)
        return bytes(buf)
    if op == 9:
        return NOT_JPEG[rng.randrange(len(NOT_JPEG))] + (data[2:] if rng.random() < 0.3 else b"")
    return havoc(data, rng, others)


def flat_jpeg(components: int = 1, precision: int = 8, sof: int = 0xC0, adobe: int | None = None,
              size: tuple[int, int] = (8, 8)) -> bytes:
    """A JPEG of one flat colour written by hand: `components` channels (1 gray, 3 YCbCr, 4 CMYK with an Adobe
    segment), `precision` bits, frame type `sof`; each block codes DC difference 0 and end-of-block, one bit each
    (Huffman tables with a single 1-bit code). The kinds of JPEG FFmpeg's encoder cannot write."""
    height, width = size

    def seg(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body

    out = b"\xff\xd8"
    if adobe is not None:
        out += seg(0xEE, b"Adobe" + struct.pack(">HHHB", 100, 0, 0, adobe))
    table = bytes([1]) * 64 if precision == 8 else b"\x00\x01" * 64
    out += seg(0xDB, bytes([0x00 if precision == 8 else 0x10]) + table)
    out += seg(sof, bytes([precision]) + struct.pack(">HH", height, width) + bytes([components])
               + b"".join(bytes([i + 1, 0x11, 0]) for i in range(components)))
    one_code = bytes([1] + [0] * 15)  # one code of length 1
    out += seg(0xC4, b"\x00" + one_code + b"\x00" + b"\x10" + one_code + b"\x00")
    out += seg(0xDA, bytes([components]) + b"".join(bytes([i + 1, 0x00]) for i in range(components)) + b"\x00\x3f\x00")
    bits = 2 * ((height + 7) // 8) * ((width + 7) // 8) * components
    data = bytearray(bits // 8)
    if bits % 8:
        data.append((1 << (8 - bits % 8)) - 1)  # padded with 1-bits
    return out + bytes(data) + b"\xff\xd9"
