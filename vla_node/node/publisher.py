"""The control-rate publisher: a process of its own, so that no Python work of the worker (receiving, decoding and
copying large frames, bookkeeping) holds the interpreter lock when a tick is due. With the publisher a thread of
the worker's process, 1920x1080 frames at 30 fps gave control jitter p99 of 5-9 ms on 2 cores; the lock is
per process, so here nothing of the worker's can delay a tick but the CPU itself (see realtime.worker_nice).

It owns the chunk broker, the control clock and the action and health sockets. The worker (node.py) reaches it
over a private socket pair (publisher_link.py): chunks with their frame's figures, withdrawals, and its figures
for health about once a health period. Every control period it publishes the broker's action (fresh, chunk or
fallback) whether or not the worker is alive; about once a second a health message from the worker's latest
figures (`worker_age_ms` says how old they are: a stalled worker shows) and its own. When the node stops, or
its process is gone (the link closes), it publishes a last health message saying why and exits.

    python -m vla_node.node.publisher FD      (spawned by PublisherLink: FD is its end of the socket pair)
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from vla_node.node.publisher_link import LinkClosed, MessageReader, encode
from vla_node.node.realtime import apply_affinity, apply_fifo, rss_bytes
from vla_node.sched.broker import ChunkBroker
from vla_node.sched.clock import ControlClock
from vla_node.wire.protocol import encode_action, encode_health
from vla_node.wire.transport import NodeTransport, TransportConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherSpec:
    """What the publisher process needs, sent in the link's hello (plain values only)."""

    transport: dict            # TransportConfig fields
    period_ns: int             # control period
    horizon: int               # chunk shape [H, D]
    dim: int
    late_after_ns: int         # ChunkBroker settings
    max_age_ns: int
    fallback_action: list
    fallback_hold: list
    health_period_ns: int
    camera_timeout_ns: int     # the worker's figures older than a health period and this: no camera is known alive
    started_ns: int            # the node's start (uptime_s)
    cpu_affinity: list         # realtime settings of this process
    sched_fifo_priority: int
    gc_freeze: bool

    @classmethod
    def for_node(cls, config, broker: ChunkBroker, started_ns: int) -> PublisherSpec:
        """The spec of a node's launch config (vla_node.config.NodeConfig) and the chunk broker it asks for."""
        rt = config.realtime
        return cls(transport=asdict(config.transport), period_ns=broker.period_ns, horizon=broker.horizon,
                   dim=broker.dim, late_after_ns=broker.late_after_ns, max_age_ns=broker.max_age_ns,
                   fallback_action=broker.fallback_action.tolist(), fallback_hold=broker.fallback_hold,
                   health_period_ns=int(config.health.period_s * 1e9),
                   camera_timeout_ns=int(config.health.camera_timeout_ms * 1e6), started_ns=started_ns,
                   cpu_affinity=list(rt.cpu_affinity), sched_fifo_priority=rt.sched_fifo_priority,
                   gc_freeze=rt.gc_freeze)


def apply_realtime(spec: PublisherSpec) -> None:
    """CPU affinity and SCHED_FIFO for this process (before its sockets: their I/O thread inherits them)."""
    apply_affinity(spec.cpu_affinity)
    apply_fifo(spec.sched_fifo_priority)


class Publisher:
    """The broker, the clock and the output sockets; `run()` ticks until the node says stop or is gone."""

    def __init__(self, spec: PublisherSpec, link: socket.socket, transport: NodeTransport | None = None) -> None:
        self.spec = spec
        self.broker = ChunkBroker(spec.horizon, spec.dim, period_ns=spec.period_ns, late_after_ns=spec.late_after_ns,
                                  max_age_ns=spec.max_age_ns, fallback_action=spec.fallback_action,
                                  fallback_hold=spec.fallback_hold)
        self.transport = transport or NodeTransport(TransportConfig(**spec.transport), inputs=False)
        self.link = link
        link.setblocking(False)  # read_link drains what select says is there
        self.reader = MessageReader()
        self.static: dict[str, Any] | None = None  # set by the start message
        self.stop_reason: str | None = None
        self.seq = 0

    # --- the link -------------------------------------------------------------------------------------------
    def handle(self, message: Mapping[str, Any]) -> None:
        kind = message.get("t")
        if kind == "offer":
            m = message
            self.broker.offer(m["chunk"], m["frame_seq"], m["frame_stamp_ns"], m["produced_ns"], m["level"],
                              m["timing_ms"], deadline_ns=m["deadline_ns"], tokens_refreshed=m["tokens_refreshed"],
                              reuse_ratio=m["reuse_ratio"], origin_ns=m.get("origin_ns"),
                              denoising_steps=m.get("denoising_steps"))
        elif kind == "withdraw":
            self.broker.withdraw(message["level"])
        elif kind == "status":
            self.broker.post_status(message["status"], message["stamp_ns"])
        elif kind == "start":
            self.static = dict(message["static"])
        elif kind == "stop":
            self.stop_reason = str(message["reason"])
        else:
            raise ValueError(f"link message type {kind!r}: expected offer, withdraw, status, start or stop")

    def read_link(self, timeout_s: float | None) -> None:
        """Handle every message that arrives within timeout_s (None: wait for one); raises LinkClosed."""
        if not select.select((self.link,), (), (), timeout_s)[0]:
            return
        while True:
            try:
                data = self.link.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            for message in self.reader.feed(data):
                self.handle(message)

    # --- the control loop -----------------------------------------------------------------------------------
    def run(self) -> int:
        """Wait for the start message, then publish every tick until stopped. Returns the exit code: 0 when the
        node said stop, 1 when its process is gone."""
        now_ns = time.monotonic_ns
        try:
            while self.static is None and self.stop_reason is None:
                self.read_link(None)
        except LinkClosed:
            return 1
        if self.spec.gc_freeze:
            gc.collect()
            gc.freeze()
            gc.disable()  # no collection in the loop (as openpilot's realtime processes)
        clock = ControlClock(self.spec.period_ns, now_ns())
        next_health = now_ns() + self.spec.health_period_ns
        code = 0
        try:
            while self.stop_reason is None:
                wait = clock.wait_time(now_ns())
                if wait > 0:
                    self.read_link(wait / 1e9)
                    continue
                now = now_ns()
                clock.tick(now)
                self.publish_tick(clock.scheduled_ns, now)
                if now >= next_health:
                    self.transport.publish_health(encode_health(self.health(now, clock), stamp_ns=now))
                    next_health = now + self.spec.health_period_ns
        except LinkClosed:
            self.stop_reason, code = "the node process is gone (its link closed)", 1
        now = now_ns()
        # the last tick is the safe action: after it nothing follows up the chunk (a controller holds what it got last)
        self.broker.withdraw(self._level(None))
        clock.tick(now)
        self.publish_tick(clock.scheduled_ns, now)
        self.transport.publish_health(encode_health({**self.health(now, clock), "stopping": self.stop_reason},
                                                    stamp_ns=now))
        log.log(logging.INFO if code == 0 else logging.ERROR, "publisher stopped: %s", self.stop_reason)
        return code

    def publish_tick(self, scheduled_ns: int, now: int) -> None:
        out = self.broker.next(scheduled_ns)  # steps count on the tick grid, not the jittered wake-up
        self.transport.publish_action(encode_action(
            seq=self.seq, stamp_ns=now, frame_seq=out.frame_seq, frame_stamp_ns=out.frame_stamp_ns,
            status=out.status.value, level=self._level(out.level),
            action=out.action.tolist(), chunk=[] if out.chunk is None else out.chunk.tolist(),
            timing_ms=dict(out.timing_ms or {}), tokens_refreshed=out.tokens_refreshed, reuse_ratio=out.reuse_ratio,
            **({} if out.step is None else {"step": out.step}),
            **({} if out.denoising_steps is None else {"denoising_steps": out.denoising_steps}),
        ))
        self.seq += 1

    def _level(self, chunk_level: int | None) -> int:
        """The level a tick reports: its chunk's (or the withdrawn one's); before any, the worker's last posted."""
        if chunk_level is not None:
            return chunk_level
        worker, _ = self.broker.status()
        return 0 if worker is None else worker["level"]

    def health(self, now: int, clock: ControlClock) -> dict:
        """The health message: the worker's latest figures, and the publisher's own. The worker posts its figures
        once a health period, on a phase of its own, so figures up to a period old are current; figures older than
        that by the camera timeout (a stalled worker) say no camera is alive: nothing is known to arrive."""
        worker, worker_ns = self.broker.status()
        worker = dict(worker or {})
        reconnects, input_links = worker.pop("reconnects", 0), worker.pop("input_links", {})
        if worker_ns and now - worker_ns > self.spec.health_period_ns + self.spec.camera_timeout_ns:
            worker["cameras"] = {name: {**cam, "alive": False, "rate_ok": False}
                                 for name, cam in worker.get("cameras", {}).items()}
        return {
            "uptime_s": round((now - self.spec.started_ns) / 1e9, 3),
            **worker,
            "worker_age_ms": round((now - worker_ns) / 1e6, 3) if worker_ns else None,
            "control": {"ticks": clock.ticks, "missed_ticks": clock.missed_ticks,
                        "max_jitter_ms": round(clock.max_jitter_ns / 1e6, 3),
                        "status_counts": {s.value: n for s, n in self.broker.ticks.items()}},
            "publisher_rss_bytes": rss_bytes(),
            "transport": {"reconnects": reconnects, "input_links": input_links,
                          "publish_dropped": self.transport.publish_dropped},
            **(self.static or {}),
        }


def main(argv: list[str] | None = None) -> int:
    """The publisher process: hello -> bind -> ready -> start -> ticks -> stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)  # a process entry of its own (cli.py configures the node's)
    for signum in (signal.SIGINT, signal.SIGTERM):  # the node stops this process over the link, after its own
        signal.signal(signum, signal.SIG_IGN)       # last frame (a terminal's Ctrl-C reaches the whole group)
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print(f"usage: python -m vla_node.node.publisher FD (got {args!r}); spawned by the node", file=sys.stderr)
        return 2
    link = socket.socket(fileno=int(args[0]))
    reader = MessageReader()
    try:
        hello: list[dict] = []
        while not hello:
            hello = reader.feed(link.recv(1 << 16))
        spec = PublisherSpec(**{k: v for k, v in hello[0].items() if k != "t"})
        apply_realtime(spec)
        publisher = Publisher(spec, link)
    except LinkClosed:
        return 1
    except Exception as e:  # reported to the node, which raises it at its start
        link.sendall(encode({"t": "error", "message": f"{type(e).__name__}: {e}"}))
        return 2
    publisher.reader = reader
    link.sendall(encode({"t": "ready", "pid": os.getpid()}))
    try:
        return publisher.run()
    finally:
        publisher.transport.close(linger_ms=200)  # the last tick and health message go out


if __name__ == "__main__":
    raise SystemExit(main())
