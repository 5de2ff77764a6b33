"""openpi's websocket policy protocol, the messages: observations in (msgpack with openpi's msgpack-numpy arrays,
decoded by our codec), replies out (a map with `actions`, H x D float32). The server is wire/openpi_server.py.

openpi's protocol (openpi-client's WebsocketClientPolicy): on connect the server sends its metadata (a map); then
each binary message the client sends is an observation, answered by one binary message (a map with `actions`), or
by a text message, which the client raises as an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from vla_node.validate import is_number, require, show
from vla_node.wire.codec import CodecError, CodecLimits, pack_numpy_maps, unpack_numpy_maps
from vla_node.wire.transport import is_loopback_host

OBSERVATION_REASONS = ("bad_msgpack", "not_a_map", "missing_key", "bad_image", "bad_state", "bad_prompt")


class ObservationError(ValueError):
    """An observation the node cannot use; `reason` is one of OBSERVATION_REASONS, the message says what and why."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in OBSERVATION_REASONS, reason
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class OpenpiConfig:
    """A launch file's [openpi]: where openpi's websocket protocol is served (off unless `listen` is set) and which
    observation keys feed which camera, the state and the instruction (openpi's LIBERO example by default)."""

    listen: str | None = None  # "ws://127.0.0.1:8000"
    allow_non_loopback: bool = False
    images: tuple[tuple[str, str], ...] = (("observation/image", "front"),)  # [observation key, camera name] pairs
    state: str | None = "observation/state"  # None: no state from the observations
    prompt: str | None = "prompt"  # None: no instruction from the observations
    reply_timeout_ms: float = 1000.0  # waiting for the observation's own fresh action; then the scheduler's answer
    max_clients: int = 16  # connections beyond this are refused (close code 1013, try again later)
    max_message_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.listen is not None:
            host, port = self.host_port()
            require(self.allow_non_loopback or is_loopback_host(host), "openpi.listen", self.listen,
                    "a loopback address (ws://127.0.0.1:PORT, ws://localhost:PORT, ws://[::1]:PORT); set "
                    "openpi.allow_non_loopback = true to serve beyond this host")
        require(type(self.allow_non_loopback) is bool, "openpi.allow_non_loopback", self.allow_non_loopback,
                "true or false")
        keys = [key for key, _ in self.images]
        require(len(keys) >= 1 and len(set(keys)) == len(keys) and all(isinstance(k, str) and k for k in keys),
                "openpi.images", self.images, "one or more [observation key, camera] pairs with distinct keys")
        for key in ("state", "prompt"):
            value = getattr(self, key)
            require(value is None or (isinstance(value, str) and value != ""), f"openpi.{key}", value,
                    "an observation key or unset")
        require(is_number(self.reply_timeout_ms) and 0 < self.reply_timeout_ms <= 60_000, "openpi.reply_timeout_ms",
                self.reply_timeout_ms, "a number of ms in (0, 60000]")
        require(type(self.max_clients) is int and 1 <= self.max_clients <= 1024, "openpi.max_clients",
                self.max_clients, "an integer in [1, 1024]")
        require(type(self.max_message_bytes) is int and self.max_message_bytes >= 1024, "openpi.max_message_bytes",
                self.max_message_bytes, "an integer >= 1024")

    @property
    def codec_limits(self) -> CodecLimits:
        """An observation's bounds: the message size, then small maps (observation keys) and lists (states)."""
        n = self.max_message_bytes
        return CodecLimits(max_bytes=n, max_str_len=64 * 1024, max_bin_len=n, max_array_len=4096, max_map_len=256)

    def host_port(self) -> tuple[str, int]:
        """listen's host and port: 'ws://127.0.0.1:8000' -> ('127.0.0.1', 8000)."""
        scheme, sep, rest = str(self.listen).partition("://")
        host, colon, port = rest.rpartition(":")
        require(scheme == "ws" and sep and colon and host and port.isdigit() and 1 <= int(port) <= 65535,
                "openpi.listen", self.listen, "ws://HOST:PORT with a port in [1, 65535] (e.g. 'ws://127.0.0.1:8000')")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Observation:
    images: dict[str, np.ndarray]  # camera -> (H, W, 3) uint8, C-ordered
    state: np.ndarray | None  # (state_dim,) float32
    prompt: str | None
    ignored_keys: tuple[str, ...]  # observation keys the mapping does not name


def _image(value: Any, key: str, max_hw: tuple[int, int]) -> np.ndarray:
    """openpi's images: uint8 (H, W, 3), or (3, H, W) as openpi's ALOHA examples send them."""
    if not (isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3):
        raise ObservationError("bad_image", f"{key}: {_describe(value)}: expected a uint8 array (H, W, 3) or (3, H, W)")
    if value.shape[-1] != 3 and value.shape[0] == 3:
        value = value.transpose(1, 2, 0)  # (3, H, W) -> (H, W, 3)
    h, w, c = value.shape
    if c != 3 or not (1 <= h <= max_hw[0] and 1 <= w <= max_hw[1]):
        raise ObservationError("bad_image", f"{key}: shape {value.shape}: expected (H, W, 3) with H <= {max_hw[0]} and "
                                         f"W <= {max_hw[1]} (the camera's max_height, max_width)")
    return np.ascontiguousarray(value)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array {value.dtype.str} {tuple(value.shape)}"
    return f"{type(value).__name__} {show(value)}"


def decode_observation(data: Any, config: OpenpiConfig, camera_sizes: Mapping[str, tuple[int, int]],
                       state_dim: int, max_prompt_bytes: int, limits: CodecLimits) -> Observation:
    """One observation message -> Observation; a bad one raises ObservationError naming the key and what was expected.
    camera_sizes: camera -> (max_height, max_width)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ObservationError("bad_msgpack", f"a text message ({show(data)}): expected a binary msgpack observation")
    try:
        obs = unpack_numpy_maps(data, limits)
    except CodecError as e:
        raise ObservationError("bad_msgpack", f"observation: {e}") from None
    if not isinstance(obs, dict):
        raise ObservationError("not_a_map", f"observation is {_describe(obs)}: expected a map of observation keys")
    missing = [key for key, _ in config.images if key not in obs]
    if missing:
        raise ObservationError("missing_key", f"observation keys {sorted(map(str, obs))} lack {missing} (the launch "
                                           f"file's openpi.images: {[list(p) for p in config.images]})")
    images = {camera: _image(obs[key], key, camera_sizes[camera]) for key, camera in config.images}
    state = None
    if config.state is not None and config.state in obs:
        value = obs[config.state]
        array = np.asarray(value, dtype=np.float32) if isinstance(value, (list, np.ndarray)) else None
        if array is None or array.shape != (state_dim,) or not np.isfinite(array).all():
            raise ObservationError("bad_state", f"{config.state}: {_describe(value)}: expected {state_dim} finite numbers "
                                             "(the model's state_dim)")
        state = array
    prompt = None
    if config.prompt is not None and config.prompt in obs:
        prompt = obs[config.prompt]
        if not isinstance(prompt, str) or len(prompt.encode()) > max_prompt_bytes:
            raise ObservationError("bad_prompt", f"{config.prompt}: {_describe(prompt)}: expected a string of at most "
                                              f"{max_prompt_bytes} UTF-8 bytes")
    named = {key for key, _ in config.images} | {config.state, config.prompt}
    ignored = tuple(sorted(str(k) for k in obs if k not in named))
    return Observation(images, state, prompt, ignored)


def encode_reply(action: Mapping[str, Any], source: str, horizon: int, dim: int, infer_ms: float) -> bytes:
    """A decoded node action message -> openpi's reply: `actions` (H, D) float32 (the chunk; a fallback tick has
    none, so its action repeated), with the node's status, frame, level and timings beside it; `source` says whether
    the actions came from this observation's frame (openpi_server.REPLY_SOURCES)."""
    chunk = action["chunk"] or [action["action"]] * horizon
    actions = np.asarray(chunk, dtype=np.float32).reshape(horizon, dim)  # (H, D)
    return pack_numpy_maps({
        "actions": actions, "source": source, "status": action["status"], "level": action["level"],
        "frame_seq": action["frame_seq"], "frame_stamp_ns": action["frame_stamp_ns"], "stamp_ns": action["stamp_ns"],
        "timing_ms": action["timing_ms"], "server_timing": {"infer_ms": round(infer_ms, 3)},
    })


def encode_metadata(config: OpenpiConfig, horizon: int, dim: int, state_dim: int, control_hz: float) -> bytes:
    """What the server sends first on each connection (openpi's `get_server_metadata()`)."""
    return pack_numpy_maps({
        "server": "vla-node", "action_horizon": horizon, "action_dim": dim, "state_dim": state_dim,
        "control_hz": control_hz, "images": dict(config.images), "state": config.state, "prompt": config.prompt,
    })
