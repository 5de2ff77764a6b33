"""The fleet's jobs (drives from paths, folders and lists; repeats; shards) and its report (distributions, worst
first, the regression gate between two fleet reports), and a shard's Ctrl-C, without running a node."""

from __future__ import annotations

import copy
import json
import os

import pytest

from helpers.ctrl_c import CtrlCWhenCollected, python_ctrl_c
from vla_node.fleet import run as fleet_run_module
from vla_node.fleet.jobs import list_drives, make_jobs, shard
from vla_node.fleet.task import Replay, write_json
from vla_node.report.fleet import build_fleet_report, compare_fleets, load_fleet_report, write_fleet_report
from vla_node.validate import ConfigError


def row(job: str, p99: float, misses: int = 0, status: str = "ok", actions=None) -> dict:
    return {"job": job, "drive": f"/d/{job}.mcap", "drive_id": job.rsplit("-r", 1)[0], "repeat": 0, "status": status,
            "attempts": 1, "errors": [] if status == "ok" else ["attempt 1: boom"],
            "machine": {"host": "m1", "cpu": "AMD EPYC"} if status == "ok" else None, "timed": True,
            "start_ns": 1, "end_ns": 2, "wall_s": 1.0, "model": "tiny", "backend": "torch", "recipe": "fp32",
            "figures": None if status != "ok" else {"latency_p50_ms": p99 / 2, "latency_p99_ms": p99,
                                                   "latency_max_ms": p99, "deadline_misses": misses,
                                                   "jitter_p99_ms": 0.3, "reuse_ratio": 0.5, "frames_sent": 10,
                                                   "frames_processed": 10, "status_counts": {}},
            "report": None, "fresh_actions": actions or {"0": [0.1, 0.2], "1": [0.3, 0.4]}}


def test_drives_from_files_folders_and_lists(tmp_path):
    (tmp_path / "lib").mkdir()
    for name in ("b.mcap", "a.mcap", "c.mp4", "notes.md"):
        (tmp_path / "lib" / name).write_bytes(b"x")
    (tmp_path / "list.txt").write_text("# drives\nlib/a.mcap\n\nlib/c.mp4  # a video\n")
    assert [p.name for p in list_drives([str(tmp_path / "lib")])] == ["a.mcap", "b.mcap", "c.mp4"]
    assert [p.name for p in list_drives([str(tmp_path / "list.txt"), str(tmp_path / "lib/a.mcap")])] == [
        "a.mcap", "c.mp4"]  # duplicates dropped, order kept
    (tmp_path / "bad.txt").write_text("lib/nope.mcap\n")
    with pytest.raises(ConfigError, match=r"bad.txt:1: drive 'lib/nope.mcap': no such file"):
        list_drives([str(tmp_path / "bad.txt")])
    with pytest.raises(ConfigError, match="existing drive file"):
        list_drives([str(tmp_path / "missing.mcap")])


def test_jobs_repeats_and_shards_cover_every_drive_once(tmp_path):
    drives = []
    for n in range(7):
        (tmp_path / f"d{n}").mkdir()
        drives.append(tmp_path / f"d{n}" / ("same.mcap" if n < 2 else f"drive{n}.mcap"))
        drives[-1].write_bytes(b"x")
    jobs = make_jobs(drives, repeat=2)
    assert len(jobs) == 14 and len({j.key for j in jobs}) == 14  # two drives named alike get distinct ids
    assert jobs[0].drive_id.startswith("same-") and jobs[0].drive_id != jobs[2].drive_id
    shards = [shard(jobs, i, 3) for i in range(3)]
    assert sorted(j.key for s in shards for j in s) == sorted(j.key for j in jobs)
    assert all(len({j.drive_id for j in s} & {j.drive_id for j in t}) == 0 for s in shards for t in shards if s is not t)
    assert [j.drive_id for j in shards[1]][::2] == [jobs[2].drive_id, jobs[8].drive_id]  # positions 1, 4
    with pytest.raises(ConfigError, match="index"):
        shard(jobs, 3, 3)


def test_the_report_puts_failed_then_the_worst_first(tmp_path):
    rows = [row("a-r0", 10.0), row("b-r0", 30.0), row("c-r0", 0.0, status="failed"), row("d-r0", 20.0)]
    report = build_fleet_report(rows, {"launch": "x.toml"})
    assert [r["job"] for r in report["rows"]] == ["c-r0", "b-r0", "d-r0", "a-r0"]
    assert report["fleet"]["ok"] == 3 and report["fleet"]["failed"] == 1 and report["fleet"]["drives"] == 4
    assert report["distributions"]["latency_p99_ms"]["max"] == 30.0
    json_path, html_path = write_fleet_report(report, tmp_path)
    assert load_fleet_report(json_path) == report and "boom" in html_path.read_text()


def test_compare_catches_a_planted_regression_and_passes_an_identical_pair():
    base = build_fleet_report([row(f"drive{n}-r0", 10.0 + n) for n in range(5)], {})
    text, regressions = compare_fleets(base, copy.deepcopy(base), 10.0)
    assert regressions == [] and text.endswith("within 10%)")
    new = copy.deepcopy(base)
    planted = next(r for r in new["rows"] if r["job"] == "drive3-r0")
    planted["figures"]["latency_p99_ms"] *= 1.5  # one drive among five got slower
    planted["figures"]["deadline_misses"] = 2
    text, regressions = compare_fleets(base, new, 10.0)
    assert len(regressions) == 2 and all(r.startswith("drive3-r0:") for r in regressions), regressions
    assert "REGRESSED" in text
    moved = copy.deepcopy(base)  # the same frames, other actions: a deviation past its bound
    next(r for r in moved["rows"] if r["job"] == "drive1-r0")["fresh_actions"]["1"] = [0.8, 0.4]
    _, regressions = compare_fleets(base, moved, 10.0, max_action_deviation=0.1)
    assert regressions == ["drive1-r0: action deviation 0.1250 over 2 frames (bound 0.1)"]
    gone = copy.deepcopy(base)
    gone["rows"] = [r for r in gone["rows"] if r["job"] != "drive0-r0"]
    assert compare_fleets(base, gone, 10.0)[1] == ["drive0-r0: missing in new"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_python_dropped_in_a_job_stops_the_shard_before_the_next(tmp_path, monkeypatch):
    ran = []

    def job_with_a_dropped_ctrl_c(job, replay_args, out, attempt):  # a replay during which a Ctrl-C was dropped
        ran.append(job.key)
        CtrlCWhenCollected()
        return row(job.key, 10.0)

    monkeypatch.setattr(fleet_run_module, "run_job", job_with_a_dropped_ctrl_c)
    jobs = make_jobs([tmp_path / f"d{n}.mcap" for n in range(3)])
    with python_ctrl_c(), pytest.raises(KeyboardInterrupt):
        fleet_run_module.run_local(jobs, Replay("launch.toml"), tmp_path / "out", progress=False)
    assert ran == ["d0-r0"]  # that job finished and its row is kept: --resume starts at the next
    assert [json.loads(p.read_text())["job"] for p in (tmp_path / "out" / "rows").glob("*.json")] == ["d0-r0"]


def test_a_row_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A Ctrl-C as the row is renamed into place leaves the old row (or none) and no temporary file."""
    path = tmp_path / "rows" / "drive0-r0.json"
    write_json(path, {"job": "drive0-r0", "attempts": 1})

    def ctrl_c(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", ctrl_c)  # write_json's rename
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"job": "drive0-r0", "attempts": 2})
    assert json.loads(path.read_text())["attempts"] == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["drive0-r0.json"]
