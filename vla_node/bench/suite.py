"""`vla-node bench all [--out DIR]`: every benchmark in one run, one report: DIR/bench.json, bench.md, bench.html.

    vla-node bench all [--out out/bench] [--drive CLIP] [--launch launch/cpu.toml] [--preset small]
                       [--frames 30] [--threads N] [--quick]

Sections, each measured side by side within itself (what a figure is compared with ran in the same section):
  model    per-frame work on a real clip at 10 fps against transformers (SigLIP + Llama generate) and the reference,
           at the compute dtype, with INT8 alongside and the accuracy of both against the fp32 reference
           (bench/per_frame.py clip_figures)
  stages   the tick and the full-refresh frame per backend, and against their floor (per_frame.stage_figures,
           bench/floor.py says how FLOPs and bytes are counted)
  cache    bench cache (the multi-rate cache's stages, the INT8 vision KV), engines: bench engines (every pure step
           in torch and ONNX Runtime with parity), reuse: bench reuse on the clip (threshold 8, 10 fps)
  node     the clip replayed at 1x through a real node started from the launch file (loopback ZeroMQ): frame-to-action
           latency, deadline misses, control jitter, startup_s (launch -> the first fresh action)

CLIP: an mp4 or drive; default the freeway clip of the shared real drives ($VLA_NODE_DRIVES, else
../shared/data/drives beside the checkout) where it is found, else the demo's synthetic drive (the report says which).
--threads: torch's intra-op threads for every section but the node's (its own launch file's); default the launch
file's model.threads, 'auto' resolved as the node resolves it (node/realtime.py resolve_threads: every CPU where the
publisher may run at SCHED_FIFO, else 1), 0 torch's default. Ours and the peer run at the same count.
--quick: fewer frames and rounds, the cache/engines/reuse sections skipped (a smoke run: its figures are noisier).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from vla_node.backends import cpu_features, cpu_kernels
from vla_node.bench import per_frame
from vla_node.bench.clips import CLIP_FPS, default_clip
from vla_node.bench.suite_report import markdown, render_html
from vla_node.config import default_launch, load_launch
from vla_node.node.realtime import resolve_threads
from vla_node.validate import require

FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
               "avx_vnni", "f16c")
TARGETS = {"speedup_vs_hf": (">=", 10.0), "tick_ratio_to_floor": ("<=", 2.0), "frame_ratio_to_floor": ("<=", 2.0),
           "replay_latency_p99_ms": ("<=", 100.0), "replay_deadline_misses": ("<=", 0),
           "replay_control_jitter_p99_ms": ("<=", 2.0), "startup_s": ("<=", 5.0)}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("onnxruntime", "onnx", "transformers", "numpy", "pyzmq", "tensorrt"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def header(threads: int, threads_from: str) -> dict:
    """What ran where: CPU model and flags, the kernels oneDNN and ATen pick and whether the fused CPU kernels run,
    threads (and what set them), versions, GPU."""
    flags = cpu_features.cpu_flags(cpu_features.read_cpuinfo())
    return {"cpu": cpu_features.cpu_model(), "cpus": os.cpu_count(), "flags": [f for f in FLAGS_SHOWN if f in flags],
            "kernels": f"{cpu_features.describe()}; fused CPU kernels {cpu_kernels.status()}",
            "bf16_hardware": cpu_features.onednn_runs_bf16(), "threads": threads, "threads_from": threads_from,
            "versions": versions(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(["vla-node", *sys.argv[1:]])}


def _clip_frames(clip: Path | None, count: int, image_size: int) -> tuple[list[np.ndarray], str]:
    from vla_node.bench.reuse import load_frames

    if clip is not None:
        return load_frames(clip, CLIP_FPS, count, image_size), str(clip)
    with tempfile.TemporaryDirectory(prefix="vla-bench-all-") as tmp:
        drive = _synthetic_drive(Path(tmp), count)
        return load_frames(drive, CLIP_FPS, count, image_size), "synthetic drive (demo's; no real clip found)"


def _synthetic_drive(folder: Path, frames: int) -> Path:
    from vla_node.drives.convert import convert_synthetic
    from vla_node.drives.demo import DEMO_NOISE_STD, DEMO_SIZE
    from vla_node.drives.synthetic import SyntheticDriveConfig

    path = folder / "synthetic.mcap"
    convert_synthetic(SyntheticDriveConfig(width=DEMO_SIZE[0], height=DEMO_SIZE[1], fps=CLIP_FPS,
                                           seconds=frames / CLIP_FPS + 1, noise_std=DEMO_NOISE_STD), path,
                      progress=False)
    return path


def _other_benchmarks(preset: str, threads: int, clip: Path | None, frames: int) -> dict:
    from vla_node.bench import cache, engines, reuse

    out = {"cache": cache.run(preset, iters=3, threads=threads, compute_dtype="auto", deviation_frames=4,
                              policy_frames=4),
           "engines": engines.run(preset, iters=5, threads=threads, rss=False)}
    if clip is not None:
        out["reuse"] = reuse.run([str(clip)], thresholds=(0.0, 8.0), rates=(CLIP_FPS,), max_frames=frames,
                                 preset=preset, threads=threads, progress=False)
    return out


def node_replay(clip: Path | None, launch: Path, out: Path, synthetic_frames: int = 200) -> dict:
    """The clip replayed at 1x through a node from `launch`; its report's figures and the latencies (for the plot)."""
    from vla_node.drives.replay import replay
    from vla_node.report.report import frame_latencies_ns

    kept: dict = {}

    def keep(frames, actions) -> None:
        kept["latency_ms"] = [round(v / 1e6, 3) for v in frame_latencies_ns(frames)[1]]

    with tempfile.TemporaryDirectory(prefix="vla-bench-all-") as tmp:
        drive = clip if clip is not None else _synthetic_drive(Path(tmp), synthetic_frames)
        report, json_path, _ = replay(drive, launch, out_dir=out / "replay", progress=False, on_records=keep)
    return {"report": report, "report_json": str(json_path), **kept}


def targets(model: dict, stages: dict, node: dict | None, eager_backend: str) -> dict:
    """Every target's measured value and whether it is met."""
    floor = stages["floor"]
    values = {"speedup_vs_hf": model["speedup_vs_hf"],
              "tick_ratio_to_floor": floor[f"{eager_backend}: tick"]["ratio_to_floor"],
              "frame_ratio_to_floor": floor[f"{eager_backend}: frame"]["ratio_to_floor"]}
    if node is not None:
        r = node["report"]
        values.update({"replay_latency_p99_ms": r["latency_ms"]["p99"], "replay_deadline_misses": r["deadline_misses"],
                       "replay_control_jitter_p99_ms": r["control_jitter_ms"]["p99"], "startup_s": r.get("startup_s")})
    out = {}
    for key, value in values.items():
        op, bound = TARGETS[key]
        met = value is not None and (value >= bound if op == ">=" else value <= bound)
        out[key] = {"value": value, "target": f"{op} {bound:g}", "met": met}
    return out


def run(out_dir: str | os.PathLike = "out/bench", drive: str | None = None, launch: str | None = None,
        preset: str | None = None, frames: int = 30, threads: int | None = None, quick: bool = False,
        replay_node: bool = True) -> dict:
    """Run every section (module docstring), write DIR/bench.json, bench.md and bench.html; return the figures."""
    require(isinstance(frames, int) and not isinstance(frames, bool) and frames >= 3, "frames", frames,
            "an integer >= 3 (the first frame is a full refresh)")
    require(threads is None or (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1),
            "threads", threads, "an integer >= 1 or unset (the launch file's)")
    clip = Path(drive) if drive is not None else default_clip()
    require(clip is None or clip.is_file(), "drive", drive, "an existing mp4 or drive file")
    launch_path = Path(launch) if launch is not None else default_launch()
    config = load_launch(launch_path)
    if preset is not None:
        config = config.replace(model=dataclasses.replace(config.model, preset=preset))
    threads_from = "--threads"
    if threads is None:
        rt = config.realtime
        threads_from = f"the launch file's model.threads = {config.model.threads!r}"
        threads = (resolve_threads(config.model.threads, rt.sched_fifo_priority, rt.cpu_affinity)
                   or torch.get_num_threads())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    frames = min(frames, 8) if quick else frames
    result: dict = {"header": header(threads, threads_from), "launch": str(launch_path), "preset": config.model.preset}
    dtype = "auto"  # bf16 where the CPU multiplies bf16 in hardware, else fp32 (ModelSection.resolved_dtype)
    instruction = config.model.instruction
    c = config.model.model_config()
    print(f"bench all: {result['header']['cpu']} ({result['header']['kernels']}), {threads} thread(s), "
          f"{c.name}, {per_frame.path_name(per_frame.compute_config(config, dtype))}", flush=True)
    images, result["clip"] = _clip_frames(clip, frames, c.image_size)
    print(f"bench all: {len(images)} frames of {result['clip']} at {CLIP_FPS:g} fps", flush=True)
    result["model"] = per_frame.clip_figures(config, images, instruction, dtype)
    print("bench all: stages and their floor ...", flush=True)
    result["stages"] = per_frame.stage_figures(config, images[0], instruction, dtype, rounds=4 if quick else 8)
    if not quick:
        result["benchmarks"] = _other_benchmarks(config.model.preset, threads, clip, min(frames, 20))
    result["node"] = node_replay(clip, launch_path, out, 30 if quick else 200) if replay_node else None
    eager = f"torch {per_frame.path_name(per_frame.compute_config(config, dtype))}"
    result["targets"] = targets(result["model"], result["stages"], result["node"], eager)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(result))
    (out / "bench.html").write_text(render_html(result))
    print(markdown(result))
    print(f"bench all: wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.html'}", flush=True)
    return result
