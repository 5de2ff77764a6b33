"""`vla-node drive`: the simulator and a real node over loopback ZeroMQ in real time, closed loop, with its reports;
and a delay that takes the node to chunk, then fallback, brings the car to a stop in its lane. The policy is the
trained tiny checkpoint kept with the code (checkpoints/tiny/bins; what it drives in process: test_checkpoints)."""

from __future__ import annotations

import json

import pytest

from vla_node.drives.closed_loop import SIM_CHECKPOINTS, SIM_LAUNCH, drive
from vla_node.node.faults import FAULT_FILE_ENV
from vla_node.report.report import load_report
from vla_node.sim.instructions import KEEP, LEFT
from vla_node.sim.scenario import Cue
from vla_node.validate import ConfigError


def test_a_trained_policy_drives_through_the_node_and_both_reports_are_written(tmp_path):
    result = drive(SIM_CHECKPOINTS / "bins", SIM_LAUNCH, minutes=0.3, seed=2, out_dir=tmp_path, progress=False,
                   cues=(Cue(0.0, KEEP), Cue(9.0, LEFT)))
    assert not result["left_road"] and result["seconds"] == pytest.approx(18.0, abs=0.05)
    assert result["lateral_error_mean_m"] < 0.5
    statuses = result["latency"]["status_counts"]
    assert statuses["fresh"] > 100 and result["latency"]["frames_processed"] > 200  # the node drove it
    assert result["lane_departures"] == 0 and result["instructions"][1]["success"]  # changed lane, in the new one
    assert [r["instruction"] for r in result["instructions"]][:2] == [KEEP, LEFT]
    saved = json.loads((tmp_path / "drive.json").read_text())
    assert saved["lane_departures"] == result["lane_departures"] and len(saved["trace"]["x"]) > 170  # 10 Hz
    assert saved["geometry"]["lanes"] >= 2 and saved["overrides"][0].startswith("model.checkpoint=")
    page = (tmp_path / "drive.html").read_text()
    for plot in ("plot-birds-eye", "plot-along-road", "plot-speed", "plot-actions"):
        assert f'id="{plot}"' in page
    latency = load_report(tmp_path / "report.json")  # the replay's latency report, validated on load
    assert latency["frames_sent"] == result["latency"]["frames_sent"] >= 440
    assert latency["deadline_misses"] == result["latency"]["deadline_misses"]


def test_a_delay_forces_chunk_then_fallback_and_the_car_stops_in_its_lane(tmp_path):
    """On road 0's curve: sim.toml's fallback brakes holding the last steering played (scheduler.fallback_hold);
    with the wheels straight instead (fallback_hold = [false, false]) the car departs its lane at speed, 2.2 m off
    (at half the brake it left the road at 13.8 s, at 6 m/s)."""
    faults = tmp_path / "faults.txt"
    result = drive(SIM_CHECKPOINTS / "bins", SIM_LAUNCH, minutes=0.35, seed=0, out_dir=tmp_path, progress=False,
                   cues=(Cue(0.0, KEEP),), env={FAULT_FILE_ENV: str(faults)},
                   fault_schedule=((9.0, faults, "vision 400\naction 200\n"),))
    statuses = result["latency"]["status_counts"]
    assert statuses["chunk"] > 0 and statuses["fallback"] > 500
    assert result["final_speed_mps"] < 0.5  # the fallback brakes: the car came to a stop
    assert result["departures_at_speed"] == 0 and not result["left_road"]
    assert result["lateral_error_max_m"] < 1.0  # in its lane


def test_drive_refuses_a_checkpoint_the_simulator_cannot_drive(tmp_path):
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        drive(tmp_path, SIM_LAUNCH, minutes=0.1, out_dir=tmp_path / "out", progress=False)


def test_the_closed_loop_bench_drives_each_configuration_and_measures_it_offline(tmp_path):
    from vla_node.bench import closed_loop

    result = closed_loop.run(json_path=str(tmp_path / "closed.json"),
                             minutes=0.05, heads=("bins",), only=("reference", "level: skip_vision"),
                             out_dir=str(tmp_path / "work"), progress=False)
    rows = {r["name"]: r for r in result["heads"]["bins"]["configurations"]}
    assert list(rows) == ["reference", "level: skip_vision"]
    for row in rows.values():
        assert set(closed_loop.FIGURES) <= set(row) and row["offline"]["frames"] > 0
    assert rows["reference"]["offline"]["logit_rel_err"] < 1e-4  # the reference is the oracle offline too
    assert rows["reference"]["offline"]["bins_agreement"] == 1.0
    assert rows["level: skip_vision"]["offline"]["logit_rel_err"] > 0.01  # acting on the first frame's vision
    assert json.loads((tmp_path / "closed.json").read_text())["heads"]["bins"]["configurations"][0]["name"] == \
        "reference"
    with pytest.raises(ConfigError, match=r"--only = \['no such'\]: expected configurations among"):
        closed_loop.run(heads=("bins",), only=("no such",),
                        progress=False)
