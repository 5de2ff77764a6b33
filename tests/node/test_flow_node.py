"""The flow head through a real node: a replay of the node started from a launch file that names a flow checkpoint,
with real-time chunking on and an injected delay of the action stage, reports its head, its denoising steps and
its chunk-boundary continuity."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.drive_checks import check_report, native_drive
from helpers.node_helpers import road_frames
from vla_node.drives.replay import replay
from vla_node.model.checkpoint import save_checkpoint
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.node.faults import FAULT_FILE_ENV

TINY_LAUNCH = Path(__file__).parents[1] / "launch" / "tiny.toml"


def test_a_flow_node_with_real_time_chunking_reports_its_chunks_continuity(tmp_path, monkeypatch):
    # four Euler steps and loose deadlines: each chunk (with the delay below) takes well under its 320 ms of play-out
    # even on a slow, shared host, so every fresh chunk takes over from one still playing; the ladder stays at normal
    # (a CI host measured 79 ms p99 against the 100 ms action deadline and degraded to chunk play-out; another, 174 ms
    # p99 and 209 ms frame-to-action p99, which outlasted 8 ticks' 160 ms: 56 fallback ticks, 9 boundaries)
    config = preset("tiny", "flow").replace(action_horizon=16, flow_steps=4)
    checkpoint = save_checkpoint(build_vla(config, seed=1), tmp_path / "m")
    launch = tmp_path / "flow.toml"
    text = TINY_LAUNCH.read_text().replace('preset = "tiny"', f'checkpoint = "{checkpoint}"')
    for key, ms in (("action", 400), ("vision", 500), ("text", 600), ("chunk_max", 400)):
        text = re.sub(rf"{key}_(deadline|age)_ms = [0-9.]+", rf"{key}_\1_ms = {ms}.0", text)
    launch.write_text(text.replace("[scheduler]", "[scheduler]\nreal_time_chunking = true\ndenoising_steps = [2]"))
    faults = tmp_path / "faults"
    faults.write_text("action 30\n")  # every tick 30 ms slower: one and a half control periods
    monkeypatch.setenv(FAULT_FILE_ENV, str(faults))
    drive = native_drive(tmp_path / "d.mcap", road_frames(30, 64, 48), fps=10.0)
    report, json_path, html_path = replay(drive, launch, out_dir=tmp_path / "out", progress=False)
    check_report(report, json_path, html_path, 30)
    assert report["head"] == "flow" and 2 <= report["denoising_steps_mean"] <= 10  # the ladder may take fewer
    assert report["chunk_boundaries"] >= 10, report
    assert report["chunk_boundary_deviation"] is not None and report["chunk_step_within"] is not None
