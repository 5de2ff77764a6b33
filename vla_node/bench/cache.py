"""`vla-node bench cache`: the multi-rate KV cache against full recompute, measured side by side in one run.

    vla-node bench cache [--preset small] [--iters 5] [--threads 1] [--compute-dtype auto|fp32|bf16]
                                   [--weights fp16|fp32|packed] [--json F]

Compute dtype: fp32 (as launch/cpu.toml), bf16, or auto (bf16 where the CPU has bf16 hardware: AVX512-BF16, AMX);
the reference and transformers compute in the same dtype.

What it measures (same weights, same synthetic 640x480 frame, one process, one thread by default):
  - action_tick_ms, vision_update_ms (full refresh, from the 640x480 frame: its resize to the model's input is
    timed too, as in the reference step and transformers' run), text_update_ms of MultiRatePolicy with the default
    cache (text bf16, vision int8, action fp32), interleaved round by round with reference_step_ms
    (ReferencePolicy.step, full recompute) so that a load change on a shared machine hits all alike;
    action_tick_after_commit_ms: the tick that follows a text or vision update, which also recomputes the
    stored states; vision_update_with_tick_ms: a full vision update given the ego state, which decodes that tick in
    the frame's own decoder pass, as the node runs a frame whose action is due (multirate.update_vision); the
    "vision update + tick" target uses it, and the separate sum (vision update, then the tick after the commit)
    is reported beside it;
  - hf_generate_ms: transformers' LlamaForCausalLM.generate on the same decoder weights and tokens
    (bench_model.hf_generate_step, our compute dtype, with fp16 weights its linear weights as ours), in the same
    rounds;
  - weights: with fp32 compute every linear layer's weights fp16 (fbgemm; the default where fbgemm exists, as in
    launch/cpu.toml) or fp32, for every policy, the reference and transformers alike (fp16 weights change the
    numbers); with bf16 compute the weights prepacked for oneDNN with fused MLP activations ("packed", the default
    where the CPU has bf16 hardware) or plain, for every policy and the reference; transformers keeps its own
    kernels (packing is our engine, not a change of precision). With fp16 or packed weights the plain-weight
    action tick, vision update and reference step are timed in the same rounds too;
  - the two targets (reference step / action tick >= 10x, transformers / (vision update + tick after a commit)
    >= 3x) as ratios of the medians, and round by round: their spread within the run and the rounds that meet them;
  - kv bytes per partition, and the vision partition's bytes if it were stored in fp16;
  - segmented vs gather attention (vision update; the action tick too, though with tick_prefix, the default, both
    modes' ticks run the same prefix-buffer attention);
  - the INT8 effect: the default cache against the all-fp32 cache over a short sequence;
  - a vision-memory policy table with vision_frames=4: timings, kv bytes, deviation against all-fp32 fifo;
  - `flow`: the flow head (action_head = "flow", flow_state 'prefix', the same preset and seed: its trunk is the bins
    model's, plus the action expert) at the same compute dtype and weights, timed in the same rounds as everything
    above: flow_tick_ms, the cached flow tick at the model's flow_steps (10; an ordinary tick, not the first after a
    commit), flow_tick_ms_by_steps at 10 and each of SchedulerConfig.denoising_steps (the degrade ladder's
    fewer_denoising_steps levels: 5, 2), flow_per_step_ms (the slope between 10 steps and the fewest: (t10 - t2) /
    8) and flow_fixed_ms (the intercept: the state's decoder pass and the tick's overhead); reference_flow_ms,
    ReferencePolicy.step of the same frame and state at 10 steps (every step a full recompute of the sequence; like
    reference_step_ms it also resizes the frame and runs the vision tower once), with reference_vision_tower_ms
    (that resize and tower pass alone, in the same rounds) and reference_flow_without_vision_ms (the median over
    rounds of the step minus the tower); the target reference_over_flow_tick >= 5x (and per round);
    flow_tick_over_bins_tick (against action_tick_ms, the same rounds). And the accuracy of fewer steps: per level
    the chunks' deviation from the 10-step chunks of the same ticks (one policy per step count in lockstep, the same
    noise: tick_noise depends only on the noise seed and the tick index) over deviation_frames frames of the shared
    real freeway clip at 10 fps where it is found (as bench all), else the synthetic frames above: max and mean
    abs, and both relative to the 10-step chunks' RMS.

Why one thread: on an AVX2-only CPU shared with other work, OpenMP spin-waits make two threads on two busy
cores several times slower; the thread count is part of the result.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import platform
import statistics
import time
from typing import Callable

import numpy as np
import torch

from vla_node.backends.fp16_weights import cpu_has_bf16, fp16_weights_available
from vla_node.backends.loading import convert_weights
from vla_node.backends.packed_weights import packed_weights_available
from vla_node.bench.model import hf_generate_step
from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.dtypes import torch_dtypes
from vla_node.kv.partition import KVPartition
from vla_node.kv.vision_config import POLICIES, VisionMemoryConfig
from vla_node.model.action_head import ActionChunk
from vla_node.model.config import ModelConfig, preset
from vla_node.model.vla import VLA, build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reference import ReferencePolicy
from vla_node.sched.scheduler import SchedulerConfig
from vla_node.validate import choose, require

INSTRUCTION = "keep lane, follow car"  # fits every preset (tiny: 23 bytes)
SECOND_INSTRUCTION = "exit, merge right"
COMPUTE_DTYPES = torch_dtypes(("fp32", "bf16"))
TARGETS = {"reference_step_over_action_tick": 10.0, "hf_generate_over_vision_update_plus_action_tick": 3.0}
# each target's ratio as (numerator cases, denominator cases), summed per round: the per-round spread of a ratio
# shows how far the machine's noise moves it within one run
TARGET_CASES = {"reference_step_over_action_tick": (("reference_step",), ("action_tick",)),
                "hf_generate_over_vision_update_plus_action_tick": (("hf_generate",), ("vision_update_with_tick",))}
POLICY_WINDOW = 4  # vision_frames of the policy table
FLOW_TARGETS = {"reference_over_flow_tick": 5.0}
FLOW_TARGET_CASES = {"reference_over_flow_tick": (("reference_flow",), ("flow_tick",))}


# ---------------------------------------------------------------------------------------------- inputs

def drive_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """n consecutive 640x480 frames of the synthetic road drive at 10 fps (they change frame to frame)."""
    cfg = SyntheticDriveConfig(width=640, height=480, fps=10, seconds=max(n, 1) / 10, seed=seed)
    return [rgb for _, rgb in synthetic_frames(cfg)][:n]


def ego_states(n: int, state_dim: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.5, size=state_dim).astype(np.float32) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- timing

def interleaved_ms(cases: dict[str, Callable[[], object]], iters: int, warmup: int = 1) -> dict[str, dict]:
    """Time every case once per round, round after round (warm-up rounds first): medians, min, max and every
    round's sample in ms. Interleaving makes ratios fair on a machine whose load changes during the run."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(warmup + iters):
        for name, fn in cases.items():
            t0 = time.perf_counter_ns()
            fn()
            if round_index >= warmup:
                samples[name].append((time.perf_counter_ns() - t0) / 1e6)
    return {name: {"median": statistics.median(s), "min": min(s), "max": max(s), "n": len(s), "samples": s}
            for name, s in samples.items()}


def per_round_ratio(timing: dict[str, dict], numerator: tuple[str, ...], denominator: tuple[str, ...],
                    target: float) -> dict:
    """sum(numerator) / sum(denominator) in each round: min, median, max and the rounds that meet `target`."""
    samples = [timing[name]["samples"] for name in (*numerator, *denominator)]
    ratios = [round(sum(r[: len(numerator)]) / sum(r[len(numerator):]), 2) for r in zip(*samples)]  # one a round
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
            "met_rounds": sum(ratio >= target for ratio in ratios), "rounds": len(ratios)}


# ---------------------------------------------------------------------------------------------- deviation

def action_deviation(ours: list[ActionChunk], theirs: list[ActionChunk], config: ModelConfig) -> dict:
    """How far a cache's action chunks are from a baseline's over the same steps.

    max_abs_logit_diff; logits_rel_l2 = ||ours - theirs|| / ||theirs|| over all steps; top1_agreement =
    fraction of (step, horizon, dim) bins equal; action_diff_pct_of_range max and mean, per dim range."""
    a = torch.stack([c.logits.float() for c in ours])  # [steps, H*D, vocab]
    b = torch.stack([c.logits.float() for c in theirs])
    bins_a, bins_b = np.stack([c.bins for c in ours]), np.stack([c.bins for c in theirs])  # [steps, H, D]
    span = np.asarray(config.action_high, np.float64) - np.asarray(config.action_low, np.float64)  # [D]
    pct = np.abs(np.stack([c.actions for c in ours]) - np.stack([c.actions for c in theirs])) / span * 100.0
    return {
        "steps": len(ours),
        "finite": bool(torch.isfinite(a).all()),
        "max_abs_logit_diff": float((a - b).abs().max()),
        "logits_rel_l2": _relative(float(torch.linalg.vector_norm(a - b)), float(torch.linalg.vector_norm(b))),
        "top1_agreement": float((bins_a == bins_b).mean()),
        "action_diff_pct_of_range_max": float(pct.max()),
        "action_diff_pct_of_range_mean": float(pct.mean()),
    }


def _relative(diff: float, norm: float) -> float:
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


@dataclasses.dataclass
class SequenceRun:
    chunks: list[ActionChunk]
    vision_ms: list[float]
    tick_ms: list[float]


def run_lockstep(policies: dict[str, MultiRatePolicy], frames: list[np.ndarray], states: list[np.ndarray],
                 steps: dict[str, int] | None = None) -> dict[str, SequenceRun]:
    """The same sequence through every policy, step by step in turn (so that a load change hits all alike):
    update_text, then per frame a full vision update and one action tick; the instruction changes halfway
    (a text update recomputes what follows it). Each vision update and tick is timed. `steps`: a flow policy's
    denoising steps by name (the others tick at their model's default)."""
    steps = steps or {}
    runs = {name: SequenceRun([], [], []) for name in policies}
    for policy in policies.values():
        policy.update_text(INSTRUCTION)
    for i, (frame, state) in enumerate(zip(frames, states)):
        for name, policy in policies.items():
            if i == len(frames) // 2:
                policy.update_text(SECOND_INSTRUCTION)
            images = policy.prepare_frames([frame])
            t0 = time.perf_counter_ns()
            policy.update_vision(images)
            t1 = time.perf_counter_ns()
            runs[name].chunks.append(policy.action_tick(state) if name not in steps
                                     else policy.action_tick(state, steps=steps[name]))
            t2 = time.perf_counter_ns()
            runs[name].vision_ms.append((t1 - t0) / 1e6)
            runs[name].tick_ms.append((t2 - t1) / 1e6)
    return runs


def vision_fp16_bytes(policy: MultiRatePolicy) -> int:
    """kv bytes of the policy's vision partitions, were every one of them stored in fp16 (no scales)."""
    total = 0
    for p in policy.vision.partitions:
        fp16 = KVPartition(dataclasses.replace(p.spec, dtype="fp16"))  # a few MB at most, freed on return
        total += fp16.nbytes()["kv_bytes"]
    return total


# ---------------------------------------------------------------------------------------------- the run

def run(preset_name: str = "small", iters: int = 5, threads: int = 1, json_path: str | None = None,
        compute_dtype: str = "fp32", deviation_frames: int = 6, policy_frames: int = 8,
        weights: str | None = None) -> dict:
    """Measure everything listed in the module docstring; print a table; return (and optionally write) the
    figures as a dict."""
    if compute_dtype == "auto":  # as launch/cpu.toml: bf16 where the CPU has bf16 hardware (fp16 weights: fp32)
        compute_dtype = "bf16" if cpu_has_bf16() and weights != "fp16" else "fp32"
    dtype = choose("compute_dtype", compute_dtype, COMPUTE_DTYPES)
    if weights is None:
        weights = ("fp16" if dtype == torch.float32 and fp16_weights_available()
                   else "packed" if dtype == torch.bfloat16 and packed_weights_available() else "fp32")
    require(weights == "fp32" or (weights == "fp16" and dtype == torch.float32 and fp16_weights_available())
            or (weights == "packed" and dtype == torch.bfloat16 and packed_weights_available()),
            "weights", weights, "'fp32', 'fp16' with fp32 compute on an x86 CPU (fbgemm), or 'packed' with bf16 "
            "compute on a CPU with bf16 hardware (oneDNN)")
    for key, value, least in (("iters", iters, 1), ("threads", threads, 1), ("deviation_frames", deviation_frames, 2),
                              ("policy_frames", policy_frames, 2)):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= least, key, value,
                f"an integer >= {least}")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(preset_name, iters, json_path, compute_dtype, dtype, deviation_frames, policy_frames, weights)
    finally:
        torch.set_num_threads(threads_before)


def _run(preset_name, iters, json_path, compute_dtype, dtype, deviation_frames, policy_frames, weights) -> dict:
    from vla_node.backends.cpu_features import cpu_model

    started = time.monotonic_ns()
    config = preset(preset_name)
    frames = drive_frames(max(deviation_frames, policy_frames))
    states = ego_states(len(frames), config.state_dim)
    results: dict = {
        "preset": preset_name, "threads": torch.get_num_threads(), "compute_dtype": compute_dtype, "weights": weights,
        "iters": iters, "machine": platform.processor() or platform.machine(), "cpu": cpu_model(),
        "torch": torch.__version__,
        "default_cache": {"text": CacheConfig().text_dtype, "vision": CacheConfig().vision.storage_dtype,
                          "action": CacheConfig().action_dtype},
    }
    print(f"bench cache: preset {preset_name}, compute {compute_dtype}, weights {weights}, "
          f"{results['threads']} thread(s), {iters} rounds, {results['machine']}", flush=True)
    base = build_vla(config, seed=0)  # fp32; shared by every fp32 policy (they only read it)
    model = _with_weights(base, dtype, weights)
    flow_model = _with_weights(build_vla(preset(preset_name, "flow"), seed=0), dtype, weights)  # flow_state 'prefix'

    results.update(_stage_timings(config, model, base, frames[0], states[0], iters, dtype, weights, flow_model))
    results["flow"]["fewer_steps_accuracy"] = _flow_steps_accuracy(flow_model, dtype, deviation_frames,
                                                                   flow_steps_levels(flow_model.config))
    exact_model = model if dtype == torch.float32 else base  # fp32 compute with the same weights
    results["int8_effect"] = _int8_effect(config, model, exact_model, frames[:deviation_frames],
                                          states[:deviation_frames], dtype)
    results["vision_policies"] = _policy_table(config, dtype, frames[:policy_frames], states[:policy_frames], weights)
    results["elapsed_s"] = round((time.monotonic_ns() - started) / 1e9, 1)
    _print_summary(results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _converted(model: VLA, dtype: torch.dtype) -> VLA:
    """The same weights in another dtype (a copy: the fp32 model stays the baseline's)."""
    return copy.deepcopy(model).to(dtype)


def _with_weights(base: VLA, dtype: torch.dtype, weights: str) -> VLA:
    """The fp32 model `base` as the run times it: in the compute dtype, with fp16 or packed linear weights where
    asked, as the node loads them (the flow head's expert stays plain: backends/loading.py), a copy unless nothing
    changes."""
    if weights == "fp16":
        return convert_weights(copy.deepcopy(base), "fp16")
    if weights == "packed":
        return convert_weights(_converted(base, dtype), "packed")
    return base if dtype == torch.float32 else _converted(base, dtype)


def _stage_timings(config, model, base, frame, state, iters, dtype, weights, flow_model) -> dict:
    """Every stage of the default cache (and the other attention mode, plain weights, the reference and
    transformers' generate) and the flow head's tick and reference timed in interleaved rounds; returns the
    figures (see _stage_figures, _flow_figures)."""
    default_mode = CacheConfig().attention
    other_mode = "segmented" if default_mode == "gather" else "gather"
    policies, reference, plain = _steady_policies(config, model, base, frame, state, dtype, weights, default_mode,
                                                  other_mode)
    cases = _stage_cases(policies, reference, plain, base, frame, state, dtype, weights, default_mode, other_mode)
    levels = flow_steps_levels(flow_model.config)
    flow_policy = _steady_flow_policy(flow_model, frame, state, dtype)
    cases.update(_flow_cases(flow_policy, ReferencePolicy(flow_model, dtype), frame, state, levels))
    timing = interleaved_ms(cases, iters)
    compute_name = "fp32" if dtype == torch.float32 else "bf16"
    hf_weights = "fp16" if weights == "fp16" else compute_name  # transformers' own kernels, never packed
    for name, t in timing.items():
        print(f"  {name + '_ms':28s} {t['median']:9.1f}  (min {t['min']:.1f}, max {t['max']:.1f}, n={t['n']})"
              + (f", {hf_weights} weights" if name == "hf_generate" else ""), flush=True)
    out = _stage_figures(timing, policies, reference, weights, compute_name, hf_weights, default_mode, other_mode)
    out["flow"] = _flow_figures(timing, flow_policy, levels, out["action_tick_ms"])
    return out


def _steady_policies(config, model, base, frame, state, dtype, weights, default_mode: str,
                     other_mode: str) -> tuple[dict[str, MultiRatePolicy], ReferencePolicy, VLA | None]:
    """The policies timed (one per attention mode, and one with plain weights where the weights are fp16 or
    packed), each in steady state (text, a frame, a full ring of states), and the reference. Returns (policies,
    reference, the plain-weights model or None)."""
    policies = {mode: MultiRatePolicy(model, CacheConfig(attention=mode), dtype) for mode in (default_mode, other_mode)}
    plain = None
    if weights in ("fp16", "packed"):  # the same weights, neither fp16 nor packed
        plain = base if weights == "fp16" else _converted(base, dtype)  # (a policy converts its model in place)
        policies["plain weights"] = MultiRatePolicy(plain, CacheConfig(), dtype)
    reference = ReferencePolicy(model, dtype)
    images = policies[default_mode].prepare_frames([frame])
    for policy in policies.values():  # steady state: text, a frame, a full ring of states
        policy.update_text(INSTRUCTION)
        policy.update_vision(images)
        for _ in range(config.state_slots):
            policy.action_tick(state)
    return policies, reference, plain


def _stage_cases(policies: dict[str, MultiRatePolicy], reference: ReferencePolicy, plain: VLA | None, base: VLA,
                 frame, state, dtype, weights, default_mode: str, other_mode: str) -> dict[str, Callable[[], object]]:
    """The timed cases by name: the default policy's stages, the other attention mode's, the reference step, the
    plain-weights policy's and reference's (with fp16 or packed weights) and transformers' generate step."""
    main, other = policies[default_mode], policies[other_mode]
    instructions = itertools.cycle([SECOND_INSTRUCTION, INSTRUCTION])  # a real change every time
    # A tick after a commit of text or vision also recomputes the stored states (multirate.py): every round starts
    # after the previous round's text update, so its first tick is that one and its second an ordinary tick.
    cases = {
        "action_tick_after_commit": lambda: main.action_tick(state),
        "action_tick": lambda: main.action_tick(state),
        "vision_update_with_tick": lambda: _with_tick(main, frame, state),
        "vision_update": lambda: main.update_vision(main.prepare_frames([frame])),
        "text_update": lambda: main.update_text(next(instructions)),
        "reference_step": lambda: reference.step([frame], INSTRUCTION, state),
        f"{other_mode}_action_tick_after_commit": lambda: other.action_tick(state),
        f"{other_mode}_action_tick": lambda: other.action_tick(state),
        f"{other_mode}_vision_update": lambda: other.update_vision(other.prepare_frames([frame])),
    }
    if weights in ("fp16", "packed"):  # the same stages with plain weights, in the same rounds
        plain_policy, plain_reference = policies["plain weights"], ReferencePolicy(plain, dtype)
        cases["plain_weights_action_tick_after_commit"] = lambda: plain_policy.action_tick(state)  # as the main
        cases["plain_weights_action_tick"] = lambda: plain_policy.action_tick(state)  # policy's: then an ordinary one
        cases["plain_weights_vision_update"] = lambda: plain_policy.update_vision(plain_policy.prepare_frames([frame]))
        cases["plain_weights_reference_step"] = lambda: plain_reference.step([frame], INSTRUCTION, state)
    cases["hf_generate"] = hf_generate_step(base, ReferencePolicy(base), frame, INSTRUCTION,
                                            fp16_weights=weights == "fp16", dtype=dtype)
    return cases


def _stage_figures(timing: dict[str, dict], policies: dict[str, MultiRatePolicy], reference: ReferencePolicy,
                   weights, compute_name: str, hf_weights: str, default_mode: str, other_mode: str) -> dict:
    """The figures of the timed stages: median ms, spreads, the linear layers each timed model ran, kv bytes, the
    targets' ratios (overall and per round), plain weights' and the attention modes' figures."""
    ms = {name: round(t["median"], 2) for name, t in timing.items()}
    main = policies[default_mode]
    kv = main.kv_bytes()
    # the class of the linear layers each timed model really ran (the weights labels above are the requested ones)
    timed = {"policy": main.model, "reference": reference.model}
    if "plain weights" in policies:
        timed["plain weights"] = policies["plain weights"].model
    linear_layers = {name: type(m.decoder.model.layers[0].self_attn.q_proj).__name__ for name, m in timed.items()}
    fp16 = vision_fp16_bytes(main)
    out = {
        "action_tick_ms": ms["action_tick"],
        "action_tick_after_commit_ms": ms["action_tick_after_commit"],
        "vision_update_ms": ms["vision_update"],
        "vision_update_with_tick_ms": ms["vision_update_with_tick"],
        "text_update_ms": ms["text_update"],
        "reference_step_ms": ms["reference_step"],
        "reference_dtype": compute_name,
        "hf_generate_ms": ms["hf_generate"],
        "hf_dtype": compute_name,
        "hf_weights": hf_weights,
        "timing_spread_ms": {name: [round(t["min"], 2), round(t["max"], 2)] for name, t in timing.items()},
        "linear_layers": linear_layers,
        "kv_bytes": kv,
        "kv_bytes_total": sum(kv.values()),
        "vision_kv_bytes_fp16_equivalent": fp16,
        "vision_int8_over_fp16": round(kv["vision"] / fp16, 4),
        "reference_step_over_action_tick": round(ms["reference_step"] / ms["action_tick"], 2),
        # a frame and its tick, as the node runs them: the tick in the frame's decoder pass
        "hf_generate_over_vision_update_plus_action_tick": round(ms["hf_generate"] / ms["vision_update_with_tick"], 2),
        # the same work as two stages: the tick after the commit recomputes the stored states (see multirate.py)
        "hf_generate_over_separate_vision_update_and_tick":
            round(ms["hf_generate"] / (ms["vision_update"] + ms["action_tick_after_commit"]), 2),
    }
    if weights in ("fp16", "packed"):
        out["plain_weights"] = {
            "weights": "fp32" if weights == "fp16" else compute_name,
            "action_tick_ms": ms["plain_weights_action_tick"], "vision_update_ms": ms["plain_weights_vision_update"],
            "reference_step_ms": ms["plain_weights_reference_step"],
            "reference_step_over_action_tick":
                round(ms["plain_weights_reference_step"] / ms["plain_weights_action_tick"], 2)}
    out["targets"] = {key: {"target": target, "measured": out[key], "met": out[key] >= target,
                            "per_round": per_round_ratio(timing, *TARGET_CASES[key], target)}
                      for key, target in TARGETS.items()}
    out["attention"] = _attention_figures(ms, default_mode, other_mode)
    return out


def _attention_figures(ms: dict[str, float], default_mode: str, other_mode: str) -> dict:
    """The default attention mode against the other: each one's action tick and vision update (median ms)."""
    modes = {default_mode: ("action_tick", "vision_update"),
             other_mode: (f"{other_mode}_action_tick", f"{other_mode}_vision_update")}
    tick = {mode: ms[keys[0]] for mode, keys in modes.items()}
    vision = {mode: ms[keys[1]] for mode, keys in modes.items()}
    attention = {
        "default": default_mode,
        **{mode: {"action_tick_ms": tick[mode], "vision_update_ms": vision[mode]} for mode in modes},
        "faster_vision_update": min(vision, key=vision.get),
        # with tick_prefix (the default) a tick attends over the one prefix buffer whatever the mode
        "action_tick_same_code": CacheConfig().tick_prefix,
    }
    if not CacheConfig().tick_prefix:
        attention["faster_action_tick"] = min(tick, key=tick.get)
    return attention


def _with_tick(policy: MultiRatePolicy, frame: np.ndarray, state: np.ndarray) -> ActionChunk:
    """A full vision update given the ego state: the tick decoded in the frame's pass (refused where it cannot be,
    so that the figure is never a vision update alone)."""
    update = policy.update_vision(policy.prepare_frames([frame]), state=state)
    if update.chunk is None:
        raise RuntimeError("bench cache: the default cache did not decode the tick in the frame's pass")
    return update.chunk


# ---------------------------------------------------------------------------------------------- the flow head

def flow_steps_levels(config: ModelConfig) -> tuple[int, ...]:
    """The flow tick's step counts the bench runs: the model's flow_steps, then each of the degrade ladder's
    fewer_denoising_steps levels below it (SchedulerConfig.denoising_steps, as the scheduler takes them)."""
    return (config.flow_steps, *(n for n in SchedulerConfig().denoising_steps if n < config.flow_steps))


def _steady_flow_policy(model: VLA, frame: np.ndarray, state: np.ndarray, dtype: torch.dtype) -> MultiRatePolicy:
    """The flow model's default-cache policy in steady state (text, a frame, a full ring of states): its ticks are
    ordinary ones (no text or vision commit comes between them in the rounds)."""
    policy = MultiRatePolicy(model, CacheConfig(), dtype)
    policy.update_text(INSTRUCTION)
    policy.update_vision(policy.prepare_frames([frame]))
    for _ in range(model.config.state_slots):
        policy.action_tick(state)
    return policy


def _flow_cases(policy: MultiRatePolicy, reference: ReferencePolicy, frame: np.ndarray, state: np.ndarray,
                levels: tuple[int, ...]) -> dict[str, Callable[[], object]]:
    """The flow head's timed cases: its tick at each step count (flow_tick: the model's flow_steps), the reference
    step (flow_steps full-recompute steps, after the frame's resize and one vision-tower pass) and that resize and
    tower pass alone."""
    cases: dict[str, Callable[[], object]] = {"flow_tick": lambda: policy.action_tick(state)}
    for n in levels[1:]:
        cases[f"flow_tick_{n}_steps"] = lambda n=n: policy.action_tick(state, steps=n)
    cases["reference_flow"] = lambda: reference.step([frame], INSTRUCTION, state)
    cases["reference_vision_tower"] = lambda: _reference_tower(reference, frame)
    return cases


@torch.inference_mode()
def _reference_tower(reference: ReferencePolicy, frame: np.ndarray) -> torch.Tensor:
    """What the reference step runs before its decode: the frame's resize and the vision tower (with projector)."""
    return reference.model.encode_frame(reference.prepare_frames([frame]))


def _flow_figures(timing: dict[str, dict], policy: MultiRatePolicy, levels: tuple[int, ...],
                  bins_tick_ms: float) -> dict:
    """The flow head's timing figures (median ms of the interleaved rounds) and its target."""
    med = {name: t["median"] for name, t in timing.items()}
    full, fewest = levels[0], levels[-1]
    tick_ms = {n: med["flow_tick" if n == full else f"flow_tick_{n}_steps"] for n in levels}
    per_step = (tick_ms[full] - tick_ms[fewest]) / (full - fewest) if fewest < full else None
    without_vision = statistics.median(a - b for a, b in zip(timing["reference_flow"]["samples"],
                                                             timing["reference_vision_tower"]["samples"]))
    flow_tick, reference = round(med["flow_tick"], 2), round(med["reference_flow"], 2)
    out = {
        "action_head": "flow",
        "flow_state": policy.config.flow_state,
        "flow_steps": full,
        "denoising_steps_levels": list(levels[1:]),
        "expert_linear_layer": type(policy.model.expert.layers[0].self_attn.q_proj).__name__,
        "flow_tick_ms": flow_tick,
        "flow_tick_ms_by_steps": {str(n): round(ms, 2) for n, ms in tick_ms.items()},
        "flow_per_step_ms": None if per_step is None else round(per_step, 3),
        "flow_fixed_ms": None if per_step is None else round(tick_ms[fewest] - fewest * per_step, 2),
        "flow_per_step_method": f"slope of the median tick between {full} and {fewest} steps: (t{full} - t{fewest}) "
                                f"/ {full - fewest}; flow_fixed_ms is its intercept at 0 steps (the state's "
                                "decoder pass and the tick's overhead)",
        "reference_flow_ms": reference,
        "reference_flow_steps": full,
        "reference_flow_includes": "the frame's resize and one vision-tower pass, then every denoising step a full "
                                   "recompute of the prefix through the decoder and the block through the expert "
                                   "(ReferencePolicy.step, as reference_step_ms)",
        "reference_vision_tower_ms": round(med["reference_vision_tower"], 2),
        "reference_flow_without_vision_ms": round(without_vision, 2),
        "reference_flow_without_vision_method": "median over rounds of reference_flow minus reference_vision_tower "
                                                "(the resize and tower pass alone, timed in the same round)",
        "reference_over_flow_tick": round(reference / flow_tick, 2),
        "reference_without_vision_over_flow_tick": round(without_vision / med["flow_tick"], 2),
        "bins_action_tick_ms": bins_tick_ms,
        "flow_tick_over_bins_tick": round(flow_tick / bins_tick_ms, 2),
    }
    out["targets"] = {key: {"target": target, "measured": out[key], "met": out[key] >= target,
                            "per_round": per_round_ratio(timing, *FLOW_TARGET_CASES[key], target)}
                      for key, target in FLOW_TARGETS.items()}
    return out


def accuracy_frames(n: int, image_size: int) -> tuple[list[np.ndarray], dict]:
    """n frames for the fewer-steps accuracy: the shared real freeway clip at 10 fps where it is found (bench all's
    clip: $VLA_NODE_DRIVES, else ../shared/data/drives beside the checkout), resized to the model's input; else the
    synthetic 640x480 drive. Returns (frames, what they are)."""
    from vla_node.bench.clips import CLIP_FPS, default_clip
    from vla_node.bench.reuse import load_frames

    clip = default_clip()
    if clip is not None:
        return load_frames(clip, CLIP_FPS, n, image_size), {"frames_source": "real clip", "clip": str(clip),
                                                            "fps": CLIP_FPS}
    return drive_frames(n), {"frames_source": "synthetic drive (no real clip found)", "clip": None, "fps": 10.0}


def _flow_steps_accuracy(model: VLA, dtype: torch.dtype, n_frames: int, levels: tuple[int, ...]) -> dict:
    frames, source = accuracy_frames(n_frames, model.config.image_size)
    print(f"  flow: {', '.join(map(str, levels[1:]))} steps vs {levels[0]} over {len(frames)} frames "
          f"({source['frames_source']}) ...", flush=True)
    states = ego_states(len(frames), model.config.state_dim)
    return {**source, **flow_steps_deviation(model, dtype, frames, states, levels[0], levels[1:])}


def flow_steps_deviation(model: VLA, dtype: torch.dtype, frames: list[np.ndarray], states: list[np.ndarray],
                         full: int, fewer: tuple[int, ...]) -> dict:
    """Each fewer step count's chunks against the `full`-step chunks of the same ticks: one default-cache policy per
    step count, in lockstep (run_lockstep: the same text, frames and states), all with noise seed 0, so that tick i
    of every policy starts from the same tick_noise(0, i). Per level: max and mean |difference|, and those and the
    difference's RMS relative to the full-step chunks' RMS (over every frame, step and dim)."""
    names = {"full": full, **{str(n): n for n in fewer}}
    policies = {name: MultiRatePolicy(model, CacheConfig(), dtype, noise_seed=0) for name in names}
    runs = run_lockstep(policies, frames, states, names)
    ref = np.stack([c.actions for c in runs["full"].chunks]).astype(np.float64)  # [frames, H, D]
    rms = float(np.sqrt(np.mean(ref**2)))
    levels = {}
    for name in names:
        if name == "full":
            continue
        diff = np.abs(np.stack([c.actions for c in runs[name].chunks]).astype(np.float64) - ref)
        levels[name] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
                        "max_abs_over_rms": _relative(float(diff.max()), rms),
                        "mean_abs_over_rms": _relative(float(diff.mean()), rms),
                        "rms_over_rms": _relative(float(np.sqrt(np.mean(diff**2))), rms)}
    return {"baseline_steps": full, "frames": len(frames), "noise": "tick_noise(seed 0, tick index): the same per "
            "tick for every step count", "baseline_rms": rms,
            "finite": bool(all(np.isfinite(c.actions).all() for run in runs.values() for c in run.chunks)),
            "by_steps": levels}


def _int8_effect(config, model, base, frames, states, dtype) -> dict:
    """The default cache (at the compute dtype) against the all-fp32 cache (fp32 compute)."""
    print(f"  int8 effect: default cache vs all-fp32 cache over {len(frames)} frames ...", flush=True)
    runs = run_lockstep({"default": MultiRatePolicy(model, CacheConfig(), dtype),
                         "exact": MultiRatePolicy(base, CacheConfig.exact())}, frames, states)
    return {"baseline": "all-fp32 cache, fp32 compute, the same weights",
            **action_deviation(runs["default"].chunks, runs["exact"].chunks, config)}


def policy_variants(config: ModelConfig) -> dict[str, tuple[str, VisionMemoryConfig]]:
    """Row name -> (knobs in words, vision memory config) of the policy table. Defaults, except where the
    default would make a policy behave as fifo: h2o by default keeps a full window (nothing to choose), so
    it gets about the quota policy's capacity (about the same memory; importance instead of age); merge is
    shown at its default threshold and at a lower one."""
    def vision(policy: str, **knobs) -> VisionMemoryConfig:  # validated against the model's frame size
        return VisionMemoryConfig(policy=policy, window_frames=config.vision_frames,
                                  tokens_per_frame=config.tokens_per_frame, **knobs)

    quota_min = min(VisionMemoryConfig.quota_min_tokens, config.tokens_per_frame)  # as MultiRatePolicy clamps it
    quota = vision("quota", quota_min_tokens=quota_min)
    same_memory = quota.full_window_tokens()
    h2o_capacity = max(same_memory, 2 * config.tokens_per_frame)  # h2o's least: the protected frame + the new one
    return {
        "fifo": ("default (int8)", vision("fifo")),
        "quota": (f"decay {quota.quota_decay}, min {quota_min} -> {same_memory} tokens", vision("quota")),
        "merge": ("cosine > 0.95 (default)", vision("merge")),
        "merge@0.8": ("cosine > 0.8", vision("merge", merge_threshold=0.8)),
        "h2o": (f"capacity {h2o_capacity} tokens (quota's: {same_memory})",
                vision("h2o", capacity_tokens=h2o_capacity)),
        "tiered": ("hot bf16 1 frame, cold int8", vision("tiered")),
    }


def _policy_table(config, dtype, frames, states, weights) -> list[dict]:
    """Each vision-memory policy with vision_frames=4 (the run's compute dtype and weights) against the all-fp32
    fifo cache on the same frames."""
    wide = config.replace(vision_frames=POLICY_WINDOW)
    base = build_vla(wide, seed=0)
    model = _with_weights(base, dtype, weights)
    variants = policy_variants(wide)
    shown = {vision.policy for _, vision in variants.values()}
    require(shown == set(POLICIES), "policy table", sorted(shown), f"every policy: {sorted(POLICIES)}")
    print(f"  vision policies, vision_frames={POLICY_WINDOW}, {len(frames)} frames, in lockstep: "
          f"{', '.join(variants)} ...", flush=True)
    policies = {"fifo (all fp32)": MultiRatePolicy(base, CacheConfig.exact())}
    knobs = {"fifo (all fp32)": "every partition fp32, fp32 compute and weights (the baseline)"}
    for name, (words, vision) in variants.items():
        policies[name] = MultiRatePolicy(model, CacheConfig(vision=vision), dtype)
        knobs[name] = words
    runs = run_lockstep(policies, frames, states)
    exact = runs["fifo (all fp32)"]
    return [_policy_row(name, knobs[name], policies[name], runs[name], exact, wide) for name in policies]


def _policy_row(name: str, knobs: str, policy: MultiRatePolicy, seq: SequenceRun, exact: SequenceRun,
                config: ModelConfig) -> dict:
    stats = policy.vision.stats()
    return {
        "policy": name,
        "knobs": knobs,
        "vision_update_ms": round(statistics.median(seq.vision_ms[1:]), 2),  # the first frame is warm-up
        "action_tick_ms": round(statistics.median(seq.tick_ms[1:]), 2),
        # the comparable figure: a vision commit's state recompute runs in the next tick (fifo, merge: the prefix
        # buffer) or in the update (h2o, quota, tiered), so only their sum measures the same work in every row
        "step_ms": round(statistics.median(v + t for v, t in zip(seq.vision_ms[1:], seq.tick_ms[1:])), 2),
        "kv_bytes": policy.kv_bytes(),
        "vision_kv_bytes": policy.kv_bytes()["vision"],
        "vision_tokens_used": stats["tokens_used"],
        "merged_tokens": stats["merged_tokens"],
        "evicted_tokens": stats["evicted_tokens"],
        "demoted_tokens": stats["demoted_tokens"],
        "deviation": action_deviation(seq.chunks, exact.chunks, config),
    }


# ---------------------------------------------------------------------------------------------- printing

def _print_summary(r: dict) -> None:
    mib = 2**20
    print()
    print(f"== multi-rate KV cache, preset {r['preset']}, compute {r['compute_dtype']}, weights {r['weights']}, "
          f"{r['threads']} thread(s) ==")
    print(f"{'stage':34s} {'median ms':>10s}")
    for key in ("action_tick_ms", "action_tick_after_commit_ms", "vision_update_ms", "vision_update_with_tick_ms",
                "text_update_ms", "reference_step_ms", "hf_generate_ms"):
        print(f"{key:34s} {r[key]:10.1f}")
    for key, t in r["targets"].items():
        n = t["per_round"]
        print(f"{key:48s} {t['measured']:7.2f}x  (target >= {t['target']:g}: {'met' if t['met'] else 'NOT met'}; "
              f"per round {n['min']:.2f}-{n['max']:.2f}x, met in {n['met_rounds']} of {n['rounds']})")
    print(f"transformers / (vision update, then the tick after its commit, as two stages): "
          f"{r['hf_generate_over_separate_vision_update_and_tick']:.2f}x")
    if "plain_weights" in r:
        f = r["plain_weights"]
        print(f"with plain {f['weights']} weights (same rounds): action tick {f['action_tick_ms']:.1f} ms, vision "
              f"update {f['vision_update_ms']:.1f} ms, reference step {f['reference_step_ms']:.1f} ms, ratio "
              f"{f['reference_step_over_action_tick']:.2f}x")
    print("kv bytes: " + ", ".join(f"{k} {v / mib:.3f} MiB" for k, v in r["kv_bytes"].items())
          + f"; vision in fp16 would be {r['vision_kv_bytes_fp16_equivalent'] / mib:.3f} MiB "
            f"(int8/fp16 = {r['vision_int8_over_fp16']:.3f})")
    a = r["attention"]
    tick_verdict = ("the same prefix-buffer code in both modes: the difference is noise" if a["action_tick_same_code"]
                    else f"{a['faster_action_tick']} faster")
    print(f"attention: vision update segmented {a['segmented']['vision_update_ms']:.1f} / gather "
          f"{a['gather']['vision_update_ms']:.1f} ms -> {a['faster_vision_update']} faster; action tick segmented "
          f"{a['segmented']['action_tick_ms']:.1f} / gather {a['gather']['action_tick_ms']:.1f} ms ({tick_verdict})")
    e = r["int8_effect"]
    print(f"int8 effect ({e['baseline']}, {e['steps']} steps): max |dlogit| {e['max_abs_logit_diff']:.4f}, "
          f"rel L2 {e['logits_rel_l2']:.4f}, top-1 agreement {e['top1_agreement']:.3f}, action diff "
          f"{e['action_diff_pct_of_range_max']:.2f}% of range max ({e['action_diff_pct_of_range_mean']:.2f}% mean)")
    _print_flow(r["flow"], r["action_tick_ms"])
    print(f"vision-memory policies, vision_frames={POLICY_WINDOW}, {r['weights']} weights (deviation vs all-fp32 fifo; "
          "step = vision + tick, the comparable figure: the states' recompute after a commit runs in the tick for "
          "fifo and merge, in the update for the others):")
    print(f"{'policy':16s} {'step ms':>8s} {'vision ms':>9s} {'tick ms':>8s} {'vision KiB':>10s} {'tokens':>6s} "
          f"{'merged':>6s} {'evicted':>7s} {'max|dlogit|':>11s} {'rel L2':>7s} {'top-1':>6s} {'act %rng':>8s}  knobs")
    for row in r["vision_policies"]:
        d = row["deviation"]
        print(f"{row['policy']:16s} {row['step_ms']:8.1f} {row['vision_update_ms']:9.1f} {row['action_tick_ms']:8.1f} "
              f"{row['vision_kv_bytes'] / 1024:10.1f} {row['vision_tokens_used']:6d} {row['merged_tokens']:6d} "
              f"{row['evicted_tokens']:7d} {d['max_abs_logit_diff']:11.4f} {d['logits_rel_l2']:7.4f} "
              f"{d['top1_agreement']:6.3f} {d['action_diff_pct_of_range_max']:8.2f}  {row['knobs']}")
    print(f"elapsed {r['elapsed_s']} s")


def _print_flow(f: dict, bins_tick_ms: float) -> None:
    steps = ", ".join(f"{n}: {ms:.1f}" for n, ms in f["flow_tick_ms_by_steps"].items())
    per_step = ("" if f["flow_per_step_ms"] is None else
                f"; per step {f['flow_per_step_ms']:.2f} ms, fixed {f['flow_fixed_ms']:.1f} ms")
    print(f"flow head (flow_state {f['flow_state']}, {f['expert_linear_layer']}): tick {f['flow_tick_ms']:.1f} ms at "
          f"{f['flow_steps']} steps (by steps {steps}{per_step}); bins tick {bins_tick_ms:.1f} ms -> flow/bins "
          f"{f['flow_tick_over_bins_tick']:.2f}x")
    for key, t in f["targets"].items():
        n = t["per_round"]
        print(f"{key:48s} {t['measured']:7.2f}x  (target >= {t['target']:g}: {'met' if t['met'] else 'NOT met'}; "
              f"per round {n['min']:.2f}-{n['max']:.2f}x, met in {n['met_rounds']} of {n['rounds']})")
    print(f"flow reference: {f['reference_flow_ms']:.1f} ms for {f['reference_flow_steps']} steps, of which resize + "
          f"vision tower {f['reference_vision_tower_ms']:.1f} ms; without it "
          f"{f['reference_flow_without_vision_ms']:.1f} ms -> {f['reference_without_vision_over_flow_tick']:.2f}x the "
          "tick")
    a = f["fewer_steps_accuracy"]
    print(f"fewer steps vs {a['baseline_steps']} (same noise, {a['frames']} frames, {a['frames_source']}; "
          f"{a['baseline_steps']}-step RMS {a['baseline_rms']:.4f}):")
    for n, d in a["by_steps"].items():
        print(f"  {n:>2s} steps: max |d| {d['max_abs']:.4f} ({d['max_abs_over_rms'] * 100:.1f}% of RMS), mean |d| "
              f"{d['mean_abs']:.4f} ({d['mean_abs_over_rms'] * 100:.1f}%), RMS of d {d['rms_over_rms'] * 100:.1f}%")
