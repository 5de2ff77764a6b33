"""The chunk broker is the only object whose state the node's worker and publisher threads share: the
publisher's code reads nothing of the worker's (pipeline, ingest, scheduler, policy), and a frame's figures reach
the published action through the broker with its chunk."""

from __future__ import annotations

import ast
import inspect
import textwrap

import numpy as np

from vla_node.node.node import Node
from vla_node.sched.broker import ChunkBroker, TickStatus

WORKER_OWNED = {"pipeline", "ingest", "frame_topics"}
# what the publisher may touch: its own settings and counters, the broker, the transport's output side
PUBLISHER_MAY_TOUCH = {"config", "backend", "clock", "broker", "transport", "seq", "started_ns", "stop_event", "health",
                       "_level"}


def self_attributes(function) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}


def test_the_publisher_thread_touches_only_the_broker_of_the_workers_state():
    touched = self_attributes(Node._publisher_loop) | self_attributes(Node.health) | self_attributes(Node._level)
    assert not touched & WORKER_OWNED, touched & WORKER_OWNED
    assert touched <= PUBLISHER_MAY_TOUCH, touched - PUBLISHER_MAY_TOUCH
    assert "pipeline" in self_attributes(Node._worker_loop) | self_attributes(Node._worker_status)


def test_a_frames_figures_travel_with_its_chunk_and_the_workers_status_with_its_stamp():
    broker = ChunkBroker(2, 3, period_ns=20_000_000, late_after_ns=100_000_000)
    assert broker.status() == (None, 0)
    chunk = np.arange(6, dtype=np.float32).reshape(2, 3)
    broker.offer(chunk, frame_seq=7, frame_stamp_ns=1_000, produced_ns=2_000, level=1, timing_ms={"vision": 3.0},
                 tokens_refreshed=42, reuse_ratio=0.75)
    out = broker.next(2_000)
    assert out.status is TickStatus.FRESH
    assert (out.frame_seq, out.level, out.tokens_refreshed, out.reuse_ratio) == (7, 1, 42, 0.75)
    later = broker.next(2_000 + 20_000_000)  # the chunk's next step keeps its frame's figures
    assert later.status is TickStatus.CHUNK and (later.tokens_refreshed, later.reuse_ratio) == (42, 0.75)
    status = {"frames_processed": 3}
    broker.post_status(status, 5_000)
    assert broker.status() == (status, 5_000)


def test_figures_of_a_stalled_worker_say_no_camera_is_alive():
    """health() on the publisher's side: the worker's posted figures, and once they are older than the camera
    timeout every camera not alive (a stalled worker learns of no frame)."""
    from types import SimpleNamespace

    from helpers.paths import TEST_LAUNCH_DIR
    from vla_node.config import load_launch
    from vla_node.node.policies import BackendChoice
    from vla_node.sched.clock import ControlClock

    config = load_launch(TEST_LAUNCH_DIR / "tiny.toml")
    node = Node.__new__(Node)  # the publisher's side only: no model, no sockets
    node.config, node.started_ns = config, 0
    node.broker = ChunkBroker(2, 3, period_ns=20_000_000, late_after_ns=100_000_000)
    node.transport = SimpleNamespace(publish_dropped=0)
    node.backend = BackendChoice("torch", "fp32 weights")
    camera = {"alive": True, "rate_ok": True, "rate_hz": 10.0}
    node.broker.post_status({"level": 2, "cameras": {"front": camera}, "reconnects": 1}, 1_000_000_000)
    clock = ControlClock(20_000_000, 0)
    fresh = node.health(1_100_000_000, clock)
    assert fresh["level"] == 2 and fresh["cameras"]["front"]["alive"] and fresh["transport"]["reconnects"] == 1
    assert fresh["worker_age_ms"] == 100.0
    timeout_ns = int(config.health.camera_timeout_ms * 1e6)
    stale = node.health(1_000_000_000 + timeout_ns + 1, clock)
    assert stale["cameras"]["front"] == {"alive": False, "rate_ok": False, "rate_hz": 10.0}
    assert camera["alive"]  # the posted figures themselves are not changed
    assert node._level(None) == 2 and node._level(0) == 0
