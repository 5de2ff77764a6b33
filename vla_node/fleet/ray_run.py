"""The fleet's jobs as Ray tasks: one task per job, each replaying on the machine Ray gives it. A timed (latency)
replay asks for one `replay_slot`, a custom resource each machine offers once (`ray start --resources
'{"replay_slot": 1}'`), so two timed replays never share a machine; a throughput run (--as-fast-as-possible) asks
for none and packs. A task that fails, or whose worker or machine dies, is submitted again (Ray's SPREAD strategy:
elsewhere where it can) up to the attempt bound; rows are written here, by the driver, as tasks end.

Job outputs (replay reports, node logs) are written by the task to `out` on its machine: on a cluster, `out` and
the drives must be on a filesystem every machine sees at the same path.
"""

from __future__ import annotations

from pathlib import Path

from vla_node.fleet.jobs import Job
from vla_node.fleet.run import MAX_ATTEMPTS, FleetProgress, finished, read_rows, row_path
from vla_node.fleet.task import Replay, error_text, failed_row, run_job, write_json
from vla_node.node.signals import CtrlCLatch
from vla_node.validate import ConfigError, require

SLOT = "replay_slot"


def _task(job: Job, replay_args: Replay, out: str, attempt: int) -> dict:
    """Runs in a Ray worker: the job on this worker's machine (its Ray node id in the row)."""
    import ray

    return run_job(job, replay_args, out, attempt, node_id=ray.get_runtime_context().get_node_id())


def run_ray(jobs: list[Job], replay_args: Replay, out: Path, *, address: str | None = None,
            local_cpus: int | None = None, resume: bool = False, max_attempts: int = MAX_ATTEMPTS,
            progress: bool = True) -> list[dict]:
    """Run `jobs` on the Ray cluster at `address` (or a local one of `local_cpus` CPUs and one replay slot, or the
    one this process already joined); returns their rows."""
    try:
        import ray
    except ModuleNotFoundError:
        raise ConfigError("fleet run needs Ray: pip install 'vla-node[fleet]' (or run `vla-node fleet shard`, "
                          "which needs none)") from None

    require(type(max_attempts) is int and max_attempts >= 1, "max_attempts", max_attempts, "an integer >= 1")
    started_here = not ray.is_initialized()
    if started_here:
        if address is not None:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=local_cpus, resources={SLOT: 1}, include_dashboard=False, log_to_driver=False)
    try:
        slots = int(ray.cluster_resources().get(SLOT, 0))
        if replay_args.timed:
            require(slots >= 1, "ray cluster", address or "local", f"machines offering the {SLOT!r} resource "
                    f"(ray start --resources '{{\"{SLOT}\": 1}}') for timed replays, or --as-fast-as-possible")
        resources = {SLOT: 1} if replay_args.timed else {}
        task = ray.remote(_task)
        remote = task.options(num_cpus=1, resources=resources, max_retries=0)
        skip = finished(out, jobs) if resume else set()
        todo = [job for job in jobs if job.key not in skip]
        bar = FleetProgress(len(jobs), len(skip), slots if replay_args.timed else max(1, len(todo)), out, progress)
        bar.note()
        pending = {remote.remote(job, replay_args, str(out), 1): (job, 1, []) for job in todo}
        with CtrlCLatch() as ctrl_c:  # a Ctrl-C Python dropped (raised in a finalizer) is raised at the next wait
            try:
                while pending:
                    ctrl_c.check()
                    ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                    for ref in ready:
                        job, attempt, errors = pending.pop(ref)
                        try:
                            row = ray.get(ref)
                        except ray.exceptions.RayError as e:  # the replay raised, or its worker or machine died
                            errors = [*errors, f"attempt {attempt}: {error_text(e)}"]
                            if attempt < max_attempts:
                                again = task.options(num_cpus=1, resources=resources, max_retries=0,
                                                     scheduling_strategy="SPREAD")
                                retry = again.remote(job, replay_args, str(out), attempt + 1)
                                pending[retry] = (job, attempt + 1, errors)
                            else:
                                write_json(row_path(out, job), failed_row(job, attempt, errors))
                                bar.note(failed=1)
                            continue
                        write_json(row_path(out, job), {**row, "errors": errors})
                        bar.note(finished=1)
            except KeyboardInterrupt:
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise  # every finished job's row is on disk: --resume picks up the rest
    finally:
        if started_here:
            ray.shutdown()
    return read_rows(out, jobs)
