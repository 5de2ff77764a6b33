"""Byte-level mutations (AFL/libFuzzer style): bit flips, interesting integers, inserted, deleted, repeated and
spliced ranges, truncation. Deterministic for a given `random.Random`."""

from __future__ import annotations

import random
import struct

INTERESTING_INTS = (0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 1023, 1024, 4095, 4096, 32767,
                    32768, 60000, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1)
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xD8, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF)
_INT_FORMATS = ("<B", "<H", ">H", "<I", ">I", "<Q", ">Q")


def _pack_int(value: int, fmt: str) -> bytes:
    bits = struct.calcsize(fmt) * 8
    return struct.pack(fmt, value % (1 << bits))


def _range(rng: random.Random, n: int, longest: int = 64) -> tuple[int, int]:
    start = rng.randrange(n)
    return start, min(n, start + rng.randint(1, longest))


def mutate_bytes(data: bytes, rng: random.Random, others: list[bytes] = (), max_len: int = 1 << 20) -> bytes:
    """One random byte-level mutation of `data` (others: inputs to splice from); at most max_len bytes."""
    buf = bytearray(data)
    op = rng.randrange(11) if buf else 9
    n = len(buf)
    if op == 0:  # flip a bit
        i = rng.randrange(n)
        buf[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # a random byte
        buf[rng.randrange(n)] = rng.randrange(256)
    elif op == 2:  # an interesting byte
        buf[rng.randrange(n)] = rng.choice(INTERESTING_BYTES)
    elif op == 3:  # an interesting integer, any width and byte order
        fmt = rng.choice(_INT_FORMATS)
        value = rng.choice(INTERESTING_INTS) + rng.choice((0, 0, 0, -1, 1))
        i = rng.randrange(n)
        chunk = _pack_int(value, fmt)
        buf[i:i + len(chunk)] = chunk
    elif op == 4:  # delete a range
        a, b = _range(rng, n)
        del buf[a:b]
    elif op == 5:  # repeat a range
        a, b = _range(rng, n)
        buf[b:b] = buf[a:b] * rng.randint(1, 8)
    elif op == 6:  # copy a range elsewhere
        a, b = _range(rng, n)
        j = rng.randrange(n)
        buf[j:j + (b - a)] = buf[a:b]
    elif op == 7:  # truncate
        del buf[rng.randrange(n):]
    elif op == 8:  # splice with another input
        other = rng.choice(others) if others else bytes(buf)
        if other:
            cut, cut_other = rng.randrange(n + 1), rng.randrange(len(other) + 1)
            buf = buf[:cut] + bytearray(other[cut_other:])
    elif op == 9:  # insert random bytes
        i = rng.randrange(n + 1)
        buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:  # add or subtract a small number from a byte
        i = rng.randrange(n)
        buf[i] = (buf[i] + rng.choice((-16, -2, -1, 1, 2, 16))) % 256
    return bytes(buf[:max_len])


def havoc(data: bytes, rng: random.Random, others: list[bytes] = (), max_len: int = 1 << 20) -> bytes:
    """1-8 stacked byte mutations."""
    for _ in range(1 << rng.randrange(4)):
        data = mutate_bytes(data, rng, others, max_len)
    return data
