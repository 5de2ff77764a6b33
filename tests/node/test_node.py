"""The node over loopback ZeroMQ, in its own process: every control tick published with valid fields, fresh
actions name frames the client sent, latest-frame-wins under a burst with bounded memory, degrade and recovery
under an injected vision delay, clean exit on SIGTERM and SIGINT."""

from __future__ import annotations

import signal
import time

import pytest

from helpers.node_harness import (
    LAUNCH_DIR,
    PATIENT_LAUNCH,
    TINY_LAUNCH,
    FreshLost,
    check_action,
    running_node,
    tick_count,
)
from vla_node.config import load_launch

LAUNCH = LAUNCH_DIR / "tiny_fast_recover.toml"
CONFIG = load_launch(LAUNCH)
MODEL = CONFIG.model.model_config()
PERIOD_NS = CONFIG.scheduler.period_ns
FALLBACK = [0.0] * MODEL.action_dims  # the launch file sets no fallback_action: zeros


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_node(LAUNCH, tmp_path_factory.mktemp("node"), stage_delay=True) as node:
        yield node


@pytest.fixture(scope="module")
def patient_node(tmp_path_factory):
    """Generous deadlines: a frame queued while the worker is held busy still makes a fresh action."""
    with running_node(PATIENT_LAUNCH, tmp_path_factory.mktemp("patient"), stage_delay=True) as node:
        yield node


def wait_level0(node, timeout_s: float = 20.0) -> dict:
    """Stream frames until health says level 0 (earlier tests may have left the node degraded)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        node.stream(0.5)
        health = node.health(timeout_s=2.0)
        if health["level"] == 0:
            return health
    raise AssertionError(f"the node did not return to level 0 within {timeout_s} s: {health}")


def test_every_tick_is_published_with_valid_fields(node):
    node.stream(1.0)  # the first frames after the handshake: let the stage estimates settle
    node.queued_health()
    actions, sent = node.stream(6.0, fps=10.0)
    healths = node.queued_health()  # published while frames were streaming
    counts = tick_count(actions, PERIOD_NS)
    log = node.process.log_tail()
    assert counts["received"] >= 0.99 * counts["expected"], (counts, log)
    assert counts["lost"] == 0, counts
    statuses = {}
    for received in actions:
        msg = received.msg
        check_action(msg, MODEL.action_horizon, MODEL.action_dims, FALLBACK)
        statuses[msg["status"]] = statuses.get(msg["status"], 0) + 1
        if msg["status"] == "fresh":
            assert msg["frame_seq"] in node.sent, msg  # a frame this client sent ...
            assert msg["frame_stamp_ns"] == node.sent[msg["frame_seq"]], msg  # ... with the stamp it was sent with
            assert msg["stamp_ns"] >= msg["frame_stamp_ns"], msg
    fresh_frames = {r.msg["frame_seq"] for r in actions if r.msg["status"] == "fresh"}
    # 10 Hz frames on a tiny model well inside its deadline: nearly every frame makes a fresh action
    assert len(fresh_frames) >= 0.8 * len(sent), (len(fresh_frames), len(sent), statuses, log)
    assert statuses.get("chunk", 0) > 0, statuses
    health = healths[-1]
    assert health["control"]["ticks"] >= counts["received"] * 0.9, health["control"]
    assert health["cameras"]["front"]["alive"] and health["cameras"]["front"]["rate_ok"], health["cameras"]
    assert health["rejected"] == 0, health["rejects"]
    print(f"ticks {counts}, statuses {statuses}, fresh frames {len(fresh_frames)}/{len(sent)}")


def burst(node, frames: int, height: int = 48, width: int = 64) -> tuple[list[int], int]:
    """Publish `frames` frames back to back: (their seqs, send time in ns)."""
    images = [node.image(height, width) for _ in range(frames)]
    seqs = []
    t0 = time.monotonic_ns()
    for image in images:
        seqs.append(node.send_frame(image)[0])
    return seqs, time.monotonic_ns() - t0


def quiescent(health: dict) -> bool:
    """Every frame received so far was processed or superseded: nothing in flight."""
    cam = health["cameras"]["front"]
    return cam["received"] == cam["processed"] + cam["dropped"]


def test_burst_of_100_frames_only_the_newest_is_processed(patient_node):
    node = patient_node
    for attempt in range(3):  # another burst only if tick jitter hid the newest frame's fresh tick (FreshLost)
        node.stream(1.0)
        before = node.health(until=quiescent)
        # Keep the worker busy in the vision stage of a primer frame while the burst arrives, so that the whole
        # burst is queued when the worker next drains (otherwise a drain could land mid-burst).
        node.set_delay("vision", 300)
        time.sleep(0.12)
        node.drain_actions()
        primer, _ = node.send_frame()
        time.sleep(0.05)
        seqs, send_ns = burst(node, 100)
        node.set_delay("vision", 0)
        newest = seqs[-1]
        try:
            action, earlier = node.wait_fresh(newest, timeout_s=5.0)
            first = action
        except FreshLost as lost:
            if attempt == 2:
                raise
            action, earlier, first = None, lost.before, lost.msg
        later = node.recv_actions(0.5)
        fresh_named = {r.msg["frame_seq"] for r in earlier + later if r.msg["status"] == "fresh"}
        assert fresh_named <= {primer, newest}, (fresh_named, send_ns / 1e6)
        assert first["frame_seq"] == newest

        def handled(h: dict) -> int:  # frames processed or dropped since `before`
            return (h["cameras"]["front"]["processed"] - before["cameras"]["front"]["processed"]
                    + h["frames_dropped"] - before["frames_dropped"])

        after = node.health(until=lambda h: handled(h) >= 101 and quiescent(h))
        processed = after["cameras"]["front"]["processed"] - before["cameras"]["front"]["processed"]
        assert processed in (1, 2), (before["cameras"], after["cameras"])  # newest; primer unless superseded
        assert handled(after) == 101, (processed, before["drops"], after["drops"])
        assert after["cameras"]["front"]["last_seq"] == newest
        assert after["rejected"] == before["rejected"]
        if action is not None:
            break
    print(f"burst of 100 sent in {send_ns / 1e6:.1f} ms (attempt {attempt + 1}): processed {processed} (primer "
          f"{primer}, newest {newest}), dropped {after['frames_dropped'] - before['frames_dropped']}, fresh actions "
          f"named {fresh_named | {newest}}")


def test_memory_stays_bounded_over_repeated_bursts(patient_node):
    node = patient_node
    rss = []
    for _ in range(6):
        seqs, _ = burst(node, 100, 480, 640)  # 100 x 921,600-byte frames at once
        node.health(until=lambda h: h["cameras"]["front"]["last_seq"] == seqs[-1] and quiescent(h))
        rss.append(node.health(timeout_s=3.0)["rss_bytes"])
    print(f"node rss after each burst (MiB): {[round(r / 2**20, 1) for r in rss]}")
    # The allocator's footprint wobbles by up to ~20 MB between samples (freed 0.9 MB message buffers are not
    # always returned at once; seen: 313, 330, 313, 315, 322, 325 MiB): compare the lowest of the last three
    # samples with the lowest of the first three. Keeping a burst's frames would add ~90 MB per burst, and
    # keeping even 10 of its 100 frames ~27 MB over the three later bursts: both fail this bound.
    growth = min(rss[3:]) - min(rss[:3])
    assert growth <= 25 * 2**20, [round(r / 2**20, 1) for r in rss]


def test_vision_delay_degrades_then_recovers_while_every_tick_is_published(node):
    wait_level0(node)
    node.queued_health()
    t0 = time.monotonic_ns()
    try:  # 10 Hz frames throughout; from 1 s to 4 s every vision stage overruns the 400 ms vision deadline
        actions, _ = node.stream(5.0, events=[(1.0, lambda: node.set_delay("vision", 500)),
                                              (4.0, lambda: node.set_delay("vision", 0))])
    finally:
        node.set_delay("vision", 0)
    healths = node.queued_health()
    counts = tick_count(actions, PERIOD_NS)
    assert counts["received"] >= 0.99 * counts["expected"], counts
    assert counts["lost"] == 0, counts
    for received in actions:
        check_action(received.msg, MODEL.action_horizon, MODEL.action_dims, FALLBACK)
    during = [r.msg for r in actions if t0 + 0.8e9 <= r.arrival_ns <= t0 + 4.0e9]
    statuses = [m["status"] for m in during]
    # the last chunk made before the delay plays out, then the safe action for as long as no chunk is on time
    # (at least 25 ticks in a row: half a second)
    text = "".join({"fresh": "F", "chunk": "c", "fallback": "b"}[s] for s in statuses)
    assert "c" + "b" * 25 in text, text
    health_levels = [h["level"] for h in healths if t0 + 1.0e9 <= h["stamp_ns"]]
    assert max(health_levels + [m["level"] for m in during]) > 0, (health_levels, statuses)
    scheduler = healths[-1]["scheduler"]
    assert scheduler["level_ups"] >= 1 and scheduler["missed_frames"] >= 1, scheduler
    # Recovery: the delay is off; hysteresis steps down one level per recover_after_ok on-time frames.
    t1 = time.monotonic()
    recovered = wait_level0(node, timeout_s=30.0)
    assert recovered["scheduler"]["level_downs"] >= 1, recovered
    seq, action = node.send_and_wait_fresh()
    assert action["level"] == 0, action
    print(f"levels during the delay (health): {health_levels}; back at level 0 {time.monotonic() - t1 + 1:.1f} s "
          f"after the delay stopped; statuses during the delay: { {s: statuses.count(s) for s in set(statuses)} }")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_clean_shutdown_on_signal(tmp_path, sig):
    with running_node(TINY_LAUNCH, tmp_path) as node:
        actions, _ = node.stream(1.0)  # under load: frames in, actions out
        assert actions
        rc, seconds = node.process.stop(sig, timeout_s=10.0)
        log = node.process.log_tail()
        assert rc == 0, (rc, log)
        assert seconds < 3.0, (seconds, log)
        assert "node stopped cleanly" in log, log
        print(f"{signal.Signals(sig).name}: exit code {rc} after {seconds:.2f} s")
