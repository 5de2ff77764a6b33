"""Prometheus's /metrics on a running node ([metrics] listen): a real HTTP GET mid-run, parsed by prometheus-client's
own parser, shows the counts of the node's health message; names follow Prometheus's conventions."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.node_harness import TINY_LAUNCH, running_node
from vla_node.bench.node import free_tcp_port


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape_since(port: int, health: dict, timeout_s: float = 5.0) -> dict[str, list]:
    """A scrape that shows `health` or a later health message. The node's metrics listener and the test's client are
    two subscribers of the same health topic, so a scrape made as soon as `health` reached the test may still show
    the message before it (ticks counted since then missing)."""
    end = time.monotonic() + timeout_s
    while True:
        families = scrape(port)
        shown = value(families, "vla_node_uptime_seconds")
        if shown >= health["uptime_s"]:
            return families
        assert time.monotonic() < end, f"/metrics still shows uptime {shown} s after {timeout_s} s: expected the " \
                                       f"health message of uptime {health['uptime_s']} s or a later one"
        time.sleep(0.05)


def value(families, name: str, **labels) -> float:
    family = families[name]
    sample_name = name + "_total" if family.type == "counter" else name
    found = [s.value for s in family.samples if s.name == sample_name and s.labels == labels]
    assert len(found) == 1, (name, labels, family.samples)
    return found[0]


@pytest.mark.timeout(180)
def test_metrics_scraped_mid_run_match_health(tmp_path):
    port = free_tcp_port()
    launch = tmp_path / "metrics.toml"
    launch.write_text(TINY_LAUNCH.read_text() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    with running_node(launch, tmp_path) as node:
        node.warm_up()
        node.stream(1.0)
        node.client.send_parts([b"frame/front", b"\xc1", b""])  # two bad messages: counted by reason
        node.client.send_parts([b"frame/nope", b"\x80", b""])
        # frames stopped: the worker's counters settle; the next health message says them, and so does /metrics
        first = node.health(until=lambda h: h["rejected"] >= 2)
        health = node.health(until=lambda h: h["cameras"]["front"] == first["cameras"]["front"])
        families = scrape_since(port, health)
        after = node.health()

    cam = health["cameras"]["front"]
    for key in ("received", "processed", "dropped"):
        assert value(families, f"vla_node_frames_{key}", camera="front") == cam[key], key
    for reason, n in health["rejects"].items():
        assert value(families, "vla_node_messages_rejected", reason=reason) == n, reason
    assert sum(s.value for s in families["vla_node_messages_rejected"].samples) == health["rejected"] == 2
    for status in ("fresh", "chunk", "fallback"):  # ticks go on: the scrape lies between the two health messages
        scraped = value(families, "vla_node_ticks", status=status)
        assert health["control"]["status_counts"].get(status, 0) <= scraped <= after["control"]["status_counts"].get(
            status, 0), status
    assert value(families, "vla_node_degrade_level") == health["level"]
    assert value(families, "vla_node_deadline_misses") == health["scheduler"]["missed_frames"]
    assert value(families, "vla_node_resident_memory_bytes", process="worker") > 50e6
    assert value(families, "vla_node_kv_cache_bytes", partition="vision") == health["kv_bytes"]["vision"]
    build = families["vla_node_build_info"].samples[0]
    assert build.name == "vla_node_build_info" and build.labels["backend"] == health["backend"] == "torch"
    # histograms from the fresh actions: frame to action, and per stage
    latency = {s.name: s for s in families["vla_node_frame_to_action_latency_seconds"].samples if not s.labels.get("le")}
    assert latency["vla_node_frame_to_action_latency_seconds_count"].value >= 5
    stages = {s.labels["stage"] for s in families["vla_node_stage_latency_seconds"].samples}
    assert stages and all(s.isidentifier() for s in stages), stages
    # conventions: the prefix; counters _total; units in the name
    for name, family in families.items():
        assert name.startswith("vla_node_"), name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family
        if "latency" in name or "uptime" in name or "jitter" in name:
            assert name.endswith("_seconds"), name
        if "memory" in name or "bytes" in name:
            assert name.endswith("_bytes"), name
