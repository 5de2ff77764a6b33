"""Ingest: raw multipart messages in, validated latest frame per camera and latest commands out.

No sockets here (the transport drains them); every message is validated, and every drop and reject is
counted with its reason. Latest frame wins: an older frame still unprocessed when a newer one arrives is
counted as dropped.

Stamps are the host's CLOCK_MONOTONIC (the wire protocol's clock for every stamp), so they order messages across
sender restarts (a restarted client counts its seq from 0 again; its stamps keep growing). A frame or command
stamped after the drain that received it (beyond FUTURE_TOLERANCE_NS) carries another clock: it is rejected as
`future_stamp`, since its age could never be judged. A frame stamped at or before its camera's last accepted frame
(a clock that jumped back, a replayed or duplicated frame) is rejected as `stale_frame`: an older view never
replaces a newer one. The newest instruction and state by (stamp_ns, seq) win; an older one arriving later is
rejected as `stale_command`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from vla_node.wire.codec import CodecError
from vla_node.wire.protocol import (
    CameraSpec,
    Frame,
    Instruction,
    ProtocolError,
    ProtocolLimits,
    decode_command,
    decode_frame,
)

FUTURE_TOLERANCE_NS = 1_000_000  # a stamp this far past the drain's clock reading is still taken as this host's


@dataclass
class CameraStats:
    received: int = 0
    processed: int = 0
    dropped: int = 0  # superseded by a newer frame before the model saw it (in the queue or unprocessed)
    last_arrival_ns: int | None = None
    last_seq: int | None = None
    reported: int = 0  # `received` at the last health figures (the worker takes them; nothing else writes it)


class Ingest:
    def __init__(self, cameras: list[CameraSpec], limits: ProtocolLimits, state_dim: int, max_text_bytes: int) -> None:
        self.cameras = {c.name: c for c in cameras}
        self.order = [c.name for c in cameras]
        self.limits = limits
        self.state_dim = state_dim
        self.max_text_bytes = max_text_bytes
        self.latest: dict[str, Frame | None] = {name: None for name in self.order}  # newest unprocessed frame
        self.current: dict[str, Frame | None] = {name: None for name in self.order}  # newest frame seen
        self.stats = {name: CameraStats() for name in self.order}
        self.rejects: Counter[str] = Counter()
        self.instruction: str | None = None  # the newest accepted instruction text
        self.instruction_order: tuple[int, int] | None = None  # its (stamp_ns, seq)
        self.state: np.ndarray | None = None
        self.state_order: tuple[int, int] | None = None
        self.commands = 0
        self.dropped_in_queue = 0  # older frames drained together with a newer valid one of the same camera
        self.dropped_unattributed = 0  # discarded unread in a burst of which no message was valid

    def reject(self, reason: str) -> None:
        self.rejects[reason] += 1

    def add_frames(self, groups: dict, now_ns: int) -> None:
        """groups: topic -> (newest messages oldest first, older ones discarded unread), from
        NodeTransport.drain_frame_messages; now_ns: the clock read after that drain. The newest valid message per
        topic is kept; newer invalid ones are rejected with their reason; older ones count as dropped (superseded
        before the model saw them)."""
        for group, discarded in groups.values():
            frame = None
            for index in range(len(group) - 1, -1, -1):  # newest first
                try:
                    candidate = decode_frame(group[index], self.cameras, self.limits)
                except (ProtocolError, CodecError) as e:
                    self.reject(getattr(e, "reason", "bad_message"))
                    continue
                if candidate.stamp_ns > now_ns + FUTURE_TOLERANCE_NS:
                    self.reject("future_stamp")
                    continue
                last = self.current[candidate.camera]
                if last is not None and candidate.stamp_ns <= last.stamp_ns:
                    self.reject("stale_frame")
                    continue
                frame = candidate
                break
            if frame is None:
                self.dropped_unattributed += discarded  # no valid frame names their camera
                continue
            index += discarded  # messages older than the kept one
            self.dropped_in_queue += index
            stats = self.stats[frame.camera]
            stats.received += 1 + index
            stats.dropped += index
            stats.last_arrival_ns = now_ns
            stats.last_seq = frame.seq
            if self.latest[frame.camera] is not None:
                stats.dropped += 1
            self.latest[frame.camera] = frame
            self.current[frame.camera] = frame

    def add_commands(self, messages: list, now_ns: int) -> None:
        """Command messages oldest first (NodeTransport.drain_commands); now_ns: the clock read after that drain."""
        for parts in messages:
            try:
                command = decode_command(parts, self.limits)
            except (ProtocolError, CodecError) as e:
                self.reject(getattr(e, "reason", "bad_message"))
                continue
            if command.stamp_ns > now_ns + FUTURE_TOLERANCE_NS:
                self.reject("future_stamp")
                continue
            order = (command.stamp_ns, command.seq)
            if isinstance(command, Instruction):
                if len(command.text.encode("utf-8")) > self.max_text_bytes:
                    self.reject("instruction_too_long")
                    continue
                if self.instruction_order is not None and order <= self.instruction_order:
                    self.reject("stale_command")
                    continue
                self.instruction, self.instruction_order = command.text, order
            else:
                if command.values.shape != (self.state_dim,):
                    self.reject("bad_state_dim")
                    continue
                if self.state_order is not None and order <= self.state_order:
                    self.reject("stale_command")
                    continue
                self.state, self.state_order = command.values, order
            self.commands += 1

    def ready(self) -> bool:
        """A new frame of the primary camera, and a frame of every other camera."""
        primary = self.order[0]
        return self.latest[primary] is not None and all(self.current[n] is not None for n in self.order)

    def take(self) -> list[Frame]:
        """The frames to process (one per camera, newest), marking them processed."""
        frames = [self.current[n] for n in self.order]
        for name in self.order:
            if self.latest[name] is not None:
                self.stats[name].processed += 1
            self.latest[name] = None
        return frames

    def health(self, now_ns: int, period_s: float, timeout_ns: int, min_hz: float) -> dict:
        cameras = {}
        for name, s in self.stats.items():
            received = s.received  # one read: the worker may add to it meanwhile
            rate = (received - s.reported) / period_s if period_s > 0 else 0.0
            alive = s.last_arrival_ns is not None and now_ns - s.last_arrival_ns <= timeout_ns
            cameras[name] = {"alive": alive, "rate_hz": round(rate, 2), "rate_ok": alive and rate >= min_hz,
                             "received": received, "processed": s.processed, "dropped": s.dropped,
                             "last_seq": s.last_seq}
            s.reported = received
        dropped = sum(s.dropped for s in self.stats.values()) + self.dropped_unattributed
        return {"cameras": cameras, "rejects": dict(self.rejects), "rejected": sum(self.rejects.values()),
                "drops": {"superseded_in_queue": self.dropped_in_queue,
                          "superseded_unprocessed": dropped - self.dropped_in_queue - self.dropped_unattributed,
                          "discarded_in_bad_burst": self.dropped_unattributed},
                "frames_dropped": dropped, "commands": self.commands}
