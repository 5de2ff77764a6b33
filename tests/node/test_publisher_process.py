"""The publisher process through its link, on real sockets: it binds, ticks once started, publishes what is
offered, says why it stops, and exits when the node's process is gone (its link closes) so that a restarted node
can bind the same addresses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import numpy as np
import pytest
import zmq

from helpers.node_harness import private_addresses
from helpers.paths import TEST_LAUNCH_DIR
from vla_node.config import load_launch
from vla_node.node.publisher import PublisherSpec
from vla_node.node.publisher_link import PublisherLink
from vla_node.wire.protocol import decode_action, decode_health


def hello(transport, sched_fifo_priority: int = 0) -> dict:
    config = load_launch(TEST_LAUNCH_DIR / "tiny.toml")
    config = replace(config, transport=transport,
                     realtime=replace(config.realtime, sched_fifo_priority=sched_fifo_priority))
    c = config.model.model_config()
    return asdict(PublisherSpec.for_node(config, config.scheduler.broker(c.action_horizon, c.action_dims),
                                         time.monotonic_ns()))


def subscriber(ctx: zmq.Context, address: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def receive(sub: zmq.Socket, decode, until, timeout_s: float = 10.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if sub.poll(100):
            msg = decode(sub.recv_multipart())
            if until(msg):
                return msg
    raise AssertionError(f"no matching message within {timeout_s} s")


def test_offers_are_published_and_the_last_health_says_why_it_stopped():
    transport = private_addresses()
    spec = hello(transport)
    link = PublisherLink(spec)
    ctx = zmq.Context()
    try:
        actions, health = subscriber(ctx, transport.actions), subscriber(ctx, transport.health)
        link.start({"backend": "torch", "model": "tiny"})
        first = receive(actions, decode_action, lambda m: True)
        assert first["status"] == "fallback" and first["action"] == spec["fallback_action"]
        chunk = np.full((spec["horizon"], spec["dim"]), 0.5, np.float32)  # (H, D)
        link.offer(chunk, 3, time.monotonic_ns(), time.monotonic_ns(), 0, {"vision": 1.0},
                   deadline_ns=time.monotonic_ns() + 10**9)
        fresh = receive(actions, decode_action, lambda m: m["status"] == "fresh")
        assert fresh["frame_seq"] == 3 and fresh["action"] == [0.5] * spec["dim"]
        link.post_status({"level": 0, "cameras": {}, "rss_bytes": 123}, time.monotonic_ns())
        beat = receive(health, decode_health, lambda m: m.get("rss_bytes") == 123, timeout_s=5)
        assert beat["backend"] == "torch" and beat["control"]["ticks"] > 0
        assert link.stop("signal 15") == 0
        last = receive(health, decode_health, lambda m: "stopping" in m, timeout_s=5)
        assert last["stopping"] == "signal 15"
    finally:
        link.close()
        ctx.destroy(linger=0)


def test_a_closed_link_stops_the_publisher_and_frees_its_addresses():
    """What a SIGKILL of the node's process leaves: the publisher sees its link close, says so and exits 1; a new
    publisher binds the same addresses."""
    transport = private_addresses()
    link = PublisherLink(hello(transport))
    link.start({})
    link.sock.close()  # the node's end of the link gone, as when its process is killed
    assert link.proc.wait(10) == 1
    second = PublisherLink(hello(transport))  # binds again: the first let go of its sockets
    assert second.stop("done") == 0


def test_an_address_in_use_fails_the_start_with_its_name():
    transport = private_addresses()
    first = PublisherLink(hello(transport))
    try:
        with pytest.raises(OSError, match="cannot bind"):
            PublisherLink(hello(transport))
    finally:
        first.close()


def fifo_permitted(priority: int) -> bool:
    """Whether a process started from here may take SCHED_FIFO at `priority` (CAP_SYS_NICE or an rtprio limit)."""
    probe = f"import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param({priority}))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_the_publisher_process_takes_the_launch_files_sched_fifo_priority():
    """realtime.sched_fifo_priority reaches the publisher process (its ticks preempt every ordinary process: on a
    2-vCPU box a replay's frame decoding otherwise delayed a tick by 3-4 ms); the node's own process keeps its
    scheduling."""
    if not fifo_permitted(10):  # probed here, not at collection: every tier collects this module
        pytest.skip("SCHED_FIFO is not permitted here (no CAP_SYS_NICE or rtprio limit): the publisher runs on with "
                    "a warning")
    link = PublisherLink(hello(private_addresses(), sched_fifo_priority=10))
    try:
        link.start({})
        assert os.sched_getscheduler(link.proc.pid) == os.SCHED_FIFO
        assert os.sched_getparam(link.proc.pid).sched_priority == 10
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        assert link.stop("done") == 0
