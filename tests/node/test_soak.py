"""A one-minute soak of the node (tiny preset, the two default cameras at their real sizes: 1920x1080 and 640x480
rgb8 at 30 fps each, the state at 10 Hz): RSS flat after warm-up, every tick published or counted as missed, every
frame and state accounted for. Jitter and a zero of missed ticks are not asserted: they are wall-clock figures, the
benchmark's (`vla-node bench soak`, target 0 missed) on a quiet machine. A shared 2-vCPU CI machine once stalled the
publisher past a whole 20 ms period (1 tick of 3000 missed, counted by the node and seen in the stamps), so the test
allows 0.1% of the ticks skipped, and none published and lost. The node runs as the launch files deploy it, its worker
at nice 10 (realtime.worker_nice), so that the publisher preempts the worker when a tick is due; at the worker's own
nice a later CI run missed 4 ticks of 3000."""

from __future__ import annotations

import pytest

from helpers.node_harness import TINY_LAUNCH
from vla_node.bench import soak
from vla_node.config import load_launch


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_minute_soak(tmp_path):
    launch = tmp_path / "tiny_soak.toml"
    launch.write_text(TINY_LAUNCH.read_text().replace("[realtime]\n", "[realtime]\nworker_nice = 10\n"))
    result = soak.run(1, launch=launch, out_dir=tmp_path, progress=False)
    log = (tmp_path / "node.log").read_text(errors="replace")[-3000:]
    table = soak.table(result)
    assert load_launch(launch).realtime.worker_nice == 10
    assert result["context"]["exit_code"] == 0, f"{table}\nnode log:\n{log}"
    assert result["context"]["cameras"] == list(soak.DEFAULT_CAMERAS)
    rss, counters, client = result["rss"], result["counters"], result["client"]
    assert rss["samples"] >= 100 and rss["growth_pct"] is not None  # health every 0.5 s in tiny.toml
    assert rss["growth_pct"] < 5.0, f"RSS grew after warm-up:\n{table}\n{rss['series_s_mb']}"
    ticks = result["ticks"]
    assert ticks["lost_seq_gaps"] == 0, ticks  # every tick published arrived
    assert result["missed_ticks"] <= 0.001 * ticks["expected"], f"{ticks}\n{table}\nnode log:\n{log}"
    assert result["ticks"]["received"] >= 0.95 * 60 * 50, table
    assert counters["reconciled"], f"{counters['mismatches']}\n{table}"
    for name, cam in client["cameras"].items():  # each camera sent at (nearly) its 30 fps
        assert cam["sent"] >= 0.95 * 60 * 30, (name, cam)
        assert counters["cameras"][name]["processed"] > 0, table
    assert client["states_sent"] >= 0.99 * 60 * 10 and counters["commands"]["accepted"] == client["states_sent"]
    assert result["statuses"]["fresh"] > 0, table
