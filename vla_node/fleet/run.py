"""Running a fleet's jobs: resume (skip jobs whose row says ok), retries up to a bound with every attempt's error
kept, a failed row for a job that fails them all, progress across the fleet. `run_local` runs the jobs one after
another on this machine (`fleet shard`); fleet/ray_run.py runs them on a Ray cluster with the same rows."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable

from vla_node.fleet.jobs import Job
from vla_node.fleet.task import ROWS, RUNNING, Replay, error_text, failed_row, run_job, write_json
from vla_node.node.signals import CtrlCLatch
from vla_node.validate import require

MAX_ATTEMPTS = 3


def row_path(out: Path, job: Job) -> Path:
    return out / ROWS / f"{job.key}.json"


def finished(out: Path, jobs: Iterable[Job]) -> set[str]:
    """The jobs whose row is there and ok (a resumed run skips them; a failed one runs again)."""
    done = set()
    for job in jobs:
        path = row_path(out, job)
        try:
            if json.loads(path.read_text())["status"] == "ok":
                done.add(job.key)
        except (OSError, ValueError, KeyError):
            continue
    return done


class FleetProgress:
    """A line per change: jobs done, running (their out/running files), failed, of all; the ETA from the mean wall
    time of the jobs run so far, over `slots` jobs at a time."""

    def __init__(self, total: int, already: int, slots: int, out: Path, enabled: bool = True) -> None:
        self.total, self.done, self.failed = total, already, 0
        self.slots, self.out, self.enabled = max(1, slots), out, enabled
        self.start, self.ran = time.monotonic(), 0

    def note(self, *, finished: int = 0, failed: int = 0) -> None:
        self.done += finished
        self.failed += failed
        self.ran += finished + failed
        if not self.enabled:
            return
        running = len(list((self.out / RUNNING).glob("*.json")))
        left = self.total - self.done - self.failed
        elapsed = time.monotonic() - self.start
        eta = f", ETA {elapsed / self.ran * left / self.slots:.0f} s" if self.ran and left else ""
        print(f"fleet: {self.done}/{self.total} done, {running} running, {self.failed} failed{eta}", flush=True)


def run_local(jobs: list[Job], replay_args: Replay, out: Path, *, resume: bool = False,
              max_attempts: int = MAX_ATTEMPTS, progress: bool = True) -> list[dict]:
    """Each job in turn on this machine (a timed replay has it to itself); returns the rows of `jobs`."""
    require(type(max_attempts) is int and max_attempts >= 1, "max_attempts", max_attempts, "an integer >= 1")
    skip = finished(out, jobs) if resume else set()
    bar = FleetProgress(len(jobs), len(skip), 1, out, progress)
    bar.note()
    # a Ctrl-C stops the shard (KeyboardInterrupt) with every finished job's row on disk: --resume picks up the
    # rest; one that Python dropped (raised in a finalizer) stops it before the next attempt
    with CtrlCLatch() as ctrl_c:
        for job in jobs:
            if job.key in skip:
                continue
            errors: list[str] = []
            for attempt in range(1, max_attempts + 1):
                ctrl_c.check()
                try:
                    row = run_job(job, replay_args, str(out), attempt)
                except Exception as e:  # noqa: BLE001 - a failed attempt is recorded, then retried
                    errors.append(f"attempt {attempt}: {error_text(e)}")
                    if attempt == max_attempts:
                        write_json(row_path(out, job), failed_row(job, attempt, errors))
                        bar.note(failed=1)
                    continue
                write_json(row_path(out, job), {**row, "errors": errors})
                bar.note(finished=1)
                break
        ctrl_c.check()
    return read_rows(out, jobs)


def read_rows(out: Path, jobs: Iterable[Job]) -> list[dict]:
    """The rows of `jobs` that have one, in the jobs' order."""
    return [json.loads(row_path(out, job).read_text()) for job in jobs if row_path(out, job).exists()]
