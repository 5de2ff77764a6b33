"""The link between the node's worker process and its publisher process: length-prefixed msgpack messages over a
private Unix socket pair (inherited by the publisher at spawn; no address another process could connect to).

    worker -> publisher   hello {spec}, start {static health}, offer {chunk + its frame's figures},
                          withdraw {level}, status {figures, stamp_ns}, stop {reason}
    publisher -> worker   ready, or error {message} (binding its sockets failed)

`PublisherLink` is the worker's side: it spawns `python -m vla_node.node.publisher`, and offers chunks, withdraws
them and posts figures as the in-process ChunkBroker took them, so the pipeline does not know which it talks to.
"""

from __future__ import annotations

import logging
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Mapping

import numpy as np

from vla_node.wire.codec import CodecLimits, pack, unpack

log = logging.getLogger(__name__)

HEADER = struct.Struct("<I")  # message length in bytes
MAX_MESSAGE_BYTES = 1 << 20  # a status or hello message is a few kB
LINK_LIMITS = CodecLimits(max_bytes=MAX_MESSAGE_BYTES)
READY_TIMEOUT_S = 60.0  # spawn + imports + socket binds (a cold disk on a small board is slow)
STOP_TIMEOUT_S = 5.0


class LinkClosed(ConnectionError):
    """The other side of the link closed it (its process exited)."""


def encode(message: Mapping[str, Any]) -> bytes:
    """One message: its length, then its msgpack map."""
    body = pack(message)
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"link message {message.get('t')!r} of {len(body)} bytes: expected at most "
                         f"{MAX_MESSAGE_BYTES}")
    return HEADER.pack(len(body)) + body


class MessageReader:
    """Whole messages out of a byte stream fed in pieces; a partial one waits for its remainder."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        """The messages `data` completes; b"" (end of stream) raises LinkClosed."""
        if not data:
            raise LinkClosed("the link's other end closed it")
        self.buffer += data
        messages = []
        while len(self.buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buffer)
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"link message of {size} bytes: expected at most {MAX_MESSAGE_BYTES}")
            if len(self.buffer) < HEADER.size + size:
                break
            messages.append(unpack(bytes(self.buffer[HEADER.size:HEADER.size + size]), LINK_LIMITS))
            del self.buffer[:HEADER.size + size]
        return messages


class PublisherLink:
    """The worker's side: the publisher process, spawned and bound (its action and health sockets open) when
    constructed; `start` begins its ticks. `hello` is the publisher's spec (node/publisher.py PublisherSpec)."""

    def __init__(self, hello: Mapping[str, Any], ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "vla_node.node.publisher", str(child.fileno())],
                                         pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        try:
            self._send({"t": "hello", **hello})
            reply = self._wait_reply(ready_timeout_s)
        except BaseException:
            self.close()
            raise
        if reply.get("t") != "ready":
            self.close()
            raise OSError(f"the publisher process could not start: {reply.get('message', reply)}")

    def _send(self, message: Mapping[str, Any]) -> None:
        try:
            self.sock.sendall(encode(message))
        except OSError as e:  # BrokenPipe, ConnectionReset: the publisher is gone
            raise RuntimeError(f"the publisher process is gone ({self._exit_text()}): {e}") from None

    def _wait_reply(self, timeout_s: float) -> dict:
        reader, end = MessageReader(), time.monotonic() + timeout_s
        try:
            while True:
                self.sock.settimeout(max(0.001, end - time.monotonic()))
                try:
                    messages = reader.feed(self.sock.recv(1 << 16))
                except TimeoutError:
                    raise RuntimeError(f"the publisher process was not ready within {timeout_s:g} s") from None
                except LinkClosed:
                    self.proc.wait(5)
                    raise RuntimeError(f"the publisher process exited before it was ready "
                                       f"({self._exit_text()})") from None
                if messages:
                    return messages[0]
        finally:
            self.sock.settimeout(None)

    def _exit_text(self) -> str:
        code = self.proc.poll()
        return "still running" if code is None else f"exit code {code}"

    # --- as the pipeline's broker ---------------------------------------------------------------------------
    def offer(self, chunk: np.ndarray, frame_seq: int, frame_stamp_ns: int, produced_ns: int, level: int,
              timing_ms: Mapping[str, float] | None = None, deadline_ns: int | None = None,
              tokens_refreshed: int | None = None, reuse_ratio: float | None = None,
              origin_ns: int | None = None, denoising_steps: int | None = None) -> bool:
        """ChunkBroker.offer, in the publisher process (it checks the shape and finiteness and counts rejects)."""
        self._send({"t": "offer", "chunk": np.ascontiguousarray(chunk, np.float32), "frame_seq": frame_seq,
                    "frame_stamp_ns": frame_stamp_ns, "produced_ns": produced_ns, "level": level,
                    "timing_ms": None if timing_ms is None else {str(k): float(v) for k, v in timing_ms.items()},
                    "deadline_ns": deadline_ns, "tokens_refreshed": tokens_refreshed, "reuse_ratio": reuse_ratio,
                    "origin_ns": origin_ns, "denoising_steps": denoising_steps})
        return True

    def withdraw(self, level: int) -> None:
        self._send({"t": "withdraw", "level": level})

    def post_status(self, status: Mapping, stamp_ns: int) -> None:
        self._send({"t": "status", "status": status, "stamp_ns": stamp_ns})

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self, static_health: Mapping[str, Any]) -> None:
        """Begin the control ticks; `static_health` joins every health message (model, backend, ...)."""
        self._send({"t": "start", "static": dict(static_health)})

    def check(self) -> None:
        """Raise when the publisher process has exited: the node cannot publish without it."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the publisher process exited unexpectedly ({self._exit_text()})")

    def stop(self, reason: str, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Ask the publisher to publish its last health message (saying `reason`) and exit; its exit code."""
        try:
            if self.proc.poll() is None:
                self._send({"t": "stop", "reason": reason})
                self.proc.wait(timeout_s)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log.error("the publisher process did not stop cleanly (%s): killed", e)
        finally:
            self.close()
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
