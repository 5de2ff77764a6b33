"""`vla-node bench soak`'s client: each camera published on its own schedule, the state at STATE_HZ, every action
and health message read, in one poll loop (no thread: nothing competes for the GIL with it).

Frames are pre-rendered synthetic road frames at each camera's size, played forward then back (no scene cut), sent
with send_multipart(copy=False) (the payload is a view of the pre-rendered array). The frame and command XPUBs set
XPUB_NODROP, so a send the node's queues cannot take raises EAGAIN and is counted as unsent instead of being lost
silently. A camera whose send came late by a period or more skips to its latest due send (as a camera would), and the
skipped sends are counted as late: the client falling behind shows, and never bursts.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from vla_node.bench.soak_figures import SoakCamera
from vla_node.wire.protocol import decode_action, decode_health, encode_frame, encode_jpeg, encode_state
from vla_node.wire.transport import Client

STATE_HZ = 10.0
SETTLE_S = 15.0  # how long settle() waits for the node's counters to stop changing
FRAMES_PER_CAMERA = 30  # rendered; played forward then back (58 distinct steps)
STATUS = {"fresh": 0, "chunk": 1, "fallback": 2}


def camera_frames(camera: SoakCamera, encoding: str, count: int = FRAMES_PER_CAMERA) -> list[Any]:
    """Synthetic road frames at the camera's size (HxWx3 uint8, or JPEG bytes), forward then back."""
    from vla_node.drives.synthetic import SyntheticDrive, SyntheticDriveConfig

    drive = SyntheticDrive(SyntheticDriveConfig(width=camera.width, height=camera.height, fps=camera.fps,
                                                seconds=count / camera.fps, seed=0))
    cut = drive.scene_cut_indices[0] if drive.scene_cut_indices else count
    frames: list[Any] = [drive.render(i) for i in range(min(count, cut))]
    if encoding == "jpeg":
        frames = [encode_jpeg(f) for f in frames]
    return frames + frames[-2:0:-1]


class _Camera:
    def __init__(self, camera: SoakCamera, frames: list[Any], encoding: str, start_ns: int) -> None:
        self.camera, self.frames, self.encoding = camera, frames, encoding
        self.period = 1e9 / camera.fps
        self.start_ns, self.k = start_ns, 0  # send k is due at start + k x period
        self.seq = self.sent = self.unsent = self.late = 0

    def due_ns(self) -> int:
        return self.start_ns + int(self.k * self.period)

    def send(self, sock: zmq.Socket, now_ns: int) -> None:
        frame = self.frames[self.seq % len(self.frames)]
        size = {"height": self.camera.height, "width": self.camera.width} if self.encoding == "jpeg" else {}
        parts = encode_frame(self.camera.name, self.seq, time.monotonic_ns(), frame, self.encoding, **size)
        try:
            sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
            self.sent += 1
        except zmq.Again:
            self.unsent += 1
        self.seq += 1
        latest = int((now_ns - self.start_ns) // self.period)
        self.late += max(0, latest - self.k)
        self.k = max(self.k, latest) + 1

    def figures(self) -> dict[str, Any]:
        return {"spec": self.camera.spec, "sent": self.sent, "unsent": self.unsent, "late": self.late}


class SoakClient:
    """Run run(seconds) once: sends and reads; then settle() reads until the node's counters stop changing.
    Actions are kept in preallocated arrays (sized for `capacity` ticks), health messages as (arrival, map)."""

    def __init__(self, client: Client, cameras: Sequence[SoakCamera], frames: dict[str, list[Any]], encoding: str,
                 state_dim: int, capacity: int) -> None:
        self.client = client
        for sock in (client.frames_pub, client.commands_pub):
            sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full queue refuses the send (counted), never drops it
        self.cameras, self.frames, self.encoding = cameras, frames, encoding
        self.state_dim = state_dim
        self.stamp = np.zeros(capacity, np.int64)
        self.seq = np.zeros(capacity, np.int64)
        self.arrival = np.zeros(capacity, np.int64)
        self.status = np.zeros(capacity, np.int8)
        self.levels: Counter[int | str] = Counter()  # action level (an integer, or a name) -> ticks
        self.n = 0
        self.health: list[tuple[int, dict]] = []
        self.states_sent = self.states_unsent = 0
        self.cams: list[_Camera] = []
        self.start_ns = self.end_ns = 0
        self._poller = zmq.Poller()
        self._poller.register(client.actions_sub, zmq.POLLIN)
        self._poller.register(client.health_sub, zmq.POLLIN)

    def run(self, seconds: float, on_health: Callable[[int, dict], None] | None = None,
            watch: Callable[[], None] | None = None) -> None:
        """Send every camera at its rate and the state at STATE_HZ for `seconds`, reading all the while; watch (which
        may raise to abort) is called about once a second."""
        self.start_ns = start = time.monotonic_ns()
        self.end_ns = end = start + int(seconds * 1e9)
        self.cams = [_Camera(c, self.frames[c.name], self.encoding, start) for c in self.cameras]
        state_period, state_k = 1e9 / STATE_HZ, 0
        values = np.zeros(self.state_dim)
        frames_pub, commands_pub = self.client.frames_pub, self.client.commands_pub
        next_watch = start + 1_000_000_000
        while (now := time.monotonic_ns()) < end:
            if watch is not None and now >= next_watch:
                watch()
                next_watch = now + 1_000_000_000
            for cam in self.cams:
                if now >= cam.due_ns():
                    cam.send(frames_pub, now)
            if now >= start + int(state_k * state_period):
                values[0] = state_k % 100 / 10.0  # a slowly changing speed
                seq = self.states_sent + self.states_unsent  # consecutive: a gap the node counts is a refused send
                try:
                    commands_pub.send_multipart(encode_state(seq, time.monotonic_ns(), values), flags=zmq.NOBLOCK)
                    self.states_sent += 1
                except zmq.Again:
                    self.states_unsent += 1
                state_k = max(state_k + 1, int((now - start) // state_period) + 1)
            next_due = min(min(c.due_ns() for c in self.cams), start + int(state_k * state_period), end)
            self.read(max(0, next_due - time.monotonic_ns() + 999_999) // 1_000_000, on_health)  # ms, rounded up

    def read(self, timeout_ms: int, on_health: Callable[[int, dict], None] | None = None) -> None:
        """Wait up to timeout_ms, then read every queued action (kept while the run lasts) and health message."""
        ready = dict(self._poller.poll(timeout_ms))
        if self.client.actions_sub in ready:
            self._read_actions()
        if self.client.health_sub in ready:
            while True:
                try:
                    parts = self.client.health_sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                arrival, msg = time.monotonic_ns(), decode_health(parts)
                self.health.append((arrival, msg))
                if on_health is not None:
                    on_health(arrival, msg)

    def _read_actions(self) -> None:
        sock = self.client.actions_sub
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            arrival, msg = time.monotonic_ns(), decode_action(parts)
            i = self.n
            if msg["stamp_ns"] > self.end_ns or i == self.stamp.size:
                continue  # published after the run (read while settling), or beyond the capacity asked for
            self.stamp[i], self.seq[i], self.arrival[i] = msg["stamp_ns"], msg["seq"], arrival
            self.status[i] = STATUS[msg["status"]]
            self.levels[msg["level"]] += 1
            self.n = i + 1

    def settle(self, timeout_s: float = SETTLE_S) -> tuple[dict | None, bool]:
        """Read on after the run until two health messages carry distinct worker posts made after it with the same
        counters (the worker drained all it was sent). Returns (the last health message, settled)."""
        deadline = time.monotonic_ns() + int(timeout_s * 1e9)
        posts: list[tuple[int, Any]] = []  # (worker post time, counters) of posts after the run
        while time.monotonic_ns() < deadline:
            seen = len(self.health)
            self.read(100)
            for _, msg in self.health[seen:]:
                age = msg.get("worker_age_ms")
                post_ns = None if age is None else msg["stamp_ns"] - int(age * 1e6)
                if post_ns is None or post_ns <= self.end_ns or (posts and posts[-1][0] == post_ns):
                    continue
                cameras = {name: (c["received"], c["processed"], c["dropped"])
                           for name, c in msg.get("cameras", {}).items()}
                counters = (cameras, msg.get("rejects"), msg.get("commands"), msg.get("drops"))
                posts.append((post_ns, counters))
                if len(posts) >= 2 and posts[-1][1] == posts[-2][1]:
                    return msg, True
        return (self.health[-1][1] if self.health else None), False

    def figures(self) -> dict[str, Any]:
        return {"cameras": {c.camera.name: c.figures() for c in self.cams}, "states_sent": self.states_sent,
                "states_unsent": self.states_unsent, "actions_read": self.n, "health_read": len(self.health)}
