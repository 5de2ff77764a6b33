"""`vla-node drive`: the road simulator and the real node over ZeroMQ, in real time, closed loop.

    drive("ckpt/tiny", "launch/sim.toml", minutes=2, out_dir="out/drive")

The node runs in its own process (as `vla-node replay` starts it) from the launch file with the checkpoint set
(`--set model.checkpoint=DIR`, plus any other `--set`). The simulator steps the car at the launch file's control rate
on the wall clock: every tick it applies the newest action the node has published (the launch file's safe action until
its first arrives), and at the camera rate it sends the state and then the frame its camera sees, stamped at send.
Instructions come from the drive's cues (scenario.py) as the node would get them from a navigation system. So the
node's latency is the car's: a late chunk is driven late, a fallback is driven.

Out: drive.json (how the car drove: sim/metrics.py's figures, the instructions and their outcome, the latency
figures, the trace) and drive.html (bird's-eye trace, the trace along the road, speed and actions over time, the
tables), beside the latency report of the frames sent and the actions received (report.json and report.html, as a
replay writes them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Mapping

import numpy as np

from vla_node.config import CHECKPOINTS_DIR, LAUNCH_DIR
from vla_node.drives.replay import SentFrame, _addresses, _drain, _handshake, _stop_node, latency_report
from vla_node.drives.replay_threads import Receiver
from vla_node.node.process import NodeProcess
from vla_node.node.signals import ExitOn, SignalFlag
from vla_node.progress import Progress
from vla_node.report.drive_html import render_drive_html
from vla_node.report.report import format_summary
from vla_node.sim.env import ACTION_DIMS, STATE_DIM, RoadEnv, SimConfig
from vla_node.sim.metrics import DriveMetrics
from vla_node.sim.scenario import Cue, InstructionGiver, default_cues
from vla_node.validate import ConfigError, is_number, require
from vla_node.wire.transport import Client

SIM_LAUNCH = LAUNCH_DIR / "sim.toml"
SIM_CHECKPOINTS = CHECKPOINTS_DIR / "tiny"  # bins/ and flow/: `vla-node train --preset tiny`'s, kept with the code
WARMUP_TIMEOUT_S = 300.0
LATENCY_KEYS = ("frames_sent", "frames_processed", "frames_dropped", "latency_ms", "control_jitter_ms",
                "deadline_misses", "status_counts", "degrade_levels", "vision_reuse_ratio", "startup_s")


@dataclasses.dataclass
class _Run:
    sent: list[SentFrame]
    interrupted: bool
    late_ticks: int  # sim ticks that started more than one period late (the simulator could not keep up)


def drive(checkpoint: str | os.PathLike, launch: str | os.PathLike | None = None, *, minutes: float = 2.0,
          seed: int = 0, out_dir: str | os.PathLike = "out/drive", overrides: tuple[str, ...] = (),
          cues: tuple[Cue, ...] | None = None, start_offset_m: float = 0.0, env: Mapping[str, str] | None = None,
          fault_schedule: tuple[tuple[float, Path, str], ...] = (), progress: bool = True,
          warmup_timeout_s: float = WARMUP_TIMEOUT_S) -> dict:
    """Drive `minutes` of real time on the road of `seed` with the node of `launch` (default launch/sim.toml)
    running `checkpoint`; writes out_dir/drive.json, drive.html, report.json, report.html. Returns drive.json's
    content. env: variables for the node's process; fault_schedule: (at_s, path, text): at simulated time at_s the
    file `path` gets `text` (the node's test-only fault file, named in env: a delay that starts mid-drive). Raises
    ConfigError (arguments, launch file, checkpoint), NodeProcessError (the node)."""
    longest = SimConfig().max_seconds() / 60
    require(is_number(minutes) and 0 < minutes <= longest, "minutes", minutes,
            f"a number of minutes in (0, {longest:.0f}] (the longest road the simulator builds)")
    from vla_node.config import load_launch
    from vla_node.model.checkpoint import CheckpointError, read_config

    launch_path = Path(launch) if launch is not None else SIM_LAUNCH
    try:
        model = read_config(checkpoint)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    require(model.action_dims == ACTION_DIMS and model.state_dim == STATE_DIM, "checkpoint", str(checkpoint),
            f"a model of {ACTION_DIMS} action dims (steer, accel) and {STATE_DIM} state values (the simulator's; "
            "`vla-node train`)")
    overrides = (f"model.checkpoint={Path(checkpoint).resolve()}", *overrides)
    config = load_launch(launch_path, overrides)
    require(len(config.cameras) == 1, "cameras", [c.name for c in config.cameras], "one camera (the simulator's)")
    seconds = float(minutes) * 60.0
    sim = SimConfig(seed=seed, control_hz=config.scheduler.control_hz)
    road_env = RoadEnv(sim, seconds=seconds, offset_m=start_offset_m)
    giver = InstructionGiver(sim, road_env.road, cues if cues is not None else default_cues(seconds))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from vla_node.node.policies import build_launch_engines

    build_launch_engines(config, str(launch_path), progress=lambda line: print(f"engines: {line}", flush=True))
    print(f"drive: {minutes:g} min on road {seed} ({road_env.road.lanes} lanes, {road_env.scenery.palette_name}), "
          f"checkpoint {checkpoint}, launch {launch_path}", flush=True)
    metrics = DriveMetrics(sim, road_env.road)
    transport = _addresses(config, None, connect=False)
    client = Client(transport)
    node = receiver = None
    failed = True
    with ExitOn(signal.SIGTERM, signal.SIGHUP):
        try:
            node = NodeProcess(launch_path, transport, out / "node.log", overrides, env=dict(env) if env else None)
            _handshake(client, node, warmup_timeout_s, launch_path)
            receiver = Receiver(client)
            receiver.start()
            run = _simulate(client, receiver, node, road_env, giver, metrics, config, seconds, progress,
                            fault_schedule)
            if not run.interrupted:
                _drain(receiver, run.sent[-1] if run.sent else None, 1.0, config.health.period_s)
            receiver.stop()
            receiver.check()
            failed = False
        finally:
            if receiver is not None and receiver.is_alive():
                receiver.stop()
            client.close()
            if node is not None:
                _stop_node(node, failed)
    result = _write(out, checkpoint, launch_path, overrides, sim, road_env, giver, metrics, config, run, receiver,
                    node)
    if run.interrupted:
        raise KeyboardInterrupt
    return result


def _simulate(client: Client, receiver: Receiver, node: NodeProcess, env: RoadEnv, giver: InstructionGiver,
              metrics: DriveMetrics, config, seconds: float, progress: bool,
              fault_schedule: tuple[tuple[float, Path, str], ...] = ()) -> _Run:
    """The real-time loop: one simulator tick per control period on the wall clock."""
    faults = sorted(fault_schedule, key=lambda item: item[0])
    sim = env.config
    camera = config.cameras[0].name
    period_ns = round(1e9 / sim.control_hz)
    frame_period_s = 1.0 / sim.fps
    fallback = np.asarray(config.scheduler.fallback_action or (0.0,) * ACTION_DIMS, np.float32)
    ticks = round(seconds * sim.control_hz)
    sent: list[SentFrame] = []
    seq = command_seq = late = 0
    next_frame_t = 0.0
    bar = Progress(ticks, "drive", unit="ticks", enabled=progress)
    start_ns = time.monotonic_ns()
    with SignalFlag(signal.SIGINT) as ctrl_c:
        for tick in range(ticks):
            due_ns = start_ns + tick * period_ns
            wait_ns = due_ns - time.monotonic_ns()
            if wait_ns > 0 and ctrl_c.sleep(wait_ns / 1e9):
                break
            late += wait_ns < -period_ns
            if ctrl_c.received is not None:
                break
            if node.poll() is not None:
                raise node.error("during the drive")
            receiver.check()
            while faults and faults[0][0] <= env.t:
                _, path, text = faults.pop(0)
                tmp = Path(path).with_name(Path(path).name + ".tmp")
                tmp.write_text(text)
                os.replace(tmp, path)  # the node re-reads it within 50 ms (node/faults.py)
            truth = env.truth()
            said = giver.update(truth)
            if said is not None:
                client.send_instruction(command_seq, time.monotonic_ns(), said)
                command_seq += 1
            if env.t >= next_frame_t - 1e-9:
                next_frame_t += frame_period_s
                client.send_state(command_seq, time.monotonic_ns(), env.state_vector())
                command_seq += 1
                rgb = env.frame()
                stamp_ns = time.monotonic_ns()
                client.send_frame(camera, seq, stamp_ns, rgb, "rgb8")
                sent.append(SentFrame(seq, stamp_ns, time.monotonic_ns()))
                seq += 1
            newest = receiver.actions[-1] if receiver.actions else None
            if newest is not None and newest.action is not None:
                action, status = np.asarray(newest.action, np.float32), newest.status
            else:
                action, status = fallback, "fallback"
            env.step(action)
            after = env.truth()
            metrics.record(after, giver, action, status)
            bar.update(1)
            if after.left_road:
                print(f"drive: the car left the road at {after.t:.1f} s", flush=True)
                break
    bar.close()
    return _Run(sent, ctrl_c.received is not None, late)


def road_geometry(env: RoadEnv, s_from: float, s_to: float, step_m: float = 5.0) -> dict:
    """The lines of the road over [s_from, s_to] in the world plane, for the bird's-eye view: per line its d, whether
    it is solid (the edges) and its x, y points."""
    road = env.road
    s = np.arange(max(s_from, road.s[0]), min(s_to, road.s[-1]), step_m)
    lines = []
    boundaries = road.boundaries()
    for k, d in enumerate(boundaries):
        x, y, _ = road.pose(s, float(d))
        lines.append({"d": float(d), "solid": k in (0, len(boundaries) - 1),
                      "x": np.round(x, 2).tolist(), "y": np.round(y, 2).tolist()})
    return {"lines": lines, "lane_width_m": road.lane_width, "lanes": road.lanes}


def _write(out: Path, checkpoint, launch_path: Path, overrides: tuple[str, ...], sim: SimConfig, env: RoadEnv,
           giver: InstructionGiver, metrics: DriveMetrics, config, run: _Run, receiver: Receiver,
           node: NodeProcess) -> dict:
    latency = latency_report(f"sim:{sim.seed}", config, run.sent, receiver, node, out)[0]
    summary = metrics.summary(giver)
    trace = metrics.trace
    result = {
        "checkpoint": str(checkpoint), "launch": str(launch_path), "overrides": list(overrides),
        "sim": {"seed": sim.seed, "lanes": env.road.lanes, "palette": env.scenery.palette_name,
                "cruise_mps": sim.cruise_mps, "slow_mps": sim.slow_mps, "fps": sim.fps, "control_hz": sim.control_hz},
        **summary,
        "latency": {key: latency.get(key) for key in LATENCY_KEYS},
        "sim_late_ticks": run.late_ticks,
        "events": [{"t": round(t, 3), "what": what, "x": round(x, 2), "y": round(y, 2)}
                   for t, what, x, y in metrics.events],
        "trace": {key: [round(v, 4) for v in values] for key, values in trace.items()},
        "geometry": road_geometry(env, min(trace["s"], default=0.0) - 30, max(trace["s"], default=0.0) + 60),
    }
    result = finite(result)
    (out / "drive.json").write_text(json.dumps(result, indent=1))
    (out / "drive.html").write_text(render_drive_html(result))
    print(format_summary(latency))
    print(_drive_line(result))
    print(f"drive report: {out / 'drive.json'}\n              {out / 'drive.html'}\n"
          f"latency report: {out / 'report.html'}", flush=True)
    return result


def finite(value):
    """NaN and infinities (no sample of a figure) as JSON null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def _drive_line(r: dict) -> str:
    def f(v, digits=3):
        return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"

    return (f"drive: {r['seconds']:.1f} s, {r['distance_m']:.0f} m; lateral error mean {f(r['lateral_error_mean_m'])} m, "
            f"max {f(r['lateral_error_max_m'])} m; lane departures {r['lane_departures']} "
            f"({r['departures_at_speed']} at speed); collisions {r['collisions']}; speed error "
            f"{f(r['speed_error_mean_mps'], 2)} m/s; instructions followed {f(r['instruction_success'], 2)}"
            + ("; LEFT THE ROAD" if r["left_road"] else ""))
