"""Prometheus's /metrics for a running node ([metrics] listen): the counters of the node's own health messages,
and latency histograms from its actions, served by prometheus-client's HTTP server.

A thread of the node's worker process listens to the node's action and health topics as any client does (so what
/metrics says is what health said, to the message) and keeps the newest health; a scrape turns it into metrics.
Fresh actions feed the histograms: each stage's time (the action's timing_ms) and frame-to-action latency. Names
follow Prometheus's conventions: `vla_node_` prefix, `_total` counters, `_seconds` and `_bytes` units.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import replace
from typing import Any, Iterator

import zmq

from vla_node.config import MetricsConfig
from vla_node.wire.protocol import ProtocolError, decode_action, decode_health
from vla_node.wire.transport import Client, TransportConfig

log = logging.getLogger(__name__)
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_STAGE = re.compile(r"[a-z][a-z0-9_]{0,31}")  # stage names become label values: the node's own, bounded
MAX_STAGES = 32


class NodeMetrics:
    """A prometheus-client collector over the newest health message, with the action histograms beside it."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics

        disable_created_metrics()  # no `_created` series beside each counter and histogram (this process only)
        self.registry = CollectorRegistry(auto_describe=False)
        self.stage_seconds = Histogram("vla_node_stage_latency_seconds", "Time of each stage of a fresh action's "
                                       "frame (its timing_ms)", ["stage"], buckets=LATENCY_BUCKETS_S,
                                       registry=self.registry)
        self.frame_to_action_seconds = Histogram("vla_node_frame_to_action_latency_seconds", "A frame's capture "
                                                 "stamp to its fresh action's publication", buckets=LATENCY_BUCKETS_S,
                                                 registry=self.registry)
        self.health: dict[str, Any] | None = None  # replaced whole by the listener thread, read whole by a scrape
        self._stages: set[str] = set()  # stage labels seen (at most MAX_STAGES)
        self.registry.register(self)

    def observe_action(self, action: dict[str, Any]) -> None:
        if action["status"] != "fresh":
            return
        self.frame_to_action_seconds.observe(max(0, action["stamp_ns"] - action["frame_stamp_ns"]) / 1e9)
        for stage, ms in action["timing_ms"].items():
            if stage not in self._stages and (len(self._stages) >= MAX_STAGES or not _STAGE.fullmatch(stage)):
                continue
            self._stages.add(stage)
            if isinstance(ms, (int, float)):
                self.stage_seconds.labels(stage).observe(max(0.0, ms) / 1e3)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        h = self.health
        if h is None:
            return
        yield InfoMetricFamily("vla_node_build", "What the node runs", value={
            k: str(h.get(k)) for k in ("model", "backend", "recipe", "device", "dtype", "weights", "head")})
        yield _gauge("vla_node_uptime_seconds", "Seconds since the node started", h["uptime_s"])
        cams = h.get("cameras", {})
        for key, text in (("received", "Frames received"), ("processed", "Frames processed"),
                          ("dropped", "Frames dropped (superseded by a newer one)")):
            family = CounterMetricFamily(f"vla_node_frames_{key}", f"{text}, per camera", labels=["camera"])
            for name, cam in cams.items():
                family.add_metric([name], cam[key])
            yield family
        alive = GaugeMetricFamily("vla_node_camera_alive", "1 while frames arrive in time", labels=["camera"])
        rate = GaugeMetricFamily("vla_node_camera_rate_hertz", "Frames per second received", labels=["camera"])
        for name, cam in cams.items():
            alive.add_metric([name], int(cam["alive"]))
            rate.add_metric([name], cam["rate_hz"])
        yield alive
        yield rate
        rejects = CounterMetricFamily("vla_node_messages_rejected", "Messages dropped as bad, by reason",
                                      labels=["reason"])
        for reason, n in h.get("rejects", {}).items():
            rejects.add_metric([reason], n)
        yield rejects
        drops = CounterMetricFamily("vla_node_frames_superseded", "Frames dropped unprocessed, by where",
                                    labels=["where"])
        for where, n in h.get("drops", {}).items():
            drops.add_metric([where], n)
        yield drops
        control = h["control"]
        ticks = CounterMetricFamily("vla_node_ticks", "Control ticks published, by status", labels=["status"])
        for status, n in control["status_counts"].items():
            ticks.add_metric([status], n)
        yield ticks
        yield _counter("vla_node_ticks_missed", "Control ticks skipped (the publisher woke a period late or more)",
                       control["missed_ticks"])
        yield _gauge("vla_node_tick_jitter_max_seconds", "Largest tick wake-up lateness so far",
                     control["max_jitter_ms"] / 1e3)
        sched = h["scheduler"]
        yield _gauge("vla_node_degrade_level", "The scheduler's degrade level (0 = normal)", h["level"])
        yield _counter("vla_node_deadline_misses", "Frames whose update missed its deadline", sched["missed_frames"])
        yield _counter("vla_node_frames_stale", "Frames too old to use when their turn came", sched["stale_frames"])
        yield _counter("vla_node_frames_skipped", "Frames the scheduler chose not to process", h["frames_skipped"])
        kv = GaugeMetricFamily("vla_node_kv_cache_bytes", "KV cache memory per partition", labels=["partition"])
        for partition, n in h.get("kv_bytes", {}).items():
            kv.add_metric([partition], n)
        yield kv
        rss = GaugeMetricFamily("vla_node_resident_memory_bytes", "Resident memory per node process",
                                labels=["process"])
        rss.add_metric(["worker"], h["rss_bytes"])
        rss.add_metric(["publisher"], h["publisher_rss_bytes"])
        yield rss
        yield _counter("vla_node_transport_reconnects", "Input connections made again after a failed handshake",
                       h["transport"]["reconnects"])


def _gauge(name: str, text: str, value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily
    return GaugeMetricFamily(name, text, value=value)


def _counter(name: str, text: str, value: float) -> Any:
    from prometheus_client.core import CounterMetricFamily
    return CounterMetricFamily(name, text, value=value)


class MetricsServer:
    """/metrics at config.listen, fed by a listener thread on the node's action and health topics."""

    def __init__(self, config: MetricsConfig, transport: TransportConfig) -> None:
        from prometheus_client import start_http_server

        self.metrics = NodeMetrics()
        self._transport = replace(transport)
        self._stop = threading.Event()
        self.error: Exception | None = None  # what stopped the listener
        host, port = config.host_port()
        try:
            self._server, self._http_thread = start_http_server(port, addr=host, registry=self.metrics.registry)
        except OSError as e:
            raise OSError(f"metrics.listen = {config.listen!r}: cannot listen there: {e}") from e
        self._thread = threading.Thread(target=self._listen, name="metrics", daemon=True)
        self._thread.start()
        log.info("metrics at http://%s/metrics", config.listen)

    def _listen(self) -> None:
        client = Client(self._transport, publish=False)  # its sockets belong to this thread
        poller = zmq.Poller()
        poller.register(client.actions_sub, zmq.POLLIN)
        poller.register(client.health_sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                        if sock is client.health_sub:
                            self.metrics.health = decode_health(parts)
                        else:
                            self.metrics.observe_action(decode_action(parts))
                    except (zmq.Again, ProtocolError):
                        continue
        except Exception as e:  # raised in the node's loop by check(): the node exits non-zero
            self.error = e
        finally:
            client.close()

    def check(self) -> None:
        """Raise what stopped the listener (called by the node's loop, which then exits non-zero)."""
        if self.error is not None:
            raise RuntimeError(f"the metrics listener stopped: {type(self.error).__name__}: {self.error}")

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
