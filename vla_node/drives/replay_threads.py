"""The replay's two helper threads: Receiver (every action and health message from the node, stamped at
arrival) and Prefetch (drive items decoded ahead of the sender)."""

from __future__ import annotations

import heapq
import queue
import threading
import time
from typing import Any, Iterator, Mapping

import zmq

from vla_node.drives.open import DriveFrame, DriveMessage, DriveReader
from vla_node.report.report import ActionRecord
from vla_node.wire.protocol import ProtocolError, decode_action, decode_health
from vla_node.wire.transport import Client

PREFETCH_DEPTH = 8  # drive items decoded ahead of the sender


# ---- receiving -----------------------------------------------------------------------------------------


def action_record(msg: Mapping[str, Any], recv_ns: int) -> ActionRecord:
    return ActionRecord(
        recv_ns=recv_ns, stamp_ns=msg["stamp_ns"], seq=msg["seq"], status=msg["status"], level=msg["level"],
        frame_seq=msg["frame_seq"], frame_stamp_ns=msg["frame_stamp_ns"], timing_ms=msg["timing_ms"],
        tokens_refreshed=msg.get("tokens_refreshed"), reuse_ratio=msg.get("reuse_ratio"),
        kv_bytes=msg.get("kv_bytes"), action=tuple(msg["action"]),
        chunk=tuple(tuple(row) for row in msg["chunk"]) if msg["chunk"] else None, step=msg.get("step"),
        denoising_steps=msg.get("denoising_steps"),
    )


class Receiver(threading.Thread):
    """Collects every action and health message from the client's SUBs, stamped at arrival. Malformed
    messages are counted (first reason kept); any other failure stops the thread and is re-raised by check()."""

    def __init__(self, client: Client) -> None:
        super().__init__(name="vla-replay-receiver", daemon=True)
        self.client = client
        self.actions: list[ActionRecord] = []
        self.health: dict | None = None
        self.health_count = 0
        self.last_health_ns = 0  # arrival of the newest health message
        self.rejected = 0
        self.first_reject: str | None = None
        self.error: BaseException | None = None
        self._answered_stamp = -1  # newest frame_stamp_ns an action named
        self._cond = threading.Condition()
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # re-raised in the sender's thread by check()
            self.error = e
        finally:
            with self._cond:
                self._cond.notify_all()

    def _loop(self) -> None:
        actions_sub, health_sub = self.client.actions_sub, self.client.health_sub
        limits = self.client.limits
        poller = zmq.Poller()
        poller.register(actions_sub, zmq.POLLIN)
        poller.register(health_sub, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(20):
                continue
            while True:
                try:
                    parts = actions_sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                recv_ns = time.monotonic_ns()
                try:
                    record = action_record(decode_action(parts, limits), recv_ns)
                except (ProtocolError, ValueError) as e:  # a malformed action: counted, reported
                    self._reject(f"action: {e}")
                    continue
                self.actions.append(record)
                if record.frame_stamp_ns is not None and record.frame_stamp_ns > self._answered_stamp:
                    with self._cond:
                        self._answered_stamp = record.frame_stamp_ns
                        self._cond.notify_all()
            while True:
                try:
                    parts = health_sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                recv_ns = time.monotonic_ns()
                try:
                    msg = decode_health(parts, limits)
                except ProtocolError as e:
                    self._reject(f"health: {e}")
                    continue
                with self._cond:
                    self.health, self.last_health_ns = msg, recv_ns
                    self.health_count += 1
                    self._cond.notify_all()

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.first_reject is None:
            self.first_reject = reason

    def wait_answered(self, frame_stamp_ns: int, timeout_s: float) -> bool:
        """Wait until an action names a frame stamped frame_stamp_ns or later."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._answered_stamp >= frame_stamp_ns or self.error is not None, timeout_s)

    def wait_health_after(self, t_ns: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.last_health_ns > t_ns or self.error is not None, timeout_s)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)


# ---- reading the drive ahead of the sender -------------------------------------------------------------

_END = object()


class Prefetch(threading.Thread):
    """Decodes drive items (frames of the mapped cameras and commands, merged in time order) `loops` times into
    a small queue; an exception while reading is handed to the consumer."""

    def __init__(self, drive: DriveReader, commands: list[DriveMessage], cameras: Mapping[str, str],
                 loops: int) -> None:
        super().__init__(name="vla-replay-reader", daemon=True)
        self.drive, self.commands, self.cameras, self.loops = drive, commands, cameras, loops
        self.items: queue.Queue = queue.Queue(PREFETCH_DEPTH)
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            for loop in range(self.loops):
                frames = (f for f in self.drive.frames() if f.camera in self.cameras)
                # commands first at equal stamps: an instruction recorded with a frame applies to it
                for item in heapq.merge(self.commands, frames, key=lambda m: m.stamp_ns):
                    if not self._put((loop, item)):
                        return
        except BaseException as e:  # handed to the sender, which re-raises it
            self._put(e)
            return
        self._put(_END)

    def _put(self, item: object) -> bool:
        while not self._stopping.is_set():
            try:
                self.items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, DriveFrame | DriveMessage]]:
        while True:
            item = self.items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)

