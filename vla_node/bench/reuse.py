"""`vla-node bench reuse`: vision-token reuse on real drives, measured against full refresh and the reference.

    vla-node bench reuse DRIVE [DRIVE ...] [--thresholds 0 2 4 8 16] [--rates native 10]
                                   [--max-frames 12] [--preset small] [--cache default] [--pixel-floor]
                                   [--weights fp16|fp32] [--layer-budget B] [--shared-drift-samples 8]
                                   [--max-age 20] [--threads 1] [--json F]

DRIVE: an mp4 (or any video PyAV reads) or a drive (native vla-node MCAP, ROS 2 bag; its first camera).

Per clip and rate, one pass over the same frames (decoded once, resized once) runs side by side, frame by frame,
in a rotating order so that a load change on a shared machine hits every run alike:
  - the reference: `ReferencePolicy.step` (full recompute, fp32), the oracle for every deviation;
  - the full-refresh run: `MultiRatePolicy` with the benchmark's cache, every frame a full vision update
    (`tokens=None`, no gate) — the time every speedup is measured against, and the output that isolates the
    part of the deviation that reuse adds;
  - one reuse run per threshold: the same policy type and cache behind a `ReuseGate` (the node's convention,
    as in `Pipeline._vision`: a full plan passes `tokens=None`, a scene cut flushes); its vision time includes
    the gate's plan and commit.
Each run then takes one action tick with the same ego state.

Figures per clip and setting ("t8@10fps": threshold 8, resampled to 10 fps; "native" keeps the clip's rate):
  reuse_ratio_mean, reuse_ratio_p10   vision tokens reused, over the frames after the first (always full)
  vision_update_speedup              sum of full-refresh vision update times / sum of reuse ones, frames after the
                                     first, both measured in this pass on the same frames
  logit_rel_err, logit_rel_err_max   ||logits - logits_ref|| / ||logits_ref|| per frame (action-query logits,
                                     [H*D, vocab]), mean and max over all frames
  top1_agreement                     fraction of action bins equal to the reference's
  action_dev_pct_mean, _max          |action - action_ref| in % of each dim's range
  reuse_only_*                       the same against the full-refresh run (same cache): what reuse alone adds
  ref_logit_change_mean              how far the reference's own logits move from one frame to the next (relative):
                                     the scale against which the deviations are small or not
  pixel_floor_logit_rel_err[_max]    (--pixel-floor, one more reference step per threshold and frame) the reference
                                     run on the gate's reference picture (every patch as last refreshed) against the
                                     reference on the true frame: the error the threshold alone causes, with every
                                     token computed in its current context; the rest of logit_rel_err comes from the
                                     reused tokens' stale context (tower outputs and decoder K/V computed around older
                                     pictures)

Threshold 0 refreshes every patch: its deviation is the cache's alone (text bf16, vision int8 by default);
`--cache exact` runs every policy with all-fp32 partitions, so every deviation is reuse's alone.

With the built-in presets the weights are random (build_vla's seeded init): such a model puts nearly every action
query on the same one or two bins, so top1_agreement and action_dev_pct move in coarse steps (one bin flip moves
every dim of the chunk); logit_rel_err against ref_logit_change_mean is the informative pair.

The ego state is held constant (so that logit changes between frames come from the pictures) and the state ring
is the model's. One torch thread by default: on an AVX2-only CPU shared with other work, OpenMP spin-waits make
two threads several times slower.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from vla_node.backends.fp16_weights import fp16_weights_available, use_fp16_weights
from vla_node.drives.open import open_drive
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.action_head import ActionChunk
from vla_node.model.config import ModelConfig
from vla_node.model.config import preset as model_preset
from vla_node.model.vla import VLA, build_vla, preprocess_frame
from vla_node.progress import Progress
from vla_node.runtime.policy import MultiRatePolicy, VisionUpdate
from vla_node.runtime.reference import ReferencePolicy
from vla_node.runtime.reuse import ReuseConfig, ReuseGate, ReusePlan
from vla_node.validate import require

INSTRUCTION = "keep lane, follow car"  # fits every preset (tiny: 23 bytes)
DEFAULT_THRESHOLDS = (0, 2, 4, 8, 16)
DEFAULT_RATES: tuple[str | float, ...] = ("native", 10)
DEFAULT_MAX_FRAMES = 12  # per clip and rate: the whole sweep costs ~5-8 s a frame on a busy 2-core box
CACHES = {"default": CacheConfig, "exact": CacheConfig.exact}
NS_PER_S = 1_000_000_000


# ---------------------------------------------------------------------------------------------- inputs

def rate_label(rate: str | float) -> str:
    return "native" if rate == "native" else f"{float(rate):g}fps"


def setting_key(threshold: float, rate: str | float) -> str:
    return f"t{float(threshold):g}@{rate_label(rate)}"


def _check_rate(rate: object) -> str | float:
    ok = rate == "native" or (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate <= 1000)
    require(ok, "rates", rate, "'native' (the clip's own frames) or a frame rate in (0, 1000] Hz")
    return rate if rate == "native" else float(rate)


def _drive_frames(path: Path, fps: float | None) -> Iterator[np.ndarray]:
    """The first camera of a drive, every frame (fps None) or resampled to ticks k/fps (the latest frame at or
    before each tick, as video.decode_video does; the last frame is shown up to its own stamp, not beyond)."""
    drive = open_drive(path)
    camera = drive.cameras[0]
    tick = 0
    held: np.ndarray | None = None
    stamp_ns = 0
    for frame in drive.frames():
        if frame.camera != camera:
            continue
        if fps is None:
            yield frame.rgb()
            continue
        while held is not None and tick * NS_PER_S / fps < frame.stamp_ns:
            yield held
            tick += 1
        held, stamp_ns = frame.rgb(), frame.stamp_ns
    while fps is not None and held is not None and tick * NS_PER_S / fps <= stamp_ns:
        yield held
        tick += 1


def load_frames(path: str | Path, rate: str | float, max_frames: int | None, image_size: int) -> list[np.ndarray]:
    """Frames of a clip at `rate` ("native" or fps), at most `max_frames`, each uint8 [S, S, 3] at the model's
    input size (resized the way the policy resizes)."""
    from vla_node.drives.video import decode_video

    path = Path(path)
    fps = None if _check_rate(rate) == "native" else float(rate)
    if open_drive(path).kind == "video":
        source: Iterator[np.ndarray] = (rgb for _, rgb in decode_video(path, fps=fps, max_frames=max_frames))
    else:
        source = _drive_frames(path, fps)
    frames = []
    for rgb in source:
        if max_frames is not None and len(frames) >= max_frames:
            break
        # its own copy, laid out as the node's are (policy.prepare_frames stacks them), not as the resize's view
        frames.append(np.array(preprocess_frame(rgb, image_size), order="C"))
    if len(frames) < 2:
        raise ValueError(f"{path} at {rate_label(rate)}: {len(frames)} frame(s); expected at least 2 (the first "
                         f"is always a full refresh)")
    return frames


def ego_state(config: ModelConfig) -> np.ndarray:
    """A constant, plausible ego state (speed-like first value, the rest zero)."""
    state = np.zeros(config.state_dim, np.float32)
    state[0] = 0.6
    return state


# ---------------------------------------------------------------------------------------------- the gated policy

def gate_tokens(plans: Sequence[ReusePlan], tokens_per_camera: int) -> tuple[list[torch.Tensor | None], bool]:
    """The node's convention (Pipeline._vision): per camera the tokens to recompute, None for a full refresh of
    every token; and whether any camera saw a scene cut (a full refresh that flushes the vision memory)."""
    tokens = [None if (p.full and p.refresh.size == tokens_per_camera) else torch.from_numpy(p.refresh.copy())
              for p in plans]
    return tokens, any(p.scene_cut for p in plans)


class GatedPolicy:
    """A MultiRatePolicy behind one ReuseGate per camera, driven the way the node drives it."""

    def __init__(self, policy: MultiRatePolicy, reuse: ReuseConfig) -> None:
        c = policy.config
        self.policy = policy
        self.gates = [ReuseGate(reuse, c.image_size, c.patch_size) for _ in range(c.num_cameras)]

    def update_vision(self, images: np.ndarray, state=None) -> tuple[VisionUpdate, list[ReusePlan]]:
        """images uint8 [C, S, S, 3]: plan every camera, update the policy (with `state`: the tick in the frame's
        pass, as the node runs a frame whose action is due), commit the plans."""
        plans = [gate.plan(images[i]) for i, gate in enumerate(self.gates)]
        tokens, scene_cut = gate_tokens(plans, self.policy.config.tokens_per_camera)
        update = self.policy.update_vision(images, tokens, scene_cut, None, state)
        for i, (gate, plan) in enumerate(zip(self.gates, plans)):
            gate.commit(plan, images[i])
        return update, plans


# ---------------------------------------------------------------------------------------------- deviation

def logit_rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """||ours - theirs|| / ||theirs|| (L2 over every element)."""
    ours, theirs = ours.double(), theirs.double()
    return float(torch.linalg.vector_norm(ours - theirs) / torch.linalg.vector_norm(theirs))


@dataclass
class Deviation:
    """Per-frame deviation of one run's chunks from a baseline's."""

    span: np.ndarray  # [D] range of each action dim
    rel_err: list[float] = field(default_factory=list)
    bins_equal: list[float] = field(default_factory=list)  # fraction of the frame's bins equal
    dev_pct: list[np.ndarray] = field(default_factory=list)  # [H, D] % of range

    def add(self, ours: ActionChunk, theirs: ActionChunk) -> None:
        self.rel_err.append(logit_rel_err(ours.logits, theirs.logits))
        self.bins_equal.append(float((ours.bins == theirs.bins).mean()))
        self.dev_pct.append(np.abs(ours.actions - theirs.actions) / self.span * 100.0)

    def figures(self, prefix: str = "") -> dict:
        pct = np.stack(self.dev_pct)  # [frames, H, D]
        return {
            f"{prefix}logit_rel_err": float(np.mean(self.rel_err)),
            f"{prefix}logit_rel_err_max": float(np.max(self.rel_err)),
            f"{prefix}top1_agreement": float(np.mean(self.bins_equal)),
            f"{prefix}action_dev_pct_mean": float(pct.mean()),
            f"{prefix}action_dev_pct_max": float(pct.max()),
        }


@dataclass
class ReuseRun:
    gated: GatedPolicy
    vs_reference: Deviation
    vs_full: Deviation
    floor: ReferencePolicy | None = None  # the reference on the gate's reference picture (--pixel-floor)
    floor_err: list[float] = field(default_factory=list)
    vision_ms: list[float] = field(default_factory=list)
    reuse_ratio: list[float] = field(default_factory=list)
    full_refreshes: int = 0  # after the first frame
    scene_cuts: int = 0


# ---------------------------------------------------------------------------------------------- one clip

def measure_clip(frames: list[np.ndarray], thresholds: Sequence[float], config: ModelConfig, *, seed: int = 0,
                 cache: str = "default", pixel_floor: bool = False, label: str = "",
                 progress: bool = True, weights: str = "fp32", reuse: ReuseConfig = ReuseConfig()) -> dict[float, dict]:
    """One pass over `frames` (uint8 [S, S, 3] at the model's size): reference, full refresh and one reuse run per
    threshold, side by side; every reuse run takes `reuse` with its threshold. Returns {threshold: figures} (see the
    module docstring)."""
    cache_config = CACHES[cache]()
    model = build_vla(config, seed=seed)  # fp32 compute; shared by every policy (they only read it)
    if weights == "fp16":
        model = use_fp16_weights(model)  # the reference too: every deviation is at one precision
    reference = ReferencePolicy(model)
    full = MultiRatePolicy(model, cache_config)
    span = np.asarray(config.action_high, np.float64) - np.asarray(config.action_low, np.float64)  # [D]
    runs = {t: ReuseRun(_gated_policy(model, cache_config, reuse, t), Deviation(span), Deviation(span),
                        ReferencePolicy(model) if pixel_floor else None)
            for t in thresholds}
    for policy in (full, *(r.gated.policy for r in runs.values())):
        policy.update_text(INSTRUCTION)
    state = ego_state(config)
    full_ms: list[float] = []
    ref_change: list[float] = []
    previous_ref: torch.Tensor | None = None
    names: list[float | None] = [None, *runs]  # None = the full-refresh run
    chunks: dict[float | None, ActionChunk] = {}

    with Progress(len(frames), label, enabled=progress) as bar:
        for index, frame in enumerate(frames):
            images = frame[None]  # [S, S, 3] -> [1, S, S, 3] (one camera)
            ref = reference.step([frame], INSTRUCTION, state)
            if previous_ref is not None:
                ref_change.append(logit_rel_err(ref.logits, previous_ref))
            previous_ref = ref.logits
            shift = index % len(names)
            order = names[shift:] + names[:shift]  # rotate the order frame by frame
            _update_in_turn(images, index, order, full, runs, state, full_ms, chunks)
            _add_deviations(runs, chunks, ref, state)
            bar.update()
    return _clip_figures(runs, len(frames), full_ms, ref_change, cache, weights, reuse)


def _gated_policy(model: VLA, cache_config: CacheConfig, reuse: ReuseConfig, threshold: float) -> GatedPolicy:
    """A reuse run's policy: `reuse` with its threshold, behind its gates."""
    knobs = dataclasses.replace(reuse, threshold=float(threshold))
    return GatedPolicy(MultiRatePolicy(model, cache_config, reuse=knobs), knobs)


def _update_in_turn(images: np.ndarray, index: int, order: list[float | None], full: MultiRatePolicy,
                    runs: dict[float, ReuseRun], state: np.ndarray, full_ms: list[float],
                    chunks: dict[float | None, ActionChunk]) -> None:
    """Frame `index` (images uint8 [1, S, S, 3]) through every run in `order` (None = the full-refresh run): a
    timed vision update and an action tick each, the chunks into `chunks`; after the first frame each reuse run
    also counts its reuse ratio, full refreshes and scene cuts."""
    for name in order:
        if name is None:
            t0 = time.perf_counter_ns()
            full.update_vision(images)
            full_ms.append((time.perf_counter_ns() - t0) / 1e6)
            chunks[None] = full.action_tick(state)
            continue
        run = runs[name]
        t0 = time.perf_counter_ns()
        update, plans = run.gated.update_vision(images)
        run.vision_ms.append((time.perf_counter_ns() - t0) / 1e6)
        chunks[name] = run.gated.policy.action_tick(state)
        if index > 0:
            run.reuse_ratio.append(update.reuse_ratio)
            run.full_refreshes += update.full
            run.scene_cuts += any(p.scene_cut for p in plans)


def _add_deviations(runs: dict[float, ReuseRun], chunks: dict[float | None, ActionChunk], ref: ActionChunk,
                    state: np.ndarray) -> None:
    """One frame's deviation of every reuse run from the reference and from the full refresh; with the pixel
    floor, the reference's on what the gate holds from it."""
    for name, run in runs.items():
        run.vs_reference.add(chunks[name], ref)
        run.vs_full.add(chunks[name], chunks[None])
        if run.floor is not None:
            seen = np.array(run.gated.gates[0].reference)  # what the gate holds: patches as last refreshed
            run.floor_err.append(logit_rel_err(run.floor.step([seen], INSTRUCTION, state).logits, ref.logits))


def _clip_figures(runs: dict[float, ReuseRun], frame_count: int, full_ms: list[float], ref_change: list[float],
                  cache: str, weights: str, reuse: ReuseConfig) -> dict[float, dict]:
    """{threshold: figures} of a clip's runs (see the module docstring); timings leave out the first frame."""
    results = {}
    for threshold, run in runs.items():
        ratios = np.asarray(run.reuse_ratio)
        results[threshold] = {
            "threshold": float(threshold),
            "frames": frame_count,
            "cache": cache,
            "weights": weights,
            "layer_budget": reuse.layer_budget,
            "shared_drift_samples": reuse.shared_drift_samples,
            "max_age": reuse.max_age,
            "reuse_ratio_mean": float(ratios.mean()),
            "reuse_ratio_p10": float(np.percentile(ratios, 10)),
            "full_refreshes": run.full_refreshes,
            "scene_cuts": run.scene_cuts,
            "vision_update_speedup": float(np.sum(full_ms[1:]) / np.sum(run.vision_ms[1:])),
            "vision_full_ms_median": float(np.median(full_ms[1:])),
            "vision_reuse_ms_median": float(np.median(run.vision_ms[1:])),
            **run.vs_reference.figures(),
            **run.vs_full.figures("reuse_only_"),
            "ref_logit_change_mean": float(np.mean(ref_change)),
        }
        if run.floor is not None:
            results[threshold]["pixel_floor_logit_rel_err"] = float(np.mean(run.floor_err))
            results[threshold]["pixel_floor_logit_rel_err_max"] = float(np.max(run.floor_err))
    return results


# ---------------------------------------------------------------------------------------------- the run

def run(drives: list[str], thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
        rates: Sequence[str | float] = DEFAULT_RATES, max_frames: int | None = DEFAULT_MAX_FRAMES,
        preset: str = "small", threads: int = 1, json_path: str | None = None, cache: str = "default",
        pixel_floor: bool = False, seed: int = 0, progress: bool = True, weights: str | None = None,
        layer_budget: float | None = None, shared_drift_samples: int = ReuseConfig.shared_drift_samples,
        max_age: int = ReuseConfig.max_age) -> dict:
    """Measure every clip at every rate and threshold (max_frames None or 0: every frame); print a table; return
    (and optionally write) the figures as {clip file name: {setting: figures}}, settings named by `setting_key`."""
    require(isinstance(drives, (list, tuple)) and len(drives) > 0 and all(isinstance(d, (str, Path)) for d in drives),
            "drives", drives, "a non-empty list of mp4 files or drives")
    require(len({Path(d).name for d in drives}) == len(drives), "drives", drives,
            "files with distinct names (the results are keyed by file name)")
    require(len(thresholds) > 0 and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0
                                        for t in thresholds), "thresholds", thresholds,
            "one or more mean absolute pixel differences >= 0 (0-255 scale)")
    require(len(rates) > 0, "rates", rates, "one or more rates ('native' or fps)")
    rates = [_check_rate(r) for r in rates]
    max_frames = max_frames or None
    require(max_frames is None or (isinstance(max_frames, int) and not isinstance(max_frames, bool)
                                   and max_frames >= 2), "max_frames", max_frames, "None (all) or an integer >= 2")
    require(isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1, "threads", threads,
            "an integer >= 1")
    require(cache in CACHES, "cache", cache, f"one of {sorted(CACHES)}")
    if weights is None:
        weights = "fp16" if fp16_weights_available() else "fp32"
    require(weights == "fp32" or (weights == "fp16" and fp16_weights_available()), "weights", weights,
            "'fp32', or 'fp16' on an x86 CPU (fbgemm)")
    config = model_preset(preset)
    reuse = ReuseConfig(layer_budget=layer_budget, shared_drift_samples=shared_drift_samples,
                        max_age=max_age)  # validated before any clip is decoded
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    started = time.monotonic_ns()
    try:
        print(f"bench reuse: preset {preset}, cache {cache}, weights {weights}, layer budget {layer_budget}, "
              f"shared drift samples {shared_drift_samples}, max age {max_age}, {threads} thread(s), thresholds "
              f"{[float(t) for t in thresholds]}, rates {[rate_label(r) for r in rates]}, max_frames {max_frames}, "
              f"{platform.processor() or platform.machine()}, torch {torch.__version__}", flush=True)
        results: dict[str, dict[str, dict]] = {}
        for drive in drives:
            clip = Path(drive).name
            results[clip] = {}
            for rate in rates:
                frames = load_frames(drive, rate, max_frames, config.image_size)
                figures = measure_clip(frames, thresholds, config, seed=seed, cache=cache, pixel_floor=pixel_floor,
                                       reuse=reuse,
                                       label=f"{clip} {rate_label(rate)}", progress=progress, weights=weights)
                for threshold, row in figures.items():
                    results[clip][setting_key(threshold, rate)] = {"rate": rate_label(rate), **row}
    finally:
        torch.set_num_threads(threads_before)
    print_table(results)
    print(f"elapsed {(time.monotonic_ns() - started) / NS_PER_S:.0f} s", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results


def print_table(results: dict) -> None:
    print(f"{'clip':36s} {'setting':13s} {'frames':>6s} {'reuse':>6s} {'p10':>6s} {'speedup':>7s} "
          f"{'full ms':>7s} {'reuse ms':>8s} {'rel err':>8s} {'max':>8s} {'top-1':>6s} {'act %':>6s} "
          f"{'act %max':>8s} {'reuse-only':>10s} {'ref chg':>8s} {'px floor':>8s}")
    for clip, settings in results.items():
        for name, r in settings.items():
            floor = f"{r['pixel_floor_logit_rel_err']:8.2e}" if "pixel_floor_logit_rel_err" in r else f"{'-':>8s}"
            print(f"{clip:36s} {name:13s} {r['frames']:6d} {r['reuse_ratio_mean']:6.1%} {r['reuse_ratio_p10']:6.1%} "
                  f"{r['vision_update_speedup']:7.2f} {r['vision_full_ms_median']:7.0f} "
                  f"{r['vision_reuse_ms_median']:8.0f} {r['logit_rel_err']:8.2e} {r['logit_rel_err_max']:8.2e} "
                  f"{r['top1_agreement']:6.3f} {r['action_dev_pct_mean']:6.2f} {r['action_dev_pct_max']:8.2f} "
                  f"{r['reuse_only_logit_rel_err']:10.2e} {r['ref_logit_change_mean']:8.2e} "
                  f"{floor}")
