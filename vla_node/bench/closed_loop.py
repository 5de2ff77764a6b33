"""`vla-node bench closed-loop`: what each optimisation costs a trained driving policy in closed loop, and what offline
similarity on real footage says about the same configuration.

    vla-node bench closed-loop [--checkpoints DIR] [--minutes 1] [--seeds 0] [--heads bins flow] [--only NAME ...]
                               [--json PATH]

For each action head a trained tiny checkpoint (DIR/bins, DIR/flow; default checkpoints/tiny, kept with the code;
trained there with `vla-node train`'s defaults where missing) is driven by the real node (`vla-node drive`: the
simulator over ZeroMQ in real time) under each configuration, each a set of `--set` changes to launch/sim.toml:

    reference          every optimisation off: fp32 compute and weights, fp32 text/vision/action partitions, no
                       reuse (threshold 0), the eager torch backend
    reference_repeat   the same again: the run-to-run spread of a real-time loop, against which to read the rest
    defaults           launch/sim.toml as it is (its default optimisations together)
    <one optimisation> the reference with only that changed: INT8 vision KV, bf16 text KV, the CPU's compute path
                       (auto: bf16 with packed weights where the CPU has bf16 hardware), fp16 weights, int8
                       weights (where the CPU kernels' int8 linear runs: AVX512-VNNI), each reuse
                       threshold, each engine recipe (ONNX Runtime fp32, int8-ort, int8-trt calibrated on simulator
                       frames)
    level: <name>      the defaults with the scheduler held at that degrade level (scheduler.min_level): each level
                       that runs inference; levels accumulate (a cap level keeps the raised threshold, fewer
                       denoising steps keep the cap: sched/ladder.py)
    denoising_<n>      (flow) the reference with only fewer Euler steps: a ladder of that step alone, held there
    rtc                (flow) the defaults with real-time chunking on (off in the defaults)
    delay              the defaults with a stage delay (the test-only fault file: vision and action far past their
                       deadlines) from a fifth of the drive on: the scheduler goes to chunk, then fallback

Per configuration: `lateral_error_mean_m`, `lateral_error_max_m`, `lane_departures`, `departures_at_speed`,
`collisions`, `instruction_success`, `speed_error_mean_mps`, the final speed, the status counts and the latency
p99, over the drives of --seeds (means of the means, the largest maximum, summed counts); and `offline`: the same
configuration's deviation from the reference path on the shared real clips (bench/offline_deviation.py; logits and
bins for the bins head, chunk error for flow; none for `delay` and `rtc`, which are about time).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np

from vla_node.backends import cpu_features
from vla_node.bench.clips import shared_clips
from vla_node.sim.metrics import aggregate
from vla_node.validate import require

REFERENCE = ("model.dtype=fp32", "model.weights=fp32", "model.backend=torch", "cache.text_dtype=fp32",
             "cache.action_dtype=fp32", "cache.vision.storage_dtype=fp32", "reuse.threshold=0",
             "scheduler.real_time_chunking=false")
DELAY_FAULTS = "vision 400\naction 200\n"  # far past sim.toml's 120 ms vision and 60 ms action deadlines
DELAY_FROM = 0.2  # of the drive
DENOISING_ONLY = 'scheduler.ladder=["fewer_denoising_steps", "chunk", "fallback"]'
FIGURES = ("lateral_error_mean_m", "lateral_error_max_m", "lane_departures", "departures_at_speed", "collisions",
           "instruction_success", "speed_error_mean_mps", "final_speed_mps")  # per configuration (sim.metrics)
OFFLINE_FRAMES_PER_CLIP = 24
OFFLINE_FPS = 10.0


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    what: str
    overrides: tuple[str, ...]
    level: str | None = None  # scheduler.min_level
    faults: str | None = None  # the fault file's text, from DELAY_FROM of the drive
    offline: bool = True


def settings(head: str, level_names: list[str], calibration: str) -> list[Setting]:
    """The configurations for `head`; level_names: the node's levels that run inference, normal first."""
    from vla_node.backends.packed_weights import int8_weights_available

    out = [Setting("reference", "every optimisation off", REFERENCE),
           Setting("reference_repeat", "the same again (run-to-run spread)", REFERENCE, offline=False),
           Setting("defaults", "launch/sim.toml as it is", ())]
    alone = [("int8_vision_kv", "INT8 vision KV (KIVI)", ("cache.vision.storage_dtype=int8",)),
             ("bf16_text_kv", "bf16 text KV", ("cache.text_dtype=bf16",)),
             ("compute_auto", "bf16 compute with packed weights where the CPU has it", ("model.dtype=auto",
                                                                                       "model.weights=auto")),
             ("fp16_weights", "fp16 linear weights, fp32 compute", ("model.weights=fp16",))]
    if int8_weights_available():  # the CPU kernels' int8 linear: AVX512-VNNI (model.weights = "int8")
        alone.append(("int8_weights", "int8 linear weights (the CPU kernels' int8 linear), bf16 compute",
                      ("model.dtype=bf16", "model.weights=int8")))
    alone += [(f"reuse_t{t:g}", f"vision reuse, threshold {t:g}", (f"reuse.threshold={t}",)) for t in (2, 4, 8, 16)]
    alone += [("engine_ort_fp32", "ONNX Runtime, fp32", ("model.backend=onnxruntime", "model.recipe=fp32")),
              ("engine_ort_int8", "ONNX Runtime, int8-ort (dynamic int8)", ("model.backend=onnxruntime",
                                                                            "model.recipe=int8-ort")),
              ("engine_int8_trt", "the int8-trt recipe (symmetric Q/DQ, calibrated) on ONNX Runtime",
               ("model.backend=onnxruntime", "model.recipe=int8-trt", f"model.calibration={calibration}"))]
    out += [Setting(name, what, REFERENCE + changes) for name, what, changes in alone]
    if head == "flow":  # the fewer_denoising_steps level alone: a ladder of that step only, held at its level
        out += [Setting(f"denoising_{n}", f"{n} Euler steps a tick", REFERENCE + (
            DENOISING_ONLY, f"scheduler.min_level=fewer_denoising_steps {n}"), f"fewer_denoising_steps {n}")
            for n in _denoising_levels()]
    out += [Setting(f"level: {name}", f"held at degrade level {name!r}", (f"scheduler.min_level={name}",), name)
            for name in level_names[1:]]
    if head == "flow":
        out.append(Setting("rtc", "real-time chunking on", ("scheduler.real_time_chunking=true",), offline=False))
    out.append(Setting("delay", f"stage delay ({DELAY_FAULTS.strip().replace(chr(10), ', ')} ms) from "
                                f"{DELAY_FROM:.0%} of the drive", (), faults=DELAY_FAULTS, offline=False))
    return out


def _levels(head: str, checkpoint: Path | None = None) -> dict:
    """The levels of a node of `head` on launch/sim.toml (the checkpoint's model, else the tiny preset's), by name."""
    from vla_node.config import load_launch, node_levels
    from vla_node.drives.closed_loop import SIM_LAUNCH

    model = (f"model.checkpoint={checkpoint}",) if checkpoint else ("model.preset=tiny", f"model.action_head={head}")
    return {level.name: level for level in node_levels(load_launch(SIM_LAUNCH, model))}


def _denoising_levels() -> tuple[int, ...]:
    from vla_node.config import load_launch
    from vla_node.drives.closed_loop import SIM_LAUNCH

    return load_launch(SIM_LAUNCH, ("model.preset=tiny",)).scheduler.denoising_steps


def _inference_levels(head: str, checkpoint: Path | None = None) -> list[str]:
    return [name for name, level in _levels(head, checkpoint).items() if level.knobs.run_inference]


def checkpoint_for(root: Path, head: str, progress: bool) -> Path:
    """root/head, trained there (tiny, `vla-node train`'s defaults; both heads on one dataset, root/data) unless it
    holds a finished checkpoint."""
    from vla_node.train.trainer import TrainConfig, train

    path = root / head
    if not (path / "vla.json").is_file():
        print(f"bench closed-loop: training the {head} checkpoint into {path}", flush=True)
        train(TrainConfig.for_preset("tiny", action_head=head), path, data_dir=root / "data", progress=progress)
    return path


def _calibrate(folder: Path, launch: Path, checkpoint: Path, frames: int = 48) -> None:
    """The int8-trt calibration set of `checkpoint` from an expert drive in the simulator, in `folder`."""
    from vla_node.config import load_launch
    from vla_node.drives.calibrate import calibrate
    from vla_node.sim.env import RoadEnv, SimConfig
    from vla_node.sim.expert import ExpertConfig, expert_action
    from vla_node.sim.scenario import InstructionGiver, default_cues

    config = load_launch(launch, (f"model.checkpoint={checkpoint}", f"model.calibration={folder}") + REFERENCE)
    sim = SimConfig(seed=1000)
    env = RoadEnv(sim, seconds=60)
    giver = InstructionGiver(sim, env.road, default_cues(60))

    def images():
        for tick in range(frames * 4):
            giver.update(env.truth())
            if tick % 4 == 0:
                yield [env.frame()]
            env.step(expert_action(ExpertConfig(), env.road, sim.vehicle, env.ego, env.s, giver.goal))

    calibrate(config, images(), "simulator (seed 1000)", frames, progress=lambda line: None)


def _offline_frames(image_limit: int) -> tuple[list[np.ndarray], str]:
    """Frames of every shared clip at OFFLINE_FPS, one after another (a cut between clips), or of a synthetic drive
    where the clips are not on this machine."""
    from vla_node.drives.video import decode_video

    clips = shared_clips()
    if clips:
        frames = [rgb for clip in clips for _, rgb in decode_video(clip, fps=OFFLINE_FPS, max_frames=image_limit)]
        return frames, ", ".join(c.name for c in clips)
    from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames

    config = SyntheticDriveConfig(width=640, height=360, fps=OFFLINE_FPS, seconds=3 * image_limit / OFFLINE_FPS)
    return [rgb for _, rgb in synthetic_frames(config)], "synthetic drive (the shared clips are not here)"


def _aggregate(drives: list[dict]) -> dict:
    """The drives of one configuration: sim.metrics.aggregate's figures, their status counts and latency p99."""
    out = aggregate(drives)
    statuses: dict[str, int] = {}
    for d in drives:
        for k, v in (d["latency"].get("status_counts") or {}).items():
            statuses[k] = statuses.get(k, 0) + v
    out["status_counts"] = statuses
    p99 = [d["latency"]["latency_ms"]["p99"] for d in drives if (d["latency"].get("latency_ms") or {}).get("p99")]
    out["latency_p99_ms"] = float(max(p99)) if p99 else None
    return out


def run(json_path: str | None = None, checkpoints: str | None = None, minutes: float = 1.0,
        seeds: tuple[int, ...] = (0,), heads: tuple[str, ...] = ("bins", "flow"), only: tuple[str, ...] = (),
        out_dir: str | None = None, progress: bool = True) -> dict:
    from vla_node.drives.closed_loop import SIM_CHECKPOINTS, SIM_LAUNCH, finite

    require(all(h in ("bins", "flow") for h in heads) and heads, "heads", heads, "bins and/or flow")
    require(minutes > 0, "minutes", minutes, "a number of minutes > 0")
    known = {s.name for head in heads for s in settings(head, _inference_levels(head), "calib")}
    unknown = sorted(set(only) - known)
    require(not unknown, "--only", unknown, f"configurations among {sorted(known)}")
    root = Path(checkpoints) if checkpoints else SIM_CHECKPOINTS
    work = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="vla-closed-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        offline_frames, offline_source = _offline_frames(OFFLINE_FRAMES_PER_CLIP)
        result = {"machine": {"cpu": cpu_features.cpu_model(), "python": platform.python_version()}, "minutes": minutes,
                  "seeds": list(seeds), "launch": str(SIM_LAUNCH), "offline_frames": offline_source, "heads": {}}
        for head in heads:
            checkpoint = checkpoint_for(root, head, progress).resolve()
            chosen = [s for s in settings(head, _inference_levels(head, checkpoint), str(work / head / "calib"))
                      if not only or s.name in only]
            rows = _head(head, checkpoint, chosen, minutes, seeds, work, offline_frames, progress)
            result["heads"][head] = {"checkpoint": str(checkpoint), "configurations": rows}
    finally:
        if out_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(format_table(result))
    if json_path:
        Path(json_path).write_text(json.dumps(finite(result), indent=1))
    return result


def _head(head: str, checkpoint: Path, chosen: list[Setting], minutes: float, seeds: tuple[int, ...], work: Path,
          offline_frames: list[np.ndarray], progress: bool) -> list[dict]:
    """Every chosen configuration of one head: its drives (one per seed) and its offline deviation."""
    from vla_node.bench.offline_deviation import offline_deviation
    from vla_node.config import load_launch, node_levels
    from vla_node.drives.closed_loop import SIM_LAUNCH
    from vla_node.sched.ladder import Knobs

    if any("model.recipe=int8-trt" in s.overrides for s in chosen):
        _calibrate(work / head / "calib", SIM_LAUNCH, checkpoint)
    rows = []
    for index, setting in enumerate(chosen):
        print(f"bench closed-loop: {head} {index + 1}/{len(chosen)} {setting.name}", flush=True)
        overrides = setting.overrides + (f"model.engines_dir={work / 'engines'}",)
        drives = [_drive_one(checkpoint, overrides, setting, minutes, seed,
                             work / head / _slug(setting.name) / f"seed{seed}", progress) for seed in seeds]
        row = {"name": setting.name, "what": setting.what, "overrides": list(setting.overrides), **_aggregate(drives)}
        row["offline"] = None
        if setting.offline:
            config = load_launch(SIM_LAUNCH, (f"model.checkpoint={checkpoint}",) + overrides)
            levels = {level.name: level for level in node_levels(config)}  # this configuration's own ladder
            knobs = levels[setting.level].knobs if setting.level else Knobs()
            row["offline"] = offline_deviation(config, offline_frames, knobs)
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def _drive_one(checkpoint: Path, overrides: tuple[str, ...], setting: Setting, minutes: float, seed: int,
               out: Path, progress: bool) -> dict:
    from vla_node.drives.closed_loop import drive

    env, schedule = None, ()
    if setting.faults is not None:
        from vla_node.node.faults import FAULT_FILE_ENV

        fault_file = out / "faults.txt"
        out.mkdir(parents=True, exist_ok=True)
        env = {FAULT_FILE_ENV: str(fault_file)}
        schedule = ((DELAY_FROM * minutes * 60.0, fault_file, setting.faults),)
    return drive(checkpoint, None, minutes=minutes, seed=seed, out_dir=out, overrides=overrides, env=env,
                 fault_schedule=schedule, progress=progress)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")


def _f(value, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def format_row(row: dict) -> str:
    offline = row["offline"] or {}
    off = (f"logit err {_f(offline.get('logit_rel_err'))}, bins {_f(offline.get('bins_agreement'))}"
           if "logit_rel_err" in offline else
           f"chunk err {_f(offline.get('chunk_rel_err'))}" if offline else "offline -")
    return (f"  {row['name']:<34} lateral mean {_f(row['lateral_error_mean_m'])} max {_f(row['lateral_error_max_m'])} "
            f"m, departures {row['lane_departures']} ({row['departures_at_speed']} at speed), collisions "
            f"{row['collisions']}, instructions {_f(row['instruction_success'], 2)}, final speed "
            f"{_f(row['final_speed_mps'], 1)} m/s; {off}")


def format_table(result: dict) -> str:
    lines = [f"closed loop on {result['machine']['cpu']}: {result['minutes']:g} min drives, seeds {result['seeds']}"]
    for head, block in result["heads"].items():
        rows = block["configurations"]
        ref = next((r["lateral_error_mean_m"] for r in rows if r["name"] == "reference"), None)
        lines.append(f"\n{head} head ({block['checkpoint']})")
        lines.append("| configuration | lateral mean m | vs reference | lateral max m | departures (at speed) | "
                     "collisions | instructions | final speed m/s | offline |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            change = "-" if not ref or r["lateral_error_mean_m"] is None else \
                f"{(r['lateral_error_mean_m'] / ref - 1) * 100:+.0f}%"
            offline = r["offline"] or {}
            off = (f"logit {_f(offline.get('logit_rel_err'))}, bins {_f(offline.get('bins_agreement'), 2)}"
                   if "logit_rel_err" in offline else
                   f"chunk {_f(offline.get('chunk_rel_err'))}" if offline else "-")
            lines.append(f"| {r['name']} | {_f(r['lateral_error_mean_m'])} | {change} | {_f(r['lateral_error_max_m'])} |"
                         f" {r['lane_departures']} ({r['departures_at_speed']}) | {r['collisions']} | "
                         f"{_f(r['instruction_success'], 2)} | {_f(r['final_speed_mps'], 1)} | {off} |")
    return "\n".join(lines)
