"""The node: transport -> ingest -> scheduler -> pipeline -> publish.

Two threads, and the chunk broker is the only object whose state both touch. The worker owns the model and the
transport's input sockets: it drains frames and commands (latest frame wins), runs the pipeline on the newest
frames, offers each chunk to the broker with its frame's figures, and about once a health period posts its own
figures (ingest, scheduler, cache) there. The main thread owns the output sockets: every control period it
publishes the broker's action (fresh, chunk or fallback), and about once a second the health message built from
the worker's latest posted figures (`worker_age_ms` says how old they are: a stalled worker shows) and its own.
Publishing never waits on inference. SIGINT/SIGTERM stop both cleanly (exit 0); an unexpected exception in either
thread is reported and the node exits non-zero so that launch restarts it.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
import traceback
from typing import Callable

import torch

from vla_node.config import NodeConfig
from vla_node.node.ingest import Ingest
from vla_node.node.pipeline import Pipeline
from vla_node.node.realtime import apply_realtime, drop_realtime_priority, lower_thread_priority, rss_bytes
from vla_node.node.signals import SignalFlag
from vla_node.sched.broker import ChunkBroker
from vla_node.sched.clock import ControlClock
from vla_node.wire.protocol import FRAME_TOPIC_PREFIX, encode_action, encode_health
from vla_node.wire.transport import NodeTransport

log = logging.getLogger(__name__)


class Node:
    """Warmed up, with its sockets open, when constructed; `run()` runs it until a signal or an error."""

    def __init__(self, config: NodeConfig, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self.clock = clock
        if config.model.threads:
            torch.set_num_threads(config.model.threads)
        sys.setswitchinterval(0.0005)  # the publisher thread gets the GIL back within 0.5 ms of its tick
        self.started_ns = clock()
        self.pipeline = Pipeline(config, clock)
        self.backend = self.pipeline.backend  # what runs (frozen): read by the health topic on the publisher's side
        c = self.pipeline.policy.config
        self.ingest = Ingest(config.cameras, config.limits, c.state_dim, c.max_text_tokens - 1)
        self.frame_topics = frozenset(FRAME_TOPIC_PREFIX + cam.name.encode() for cam in config.cameras)
        self.broker: ChunkBroker = self.pipeline.broker
        self.transport = NodeTransport(config.transport)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.seq = 0

    # --- lifecycle ------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run until a signal or an error; close the sockets. Returns the exit code."""
        apply_realtime(self.config.realtime)
        if self.config.realtime.gc_freeze:
            gc.collect()
            gc.freeze()
            gc.disable()  # no collection in the loops (as openpilot's realtime processes)
        worker = threading.Thread(target=self._guard(self._worker_loop), name="vla-worker", daemon=True)
        with SignalFlag(signal.SIGINT, signal.SIGTERM) as signals:
            worker.start()
            try:
                self._guard(lambda: self._publisher_loop(signals))()
            finally:
                self.stop_event.set()
                worker.join(timeout=10)
                self.transport.close()
        if self.error is not None:
            log.error("node stopped by an unexpected error:\n%s",
                      "".join(traceback.format_exception(self.error)))
            return 1
        log.info("node stopped cleanly")
        return 0

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def guarded() -> None:
            try:
                fn()
            except BaseException as e:  # reported by run(), which exits non-zero
                self.error = self.error or e
                self.stop_event.set()

        return guarded

    # --- worker: inputs and inference -----------------------------------------------------------------
    def _worker_loop(self) -> None:
        if self.config.realtime.sched_fifo_priority:
            drop_realtime_priority()  # SCHED_FIFO is the publisher's alone
        lower_thread_priority(self.config.realtime.worker_nice)
        transport, ingest, pipeline = self.transport, self.ingest, self.pipeline
        period = int(self.config.health.period_s * 1e9)
        posted = self.clock() - period  # the first figures cover one nominal period
        while not self.stop_event.is_set():
            if self.clock() - posted >= period:
                now = self.clock()
                self.broker.post_status(self._worker_status(now, (now - posted) / 1e9), now)
                posted = now
            if not transport.poll(5):
                continue
            commands, frames = transport.drain_commands(), transport.drain_frame_messages(self.frame_topics)
            now = self.clock()  # after the drains: nothing drained can be stamped later on this host's clock
            ingest.add_commands(commands, now)
            ingest.add_frames(frames, now)
            if ingest.ready():
                pipeline.process(ingest.take(), ingest.instruction, ingest.state)

    def _worker_status(self, now: int, elapsed_s: float) -> dict:
        """The worker's figures for health (taken in the worker thread, posted through the broker); camera rates
        over the `elapsed_s` since the last post (a long frame can delay a post past its period)."""
        cfg = self.config.health
        pipeline = self.pipeline
        sched = pipeline.scheduler.health()
        ingest = self.ingest.health(now, elapsed_s, int(cfg.camera_timeout_ms * 1e6), cfg.min_camera_hz)
        return {
            "level": sched.level, "level_name": sched.level_name,
            "scheduler": {k: getattr(sched, k) for k in sched.__dataclass_fields__},
            "frames_processed": pipeline.frames_processed, "frames_skipped": pipeline.frames_skipped,
            **ingest,
            "instruction": pipeline.instruction,
            "kv_bytes": pipeline.policy.kv_bytes(),
            "reconnects": self.transport.reconnects,
        }

    # --- publisher: control rate and health -----------------------------------------------------------
    def _publisher_loop(self, signals: SignalFlag) -> None:
        config, broker = self.config, self.broker
        clock = ControlClock(config.scheduler.period_ns, self.clock())
        health_period = int(config.health.period_s * 1e9)
        next_health = self.clock() + health_period
        while not self.stop_event.is_set():
            if signals.received is not None:  # the handler only records it (see signals.py)
                log.info("signal %d: stopping", signals.received)
                return
            wait = clock.wait_time(self.clock())
            if wait > 0:
                self.stop_event.wait(wait / 1e9)  # no handler touches the Event; a signal is seen next tick
                continue
            now = self.clock()
            clock.tick(now)
            out = broker.next(clock.scheduled_ns)  # steps count on the tick grid, not the jittered wake-up
            self.transport.publish_action(encode_action(
                seq=self.seq, stamp_ns=now, frame_seq=out.frame_seq, frame_stamp_ns=out.frame_stamp_ns,
                status=out.status.value, level=self._level(out.level),
                action=out.action.tolist(), chunk=[] if out.chunk is None else out.chunk.tolist(),
                timing_ms=dict(out.timing_ms or {}), tokens_refreshed=out.tokens_refreshed,
                reuse_ratio=out.reuse_ratio,
            ))
            self.seq += 1
            if now >= next_health:
                self.transport.publish_health(encode_health(self.health(now, clock), stamp_ns=now))
                next_health = now + health_period

    def _level(self, chunk_level: int | None) -> int:
        """The level a tick reports: its chunk's (or the withdrawn one's); before any, the worker's last posted."""
        if chunk_level is not None:
            return chunk_level
        worker, _ = self.broker.status()
        return 0 if worker is None else worker["level"]

    def health(self, now: int, clock: ControlClock) -> dict:
        """The health message: the worker's latest posted figures, and the publisher's own. Figures older than the
        camera timeout (a stalled worker) say no camera is alive: nothing is known to arrive."""
        worker, worker_ns = self.broker.status()
        worker = dict(worker or {})
        reconnects = worker.pop("reconnects", 0)
        if worker_ns and now - worker_ns > self.config.health.camera_timeout_ms * 1e6:
            worker["cameras"] = {name: {**cam, "alive": False, "rate_ok": False}
                                 for name, cam in worker.get("cameras", {}).items()}
        model = self.config.model
        return {
            "uptime_s": round((now - self.started_ns) / 1e9, 3),
            **worker,
            "worker_age_ms": round((now - worker_ns) / 1e6, 3) if worker_ns else None,
            "control": {"ticks": clock.ticks, "missed_ticks": clock.missed_ticks,
                        "max_jitter_ms": round(clock.max_jitter_ns / 1e6, 3),
                        "status_counts": {s.value: n for s, n in self.broker.ticks.items()}},
            "rss_bytes": rss_bytes(),
            "transport": {"reconnects": reconnects, "publish_dropped": self.transport.publish_dropped},
            "model": model.checkpoint or model.preset, "backend": self.backend.backend,
            "recipe": self.backend.recipe, "backend_skipped": list(self.backend.skipped),
            "device": model.device, "dtype": model.resolved_dtype, "weights": model.resolved_weights,
        }
