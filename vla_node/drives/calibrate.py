"""`vla-node calibrate`: a calibration set for the int8 recipes, recorded from real frames through the engine policy.

The launch file's model runs on the torch steps with every engine wrapped in a StepRecorder (backends/calibration.py),
so each step's recorded inputs are exactly what the node would feed it on those frames: the reuse gate plans each
frame as the node does, and the schedule below makes every step run on real data at least once:

  - frame i's refresh is padded to the capacities in turn (the gate's tokens, then evenly spaced others up to the
    capacity's tokens less the shared-drift sample), so every tower-K and decoder-K piece sees frames;
  - every other frame carries the ego state (its tick runs in the frame's pass: decoder-tick-K) and every frame is
    followed by a separate tick (tick);
  - the instruction changes every few frames (text, and the full decoder over the held frame).

The set is written to `<model.calibration>/<weights digest>/` with each step's fp32 ONNX (exported for the ranges
and the weight scales, then dropped), and `model.recipe = "int8-trt"` finds it there.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from vla_node.backends.calibration import StepRecorder, write_calibration
from vla_node.backends.engine_set import EngineSet, capacities, flow_step_counts, step_specs, torch_engines
from vla_node.backends.export import export_step
from vla_node.backends.loading import load_model
from vla_node.backends.store import weights_digest
from vla_node.config import NodeConfig
from vla_node.model.vla import preprocess_frame
from vla_node.runtime.engine_policy import EnginePolicy
from vla_node.runtime.reuse import ReuseGate
from vla_node.validate import ConfigError

INSTRUCTIONS = ("keep lane", "turn left at light", "slow down", "merge right")  # short: they fit every preset
TEXT_EVERY = 4  # frames between instruction changes


def drive_images(path: Path, cameras: int, limit: int) -> Iterator[list[np.ndarray]]:
    """Up to `limit` sets of one frame per camera (RGB uint8) from a drive, in recorded order."""
    from vla_node.drives.open import open_drive

    latest: dict[str, np.ndarray] = {}
    sent = 0
    for frame in open_drive(path).frames():
        latest[frame.camera] = frame.rgb()
        if len(latest) == cameras:
            yield [latest[name] for name in sorted(latest)]
            latest, sent = {}, sent + 1
            if sent == limit:
                return


def folder_images(folder: Path, cameras: int, limit: int) -> Iterator[list[np.ndarray]]:
    """Image files (png, jpg) of a folder in name order, `cameras` at a time, decoded with PyAV."""
    import av

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not files:
        raise ConfigError(f"--frames {folder}: no .png or .jpg file in it")
    for start in range(0, min(len(files), limit * cameras) - cameras + 1, cameras):
        images = []
        for path in files[start : start + cameras]:
            with av.open(str(path)) as container:
                images.append(next(container.decode(video=0)).to_ndarray(format="rgb24"))
        yield images


def _padded(tokens: torch.Tensor | None, tokens_per_camera: int, want: int) -> torch.Tensor | None:
    """The gate's tokens with evenly spaced others added up to `want` (None: a full refresh stays full)."""
    if tokens is None or tokens.numel() >= want:
        return tokens
    rest = np.setdiff1d(np.arange(tokens_per_camera), tokens.numpy())
    extra = rest[np.linspace(0, rest.size - 1, min(rest.size, want - tokens.numel())).round().astype(int)]
    return torch.from_numpy(np.union1d(tokens.numpy(), extra))


def calibrate(config: NodeConfig, images: Iterator[list[np.ndarray]], source: str, limit: int,
              progress: Callable[[str], None] = print) -> Path:
    """Record every step's inputs over `images` and write the calibration set; returns its folder."""
    section = config.model
    model = load_model(section.model_config(), "plain", section.checkpoint, section.seed)
    c = model.config
    samples = config.reuse.shared_drift_samples
    counts = flow_step_counts(c, config.scheduler.denoising_steps) if c.action_head == "flow" else (None,)
    specs = step_specs(c, samples, tick_in_frame=True, denoising_steps=config.scheduler.denoising_steps)
    engines = torch_engines(model, specs, section.device).engines
    recorders = {name: StepRecorder(engine, limit) for name, engine in engines.items()}
    policy = EnginePolicy(model, EngineSet("torch", "fp32", recorders), config.cache, section.device, config.reuse)
    gates = [ReuseGate(config.reuse, c.image_size, c.patch_size) for _ in range(c.num_cameras)]
    bucket_tokens = [max(1, k - samples) for k in capacities(c.tokens_per_camera, samples)]
    state = np.zeros(c.state_dim, np.float32)
    frames = 0
    for frames, cameras in enumerate(images, 1):
        if (frames - 1) % TEXT_EVERY == 0:
            policy.update_text(INSTRUCTIONS[(frames - 1) // TEXT_EVERY % len(INSTRUCTIONS)])
        batch = np.stack([preprocess_frame(rgb, c.image_size) for rgb in cameras])  # [C, S, S, 3]
        plans = [gate.plan(batch[i]) for i, gate in enumerate(gates)]
        want = bucket_tokens[frames % len(bucket_tokens)]
        tokens = [None if p.full else _padded(torch.from_numpy(p.refresh.copy()), c.tokens_per_camera, want)
                  for p in plans]
        scene_cut = any(p.scene_cut and p.full for p in plans)
        state = np.tanh(state + np.float32(0.1) * np.random.default_rng(frames).normal(size=c.state_dim))
        state = state.astype(np.float32)
        update = policy.update_vision(batch, tokens, scene_cut, None, state if frames % 2 else None)
        for gate, plan, image in zip(gates, plans, batch):
            gate.commit(plan, image)
        for tick in range(1 if update.chunk is not None else 2):  # the flow head: every engine's step count in turn
            steps = counts[(2 * frames + tick) % len(counts)]
            policy.action_tick(state) if steps is None else policy.action_tick(state, steps=steps)
        if frames % 8 == 0:
            progress(f"calibrate: {frames} frames, {sum(len(r.samples) for r in recorders.values())} step calls kept")
    if frames == 0:
        raise ConfigError(f"{source}: no frames to calibrate on")
    recorded = {name: r.samples for name, r in recorders.items() if r.samples}
    missing = sorted(set(recorders) - set(recorded))
    if missing:
        raise ConfigError(f"{source}: {frames} frames ran no {missing} step; give more frames (--frames-max)")
    with tempfile.TemporaryDirectory(prefix="vla-calibrate-") as tmp:
        onnx = {}
        for index, (name, spec) in enumerate(specs.items()):
            progress(f"calibrate: exporting {name} for its ranges ({index + 1}/{len(specs)})")
            onnx[name] = Path(tmp) / f"{name}.onnx"
            export_step(spec.build(model), spec.inputs(), spec.outputs, onnx[name])
        folder = write_calibration(section.calibration, weights_digest(model), recorded, source, onnx)
    progress(f"calibrate: {frames} frames; wrote {folder} ({', '.join(f'{n} {len(s)}' for n, s in recorded.items())})")
    return folder
