"""`vla-node bench soak`: the node in its own process under load for minutes, against its soak targets.

The node runs a launch file (default launch/cpu.toml) whose [[cameras]] are replaced by the soak's (max_width and
max_height each camera's frame size), written to the work folder and validated by loading it. The presets take one
camera: for more, the launch file's preset (or --preset) is written there as a checkpoint of the same shapes and
seed taking that many cameras. The client (bench/soak_client.py) publishes each camera at its own rate and the state
at 10 Hz over private ipc addresses, and reads every action and health message. Over the run:

    rss              the node's RSS from each health message; growth after warm-up (the first 20% or 10 s, the
                     longer), median of the last samples against the first after warm-up (soak_figures.rss_figures)
    missed_ticks     seq gaps + the ticks the node skipped (health control.missed_ticks, or the grid gaps)
    control_jitter   each action's stamp_ns against the control grid (p50 / p99 / max, ms)
    counters         frames sent = received by the node (+ rejected), received = processed + dropped (+ pending)

Targets: RSS growth < 5% after warm-up, zero missed ticks, jitter p99 <= 2 ms, counters reconcile.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from vla_node.backends import cpu_features
from vla_node.bench.node import handshake, tick_figures
from vla_node.bench.soak_client import SETTLE_S, STATUS, SoakClient, camera_frames
from vla_node.bench.soak_figures import (
    TARGETS,
    SoakCamera,
    missed_ticks,
    parse_cameras,
    reconcile,
    rss_figures,
    table,
    targets_met,
    warmup_s,
)
from vla_node.config import NodeConfig, default_launch, load_launch
from vla_node.model.config import preset as model_preset
from vla_node.node.process import NodeProcess, NodeProcessError, private_addresses
from vla_node.progress import Progress
from vla_node.validate import ConfigError
from vla_node.wire.transport import Client, TransportConfig

DEFAULT_CAMERAS = ("front=1920x1080@30", "rear=640x480@30")
ENCODINGS = ("rgb8", "jpeg")
HANDSHAKE_S = 300.0
CLIENT_RCV_HWM = 100_000  # the client's action queue: a client stall is never read as ticks the node lost


# --- the launch file ------------------------------------------------------------------------------------------
def _set_key(lines: list[str], table: str, key: str, value: str) -> list[str]:
    """The TOML lines with `key = value` in [table]: the key's line replaced, else added under the header, else the
    table appended."""
    header = re.compile(r"\s*\[")
    start = next((i for i, line in enumerate(lines) if line.strip() == f"[{table}]"), None)
    if start is None:
        return lines + ["", f"[{table}]", f"{key} = {value}"]
    end = next((i for i in range(start + 1, len(lines)) if header.match(lines[i])), len(lines))
    for i in range(start + 1, end):
        if re.match(rf"\s*{re.escape(key)}\s*=", lines[i]):
            return lines[:i] + [f"{key} = {value}  # bench soak"] + lines[i + 1:]
    return lines[:start + 1] + [f"{key} = {value}  # bench soak"] + lines[start + 1:]


def _without_cameras(lines: list[str]) -> list[str]:
    out, inside = [], False
    for line in lines:
        if re.match(r"\s*\[", line):
            inside = line.strip() == "[[cameras]]"
        if not inside:
            out.append(line)
    return out


def soak_launch(base: Path, cameras: Sequence[SoakCamera], out_dir: Path, control_hz: float | None = None,
                preset: str | None = None) -> Path:
    """`base` with the soak's cameras (and control rate, preset) -> out_dir/soak.toml, validated by loading it."""
    config = load_launch(base)
    model = config.model
    out_dir.mkdir(parents=True, exist_ok=True)
    if model.checkpoint is not None and preset is not None:
        raise ConfigError(f"--preset {preset!r}: {base} runs the checkpoint {model.checkpoint!r} (no preset applies)")
    lines = _without_cameras(base.read_text().splitlines())
    shapes = model.model_config() if model.checkpoint is not None else model_preset(preset or model.preset)
    if preset is not None:
        lines = _set_key(lines, "model", "preset", json.dumps(preset))
    if shapes.num_cameras != len(cameras):
        if model.checkpoint is not None:
            raise ConfigError(f"{base}: its checkpoint {model.checkpoint!r} takes {shapes.num_cameras} camera(s): "
                              f"expected {len(cameras)} for --camera {[c.spec for c in cameras]} (or a preset)")
        lines = _set_key(lines, "model", "checkpoint", json.dumps(str(_checkpoint(shapes, len(cameras), model.seed,
                                                                                   out_dir))))
    limit = shapes.max_text_tokens - 1
    if len(model.instruction.encode()) > limit:
        short = model.instruction.encode()[:limit].decode("utf-8", "ignore").rstrip()
        lines = _set_key(lines, "model", "instruction", json.dumps(short))
    if control_hz is not None:
        lines = _set_key(lines, "scheduler", "control_hz", repr(float(control_hz)))
    for c in cameras:
        lines += ["", "[[cameras]]", f"name = {json.dumps(c.name)}", f"max_width = {c.width}",
                  f"max_height = {c.height}"]
    path = out_dir / "soak.toml"
    path.write_text("\n".join(lines) + "\n")
    derived = load_launch(path)
    got = [(c.name, c.max_width, c.max_height) for c in derived.cameras]
    if got != [(c.name, c.width, c.height) for c in cameras] or (
            control_hz is not None and derived.scheduler.control_hz != float(control_hz)):
        raise ConfigError(f"{base}: the derived {path} has cameras {got}, control_hz {derived.scheduler.control_hz}: "
                          f"expected {[c.spec for c in cameras]}, {control_hz} (a layout this rewrite cannot follow)")
    return path


def _checkpoint(shapes, cameras: int, seed: int, out_dir: Path) -> Path:
    """The preset's shapes taking `cameras` cameras, seeded as the preset would be, as a checkpoint in out_dir."""
    from vla_node.model.checkpoint import save_checkpoint
    from vla_node.model.vla import build_vla

    config = shapes.replace(name=f"{shapes.name}-{cameras}cam", num_cameras=cameras)
    path = out_dir / f"{config.name}-seed{seed}"
    if not (path / "vla.json").is_file():
        save_checkpoint(build_vla(config, seed=seed), path)
    return path


# --- the run ----------------------------------------------------------------------------------------------------
def _soak(launch: Path, config: NodeConfig, cameras: Sequence[SoakCamera], encoding: str, seconds: float,
          work: Path, show_progress: bool) -> tuple[SoakClient, dict | None, bool, int]:
    """Start the node, soak it, settle; returns (the client and what it read, the settled health, settled, rc)."""
    addresses = TransportConfig(**private_addresses(), rcv_hwm=CLIENT_RCV_HWM)
    client = Client(addresses)
    node = NodeProcess(launch, addresses, work / "node.log")
    try:
        frames = {c.name: camera_frames(c, encoding) for c in cameras}  # rendered while the node starts
        handshake(client, node, HANDSHAKE_S)
        capacity = int(seconds * 1e9 / config.scheduler.period_ns * 1.2) + 1000
        soak = SoakClient(client, cameras, frames, encoding, config.model.model_config().state_dim, capacity)
        with Progress(max(1, int(seconds)), "soak", unit="s", enabled=show_progress) as bar:
            def on_health(arrival_ns: int, msg: dict) -> None:
                bar.label = f"soak: rss {msg.get('rss_bytes', 0) / 2**20:.0f} MB, level {msg.get('level')}"
                bar.update(min(bar.total, int((arrival_ns - soak.start_ns) / 1e9)) - bar.count)

            soak.run(seconds, on_health, watch=lambda: _check_alive(node))
            bar.update(bar.total - bar.count)
        final, settled = soak.settle()
        if final is None:
            raise NodeProcessError(f"no health message from the node; last lines of its log:\n{node.tail()}")
    finally:
        rc = node.stop()
        client.close()
    return soak, final, settled, rc


def _check_alive(node: NodeProcess) -> None:
    if node.poll() is not None:
        raise node.error("during the soak")


def run(minutes: float, cameras: Sequence[str] | None = None, launch: str | os.PathLike | None = None,
        control_hz: float | None = None, encoding: str = "rgb8", json_path: str | os.PathLike | None = None,
        out_dir: str | os.PathLike | None = None, preset: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Soak the node for `minutes`; print the table; write JSON to json_path (or out_dir/soak.json). out_dir keeps
    the derived launch file, the checkpoint it names and the node's log (default: a temporary folder)."""
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not 0 < minutes <= 24 * 60:
        raise ConfigError(f"--minutes {minutes!r}: expected a number of minutes in (0, 1440]")
    if encoding not in ENCODINGS:
        raise ConfigError(f"--encoding {encoding!r}: expected one of {list(ENCODINGS)}")
    if control_hz is not None and not 0 < control_hz <= 1000:
        raise ConfigError(f"--control-hz {control_hz!r}: expected a rate in Hz in (0, 1000]")
    specs = parse_cameras(cameras or DEFAULT_CAMERAS)
    seconds = float(minutes) * 60
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="vla-soak-") as tmp:
        work = Path(tmp) if out_dir is None else Path(out_dir)
        work.mkdir(parents=True, exist_ok=True)
        base = Path(launch) if launch is not None else default_launch()
        path = soak_launch(base, specs, work, control_hz, preset)
        config = load_launch(path)
        from vla_node.node.policies import build_launch_engines

        build_launch_engines(config, str(path), progress=lambda line: print(f"engines: {line}", flush=True))
        soak, final, settled, rc = _soak(path, config, specs, encoding, seconds, work, progress)
        result = figures(soak, final, settled, config, seconds)  # while the derived checkpoint is there
    result["context"].update(
        cameras=[c.spec for c in specs], encoding=encoding, launch=str(base), derived_launch_kept=out_dir is not None,
        exit_code=rc, loadavg_before=[round(v, 2) for v in load_before],
        loadavg_after=[round(v, 2) for v in os.getloadavg()])
    print(table(result))
    if json_path is None and out_dir is not None:
        json_path = Path(out_dir) / "soak.json"
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def figures(soak: SoakClient, final: dict, settled: bool, config: NodeConfig, seconds: float) -> dict[str, Any]:
    """Every figure of a finished soak (final: the settled health message)."""
    period_ns, warmup_ns = config.scheduler.period_ns, int(warmup_s(seconds) * 1e9)
    during = [msg for _, msg in soak.health if msg["stamp_ns"] <= soak.end_ns]
    first, last = (during[0], during[-1]) if during else (final, final)
    n = soak.n
    ticks = tick_figures(soak.stamp[:n], soak.seq[:n], soak.arrival[:n], period_ns)
    node_missed = last["control"]["missed_ticks"] - first["control"]["missed_ticks"]
    client = soak.figures()
    counters = reconcile({name: cam["sent"] for name, cam in client["cameras"].items()}, soak.states_sent, final,
                         soak.states_unsent)
    if not settled:
        counters["mismatches"].append(f"the node's counters were still changing {SETTLE_S:g} s after the run")
        counters["reconciled"] = False
    result = {
        "rss": rss_figures(_samples(during, "rss_bytes"), soak.start_ns, warmup_ns),
        "missed_ticks": missed_ticks(ticks, node_missed),
        "ticks": {"received": ticks["received"], "expected": ticks["expected"], "lost_seq_gaps": ticks["lost"],
                  "node_missed_ticks": node_missed, "skipped_from_stamps": ticks["skipped"],
                  "publish_dropped": last["transport"]["publish_dropped"] - first["transport"]["publish_dropped"]},
        "control_jitter_ms": ticks["jitter_ms"],
        "control_jitter_arrival_ms": ticks["arrival_jitter_ms"],
        "counters": counters,
        "client": client,
        "statuses": {name: int((soak.status[:n] == code).sum()) for name, code in STATUS.items()},
        "levels": {str(k): v for k, v in sorted(soak.levels.items(), key=str)},
        "health_levels": dict(Counter(str(m.get("level")) for m in during)),
        "node": {"frames_processed": final.get("frames_processed"), "frames_skipped": final.get("frames_skipped"),
                 "drops": final.get("drops"), "level_at_end": last.get("level"), "level_name": last.get("level_name"),
                 "status_counts": last["control"].get("status_counts"), "settled": settled},
        "targets": TARGETS,
        "context": {"seconds": seconds, "control_hz": round(1e9 / period_ns, 3), "model": _model_name(config),
                    "cpu": cpu_features.cpu_model(), "cpus": os.cpu_count()},
    }
    publisher = _samples(during, "publisher_rss_bytes")  # a node whose publisher runs in a process of its own
    if publisher:
        result["publisher_rss"] = rss_figures(publisher, soak.start_ns, warmup_ns)
    result["pass"] = targets_met(result)
    return result


def _samples(healths: Sequence[dict], key: str) -> list[tuple[int, int]]:
    return [(m["stamp_ns"], m[key]) for m in healths if isinstance(m.get(key), int)]


def _model_name(config: NodeConfig) -> str:
    shapes = config.model.model_config()
    return f"{shapes.name} ({config.model.resolved_dtype}, {config.model.backend})"
