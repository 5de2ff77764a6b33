"""openpi's websocket policy protocol served beside ZeroMQ: openpi's clients (openpi-client's WebsocketClientPolicy,
LeRobot's and vLLM-Omni's robot clients) drive the node unchanged.

One websocket thread per connection decodes observations (wire/openpi.py); one pump thread owns a ZeroMQ client
whose frame and command XPUBs the node's SUBs also connect to (NodeTransport's `also_from`), so an observation
enters the node exactly as a ZeroMQ client's frames do, and the node's loop knows nothing of websockets. The pump
sends each observation's frames, state and instruction, and answers it with the action made from its own frame
(matched by frame seq and stamp), or, after `reply_timeout_ms`, with the newest action the node published: the
scheduler's answer (its status says which: chunk, fallback, ...). The control tick runs in the node's publisher
process, which many clients here cannot stall.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import zmq

from vla_node.wire.openpi import (
    Observation,
    ObservationError,
    OpenpiConfig,
    decode_observation,
    encode_metadata,
    encode_reply,
)
from vla_node.wire.protocol import ProtocolError, decode_action
from vla_node.wire.transport import Client, TransportConfig

log = logging.getLogger(__name__)
PUMP_POLL_MS = 1  # the pump's wait for an action between request checks (actions arrive every control period)
TRY_AGAIN_LATER = 1013  # websocket close code: the server is at max_clients
# what a reply's actions come from: the action made from the observation's own frame; the newest action once the
# node took a newer frame (its own will never be processed); the newest action after openpi.reply_timeout_ms
REPLY_SOURCES = ("own_frame", "newer_frame", "timeout")


@dataclass(frozen=True)
class OpenpiModel:
    """What the server needs to know of the node's model and cameras."""

    cameras: Mapping[str, tuple[int, int]]  # camera -> (max_height, max_width)
    horizon: int
    dim: int
    state_dim: int
    max_prompt_bytes: int
    control_hz: float


@dataclass
class _Request:
    observation: Observation
    received_ns: int
    done: threading.Event = field(default_factory=threading.Event)
    key: tuple[int, int] | None = None  # (frame seq, frame stamp) once sent
    deadline_ns: int = 0
    action: dict | None = None  # the reply's action message, set by the pump
    source: str = ""  # one of REPLY_SOURCES


class OpenpiServer:
    """Serves openpi's protocol at config.listen; `inputs` are the addresses the node's SUBs must also connect to.
    Counters (`figures()`) go into the node's health under `openpi`."""

    def __init__(self, config: OpenpiConfig, node_transport: TransportConfig, model: OpenpiModel) -> None:
        from websockets.sync.server import serve  # imported only where the endpoint is configured

        self.config, self.model, self.limits = config, model, config.codec_limits
        tag = f"vla-openpi-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.inputs = (f"ipc://@{tag}-frames", f"ipc://@{tag}-commands")
        self._client_config = replace(node_transport, frames=self.inputs[0], commands=self.inputs[1])
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.error: Exception | None = None  # what stopped the pump
        self._lock = threading.Lock()  # the counters below, written by the connection threads and the pump
        self.clients = 0
        self.connections = 0
        self.refused = 0
        self.observations = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.ignored_keys: collections.Counter[str] = collections.Counter()
        self.replies: collections.Counter[str] = collections.Counter()
        self.answered: collections.Counter[str] = collections.Counter()  # REPLY_SOURCES
        self._client = Client(self._client_config)  # binds the inputs now: the node connects to them at its start
        host, port = config.host_port()
        try:
            self._server = serve(self._serve_connection, host, port, compression=None,
                                 max_size=config.max_message_bytes)
        except OSError as e:
            self._client.close()
            raise OSError(f"openpi.listen = {config.listen!r}: cannot listen there: {e}") from e
        self._pump_thread = threading.Thread(target=self._pump, name="openpi-pump", daemon=True)
        self._server_thread = threading.Thread(target=self._server.serve_forever, name="openpi-server", daemon=True)
        self._pump_thread.start()
        self._server_thread.start()
        log.info("openpi protocol at %s (observation keys: images %s, state %r, prompt %r)", config.listen,
                 dict(config.images), config.state, config.prompt)

    # --- the connections (one thread each) ------------------------------------------------------------------
    def _serve_connection(self, ws: Any) -> None:
        with self._lock:
            full = self.clients >= self.config.max_clients
            self.refused += full
            if not full:
                self.clients += 1
                self.connections += 1
        if full:
            ws.close(TRY_AGAIN_LATER, f"at most {self.config.max_clients} clients (openpi.max_clients)")
            return
        from websockets.exceptions import ConnectionClosed

        m = self.model
        try:
            ws.send(encode_metadata(self.config, m.horizon, m.dim, m.state_dim, m.control_hz))
            for message in ws:
                ws.send(self._answer(message))
        except ConnectionClosed:
            pass  # the client went away
        except Exception as e:  # a bug: logged with its traceback; the other connections and the node go on
            log.exception("openpi connection: %s", e)
        finally:
            with self._lock:
                self.clients -= 1

    def _answer(self, message: Any) -> bytes | str:
        """One observation -> the reply (bytes), or an error text (openpi's clients raise it; the connection stays)."""
        received = time.monotonic_ns()
        m = self.model
        try:
            observation = decode_observation(message, self.config, m.cameras, m.state_dim, m.max_prompt_bytes,
                                             self.limits)
        except ObservationError as e:
            with self._lock:
                self.errors[e.reason] += 1
            return f"vla-node: bad observation: {e}"
        with self._lock:
            self.observations += 1
            self.ignored_keys.update(observation.ignored_keys)
        request = _Request(observation, received)
        self._requests.put(request)
        if not request.done.wait(self.config.reply_timeout_ms / 1000 + 5.0) or request.action is None:
            with self._lock:
                self.errors["no_action"] += 1
            return "vla-node: no action from the node (is it running?)"
        return encode_reply(request.action, request.source, m.horizon, m.dim, (time.monotonic_ns() - received) / 1e6)

    # --- the pump: the only thread that touches the ZeroMQ client ---------------------------------------------
    def _pump(self) -> None:
        client, pending = self._client, {}
        latest: dict | None = None
        prompt: str | None = None
        seq = 0
        timeout_ns = int(self.config.reply_timeout_ms * 1e6)
        try:
            while not self._stop.is_set():
                while True:  # the new observations in: frames, then state and instruction
                    try:
                        request = self._requests.get_nowait()
                    except queue.Empty:
                        break
                    seq += 1
                    now = time.monotonic_ns()
                    obs = request.observation
                    if obs.prompt is not None and obs.prompt != prompt:
                        client.send_instruction(seq, now, obs.prompt)
                        prompt = obs.prompt
                    if obs.state is not None:
                        client.send_state(seq, now, obs.state)
                    for camera, image in obs.images.items():
                        client.send_frame(camera, seq, now, image)
                    request.key, request.deadline_ns = (seq, now), now + timeout_ns
                    pending[request.key] = request
                if client.actions_sub.poll(PUMP_POLL_MS):
                    while True:
                        try:
                            parts = client.actions_sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            latest = decode_action(parts)
                        except ProtocolError:
                            continue
                        request = pending.pop((latest["frame_seq"], latest["frame_stamp_ns"]), None)
                        if request is not None:
                            self._reply(request, latest, "own_frame")
                        # the node went past these frames (it takes the newest): they will never have an action
                        for key in [k for k in pending if k[1] < latest["frame_stamp_ns"]]:
                            self._reply(pending.pop(key), latest, "newer_frame")
                if pending and latest is not None:
                    now = time.monotonic_ns()
                    for key in [k for k, r in pending.items() if now >= r.deadline_ns]:
                        self._reply(pending.pop(key), latest, "timeout")
        except Exception as e:  # raised in the node's loop by check(): the node exits non-zero
            self.error = e
        finally:
            for request in pending.values():
                request.done.set()  # action None: the connection answers with an error

    def _reply(self, request: _Request, action: dict, source: str) -> None:
        request.action, request.source = action, source
        with self._lock:
            self.replies[action["status"]] += 1
            self.answered[source] += 1
        request.done.set()

    # --- figures and lifecycle -------------------------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        """For the node's health: connections, observations, replies by status, errors by reason, ignored keys."""
        with self._lock:
            return {"listen": self.config.listen, "clients": self.clients, "connections": self.connections,
                    "refused": self.refused, "observations": self.observations, "replies": dict(self.replies),
                    "answered": dict(self.answered), "errors": dict(self.errors),
                    "ignored_keys": dict(self.ignored_keys)}

    def check(self) -> None:
        """Raise what stopped the pump (called by the node's loop, which then exits non-zero)."""
        if self.error is not None:
            raise RuntimeError(f"the openpi endpoint's pump stopped: {type(self.error).__name__}: {self.error}")

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server_thread.join(5.0)
        self._pump_thread.join(5.0)
        self._client.close()
