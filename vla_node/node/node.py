"""The node: transport -> ingest -> scheduler -> pipeline -> the publisher process.

Two processes. This one (the worker) owns the model and the input sockets: its main thread drains frames and
commands (latest frame wins), runs the pipeline on the newest frames, offers each chunk to the publisher with its
frame's figures, and about once a health period posts its own figures (ingest, scheduler, cache, memory). The
publisher process (node/publisher.py) owns the chunk broker and the output sockets: every control period it
publishes the broker's action (fresh, chunk or fallback), about once a second the health message. It has its own
interpreter lock, so no Python work here can delay a tick. SIGINT/SIGTERM stop both cleanly (exit 0): the worker
finishes its frame and tells the publisher, which publishes a last health message saying why. An unexpected
exception here, or the publisher exiting, is reported and the node exits non-zero so that launch restarts it;
when this process dies (SIGKILL) the publisher sees its link close and exits too.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
import traceback
from dataclasses import asdict, replace
from typing import Callable

import torch

from vla_node.config import NodeConfig
from vla_node.node.ingest import Ingest
from vla_node.node.metrics import MetricsServer
from vla_node.node.pipeline import Pipeline
from vla_node.node.publisher import PublisherSpec
from vla_node.node.publisher_link import PublisherLink
from vla_node.node.realtime import apply_affinity, lower_thread_priority, resolve_threads, rss_bytes
from vla_node.node.signals import SignalFlag
from vla_node.wire.openpi_server import OpenpiModel, OpenpiServer
from vla_node.wire.protocol import FRAME_TOPIC_PREFIX
from vla_node.wire.transport import NodeTransport

log = logging.getLogger(__name__)


class Node:
    """Warmed up, with its publisher started and its sockets open, when constructed; `run()` runs it until a
    signal or an error."""

    def __init__(self, config: NodeConfig, clock: Callable[[], int] = time.monotonic_ns) -> None:
        threads = resolve_threads(config.model.threads, config.realtime.sched_fifo_priority,
                                  config.realtime.cpu_affinity)
        if config.model.threads == "auto":
            log.info("model.threads auto: %d (every CPU where the publisher may run at SCHED_FIFO, else 1)", threads)
        config = config.replace(model=replace(config.model, threads=threads))  # what runs below sees the count
        self.config = config
        self.clock = clock
        if threads:
            torch.set_num_threads(threads)
        self.started_ns = clock()
        c = config.model.model_config()
        # First, before the model: an action or health address in use fails fast, and the publisher's imports and
        # binds overlap the warm-up. Spawned before worker_nice lowers this thread: it keeps the process's own.
        spec = PublisherSpec.for_node(config, config.scheduler.broker(c.action_horizon, c.action_dims),
                                      self.started_ns)
        self.publisher = PublisherLink(asdict(spec))
        # Then lowered before the input sockets' context starts its I/O thread, which inherits it: receiving a
        # 1920x1080 frame (6 MB copied) must not delay a tick any more than inference may.
        lower_thread_priority(config.realtime.worker_nice)
        self.openpi: OpenpiServer | None = None  # openpi's websocket protocol beside ZeroMQ ([openpi] listen)
        self.metrics: MetricsServer | None = None  # Prometheus's /metrics ([metrics] listen)
        try:
            self.pipeline = Pipeline(config, clock, broker=self.publisher)
            self.backend = self.pipeline.backend
            self.ingest = Ingest(config.cameras, config.limits, c.state_dim, c.max_text_tokens - 1)
            self.frame_topics = frozenset(FRAME_TOPIC_PREFIX + cam.name.encode() for cam in config.cameras)
            if config.openpi.listen is not None:  # before the SUBs: they connect to its inputs too
                self.openpi = OpenpiServer(config.openpi, config.transport, OpenpiModel(
                    cameras={cam.name: (cam.max_height, cam.max_width) for cam in config.cameras},
                    horizon=c.action_horizon, dim=c.action_dims, state_dim=c.state_dim,
                    max_prompt_bytes=c.max_text_tokens - 1, control_hz=config.scheduler.control_hz))
            self.transport = NodeTransport(config.transport, outputs=False,
                                           also_from=None if self.openpi is None else self.openpi.inputs)
            if config.metrics.listen is not None:
                self.metrics = MetricsServer(config.metrics, config.transport)
        except BaseException:
            self.publisher.close()
            self._close_integrations()
            raise

    # --- lifecycle ------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run until a signal or an error; stop the publisher, close the sockets. Returns the exit code."""
        rt = self.config.realtime
        apply_affinity(rt.cpu_affinity)  # SCHED_FIFO is the publisher's alone
        if rt.gc_freeze:
            gc.collect()
            gc.freeze()
            gc.disable()  # no collection in the loop (as openpilot's realtime processes)
        model = self.config.model
        self.publisher.start({
            "model": model.checkpoint or model.preset, "backend": self.backend.backend,
            "recipe": self.backend.recipe, "backend_skipped": list(self.backend.skipped),
            "device": model.device, "dtype": model.resolved_dtype, "weights": model.resolved_weights,
            "threads": torch.get_num_threads(),
            "head": self.pipeline.policy.config.action_head,
            "real_time_chunking": self.pipeline.chunking is not None,
        })
        error: BaseException | None = None
        reason = "error"
        with SignalFlag(signal.SIGINT, signal.SIGTERM) as signals:
            try:
                received = self._worker_loop(signals)
                reason = f"signal {received}"
                log.info("signal %d: stopping", received)
            except BaseException as e:  # reported below; the node exits non-zero
                error = e
                reason = f"error: {type(e).__name__}: {e}"
            finally:
                self._close_integrations()
                self.publisher.stop(reason)
                self.transport.close()
        if error is not None:
            log.error("node stopped by an unexpected error:\n%s", "".join(traceback.format_exception(error)))
            return 1
        log.info("node stopped cleanly")
        return 0

    def _close_integrations(self) -> None:
        for integration in (self.openpi, self.metrics):
            if integration is not None:
                integration.close()

    # --- the worker: inputs and inference -------------------------------------------------------------
    def _worker_loop(self, signals: SignalFlag) -> int:
        """Frames and commands in, chunks out, until a signal (returned; the handler only records it)."""
        transport, ingest, pipeline, publisher = self.transport, self.ingest, self.pipeline, self.publisher
        integrations = tuple(i for i in (self.openpi, self.metrics) if i is not None)
        period = int(self.config.health.period_s * 1e9)
        posted = self.clock() - period  # the first figures cover one nominal period
        while signals.received is None:
            publisher.check()
            for integration in integrations:
                integration.check()
            if self.clock() - posted >= period:
                now = self.clock()
                publisher.post_status(self._worker_status(now, (now - posted) / 1e9), now)
                posted = now
            if not transport.poll(5):
                continue
            commands, frames = transport.drain_commands(), transport.drain_frame_messages(self.frame_topics)
            now = self.clock()  # after the drains: nothing drained can be stamped later on this host's clock
            ingest.add_commands(commands, now)
            ingest.add_frames(frames, now)
            if ingest.ready():
                pipeline.process(ingest.take(), ingest.instruction, ingest.state)
        return signals.received

    def _worker_status(self, now: int, elapsed_s: float) -> dict:
        """The worker's figures for health (posted to the publisher); camera rates over the `elapsed_s` since the
        last post (a long frame can delay a post past its period)."""
        cfg = self.config.health
        pipeline = self.pipeline
        sched = pipeline.scheduler.health()
        ingest = self.ingest.health(now, elapsed_s, int(cfg.camera_timeout_ms * 1e6), cfg.min_camera_hz)
        return {
            "level": sched.level, "level_name": sched.level_name,
            "scheduler": {k: getattr(sched, k) for k in sched.__dataclass_fields__},
            "frames_processed": pipeline.frames_processed, "frames_skipped": pipeline.frames_skipped,
            "frames_stale_view": pipeline.frames_stale_view,
            **ingest,
            "instruction": pipeline.instruction,
            "kv_bytes": pipeline.policy.kv_bytes(),
            "reconnects": self.transport.reconnects, "input_links": self.transport.input_links(),
            **({} if self.openpi is None else {"openpi": self.openpi.figures()}),
            "rss_bytes": rss_bytes(),
        }
