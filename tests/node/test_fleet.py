"""Fleet replay with the real node: a local Ray cluster started here (one replay slot) replays six short drives,
one of its tasks killed mid-drive and retried, then resumes with one job missing; timed replays never overlap on
the slot; `fleet shard` over the same
six drives in three shards, merged, has the same jobs and figures; an interrupted shard resumes with only what was
missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers.drive_checks import native_drive
from helpers.node_harness import REPO_ROOT, TINY_LAUNCH
from vla_node.fleet.commands import fleet_merge, fleet_run, fleet_shard
from vla_node.fleet.task import RUNNING

DRIVES = 6


@pytest.fixture(scope="module")
def drives(tmp_path_factory):
    """Six drives of 1 s (10 frames at 10 fps, 64x48), each its own picture, with an instruction."""
    folder = tmp_path_factory.mktemp("library")
    rng = np.random.default_rng(0)
    for n in range(DRIVES):
        frames = [np.full((48, 64, 3), 20 * n, np.uint8) + rng.integers(0, 30, (48, 64, 3), dtype=np.uint8)
                  for _ in range(10)]
        native_drive(folder / f"drive{n}.mcap", frames, fps=10.0, commands=[(0, "instruction", {"text": "keep lane"})])
    return folder


def kill_first_job_midway(out, killed: list) -> None:
    """SIGKILL the worker of the first job seen running, a moment into its drive (its node stops with it)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        running = sorted((out / RUNNING).glob("*.json")) if (out / RUNNING).exists() else []
        if running:
            info = json.loads(running[0].read_text())
            time.sleep(2.0)  # the node is starting or the drive is playing
            os.kill(info["pid"], signal.SIGKILL)
            killed.append(info["job"])
            return
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_fleet_on_a_local_ray_cluster_and_by_shards(tmp_path, drives):
    ray = pytest.importorskip("ray")
    out = tmp_path / "fleet"
    ray.init(num_cpus=2, resources={"replay_slot": 1}, include_dashboard=False, log_to_driver=False)
    try:
        killed: list[str] = []
        killer = threading.Thread(target=kill_first_job_midway, args=(out, killed))
        killer.start()
        report = fleet_run([str(drives)], str(TINY_LAUNCH), out, progress=False)
        killer.join()
        # as after an interrupt: one job's row missing; --resume replays that job alone
        before = {r["job"]: r["start_ns"] for r in report["rows"]}
        (out / "rows" / "drive3-r0.json").unlink()
        resumed = {r["job"]: r for r in fleet_run([str(drives)], str(TINY_LAUNCH), out, resume=True,
                                                   progress=False)["rows"]}
    finally:
        ray.shutdown()
    assert sorted(resumed) == sorted(before) and resumed["drive3-r0"]["start_ns"] > max(before.values())
    assert all(resumed[job]["start_ns"] == start for job, start in before.items() if job != "drive3-r0")
    rows = {r["job"]: r for r in report["rows"]}
    assert sorted(rows) == [f"drive{n}-r0" for n in range(DRIVES)] and report["fleet"]["failed"] == 0, report["fleet"]
    # the killed task ran again and says so
    assert killed and rows[killed[0]]["attempts"] == 2, (killed, rows[killed[0]])
    assert "attempt 1:" in rows[killed[0]]["errors"][0], rows[killed[0]]["errors"]
    assert all(r["attempts"] == 1 for job, r in rows.items() if job != killed[0])
    # one timed replay at a time on the one slot: each starts after the one before ended (wall clock, one host)
    spans = sorted((r["start_ns"], r["end_ns"]) for r in rows.values())
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans
    assert all(r["figures"]["frames_sent"] == 10 and r["figures"]["latency_p99_ms"] for r in rows.values())
    assert (out / "fleet.html").stat().st_size > 1000 and not list((out / RUNNING).glob("*.json"))

    shards = [tmp_path / f"shard{i}" for i in range(3)]
    for i, folder in enumerate(shards):
        fleet_shard([str(drives)], str(TINY_LAUNCH), folder, index=i, count=3, progress=False)
    merged = fleet_merge([str(s) for s in shards], tmp_path / "merged")
    keys = lambda rep: {(r["job"], r["drive"], *sorted(r["figures"])) for r in rep["rows"]}  # noqa: E731
    assert keys(merged) == keys(report) and merged["fleet"]["ok"] == DRIVES


@pytest.mark.timeout(300)
def test_an_interrupted_shard_resumes_with_only_what_was_missing(tmp_path, drives):
    out = tmp_path / "shard"
    names = [f"drive{n}-r0.json" for n in range(DRIVES)]
    command = [sys.executable, "-m", "vla_node.cli", "fleet", "shard", *(str(drives / f"drive{n}.mcap")
                                                                          for n in range(DRIVES)),
               "--launch", str(TINY_LAUNCH), "--out", str(out), "--index", "0", "--count", "1", "--no-progress"]

    def ctrl_c_as_a_terminal_sends_it() -> None:
        """Ctrl-C's default action in the shard whatever the runner's: a shell's background job starts with SIGINT
        ignored, and a thread may block it (Ray's do); both an ignored disposition and the mask survive exec."""
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, preexec_fn=ctrl_c_as_a_terminal_sends_it)
    first = out / "rows" / names[0]
    deadline = time.monotonic() + 120
    while not first.exists() and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)  # a Ctrl-C while the second of six drives plays (the rest: seconds of margin)
    output, _ = run.communicate(timeout=60)
    done_before = {p.name: json.loads(p.read_text())["start_ns"] for p in (out / "rows").glob("*.json")}
    assert names[0] in done_before and names[-1] not in done_before, (done_before, output[-3000:])
    assert run.returncode == 130, output[-3000:]  # stopped by the Ctrl-C, as Python's KeyboardInterrupt exits
    again = subprocess.run([*command, "--resume"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = {p.name: json.loads(p.read_text()) for p in (out / "rows").glob("*.json")}
    assert sorted(rows) == names
    for name, start in done_before.items():  # what had finished was not replayed again
        assert rows[name]["start_ns"] == start, name
    report = json.loads((out / "fleet.json").read_text())
    assert report["fleet"]["ok"] == DRIVES
