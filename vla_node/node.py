"""The node: transport -> ingest -> scheduler -> pipeline -> publish.

Two threads. The worker owns the input sockets and the model: it drains frames and commands (latest frame
wins), and runs the pipeline on the newest frames. The main thread owns the output sockets: every control
period it publishes the broker's action (fresh, chunk or fallback) and about once a second the health
message. Publishing never waits on inference. SIGINT/SIGTERM stop both cleanly (exit 0); an unexpected
exception in either thread is reported and the node exits non-zero so that launch restarts it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

import torch

from vla_node.config import NodeConfig
from vla_node.ingest import Ingest
from vla_node.pipeline import Pipeline
from vla_node.protocol import FRAME_TOPIC_PREFIX, encode_action, encode_health
from vla_node.scheduler import ControlClock
from vla_node.signals import SignalFlag
from vla_node.transport import NodeTransport

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def apply_realtime(config: NodeConfig) -> None:
    rt = config.realtime
    if rt.cpu_affinity:
        try:
            os.sched_setaffinity(0, set(rt.cpu_affinity))
        except (OSError, AttributeError) as e:
            log.warning("cpu_affinity %s not applied: %s", rt.cpu_affinity, e)
    if rt.sched_fifo_priority:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt.sched_fifo_priority))
        except (OSError, AttributeError) as e:
            log.warning("SCHED_FIFO priority %d not applied (needs CAP_SYS_NICE or an rtprio limit): %s",
                        rt.sched_fifo_priority, e)


def drop_realtime_priority() -> None:
    """This thread back to SCHED_OTHER: a thread started after apply_realtime inherits SCHED_FIFO, and under
    SCHED_FIFO a thread cannot preempt another of the same priority, so inference would delay the control ticks."""
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (OSError, AttributeError) as e:
        log.warning("the worker thread keeps the realtime priority (SCHED_OTHER not applied: %s)", e)


class Node:
    def __init__(self, config: NodeConfig, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self.clock = clock
        if config.model.threads:
            torch.set_num_threads(config.model.threads)
        sys.setswitchinterval(0.0005)  # the publisher thread gets the GIL back within 0.5 ms of its tick
        self.pipeline = Pipeline(config, clock)
        c = self.pipeline.policy.config
        self.ingest = Ingest([cam.spec() for cam in config.cameras], config.limits, c.state_dim,
                             c.max_text_tokens - 1)
        self.frame_topics = frozenset(FRAME_TOPIC_PREFIX + cam.name.encode() for cam in config.cameras)
        self.transport: NodeTransport | None = None
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.seq = 0
        self.started_ns = clock()

    # --- lifecycle ------------------------------------------------------------------------------------
    def run(self) -> int:
        """Warm up, open sockets, run until a signal or an error. Returns the exit code."""
        self.pipeline.warm_up()
        apply_realtime(self.config)
        if self.config.realtime.gc_freeze:
            gc.collect()
            gc.freeze()
            gc.disable()  # no collection in the loops (as openpilot's realtime processes)
        self.transport = NodeTransport(self.config.transport)
        worker = threading.Thread(target=self._guard(self._worker_loop), name="vla-worker", daemon=True)
        with SignalFlag(signal.SIGINT, signal.SIGTERM) as self.signals:
            worker.start()
            try:
                self._guard(self._publisher_loop)()
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
        transport, ingest, pipeline = self.transport, self.ingest, self.pipeline
        while not self.stop_event.is_set():
            if not transport.poll(5):
                continue
            commands, frames = transport.drain_commands(), transport.drain_frame_messages(self.frame_topics)
            now = self.clock()  # after the drains: nothing drained can be stamped later on this host's clock
            ingest.add_commands(commands, now)
            ingest.add_frames(frames, now)
            if ingest.ready():
                pipeline.process(ingest.take(), ingest.instruction, ingest.state)

    # --- publisher: control rate and health -----------------------------------------------------------
    def _publisher_loop(self) -> None:
        config, broker = self.config, self.pipeline.broker
        clock = ControlClock(config.scheduler.period_ns, self.clock())
        health_period = int(config.health.period_s * 1e9)
        next_health = self.clock() + health_period
        while not self.stop_event.is_set():
            if self.signals.received is not None:  # the handler only records it (see signals.py)
                log.info("signal %d: stopping", self.signals.received)
                return
            wait = clock.wait_time(self.clock())
            if wait > 0:
                self.stop_event.wait(wait / 1e9)  # no handler touches the Event; a signal is seen next tick
                continue
            now = self.clock()
            clock.tick(now)
            out = broker.next(clock.scheduled_ns)  # steps count on the tick grid, not the jittered wake-up
            metrics = self.pipeline.metrics
            fresh_meta = metrics.frame_seq == out.frame_seq
            self.transport.publish_action(encode_action(
                seq=self.seq, stamp_ns=now, frame_seq=out.frame_seq, frame_stamp_ns=out.frame_stamp_ns,
                status=out.status.value, level=self.pipeline.scheduler.level if out.level is None else out.level,
                action=out.action.tolist(), chunk=[] if out.chunk is None else out.chunk.tolist(),
                timing_ms=dict(out.timing_ms or {}),
                tokens_refreshed=metrics.tokens_refreshed if fresh_meta else None,
                reuse_ratio=metrics.reuse_ratio if fresh_meta else None,
            ))
            self.seq += 1
            if now >= next_health:
                self.transport.publish_health(encode_health(self.health(now, clock), stamp_ns=now))
                next_health = now + health_period

    def health(self, now: int, clock: ControlClock) -> dict:
        cfg = self.config.health
        pipeline = self.pipeline
        sched = pipeline.scheduler.health()
        ingest = self.ingest.health(now, cfg.period_s, int(cfg.camera_timeout_ms * 1e6), cfg.min_camera_hz)
        return {
            "uptime_s": round((now - self.started_ns) / 1e9, 3),
            "level": sched.level, "level_name": sched.level_name,
            "scheduler": {k: getattr(sched, k) for k in sched.__dataclass_fields__},
            "control": {"ticks": clock.ticks, "missed_ticks": clock.missed_ticks,
                        "max_jitter_ms": round(clock.max_jitter_ns / 1e6, 3),
                        "status_counts": {s.value: n for s, n in pipeline.broker.ticks.items()}},
            "frames_processed": pipeline.frames_processed, "frames_skipped": pipeline.frames_skipped,
            **ingest,
            "instruction": pipeline.instruction,
            "kv_bytes": pipeline.policy.kv_bytes(),
            "rss_bytes": rss_bytes(),
            "transport": {"reconnects": self.transport.reconnects, "publish_dropped": self.transport.publish_dropped},
            "model": self.config.model.checkpoint or self.config.model.preset,
            "backend": self.config.model.backend,
            "device": self.config.model.device,
            "dtype": self.config.model.resolved_dtype,
            "weights": self.config.model.resolved_weights,
        }
