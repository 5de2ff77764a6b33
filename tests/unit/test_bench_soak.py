"""bench soak's pure figures on made-up inputs: camera specs, RSS growth after warm-up, counter reconciliation (true
and false), the tick figures against bench node's, and the derived launch file."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from helpers.paths import TEST_LAUNCH_DIR
from vla_node.bench import soak
from vla_node.bench.soak import soak_launch
from vla_node.bench.soak_figures import (
    SoakCamera,
    missed_ticks,
    parse_camera,
    parse_cameras,
    reconcile,
    rss_figures,
    warmup_s,
)
from vla_node.config import default_launch, load_launch
from vla_node.validate import ConfigError

pytestmark = pytest.mark.timeout(120)
TINY = TEST_LAUNCH_DIR / "tiny.toml"
S = 1_000_000_000
MB = 2**20


def test_parse_camera():
    assert parse_camera("front=1920x1080@30") == SoakCamera("front", 1920, 1080, 30.0)
    assert parse_camera("rear.left=640x480@12.5").fps == 12.5
    for bad in ("front=1920x1080", "front:1920x1080@30", "=640x480@30", "front=16x16@30", "front=640x480@0",
                "front=640x480@300", "front=640x480@x"):
        with pytest.raises(ConfigError, match=r"--camera .*expected NAME=WxH@FPS"):
            parse_camera(bad)
    with pytest.raises(ConfigError, match="distinct names"):
        parse_cameras(["a=64x64@10", "a=64x64@10"])


def test_warmup_is_20_percent_or_10_s():
    assert warmup_s(60) == 12.0
    assert warmup_s(30) == 10.0
    assert warmup_s(3600) == 720.0


def _samples(mb_per_s, seconds=60, base_mb=400.0, start=5 * S):
    return [(start + i * S, int((base_mb + mb_per_s * i) * MB)) for i in range(seconds)]


def test_rss_flat_after_warmup_growth_before_is_ignored():
    start = 5 * S
    warm = [(start + i * S, int((300 + 10 * i) * MB)) for i in range(12)]  # 300 -> 410 MB during warm-up
    flat = [(start + (12 + i) * S, 410 * MB + (i % 3) * MB) for i in range(48)]  # +-1 MB noise
    r = rss_figures(warm + flat, start, 12 * S)
    assert r["samples"] == 60 and r["first_mb"] == 300.0
    assert abs(r["growth_pct"]) < 0.5 and r["start_mb"] == pytest.approx(411, abs=1)
    assert r["peak_growth_pct"] < 1 and abs(r["slope_mb_per_min"]) < 1
    assert len(r["series_s_mb"]) == 60 and r["series_s_mb"][0] == [0.0, 300.0]


def test_rss_growth_of_a_leak():
    r = rss_figures(_samples(1.0), 5 * S, 12 * S)  # 1 MB/s from 400 MB
    # medians of the first 5 after warm-up (12..16 s -> 414 MB) and the last 5 (55..59 s -> 457 MB)
    assert r["start_mb"] == pytest.approx(414) and r["end_mb"] == pytest.approx(457)
    assert r["growth_pct"] == pytest.approx((457 - 414) / 414 * 100, abs=1e-3)
    assert r["slope_mb_per_min"] == pytest.approx(60, rel=1e-3)


def test_rss_one_spike_moves_peak_not_growth():
    samples = _samples(0.0)
    samples[30] = (samples[30][0], 500 * MB)
    r = rss_figures(samples, 5 * S, 12 * S)
    assert r["growth_pct"] == 0 and r["peak_growth_pct"] == pytest.approx(25.0)


def test_rss_too_short_for_warmup():
    r = rss_figures(_samples(1.0, seconds=10), 5 * S, 12 * S)
    assert r["growth_pct"] is None and r["samples"] == 10 and r["max_mb"] == pytest.approx(409)
    assert rss_figures([], 0, S)["growth_pct"] is None


def _health(cameras, rejects=None, commands=100, discarded=0):
    rejects = rejects or {}
    return {"cameras": {name: {"received": r, "processed": p, "dropped": d} for name, (r, p, d) in cameras.items()},
            "rejects": rejects, "rejected": sum(rejects.values()), "commands": commands,
            "drops": {"discarded_in_bad_burst": discarded}}


def test_reconciled():
    health = _health({"front": (1800, 1200, 600), "rear": (1800, 1190, 609)})  # rear: one frame pending
    r = reconcile({"front": 1800, "rear": 1800}, 100, health)
    assert r["reconciled"] and r["mismatches"] == []
    assert r["cameras"]["rear"] == {"sent": 1800, "received": 1800, "processed": 1190, "dropped": 609, "pending": 1}


def test_reconciled_with_rejects_node_wide():
    health = _health({"front": (1795, 1200, 595), "rear": (1800, 1200, 600)}, rejects={"bad_size": 3}, commands=98,
                     discarded=2)
    r = reconcile({"front": 1800, "rear": 1800}, 100, health)  # 5 frames + 2 states = 3 rejected + 2 discarded + 2
    assert not r["reconciled"] and "+2 unaccounted" in r["mismatches"][0]
    health["rejects"], health["rejected"] = {"bad_size": 3, "stale_command": 2}, 5
    assert reconcile({"front": 1800, "rear": 1800}, 100, health)["reconciled"]


def test_not_reconciled_frames_lost():
    r = reconcile({"front": 1800, "rear": 1800}, 100, _health({"front": (1790, 1200, 590), "rear": (1800, 1200, 600)}))
    assert not r["reconciled"]
    assert r["mismatches"] == ["sent 3600 frames + 100 states, the node received 3590 frames + accepted 100 commands, "
                               "rejected 0 {}, discarded 0: +10 unaccounted"]


def test_not_reconciled_processed_dropped_do_not_add_up():
    r = reconcile({"front": 1800}, 100, _health({"front": (1800, 1200, 590)}))  # 10 frames neither
    assert not r["reconciled"]
    assert r["mismatches"] == ["front: received 1800 != processed 1200 + dropped 590 (+ pending <= 1): +10"]
    r = reconcile({"front": 1800}, 100, _health({"front": (1800, 1200, 601)}))
    assert r["mismatches"] == ["front: received 1800 != processed 1200 + dropped 601 (+ pending <= 1): -1"]


def test_not_reconciled_more_received_than_sent_or_unknown_camera():
    r = reconcile({"front": 1800}, 100, _health({"front": (1801, 1201, 600)}))
    assert not r["reconciled"] and "the node received 1801 frames, the client sent 1800" in r["mismatches"][0]
    r = reconcile({"front": 10, "rear": 10}, 100, _health({"front": (10, 10, 0), "side": (0, 0, 0)}))
    assert any(m.startswith("rear: not in the node's health") for m in r["mismatches"])
    assert any("never sent: ['side']" in m for m in r["mismatches"])


def test_missed_ticks_counts_skips_once():
    assert missed_ticks({"lost": 2, "skipped": 3}, node_missed=3) == 5
    assert missed_ticks({"lost": 0, "skipped": 0}, node_missed=4) == 4
    assert missed_ticks({"lost": 0, "skipped": 0}, node_missed=0) == 0


def test_soak_launch_replaces_cameras(tmp_path):
    cameras = parse_cameras(["front=1920x1080@30", "rear=640x480@30"])
    path = soak_launch(default_launch(), cameras, tmp_path, control_hz=40.0,
                       preset="tiny")
    config = load_launch(path)
    assert [(c.name, c.max_width, c.max_height) for c in config.cameras] == [("front", 1920, 1080),
                                                                             ("rear", 640, 480)]
    assert config.scheduler.control_hz == 40.0 and config.model.model_config().num_cameras == 2
    assert config.model.model_config().hidden_size == 64  # tiny's shapes
    one = soak_launch(default_launch(), cameras[:1], tmp_path / "one", preset="tiny")
    assert load_launch(one).model.checkpoint is None and load_launch(one).model.preset == "tiny"


def test_soak_launch_refuses_a_checkpoint_of_other_cameras(tmp_path):
    cameras = parse_cameras(["a=64x64@10", "b=64x64@10"])
    two = soak_launch(default_launch(), cameras, tmp_path, preset="tiny")
    with pytest.raises(ConfigError, match=r"takes 2 camera\(s\): expected 1"):
        soak_launch(two, cameras[:1], tmp_path / "again")


def test_reconcile_state_seq_gaps_against_refused_sends():
    health = _health({"front": (10, 10, 0)}, commands=98)
    health["commands_lost"] = {"instruction": 0, "state": 2}
    assert reconcile({"front": 10}, 98, health, states_unsent=2)["reconciled"]
    r = reconcile({"front": 10}, 98, health, states_unsent=0)
    assert r["mismatches"] == ["the node counts 2 states lost on the way (seq gaps), the client 0 refused at send"]


def _made_up_soak(seconds=60, rss_mb=lambda t: 400.0, publisher_mb=None):
    """What SoakClient holds after a run: ticks on a 50 Hz grid, health each second, a settled final health."""
    period, start = 20_000_000, 10**12
    n = seconds * 50
    stamps = start + np.arange(n) * period + 100_000
    health = []
    for i in range(1, seconds + 1):
        msg = {"stamp_ns": start + i * S, "rss_bytes": int(rss_mb(i) * MB), "level": 0,
               "control": {"missed_ticks": 0}, "transport": {"publish_dropped": 0}}
        if publisher_mb is not None:
            msg["publisher_rss_bytes"] = int(publisher_mb(i) * MB)
        health.append((msg["stamp_ns"] + 50_000, msg))
    client = {"cameras": {"front": {"spec": "front=64x64@30", "sent": 1800, "unsent": 0, "late": 0}},
              "states_sent": 600, "states_unsent": 0, "actions_read": n, "health_read": seconds}
    return SimpleNamespace(health=health, start_ns=start, end_ns=start + seconds * S, n=n, stamp=stamps,
                           seq=np.arange(n), arrival=stamps + 200_000, status=np.zeros(n, np.int8),
                           levels=Counter({0: n}), states_sent=600, states_unsent=0, figures=lambda: client)


def _final():
    final = _health({"front": (1800, 1000, 800)}, commands=600)
    final.update(level=0, control={"missed_ticks": 0, "status_counts": {}}, frames_processed=1000)
    return final


def test_figures_targets_and_table_of_a_made_up_soak():
    config = load_launch(TINY)
    result = soak.figures(_made_up_soak(), _final(), True, config, 60.0)
    result["context"].update(cameras=["front=64x64@30"], encoding="rgb8", loadavg_before=[0], loadavg_after=[0])
    assert result["pass"] == {"rss_growth_pct": True, "missed_ticks": True, "control_jitter_ms_p99": True,
                              "reconciled": True}
    assert result["missed_ticks"] == 0 and result["ticks"]["received"] == 3000
    assert result["control_jitter_ms"]["p99"] == 0.0  # a constant lateness moves the recovered grid
    assert result["statuses"] == {"fresh": 3000, "chunk": 0, "fallback": 0} and result["levels"] == {"0": 3000}
    text = soak.table(result)
    assert "counters reconcile" in text and "MISS" not in text and "front" in text
    leaking = soak.figures(_made_up_soak(rss_mb=lambda t: 400 + t), _final(), False, config, 60.0)
    assert leaking["pass"]["rss_growth_pct"] is False and leaking["rss"]["growth_pct"] > 5
    assert not leaking["pass"]["reconciled"] and "still changing" in leaking["counters"]["mismatches"][-1]
    publisher = soak.figures(_made_up_soak(publisher_mb=lambda t: 50 + t), _final(), True, config, 60.0)
    assert publisher["rss"]["growth_pct"] == 0 and publisher["pass"]["rss_growth_pct"] is False
