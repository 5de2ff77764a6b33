"""openpi's messages: msgpack-numpy maps decoded by our codec (limits, dtype allow-list, byte counts), observations
mapped to cameras, state and instruction with errors that name the key, replies in openpi's array format, the
[openpi] launch section; the server refuses clients past max_clients."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from vla_node.bench.node import free_tcp_port
from vla_node.validate import ConfigError
from vla_node.wire.codec import CodecError, pack_numpy_maps, unpack_numpy_maps
from vla_node.wire.openpi import ObservationError, OpenpiConfig, decode_observation, encode_reply

CONFIG = OpenpiConfig(listen="ws://127.0.0.1:8000")
CAMERAS = {"front": (480, 640)}


def nd(data: bytes, dtype: str, shape: list) -> dict:
    """An array as openpi's msgpack_numpy.pack_array writes it."""
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def decode(obs: dict, **kwargs):
    return decode_observation(msgpack.packb(obs, use_bin_type=True), kwargs.pop("config", CONFIG), CAMERAS, 4, 23,
                              CONFIG.codec_limits)


def test_arrays_round_trip_in_openpis_map_format():
    value = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((2, 2, 3), np.uint8), "n": 3}
    out = unpack_numpy_maps(pack_numpy_maps(value))
    assert out["a"].dtype == np.float32 and out["a"].shape == (2, 3) and (out["a"] == value["a"]).all()
    assert out["b"].dtype == np.uint8 and out["n"] == 3
    raw = msgpack.unpackb(pack_numpy_maps({"a": value["a"]}), strict_map_key=False)  # what openpi's decoder reads
    assert raw["a"][b"__ndarray__"] is True and raw["a"][b"dtype"] == "<f4" and raw["a"][b"shape"] == [2, 3]
    scalar = msgpack.packb({b"__npgeneric__": True, b"data": 2.5, b"dtype": "<f4"}, use_bin_type=True)
    assert unpack_numpy_maps(scalar) == np.float32(2.5) and isinstance(unpack_numpy_maps(scalar), np.float32)


@pytest.mark.parametrize("bad, reason", [
    (nd(b"\0" * 8, "|O", [1]), "bad_dtype"),  # an object array: their decoder would build it
    (nd(b"\0" * 8, ">f4", [2]), "bad_dtype"),
    (nd(b"\0" * 7, "<f4", [2]), "bad_ndarray"),  # byte count unlike the shape
    (nd(b"\0" * 8, "<f4", [-2]), "bad_ndarray"),
    (nd(b"\0" * 8, "<f4", "2"), "bad_ndarray"),
    ({**nd(b"", "<f4", [0]), b"extra": 1}, "bad_ndarray"),
    ({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}, "bad_ndarray"),
    ({b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}, "bad_ndarray"),
])
def test_a_bad_array_map_is_refused_with_its_reason(bad, reason):
    with pytest.raises(CodecError) as info:
        unpack_numpy_maps(msgpack.packb({"x": bad}, use_bin_type=True))
    assert info.value.reason == reason, info.value


def test_limits_and_garbage():
    with pytest.raises(CodecError, match="too_large"):
        unpack_numpy_maps(b"\x00" * 2048, CONFIG.codec_limits.__class__(max_bytes=1024))
    with pytest.raises(CodecError, match="unknown_ext|limit_exceeded|bad_format"):
        unpack_numpy_maps(msgpack.packb(msgpack.ExtType(1, b"xx")))
    with pytest.raises(CodecError, match="bad_format|truncated"):
        unpack_numpy_maps(b"\xc1")


def test_an_observation_maps_to_cameras_state_and_instruction():
    image = np.arange(24 * 32 * 3, dtype=np.uint8).reshape(24, 32, 3)
    obs = decode({"observation/image": nd(image.tobytes(), "|u1", [24, 32, 3]), "prompt": "keep lane",
                  "observation/state": nd(np.ones(4, np.float32).tobytes(), "<f4", [4]), "extra": 1})
    assert (obs.images["front"] == image).all() and obs.prompt == "keep lane" and obs.ignored_keys == ("extra",)
    assert obs.state.dtype == np.float32 and obs.state.tolist() == [1, 1, 1, 1]
    chw = decode({"observation/image": nd(image.transpose(2, 0, 1).copy().tobytes(), "|u1", [3, 24, 32])})
    assert (chw.images["front"] == image).all() and chw.state is None and chw.prompt is None  # (3, H, W) accepted
    assert decode({"observation/image": nd(image.tobytes(), "|u1", [24, 32, 3]),
                   "observation/state": [0.0, 1, 2, 3]}).state.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("obs, match", [
    ({"prompt": "x"}, r"missing_key: observation keys \['prompt'\] lack \['observation/image'\]"),
    ({"observation/image": nd(b"\0" * 12, "<f4", [1, 1, 3])}, r"bad_image: observation/image: array <f4"),
    ({"observation/image": nd(b"\0" * 4, "|u1", [2, 2])}, "bad_image"),
    ({"observation/image": nd(b"\0" * 481 * 3, "|u1", [481, 1, 3])}, r"H <= 480"),
    ({"observation/image": nd(b"\0" * 3, "|u1", [1, 1, 3]), "observation/state": [1.0, 2.0]},
     r"bad_state: observation/state: .*4 finite numbers"),
    ({"observation/image": nd(b"\0" * 3, "|u1", [1, 1, 3]), "observation/state": [1.0, 2.0, float("nan"), 0.0]},
     "bad_state"),
    ({"observation/image": nd(b"\0" * 3, "|u1", [1, 1, 3]), "prompt": "x" * 24}, r"bad_prompt: .*23 UTF-8 bytes"),
    ({"observation/image": nd(b"\0" * 3, "|u1", [1, 1, 3]), "prompt": 5}, "bad_prompt"),
])
def test_a_bad_observation_names_the_key_and_what_was_expected(obs, match):
    with pytest.raises(ObservationError, match=match):
        decode(obs)


def test_not_a_map_or_not_binary():
    with pytest.raises(ObservationError, match="not_a_map"):
        decode_observation(msgpack.packb([1, 2]), CONFIG, CAMERAS, 4, 23, CONFIG.codec_limits)
    with pytest.raises(ObservationError, match="bad_msgpack: a text message"):
        decode_observation("hello", CONFIG, CAMERAS, 4, 23, CONFIG.codec_limits)
    with pytest.raises(ObservationError, match="bad_msgpack: observation: bad_dtype"):
        decode({"observation/image": nd(b"", "|O", [0])})


def test_a_reply_carries_the_chunk_or_the_fallback_action_repeated():
    action = {"status": "fresh", "level": 0, "frame_seq": 3, "frame_stamp_ns": 5, "stamp_ns": 6, "timing_ms": {},
              "chunk": [[0.1, 0.2], [0.3, 0.4]], "action": [0.1, 0.2]}
    out = unpack_numpy_maps(encode_reply(action, "own_frame", 2, 2, 1.5))
    assert out["actions"].dtype == np.float32 and out["actions"].shape == (2, 2) and out["source"] == "own_frame"
    fallback = unpack_numpy_maps(encode_reply({**action, "status": "fallback", "chunk": []}, "timeout", 2, 2, 1.5))
    assert np.allclose(fallback["actions"], [[0.1, 0.2], [0.1, 0.2]]) and fallback["status"] == "fallback"


@pytest.mark.parametrize("table, match", [
    ({"listen": "ws://0.0.0.0:8000"}, "loopback"),
    ({"listen": "http://127.0.0.1:8000"}, "ws://HOST:PORT"),
    ({"listen": "ws://127.0.0.1:0"}, "port in"),
    ({"images": []}, "one or more"),
    ({"images": [["a", "front"], ["a", "front"]]}, "distinct keys"),
    ({"reply_timeout_ms": 0}, "reply_timeout_ms"),
])
def test_the_openpi_section_is_checked(table, match):
    from vla_node.validate import from_dict
    with pytest.raises(ConfigError, match=match):
        from_dict(OpenpiConfig, table, "openpi")


def test_the_launch_file_names_known_cameras():
    from vla_node.config import NodeConfig
    from vla_node.validate import from_dict
    with pytest.raises(ConfigError, match=r"openpi.images .*unknown: \['wrist'\]"):
        from_dict(NodeConfig, {"openpi": {"listen": "ws://127.0.0.1:8000", "images": [["observation/image", "wrist"]]},
                               "model": {"preset": "tiny"}})
    assert from_dict(OpenpiConfig, {"listen": "ws://[::1]:8000"}).host_port() == ("::1", 8000)
    assert from_dict(OpenpiConfig, {"listen": "ws://10.0.0.2:8000", "allow_non_loopback": True}).listen


def test_the_server_refuses_clients_past_max_clients():
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from helpers.node_harness import private_addresses
    from vla_node.wire.openpi_server import TRY_AGAIN_LATER, OpenpiModel, OpenpiServer
    port = free_tcp_port()
    server = OpenpiServer(OpenpiConfig(listen=f"ws://127.0.0.1:{port}", max_clients=1), private_addresses(),
                          OpenpiModel({"front": (480, 640)}, 4, 2, 4, 23, 50.0))
    try:
        with connect(f"ws://127.0.0.1:{port}", compression=None) as first:
            meta = unpack_numpy_maps(first.recv(timeout=5))
            assert meta["action_horizon"] == 4 and meta["images"] == {"observation/image": "front"}
            with connect(f"ws://127.0.0.1:{port}", compression=None) as second:
                with pytest.raises(ConnectionClosed) as info:
                    second.recv(timeout=5)
                assert info.value.rcvd.code == TRY_AGAIN_LATER and "max_clients" in info.value.rcvd.reason
            first.send("not binary")  # a text message: the error text back, and the connection stays
            assert "bad_msgpack" in first.recv(timeout=5)
        assert server.figures()["refused"] == 1 and server.figures()["errors"] == {"bad_msgpack": 1}
    finally:
        server.close()
