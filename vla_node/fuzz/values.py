"""Value-level mutations of the three text/map formats the decoders read: msgpack maps (wire headers, drive
messages), JSON (checkpoint configs) and TOML (launch files).

Each mutator parses its input, changes one value, key or line into an interesting one (wrong type, out of range,
non-finite, huge, nested deep, invalid encoding), and writes it back; what the format's own writer refuses (a list
nested 900 deep, an over-long integer, a reserved msgpack byte) is spliced in as raw bytes. Input that does not
parse gets byte-level havoc instead.
"""

from __future__ import annotations

import json
import math
import random
import re
import struct

import msgpack
import numpy as np

from vla_node.fuzz.mutate import havoc

WIRE_KEYS = ("v", "seq", "stamp_ns", "camera", "encoding", "height", "width", "text", "values", "status", "level",
             "action", "chunk", "timing_ms", "frame_seq", "frame_stamp_ns", "data", "extra", "")


class Raw:
    """Bytes spliced verbatim into a packed msgpack/JSON document (what the writer itself would refuse)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _ndarray_ext(dtype: str, shape: list, raw: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([dtype, shape, raw], use_bin_type=True))


MSGPACK_VALUES = (
    None, True, False, 0, 1, -1, 2, 7, 255, 256, 65535, 60000, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1,
    2**64 - 1, -(2**63), 0.0, -0.0, 0.5, 1.5, -2.5, math.nan, math.inf, -math.inf, 3.5e38, -3.5e38, 1e-45, 1e308,
    "", "x", "front", "side", "jpeg", "rgb8", "bgr8", "yuv", "fresh", "chunk", "fallback", "keep the lane",
    "\u00e9\u6f22\U0001f697", "\x00", "x" * 5000, b"", b"\xff\xd8\xff", b"\x00" * 64, [], [0.0], [1.0, 2.0],
    [1, 2, 3, 4], [0.0] * 2000, [math.nan], [math.inf, 1.0], [True], ["a"], [[1.0, 2.0]], [[1.0], [2.0, 3.0]],
    [[]], {}, {"a": 1}, {"stage": 1.5}, {"stage": "x"}, {b"k": 1},
    _ndarray_ext("<f4", [2], b"\x00" * 8), _ndarray_ext("<f4", [3], b"\x00" * 8), _ndarray_ext(">f4", [1], b"\0" * 4),
    _ndarray_ext("|O", [1], b"\0" * 8), _ndarray_ext("<f4", [0, 2**62, 2**62], b""), _ndarray_ext("<u1", [-1], b""),
    msgpack.ExtType(1, b"\xc1"), msgpack.Timestamp(0, 5), Raw(b"\xd6\xff" + struct.pack(">I", 7)),
    msgpack.ExtType(9, b""),
    Raw(b"\x91" * 1010 + b"\xc0"), Raw(b"\x81\xa1a" * 300 + b"\xc0"), Raw(b"\xc1"), Raw(b"\x81\x01\x01"),
    Raw(b"\x81\xc0\x01"), Raw(b"\xdb\xff\xff\xff\xff"), Raw(b"\xdd\xff\xff\xff\xff"), Raw(b"\xdf\xff\xff\xff\xff"),
    Raw(b"\xc6\xff\xff\xff\xff"), Raw(b"\xc9\xff\xff\xff\xff\x01"), Raw(b"\xa2\xff\xfe"), Raw(b"\xcf" + b"\xff" * 8),
    Raw(b"\xd3\x80" + b"\x00" * 7), Raw(b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x01"), Raw(b"\xd9"),
)

JSON_VALUES = (
    None, True, False, 0, 1, -1, 2, 3, 4, 8, 16, 17, 100, 256, 257, 2**31, 2**63, 2**64, 10**30, 0.0, -0.0, 0.5, 1.5,
    1e-300, 1e308, math.nan, math.inf, -math.inf, "", "x", "tiny", "parallel", "autoregressive", "fp32", [], [1.0],
    [-1.0, 1.0], [1.0, -1.0], [0, 0], [math.nan, 1.0], {}, {"a": 1},
    Raw(b"1" * 5000), Raw(b"[" * 5000 + b"]" * 5000), Raw(b'"\\ud800"'), Raw(b"1e999"), Raw(b"-"), Raw(b"\xff"),
)

TOML_LITERALS = (
    "nan", "+nan", "-nan", "inf", "+inf", "-inf", "1e400", "-1e400", "0", "-1", "1", "2", "3", "0.0", "-0.0", "0.5",
    "1e-320", "3.5e38", "9223372036854775807", "-9223372036854775808", "9223372036854775808", "18446744073709551616",
    "0x7fffffffffffffff", "0xffffffffffffffff", "1" * 5000, "0x" + "f" * 5000, "true", "false", '"x"', '""',
    "'front'", '"' + "x" * 5000 + '"', "[]", "[1, 2, 3]", "[1.5, nan]", '["a", 1]', "[[1], [2]]", "{}", "{ a = 1 }",
    "1979-05-27T07:32:00Z", "1979-05-27", "07:32:00", "[" * 400 + "]" * 400, "{ a = " * 300 + "1" + " }" * 300,
    '"\\u0000"', '"cpu"', '"cuda:99999999999999999999"', '"tcp://0.0.0.0:1"', '"tcp://*:5560"', '"ipc:///tmp/x"',
    '"auto"', '"tiny"', '"int8-trt"', '"tensorrt"', '"/"', '"/dev/null"', '"."', "-0", "1_000", "0o777", "0b101",
)
TOML_LINES = ("bogus = 1", "presett = 'tiny'", "[bogus]", "[model.extra]", "[[cameras]]", "[cameras]",
              "[cache.vision]", "[health]", "[model]", "name = 'side'", "max_width = 60000", "\x00", "a.b.c = 1",
              "= 1", "[[model]]", "'quoted key' = 1", '"" = 1', "\ufeffx = 1", "x = 1 # \udcff")


def pick(rng: random.Random, values: tuple):
    return values[rng.randrange(len(values))]


# ---------------------------------------------------------------- containers inside a parsed document


def _slots(value, limit: int = 256) -> list[tuple[object, object]]:
    """(container, key or index) of every slot in `value`, breadth first, at most `limit` (no recursion)."""
    out: list[tuple[object, object]] = []
    queue = [value]
    while queue and len(out) < limit:
        node = queue.pop(0)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append((node, k))
            if isinstance(v, (dict, list)) and len(queue) < limit:
                queue.append(v)
    return out


def _containers(value, limit: int = 64) -> list:
    found, queue = [], [value]
    while queue and len(found) < limit:
        node = queue.pop(0)
        if isinstance(node, (dict, list)):
            found.append(node)
            queue.extend(v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, (dict, list)))
    return found


def mutate_document(doc, rng: random.Random, values: tuple, keys: tuple[str, ...]):
    """Change one slot of a parsed map/array document in place (or return a replacement for the whole)."""
    slots = _slots(doc)
    op = rng.randrange(10)
    if not slots or op == 9:
        return pick(rng, values)
    container, key = slots[rng.randrange(len(slots))]
    if op <= 4:  # a new value
        container[key] = pick(rng, values)
    elif op == 5:  # gone
        del container[key]
    elif op == 6:  # a value moved from another slot (right type, wrong place)
        other, other_key = slots[rng.randrange(len(slots))]
        container[key] = other[other_key]
    elif op == 7:  # an extra key or element
        target = pick(rng, tuple(_containers(doc))) if _containers(doc) else container
        if isinstance(target, dict):
            target[pick(rng, keys) if rng.random() < 0.7 else f"k{rng.randrange(100)}"] = pick(rng, values)
        else:
            target.insert(rng.randrange(len(target) + 1), pick(rng, values))
    else:  # a number nudged
        v = container[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            container[key] = pick(rng, values)
        else:
            container[key] = pick(rng, (v + 1, v - 1, -v, v * 2, v * 1000, 0, v + 0.5))
    return doc


# ---------------------------------------------------------------- msgpack


def _splice(packed: bytes, raws: dict[bytes, bytes]) -> bytes:
    for token, raw in raws.items():
        packed = packed.replace(token, raw, 1)
    return packed


def pack_with_raw(value, rng: random.Random) -> bytes:
    """msgpack of `value` with every Raw spliced in as its bytes."""
    raws: dict[bytes, bytes] = {}

    def default(obj):
        if isinstance(obj, Raw):
            token = b"\xd6\x7f" + rng.randbytes(4)  # fixext4 of type 127: a placeholder
            raws[token] = obj.data
            return msgpack.ExtType(127, token[2:])
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(type(obj).__name__)

    return _splice(msgpack.packb(value, use_bin_type=True, default=default), raws)


def mutate_msgpack(data: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    """One value-level change of a msgpack document, or byte havoc when it does not parse."""
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType, timestamp=0)
    except Exception:  # noqa: BLE001 - not msgpack (any more): bytes it is
        return havoc(data, rng, others)
    try:
        return pack_with_raw(mutate_document(doc, rng, MSGPACK_VALUES, WIRE_KEYS), rng)
    except Exception:  # noqa: BLE001 - e.g. an unhashable key the packer refuses
        return havoc(data, rng, others)


# ---------------------------------------------------------------- JSON


def _dump_json(value, rng: random.Random) -> bytes:
    raws: dict[bytes, bytes] = {}

    def default(obj):
        if isinstance(obj, Raw):
            token = f"@@raw{rng.randrange(1 << 30)}@@"
            raws[json.dumps(token).encode()] = obj.data
            return token
        raise TypeError(type(obj).__name__)

    return _splice(json.dumps(value, default=default, allow_nan=True).encode(), raws)


def mutate_json(data: bytes, rng: random.Random, keys: tuple[str, ...] = ()) -> bytes:
    try:
        doc = json.loads(data)
    except Exception:  # noqa: BLE001
        return havoc(data, rng)
    try:
        return _dump_json(mutate_document(doc, rng, JSON_VALUES, keys or ("model", "format_version", "x")), rng)
    except Exception:  # noqa: BLE001
        return havoc(data, rng)


# ---------------------------------------------------------------- TOML

_KEY_LINE = re.compile(r"^(\s*[A-Za-z0-9_.\"'-]+\s*=\s*)(.*)$")


def mutate_toml(data: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    """One line-level change of a TOML document: a value replaced, a line dropped, repeated or moved, an
    unknown key or table added; byte havoc now and then."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return havoc(data, rng, others)
    lines = text.split("\n")
    keyed = [i for i, line in enumerate(lines) if _KEY_LINE.match(line)]
    op = rng.randrange(12)
    if op <= 5 and keyed:
        i = pick(rng, tuple(keyed))
        head = _KEY_LINE.match(lines[i]).group(1)
        lines[i] = head + pick(rng, TOML_LITERALS)
    elif op == 6 and lines:
        del lines[rng.randrange(len(lines))]
    elif op == 7 and lines:
        i = rng.randrange(len(lines))
        lines.insert(rng.randrange(len(lines) + 1), lines[i])
    elif op == 8:
        lines.insert(rng.randrange(len(lines) + 1), pick(rng, TOML_LINES))
    elif op == 9 and len(lines) > 1:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 10 and keyed:  # a key renamed by one character: the did-you-mean path
        i = pick(rng, tuple(keyed))
        head, value = _KEY_LINE.match(lines[i]).groups()
        name = head.split("=")[0].strip()
        cut = rng.randrange(len(name) + 1)
        lines[i] = f"{name[:cut]}{pick(rng, ('x', '', '_', 'e'))}{name[cut + 1:]} = {value}"
    else:
        return havoc(data, rng, others)
    return "\n".join(lines).encode("utf-8", "surrogatepass")
