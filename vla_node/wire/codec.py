"""The only msgpack module: `pack` and a bounded, pickle-free `unpack` with a numpy dtype allow-list.

numpy arrays travel as msgpack ext type `NDARRAY_EXT` (= 1) whose payload is itself msgpack:
`[dtype_str, shape, raw_bytes]`, e.g. `["<f4", [2, 3], <24 bytes>]`, always little-endian and C-ordered.
Decoding accepts only the dtype strings in `ALLOWED_DTYPES` (kinds b, i, u, f; no object, void, structured
or big-endian) and checks `len(raw_bytes) == prod(shape) * itemsize`. Decoded arrays are read-only views of
the received bytes.

Every malformed input raises `CodecError` (a ValueError) whose `reason` is one of `CODEC_REASONS`.
Nesting depth is bounded by msgpack's own fixed parser stack (1024 levels; deeper -> reason `too_deep`).
msgpack's built-in timestamp ext (-1) decodes to `msgpack.Timestamp`; protocol type checks reject it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from vla_node.validate import is_int, require, show

NDARRAY_EXT = 1
MAX_NDIM = 32

# Exactly the dtype strings accepted on decode (numpy's own `dtype.str` spelling).
ALLOWED_DTYPES: dict[str, np.dtype] = {
    s: np.dtype(s)
    for s in ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8")
}
_ALLOWED_KINDS = frozenset("biuf")

CODEC_REASONS = (
    "too_large",  # input longer than CodecLimits.max_bytes
    "limit_exceeded",  # a str/bin/array/map/ext longer than its limit
    "truncated",  # input ends inside an object
    "extra_data",  # bytes left after the first object
    "too_deep",  # nesting deeper than msgpack's parser stack
    "bad_format",  # reserved byte or otherwise invalid msgpack
    "bad_utf8",  # str that is not valid UTF-8
    "bad_map_key",  # map key that is not str or bytes
    "unknown_ext",  # ext type code other than NDARRAY_EXT
    "bad_ndarray",  # ndarray payload malformed (layout, shape, byte count)
    "bad_dtype",  # ndarray dtype not in ALLOWED_DTYPES
    "bad_input",  # not a bytes-like object
    "unsupported_type",  # pack(): a value msgpack cannot carry (or a disallowed numpy dtype)
)


class CodecError(ValueError):
    """Malformed or over-limit msgpack; `reason` is one of CODEC_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in CODEC_REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class CodecLimits:
    """Bounds for decoding untrusted bytes; every length is checked by msgpack before allocating."""

    max_bytes: int = 16 * 1024 * 1024
    max_str_len: int = 1024 * 1024
    max_bin_len: int = 16 * 1024 * 1024
    max_array_len: int = 100_000
    max_map_len: int = 10_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_str_len", "max_bin_len", "max_array_len", "max_map_len"):
            value = getattr(self, name)
            require(
                is_int(value) and value >= 1,
                name, value, "an integer >= 1",
            )


DEFAULT_LIMITS = CodecLimits()


# ---------------------------------------------------------------- pack


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ALLOWED_KINDS:
            raise CodecError(
                "unsupported_type", f"ndarray dtype {obj.dtype.str!r}: expected kinds b, i, u or f"
            )
        little = obj.dtype.newbyteorder("<") if obj.dtype.byteorder == ">" else obj.dtype
        arr = obj.astype(little, order="C", copy=False)  # same shape, C-ordered, little-endian
        payload = msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()], use_bin_type=True)
        return msgpack.ExtType(NDARRAY_EXT, payload)
    if isinstance(obj, (np.bool_, np.integer, np.floating)):
        return obj.item()
    raise CodecError("unsupported_type", f"cannot pack {type(obj).__name__}")


def _packb(obj: Any, default: Any) -> bytes:
    try:
        return msgpack.packb(obj, default=default, use_bin_type=True)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError("unsupported_type", str(e)) from None


def pack(obj: Any) -> bytes:
    """msgpack-encode `obj` (None, bool, int, float, str, bytes, list/tuple, str-keyed dict, numpy arrays
    of kinds b/i/u/f and numpy scalars). Anything else raises CodecError('unsupported_type')."""
    return _packb(obj, _pack_default)


# ---------------------------------------------------------------- unpack


def _decode_ndarray(data: bytes, limits: CodecLimits) -> np.ndarray:
    try:
        fields = msgpack.unpackb(
            data, raw=False, use_list=True, max_str_len=16, max_bin_len=limits.max_bin_len,
            max_array_len=MAX_NDIM, max_map_len=0, max_ext_len=0,
        )
    except Exception as e:  # any malformed payload, whatever msgpack raises
        reason = "limit_exceeded" if "exceeds max_bin_len" in str(e) else "bad_ndarray"
        raise CodecError(reason, f"ndarray payload: {type(e).__name__}: {e}") from None
    if not (isinstance(fields, list) and len(fields) == 3):
        raise CodecError("bad_ndarray", "payload is not [dtype, shape, bytes]")
    dtype_str, shape, raw = fields
    if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES:
        raise CodecError("bad_dtype", f"dtype {show(dtype_str)}: expected one of {sorted(ALLOWED_DTYPES)}")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise CodecError("bad_ndarray", f"shape {show(shape)}: expected a list of non-negative integers")
    if not isinstance(raw, bytes):
        raise CodecError("bad_ndarray", f"data is {type(raw).__name__}: expected bin")
    dtype = ALLOWED_DTYPES[dtype_str]
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise CodecError(
            "bad_ndarray", f"{len(raw)} bytes for shape {shape} {dtype_str}: expected {expected}"
        )
    try:
        return np.frombuffer(raw, dtype=dtype).reshape(shape)  # (*shape,) read-only view of raw
    except ValueError as e:  # e.g. a zero-size array with a dimension numpy cannot index
        raise CodecError("bad_ndarray", f"shape {shape}: {e}") from None


def _reason_for(e: Exception) -> str:
    if isinstance(e, msgpack.ExtraData):
        return "extra_data"
    if isinstance(e, msgpack.StackError):
        return "too_deep"
    if isinstance(e, msgpack.FormatError):
        return "bad_format"
    if isinstance(e, UnicodeDecodeError):
        return "bad_utf8"
    text = str(e)
    if "exceeds max_" in text:
        return "limit_exceeded"
    if "incomplete input" in text:
        return "truncated"
    if "map key" in text:
        return "bad_map_key"
    return "bad_format"


def _unpackb(data: Any, limits: CodecLimits, **hooks: Any) -> Any:
    """msgpack.unpackb within `limits`, every failure a CodecError; `hooks`: ext or object hooks, max_ext_len."""
    try:
        view = memoryview(data)
    except TypeError:
        raise CodecError("bad_input", f"{type(data).__name__} is not bytes-like") from None
    if view.nbytes > limits.max_bytes:
        raise CodecError("too_large", f"{view.nbytes} bytes: expected at most {limits.max_bytes}")
    try:
        return msgpack.unpackb(
            view, raw=False, use_list=True, strict_map_key=True,
            max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len, max_map_len=limits.max_map_len, **hooks,
        )
    except CodecError:
        raise
    except Exception as e:  # msgpack raises ValueError subclasses, UnicodeDecodeError, TypeError, ...
        raise CodecError(_reason_for(e), f"{type(e).__name__}: {e}") from None


def unpack(data: Any, limits: CodecLimits = DEFAULT_LIMITS) -> Any:
    """Decode one msgpack object from bytes-like `data` (bytes, memoryview, zmq.Frame) within `limits`.
    Strings decode as str, bin as bytes, arrays as lists, maps as dicts with str/bytes keys."""

    def ext_hook(code: int, payload: bytes) -> Any:
        if code != NDARRAY_EXT:
            raise CodecError("unknown_ext", f"ext type {code}: expected {NDARRAY_EXT} (ndarray)")
        return _decode_ndarray(payload, limits)

    return _unpackb(data, limits, ext_hook=ext_hook, max_ext_len=limits.max_bin_len + 64)


# ---------------------------------------------------------------- numpy as maps (openpi's msgpack-numpy)
# openpi's clients send arrays as maps {b"__ndarray__": True, b"data": raw, b"dtype": "<f4", b"shape": [..]} and
# numpy scalars as {b"__npgeneric__": True, b"data": value, b"dtype": "<f4"}. Decoded here with the limits and the
# dtype allow-list above, never with their decoder (it trusts the dtype).
_ND_KEYS = frozenset((b"__ndarray__", b"data", b"dtype", b"shape"))
_NPGENERIC_KEYS = frozenset((b"__npgeneric__", b"data", b"dtype"))


def _allowed_dtype(dtype_str: Any) -> np.dtype:
    if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES:
        raise CodecError("bad_dtype", f"dtype {show(dtype_str)}: expected one of {sorted(ALLOWED_DTYPES)}")
    return ALLOWED_DTYPES[dtype_str]


def _numpy_map_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        if set(obj) != _ND_KEYS:
            raise CodecError("bad_ndarray", f"ndarray map keys {sorted(map(show, obj))}: expected {sorted(_ND_KEYS)}")
        dtype, shape, raw = _allowed_dtype(obj[b"dtype"]), obj[b"shape"], obj[b"data"]
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(n) is int and n >= 0 for n in shape)):
            raise CodecError("bad_ndarray", f"shape {show(shape)}: expected a list of at most {MAX_NDIM} integers >= 0")
        if not isinstance(raw, bytes) or len(raw) != math.prod(shape) * dtype.itemsize:
            raise CodecError("bad_ndarray", f"data of {len(raw) if isinstance(raw, bytes) else show(raw)} bytes for "
                                            f"shape {shape} {dtype.str}: expected {math.prod(shape) * dtype.itemsize}")
        return np.frombuffer(raw, dtype=dtype).reshape(shape)  # (*shape,) read-only view of raw
    if b"__npgeneric__" in obj:
        if set(obj) != _NPGENERIC_KEYS or not isinstance(obj[b"data"], (bool, int, float)):
            raise CodecError("bad_ndarray", f"numpy scalar map {show(obj)}: expected {sorted(_NPGENERIC_KEYS)} "
                                            "with a bool, int or float")
        try:
            return _allowed_dtype(obj[b"dtype"]).type(obj[b"data"])
        except (OverflowError, ValueError) as e:
            raise CodecError("bad_ndarray", f"numpy scalar {show(obj[b'data'])}: {e}") from None
    return obj


def unpack_numpy_maps(data: Any, limits: CodecLimits = DEFAULT_LIMITS) -> Any:
    """Decode one msgpack object whose arrays are openpi's msgpack-numpy maps, within `limits` (no ext types)."""
    return _unpackb(data, limits, object_hook=_numpy_map_hook, max_ext_len=0)


def _numpy_map_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray) and obj.dtype.kind in _ALLOWED_KINDS:
        arr = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<"))
        return {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str, b"shape": list(arr.shape)}
    if isinstance(obj, (np.bool_, np.integer, np.floating)):
        return obj.item()
    raise CodecError("unsupported_type", f"cannot pack {type(obj).__name__}"
                     + (f" of dtype {obj.dtype.str!r}" if isinstance(obj, np.ndarray) else ""))


def pack_numpy_maps(obj: Any) -> bytes:
    """msgpack-encode `obj` with arrays as openpi's msgpack-numpy maps (what openpi's clients decode)."""
    return _packb(obj, _numpy_map_default)
