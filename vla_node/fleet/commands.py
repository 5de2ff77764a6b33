"""`vla-node fleet run | shard | merge | compare`: the jobs listed, run (Ray or one shard), their rows joined into
the fleet report (out/fleet.json, fleet.html)."""

from __future__ import annotations

import json
from pathlib import Path

from vla_node.fleet.jobs import list_drives, make_jobs, shard
from vla_node.fleet.run import MAX_ATTEMPTS, run_local
from vla_node.fleet.task import ROWS, Replay
from vla_node.report.fleet import build_fleet_report, compare_fleets, load_fleet_report, write_fleet_report
from vla_node.validate import ConfigError, require


def _check_replay(launch: str, rate: float, as_fast_as_possible: bool, overrides: tuple[str, ...]) -> Replay:
    from vla_node.config import load_launch

    load_launch(launch, overrides)  # a bad launch file fails here, not in every job
    require(isinstance(rate, (int, float)) and rate > 0, "rate", rate, "a number > 0 (1.0 = the recorded timing)")
    return Replay(str(Path(launch).resolve()), float(rate), bool(as_fast_as_possible), tuple(overrides))


def _finish(rows: list[dict], meta: dict, out: Path) -> dict:
    report = build_fleet_report(rows, meta)
    json_path, html_path = write_fleet_report(report, out)
    f = report["fleet"]
    print(f"fleet: {f['ok']} ok, {f['failed']} failed, {f['retried']} retried, of {f['jobs']} jobs on "
          f"{len(f['machines'])} machine(s): {json_path}, {html_path}", flush=True)
    return report


def fleet_run(drives: list[str], launch: str, out: str | Path, *, ray_address: str | None = None,
              local: int | None = None, rate: float = 1.0, as_fast_as_possible: bool = False, repeat: int = 1,
              resume: bool = False, max_attempts: int = MAX_ATTEMPTS, overrides: tuple[str, ...] = (),
              progress: bool = True) -> dict:
    """Every (drive, repeat) as a Ray task: on the cluster at ray_address, or a local one of `local` CPUs."""
    from vla_node.fleet.ray_run import run_ray

    require(local is None or (type(local) is int and local >= 1), "local", local, "a number of CPUs >= 1")
    replay_args = _check_replay(launch, rate, as_fast_as_possible, overrides)
    jobs = make_jobs(list_drives(drives), repeat)
    out = Path(out)
    rows = run_ray(jobs, replay_args, out, address=ray_address, local_cpus=local, resume=resume,
                   max_attempts=max_attempts, progress=progress)
    meta = {"runner": "ray", "ray_address": ray_address or "local", "launch": replay_args.launch,
            "timed": replay_args.timed, "rate": replay_args.rate, "repeat": repeat}
    return _finish(rows, meta, out)


def fleet_shard(drives: list[str], launch: str, out: str | Path, *, index: int, count: int, rate: float = 1.0,
                as_fast_as_possible: bool = False, repeat: int = 1, resume: bool = False,
                max_attempts: int = MAX_ATTEMPTS, overrides: tuple[str, ...] = (), progress: bool = True) -> dict:
    """The drives at positions index, index + count, ... of the list, one after another on this machine (a
    Kubernetes Indexed Job passes JOB_COMPLETION_INDEX as index); `fleet merge` joins the shards."""
    replay_args = _check_replay(launch, rate, as_fast_as_possible, overrides)
    jobs = shard(make_jobs(list_drives(drives), repeat), index, count)
    out = Path(out)
    rows = run_local(jobs, replay_args, out, resume=resume, max_attempts=max_attempts, progress=progress)
    meta = {"runner": f"shard {index}/{count}", "launch": replay_args.launch, "timed": replay_args.timed,
            "rate": replay_args.rate, "repeat": repeat}
    return _finish(rows, meta, out)


def fleet_merge(dirs: list[str], out: str | Path) -> dict:
    """The rows of several shards' out folders (their rows/*.json) into one fleet report in `out`."""
    require(len(dirs) >= 1, "dirs", dirs, "one or more shard folders")
    rows: dict[str, dict] = {}
    metas = []
    for d in dirs:
        folder = Path(d)
        paths = sorted((folder / ROWS).glob("*.json"))
        if not paths:
            raise ConfigError(f"{folder}: no job rows in {folder / ROWS} (not a fleet shard's folder)")
        for path in paths:
            row = json.loads(path.read_text())
            if row["job"] in rows and rows[row["job"]]["status"] == "ok":
                continue  # a job two shards ran: the ok row wins
            row["report"] = row["report"] and str(folder / row["report"])
            rows[row["job"]] = row
        if (folder / "fleet.json").exists():
            metas.append(load_fleet_report(folder / "fleet.json")["fleet"])
    meta = {"runner": "merged", "shards": [str(d) for d in dirs],
            "launch": sorted({m["launch"] for m in metas}) if metas else None,
            "timed": sorted({m["timed"] for m in metas}) if metas else None}
    return _finish(list(rows.values()), meta, Path(out))


def fleet_compare(base: str, new: str, max_regression_pct: float, max_action_deviation: float | None = None) -> int:
    """Print the per-job comparison; 1 when any job regressed past the bounds, else 0."""
    text, regressions = compare_fleets(load_fleet_report(base), load_fleet_report(new), max_regression_pct,
                                       max_action_deviation)
    print(text)
    return 1 if regressions else 0
