"""vla_node.wire.codec: round trips, the dtype allow-list, limits, and fuzzing that only ever raises CodecError."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vla_node.validate import ConfigError
from vla_node.wire.codec import ALLOWED_DTYPES, CODEC_REASONS, NDARRAY_EXT, CodecError, CodecLimits, pack, unpack

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ndarray_ext(dtype: object, shape: object, raw: object) -> bytes:
    """A hand-made ndarray ext message, for crafting malformed ones."""
    payload = msgpack.packb([dtype, shape, raw], use_bin_type=True)
    return msgpack.packb(msgpack.ExtType(NDARRAY_EXT, payload))


def reason_of(data: object, limits: CodecLimits = CodecLimits()) -> str:
    with pytest.raises(CodecError) as info:
        unpack(data, limits)
    assert info.value.reason in CODEC_REASONS
    return info.value.reason


# ---------------------------------------------------------------- round trips

scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=50) | st.binary(max_size=50)
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=10), children, max_size=6),
    max_leaves=30,
)


@FUZZ
@given(values)
def test_plain_values_round_trip(value: object) -> None:
    assert unpack(pack(value)) == value


def test_nan_and_tuples() -> None:
    out = unpack(pack({"x": float("nan"), "t": (1, 2)}))
    assert math.isnan(out["x"])
    assert out["t"] == [1, 2]  # tuples travel as arrays


arrays = hnp.arrays(
    dtype=st.sampled_from(sorted(ALLOWED_DTYPES)).map(np.dtype),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
)


@FUZZ
@given(arrays)
def test_ndarray_round_trip(array: np.ndarray) -> None:
    out = unpack(pack({"a": array}))["a"]
    assert out.dtype == array.dtype
    assert out.shape == array.shape
    np.testing.assert_array_equal(out, array)
    assert not out.flags.writeable


def test_ndarray_big_endian_and_strided_inputs_arrive_little_endian_contiguous() -> None:
    big = np.arange(12, dtype=">f4").reshape(3, 4)
    out = unpack(pack(big))
    assert out.dtype.str == "<f4"
    np.testing.assert_array_equal(out, big)
    strided = np.arange(24, dtype=np.int16).reshape(4, 6)[::2, ::-3]
    out = unpack(pack(strided))
    np.testing.assert_array_equal(out, strided)
    fortran = np.asfortranarray(np.arange(6, dtype=np.uint32).reshape(2, 3))
    np.testing.assert_array_equal(unpack(pack(fortran)), fortran)


def test_numpy_scalars_pack_as_plain_numbers() -> None:
    out = unpack(pack([np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(200)]))
    assert out == [1.5, -3, True, 200]
    assert [type(v) for v in out] == [float, int, bool, int]


def test_unpack_accepts_memoryview_and_bytearray() -> None:
    data = pack({"k": [1, 2]})
    assert unpack(memoryview(data)) == {"k": [1, 2]}
    assert unpack(bytearray(data)) == {"k": [1, 2]}


# ---------------------------------------------------------------- pack refusals


@pytest.mark.parametrize(
    "value",
    [object(), np.array(["text"]), np.array([1 + 2j]), np.zeros(2, dtype=[("a", "<f4")]),
     np.array([None], dtype=object), np.zeros(2, dtype="V4"), {1.5j}],
    ids=["object", "unicode", "complex", "structured", "object-array", "void", "set"],
)
def test_pack_refuses_what_the_wire_cannot_carry(value: object) -> None:
    with pytest.raises(CodecError) as info:
        pack(value)
    assert info.value.reason == "unsupported_type"


# ---------------------------------------------------------------- dtype allow-list and ndarray checks


@pytest.mark.parametrize("dtype", ["|O", "|O8", ">f4", ">i8", "<c8", "|V8", "<U1", "|S4", "<M8[s]", "f4", "=f4", "<f16"])
def test_disallowed_dtypes_are_refused(dtype: str) -> None:
    assert reason_of(ndarray_ext(dtype, [1], b"\x00" * 8)) == "bad_dtype"


def test_structured_dtype_description_is_refused() -> None:
    assert reason_of(ndarray_ext([["a", "<f4"]], [1], b"\x00" * 4)) == "bad_dtype"


@pytest.mark.parametrize(
    "dtype, shape, raw",
    [
        ("<f4", [2, 2], b"\x00" * 15),  # one byte short
        ("<f4", [2, 2], b"\x00" * 17),  # one byte over
        ("<f4", [-1, 4], b"\x00" * 16),  # negative dimension
        ("<f4", [True, 4], b"\x00" * 16),  # bool is not a dimension
        ("<f4", "4", b"\x00" * 16),  # shape not a list
        ("<f4", [4], "not bin"),  # data not bin
        ("|u1", [0, 2**63], b""),  # zero elements but an impossible dimension
        ("|u1", [1] * 33, b"\x00"),  # too many dimensions
    ],
)
def test_malformed_ndarray_payloads(dtype: str, shape: object, raw: object) -> None:
    assert reason_of(ndarray_ext(dtype, shape, raw)) == "bad_ndarray"


def test_ndarray_payload_not_a_triple() -> None:
    assert reason_of(msgpack.packb(msgpack.ExtType(NDARRAY_EXT, msgpack.packb(["<f4", [1]])))) == "bad_ndarray"
    assert reason_of(msgpack.packb(msgpack.ExtType(NDARRAY_EXT, b"\xc1"))) == "bad_ndarray"


def test_unknown_ext_code() -> None:
    assert reason_of(msgpack.packb(msgpack.ExtType(7, b"\x00"))) == "unknown_ext"


# ---------------------------------------------------------------- limits and malformed msgpack


def test_limits() -> None:
    tight = CodecLimits(max_bytes=64, max_str_len=4, max_bin_len=4, max_array_len=3, max_map_len=2)
    assert reason_of(pack("x" * 100), tight) == "too_large"
    assert reason_of(pack("abcde"), tight) == "limit_exceeded"
    assert reason_of(pack(b"abcde"), tight) == "limit_exceeded"
    assert reason_of(pack([1, 2, 3, 4]), tight) == "limit_exceeded"
    assert reason_of(pack({"a": 1, "b": 2, "c": 3}), tight) == "limit_exceeded"
    assert reason_of(pack(np.zeros(8, np.uint8)), tight) == "limit_exceeded"  # the ext is bounded too
    assert unpack(pack({"a": [1, 2, 3], "b": "abcd"}), tight) == {"a": [1, 2, 3], "b": "abcd"}


def test_declared_huge_lengths_do_not_allocate() -> None:
    assert reason_of(b"\xdd\xff\xff\xff\xff") in ("limit_exceeded", "truncated")  # array of 2**32-1
    assert reason_of(b"\xdb\xff\xff\xff\xff") in ("limit_exceeded", "truncated")  # str of 2**32-1 bytes


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "truncated"),
        (b"\x93\x01", "truncated"),
        (b"\x01\x02", "extra_data"),
        (b"\xc1", "bad_format"),
        (b"\x91" * 5000 + b"\x01", "too_deep"),
        (b"\xa2\xff\xfe", "bad_utf8"),
        (b"\x81\x01\x02", "bad_map_key"),
        (b"\x81\xc0\x02", "bad_map_key"),
    ],
)
def test_malformed_msgpack(data: bytes, reason: str) -> None:
    assert reason_of(data) == reason


def test_non_bytes_input() -> None:
    assert reason_of(12345) == "bad_input"
    assert reason_of("a str") == "bad_input"


def test_codec_error_is_a_value_error_with_reason() -> None:
    with pytest.raises(ValueError, match="extra_data"):
        unpack(b"\x01\x02")


@pytest.mark.parametrize("key", ["max_bytes", "max_str_len", "max_bin_len", "max_array_len", "max_map_len"])
def test_limits_validation_names_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key} = 0"):
        CodecLimits(**{key: 0})


# ---------------------------------------------------------------- fuzz


def only_codec_errors(data: bytes) -> None:
    try:
        unpack(data, CodecLimits(max_bytes=1 << 16, max_array_len=1000, max_map_len=1000))
    except CodecError as e:
        assert e.reason in CODEC_REASONS


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_codec_error(data: bytes) -> None:
    only_codec_errors(data)


@settings(FUZZ, max_examples=80)
@given(values, arrays)
def test_every_truncation_raises_codec_error(value: object, array: np.ndarray) -> None:
    data = pack({"value": value, "array": array})
    for cut in range(len(data)):
        with pytest.raises(CodecError):
            unpack(data[:cut])


@FUZZ
@given(arrays, st.data())
def test_corrupted_messages_only_raise_codec_error(array: np.ndarray, draw: st.DataObject) -> None:
    data = bytearray(pack({"array": array, "seq": 7, "name": "cam"}))
    for _ in range(draw.draw(st.integers(1, 4))):
        data[draw.draw(st.integers(0, len(data) - 1))] = draw.draw(st.integers(0, 255))
    only_codec_errors(bytes(data))
