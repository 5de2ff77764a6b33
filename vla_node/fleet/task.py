"""One fleet job: `vla-node replay` of one drive through a node started for it, on the machine it runs on; its row
for the fleet report (figures, machine, times, attempts) written next to its replay report."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vla_node.backends.cpu_features import cpu_model
from vla_node.fleet.jobs import Job

ROWS = "rows"  # OUT/rows/<job>.json: one row per finished job (ok or failed)
JOBS = "jobs"  # OUT/jobs/<job>/: its replay report, html and node log
RUNNING = "running"  # OUT/running/<job>.json: a job in progress (its process id and machine), removed when it ends


@dataclass(frozen=True)
class Replay:
    """How every job of a run replays: the launch file and the pacing."""

    launch: str
    rate: float = 1.0
    as_fast_as_possible: bool = False
    overrides: tuple[str, ...] = ()

    @property
    def timed(self) -> bool:
        """A latency run: it needs its machine to itself (a throughput run may share one)."""
        return not self.as_fast_as_possible


def machine() -> dict[str, Any]:
    """The machine a job runs on: host, CPU model, GPU (if torch sees one, without importing torch here)."""
    gpus = Path("/proc/driver/nvidia/gpus")  # one folder per NVIDIA GPU, by PCI address
    gpu = (sorted(p.name for p in gpus.iterdir()) or None) if gpus.is_dir() else None
    return {"host": socket.gethostname(), "cpu": cpu_model(), "cpus": os.cpu_count(), "gpu": gpu}


def write_json(path: Path, data: Any) -> None:
    """Written whole or not at all (a temporary file renamed over it): an interrupted run never leaves half a row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except BaseException:  # a Ctrl-C or a full disk leaves no half-written temporary file behind
        tmp.unlink(missing_ok=True)
        raise


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The replay report's figures a fleet report compares."""
    return {
        "latency_p50_ms": report["latency_ms"]["p50"], "latency_p99_ms": report["latency_ms"]["p99"],
        "latency_max_ms": report["latency_ms"]["max"], "deadline_misses": report["deadline_misses"],
        "jitter_p99_ms": report["control_jitter_ms"]["p99"], "reuse_ratio": report["vision_reuse_ratio"],
        "frames_sent": report["frames_sent"], "frames_processed": report["frames_processed"],
        "status_counts": report["status_counts"],
    }


def run_job(job: Job, replay_args: Replay, out: str, attempt: int = 1, node_id: str | None = None) -> dict:
    """Replay `job` (on this machine) into out/jobs/<job>/ and return its row; raises whatever the replay raised."""
    from vla_node.drives.replay import replay

    out_dir = Path(out)
    job_dir = out_dir / JOBS / job.key
    running = out_dir / RUNNING / f"{job.key}.json"
    here = {**machine(), "node_id": node_id}
    write_json(running, {"job": job.key, "pid": os.getpid(), "attempt": attempt, "machine": here})
    fresh: dict[int, list[float]] = {}

    def keep_actions(frames: list, actions: list) -> None:  # each frame's first fresh action, for deviations
        for a in actions:
            if a.status == "fresh" and a.frame_seq is not None and a.action is not None:
                fresh.setdefault(a.frame_seq, list(a.action))

    start_ns, start_mono = time.time_ns(), time.monotonic_ns()
    try:
        report, json_path, _ = replay(job.drive, replay_args.launch, rate=replay_args.rate,
                                      as_fast_as_possible=replay_args.as_fast_as_possible, out_dir=job_dir,
                                      progress=False, on_records=keep_actions, overrides=replay_args.overrides)
    finally:
        running.unlink(missing_ok=True)
    return {
        "job": job.key, "drive": job.drive, "drive_id": job.drive_id, "repeat": job.repeat, "status": "ok",
        "attempts": attempt, "errors": [], "machine": here, "timed": replay_args.timed,
        "start_ns": start_ns, "end_ns": time.time_ns(), "wall_s": round((time.monotonic_ns() - start_mono) / 1e9, 3),
        "model": report["model"], "backend": report["backend"], "recipe": report["recipe"],
        "figures": figures(report), "report": str(json_path.relative_to(out_dir)),
        "fresh_actions": {str(k): v for k, v in sorted(fresh.items())},
    }


def failed_row(job: Job, attempts: int, errors: list[str]) -> dict:
    """The row of a job that failed every attempt: in the report, never lost."""
    return {"job": job.key, "drive": job.drive, "drive_id": job.drive_id, "repeat": job.repeat, "status": "failed",
            "attempts": attempts, "errors": errors, "machine": None, "timed": None, "start_ns": None, "end_ns": None,
            "wall_s": None, "model": None, "backend": None, "recipe": None, "figures": None, "report": None,
            "fresh_actions": {}}


def error_text(e: BaseException) -> str:
    """One line for a failed attempt's error."""
    lines = str(e).strip().splitlines()  # a Ray task error's text is the remote traceback: its last line is the cause
    last = f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"
    return last if len(last) <= 500 else last[:497] + "..."
