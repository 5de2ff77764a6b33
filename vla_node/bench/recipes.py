"""`vla-node bench recipes DRIVE...`: the accuracy cost of each engine recipe on real frames, side by side in one run.

The engine policy (the node's cache, the reuse gate as the node runs it, each frame's tick in its pass and a
separate tick after it) over the first frames of each drive, once per recipe, against the same policy on the torch
steps in fp32 (the reference):

    onnxruntime-fp32      the exported graphs
    onnxruntime-int8-ort  ONNX Runtime's dynamic int8 (no calibration)
    onnxruntime-int8-trt  TensorRT's form (symmetric s8 Q/DQ, zero points 0), calibrated first by `calibrate`'s
                          recording on the synthetic drive (frames the policy never sees below), run in ONNX Runtime

Per drive and recipe: the share of action bins equal to the reference's and the logits' relative L2 error (mean and
max over chunks), with the time per frame. Random weights make near-ties in the bins common: the logit error is the
steadier figure.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from vla_node.backends.calibration import read_calibration
from vla_node.backends.engine_set import exported_engines, step_specs, torch_engines
from vla_node.backends.loading import load_model
from vla_node.backends.store import EngineStore
from vla_node.bench.reuse import INSTRUCTION, ego_state, gate_tokens, load_frames, logit_rel_err
from vla_node.config import default_launch, load_launch
from vla_node.runtime.engine_policy import EnginePolicy
from vla_node.runtime.reuse import ReuseGate

RECIPES = ("fp32", "int8-ort", "int8-trt")


def gated_chunks(policy: EnginePolicy, frames: list[np.ndarray], reuse) -> tuple[list, float]:
    """The policy over `frames` (uint8 [S, S, 3], one camera) as the node drives it: the reuse gate plans each frame,
    the frame's tick runs in its pass, a separate tick follows. Returns (every chunk, ms per frame)."""
    c = policy.config
    gate = ReuseGate(reuse, c.image_size, c.patch_size)
    state = ego_state(c)
    policy.update_text(INSTRUCTION)
    out, started = [], time.perf_counter()
    for frame in frames:
        images = frame[None]  # [S, S, 3] -> [1, S, S, 3]
        plan = gate.plan(images[0])
        tokens, scene_cut = gate_tokens([plan], c.tokens_per_camera)
        update = policy.update_vision(images, tokens, scene_cut, None, state)
        gate.commit(plan, images[0])
        out.append(update.chunk if update.chunk is not None else policy.action_tick(state))
        out.append(policy.action_tick(state))
    return out, (time.perf_counter() - started) * 1e3 / max(1, len(frames))


def _calibration(config, folder: Path, frames: int):
    """A calibration set of the launch file's model from the synthetic drive (written under `folder`)."""
    import dataclasses

    from vla_node.drives.calibrate import calibrate, drive_images
    from vla_node.drives.convert import convert_synthetic
    from vla_node.drives.demo import DEMO_FPS, DEMO_NOISE_STD, DEMO_SIZE
    from vla_node.drives.synthetic import SyntheticDriveConfig

    drive = folder / "synthetic.mcap"
    convert_synthetic(SyntheticDriveConfig(width=DEMO_SIZE[0], height=DEMO_SIZE[1], fps=DEMO_FPS,
                                           seconds=frames / DEMO_FPS + 1, noise_std=DEMO_NOISE_STD), drive,
                      progress=False)
    config = config.replace(model=dataclasses.replace(config.model, calibration=str(folder / "calib")))
    images = drive_images(drive, config.model.model_config().num_cameras, frames)
    return read_calibration(calibrate(config, images, str(drive), frames, progress=lambda line: None))


def run(drives: list[str], preset: str | None = None, max_frames: int = 30, calibration_frames: int = 8,
        json_path: str | None = None) -> dict:
    import dataclasses

    config = load_launch(default_launch())
    if preset is not None:
        config = config.replace(model=dataclasses.replace(config.model, preset=preset, instruction="keep lane"))
    section = config.model
    model = load_model(section.model_config(), "plain", section.checkpoint, section.seed)
    c = model.config
    specs = step_specs(c, config.reuse.shared_drift_samples, tick_in_frame=True)
    result = {"preset": c.name, "max_frames": max_frames, "calibration_frames": calibration_frames, "drives": {}}
    with tempfile.TemporaryDirectory(prefix="vla-bench-recipes-") as tmp:
        store = EngineStore(Path(tmp) / "engines")
        print(f"bench recipes: calibrating {c.name} on {calibration_frames} synthetic frames ...", flush=True)
        calibration = _calibration(config, Path(tmp), calibration_frames)
        engines = {"torch-fp32": torch_engines(model, specs)}
        for recipe in RECIPES:
            print(f"bench recipes: building the {recipe} engines ...", flush=True)
            engines[f"onnxruntime-{recipe}"] = exported_engines(
                model, specs, "onnxruntime", recipe, store, calibration=calibration if recipe == "int8-trt" else None)
        for drive in drives:
            frames = load_frames(drive, "native", max_frames, c.image_size)
            runs = {name: gated_chunks(EnginePolicy(model, e, config.cache, section.device, config.reuse), frames,
                                  config.reuse) for name, e in engines.items()}
            reference, _ = runs["torch-fp32"]
            figures = {}
            for name, (chunks, ms) in runs.items():
                errors = [logit_rel_err(a.logits, b.logits) for a, b in zip(chunks, reference)]
                figures[name] = {"ms_per_frame": round(ms, 1),
                                 "bins_equal": round(float(np.mean([(a.bins == b.bins).mean()
                                                                    for a, b in zip(chunks, reference)])), 4),
                                 "logit_err_mean": float(f"{np.mean(errors):.3g}"),
                                 "logit_err_max": float(f"{np.max(errors):.3g}")}
            result["drives"][Path(drive).name] = {"frames": len(frames), "recipes": figures}
    print(table(result))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict) -> str:
    lines = [f"bench recipes: {result['preset']}, first {result['max_frames']} frames of each drive at its rate; "
             "against the torch steps in fp32",
             f"{'drive':<40}{'recipe':<24}{'ms/frame':>9}{'bins equal':>12}{'logit err mean':>16}{'max':>8}"]
    for drive, entry in result["drives"].items():
        for recipe, f in entry["recipes"].items():
            lines.append(f"{drive:<40}{recipe:<24}{f['ms_per_frame']:>9.1f}{f['bins_equal']:>12.4f}"
                         f"{f['logit_err_mean']:>16.3g}{f['logit_err_max']:>8.3g}")
    return "\n".join(lines)
