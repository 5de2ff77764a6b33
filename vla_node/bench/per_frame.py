"""`vla-node bench all`'s model figures: per-frame work on a real clip against transformers and the reference, the
stages against their floor, side by side in one run.

Every contender runs the same frames (a clip resampled to 10 fps, each frame resized to the model's input once), the
same instruction and ego state, the same seeded weights, frame by frame in a rotating order so that a load change on
a shared machine hits every one alike:

    ours           the node's policy (the eager MultiRatePolicy, as the launch file builds it at the compute dtype)
                   behind the reuse gate, as the node drives it: the frame's vision update with the tick in its pass
    ours int8      the same with `weights = "int8"` (every matmul on the CPU kernels' int8 linear), where it runs
                   (bf16 compute, AVX512-VNNI or AMX-INT8)
    onnxruntime int8  the engine policy on ONNX Runtime's dynamic int8 recipe (int8-ort), driven the same way
    reference      ReferencePolicy.step: full recompute of every token, at the compute dtype
    peer           transformers: SiglipVisionModel on the frame's pixels, our projector, then
                   LlamaForCausalLM.generate of the H*D action tokens after the prefix (its default dynamic cache),
                   at the compute dtype (bench model's hf_peer)
    fp32 reference the oracle of every accuracy figure (full recompute, fp32, plain weights)

Compute dtype: bf16 where the CPU multiplies bf16 in hardware (AVX512-BF16, AMX), else fp32; the report names the
path that ran (dtype, linear-weight format, the SDPA attention with AMX, the packed matmuls' row buckets).
speedup_vs_hf = peer ms / ours ms (medians over the frames after the first, which is a full refresh for every
contender); int8_speedup_vs_hf the same for the faster int8 contender.

The per-frame floor is reuse_frame's (bench/floor.py) at the clip's mean refreshed token count: peer_over_floor is
the most speedup_vs_hf any implementation could show on this machine at this dtype; int8_floor the same with int8
weights (against ours int8).

Stages (one frame, interleaved rounds, each in its own shuffled order): the action tick and the full-refresh frame
with its tick, per backend (the eager policy at the compute dtype, in fp32 and with int8 weights where they run, ONNX
Runtime fp32 and int8-ort), and each eager stage's floor (bench/floor.py) at its dtype and weights, sampled in every
round: ratio_to_floor = stage ms / floor ms.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Callable

import numpy as np
import torch

from vla_node.backends import cpu_kernels
from vla_node.backends.loading import load_model
from vla_node.backends.packed_weights import bucket_step, int8_weights_available, kernel_matmuls
from vla_node.bench.floor import FloorSampler
from vla_node.bench.model import hf_peer
from vla_node.bench.reuse import GatedPolicy, ego_state, logit_rel_err
from vla_node.config import NodeConfig
from vla_node.kv.dtypes import torch_dtype as dtype_named
from vla_node.model.action_head import ActionChunk
from vla_node.model.config import ModelConfig
from vla_node.node.policies import build_policies, engine_set
from vla_node.progress import Progress
from vla_node.runtime.engine_policy import EnginePolicy
from vla_node.runtime.policy import MultiRatePolicy, attention_kernels, fused_attention_pays
from vla_node.runtime.reference import ReferencePolicy

FLOOR_REPEATS = 3  # loops per shape and way in each floor sample (floor.MatrixRate)
FLOOR_SAMPLES = 5  # samples of the per-frame floor, after the clip
BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
WEIGHT_BYTES = {"plain": None, "fp32": 4, "fp16": 2, "packed": 2, "int8": 1}  # None: the compute dtype's


@dataclasses.dataclass
class Gated:
    """A policy behind its reuse gate (GatedPolicy: one camera), each frame timed, its chunk kept."""

    gated: GatedPolicy
    ms: list[float] = dataclasses.field(default_factory=list)
    reuse: list[float] = dataclasses.field(default_factory=list)
    chunks: list[ActionChunk] = dataclasses.field(default_factory=list)

    def frame(self, image: np.ndarray, state: np.ndarray) -> None:
        """One timed frame (uint8 [S, S, 3]): plan, vision update with the tick in its pass, commit."""
        t0 = time.perf_counter_ns()
        update, _ = self.gated.update_vision(image[None], state)  # [1, S, S, 3]
        policy = self.gated.policy
        chunk = update.chunk if update.chunk is not None else policy.action_tick(state)
        self.ms.append((time.perf_counter_ns() - t0) / 1e6)
        self.reuse.append(update.reuse_ratio)
        self.chunks.append(chunk)


def compute_config(config: NodeConfig, dtype: str) -> NodeConfig:
    """The launch file's node on the eager backend at `dtype`, its weights as the launch file resolves them."""
    return config.replace(model=dataclasses.replace(config.model, dtype=dtype, backend="torch", fallback=()))


def path_floor(c: ModelConfig, stage: str, config: NodeConfig, refreshed: int | None = None) -> FloorSampler:
    """The FloorSampler of `stage` for the path `config` runs: its compute dtype, its linear weights' bytes per
    element (plain: the compute dtype's) and, with int8 weights, the int8 linear's rate."""
    s = config.model
    compute = dtype_named(s.resolved_dtype)
    return FloorSampler(c, stage, compute, WEIGHT_BYTES[s.weight_format] or BYTES[compute], BYTES[compute],
                        refreshed, repeats=FLOOR_REPEATS, int8_weights=s.weight_format == "int8")


def path_name(config: NodeConfig) -> str:
    """The path that ran: compute dtype and linear-weight format, the attention on torch's SDPA where the CPU's AMX
    makes it pay (policy.fused_attention_pays), else in bf16 the decoder's and the tower's on the fused CPU kernel
    where it runs (policy.attention_kernels), the packed matmuls on the fused CPU kernels' linear where
    packed_weights.kernel_matmuls says so, else oneDNN's with their rows padded to buckets (packed_weights.RowBuckets:
    16 rows with AMX, else 8), with the linear kernel (bf16, or int8 with int8 weights) and the attention kernel the
    decoder's layers in one C call each (backends/native_rows.py: the tick's block; native_frame.py: a frame's with
    the tick in its pass, where the vision partition is INT8) and the tower's in two (native_tower.py: a refresh), a
    tick with the stored states fresh whole in one (native_tick.py: the parallel bins head, not compiled), and the
    tick compiled where model.compiled_tick resolves on (eager_policy checks that these ran)."""
    s = config.model
    model, dtype, device = s.model_config(), dtype_named(s.resolved_dtype), torch.device(s.device)
    parts = [f"{s.resolved_dtype} compute", f"{s.weight_format} weights"]
    isa = "AMX" if cpu_kernels.amx_tiles() else "AVX512-BF16"
    if fused_attention_pays(dtype, device):
        parts.append("SDPA attention")
    elif any(attention_kernels(model, dtype, device)):
        parts.append(f"attention on the {isa} kernel")
    if s.weight_format == "packed":
        parts.append(f"matmuls on the {isa} linear kernel" if kernel_matmuls() else f"rows padded to {bucket_step()}")
    elif s.weight_format == "int8":
        parts.append(f"matmuls on the {'AMX-INT8' if cpu_kernels.amx_int8_tiles() else 'AVX512-VNNI'} int8 linear "
                     "kernel")
    # the native layers: with int8 weights too, where a weight int8 does not fit stays bf16 on the bf16 kernel
    if s.weight_format in ("packed", "int8") and kernel_matmuls():
        decoder_kernel, tower_kernel = attention_kernels(model, dtype, device)
        if decoder_kernel is not None:
            parts.append("decoder layers one C call each (the tick's; a frame's with INT8 vision storage)")
            if (model.action_decode, model.action_head) == ("parallel", "bins") and not s.resolved_compiled_tick:
                parts.append("the tick with fresh states whole in one C call")
        if tower_kernel:
            parts.append("tower layers two C calls each")
    if s.resolved_compiled_tick:
        parts.append("tick compiled (AOTInductor)")
    return ", ".join(parts)


def eager_policy(config: NodeConfig) -> MultiRatePolicy:
    """The eager policy of `config` (compute_config), warmed up as the node's warm-up does, its tick compiled where
    path_name says so: a compiled tick that could not be had (or native layers other than path_name names) is an
    error here, not a mislabelled figure."""
    policy, _, _ = build_policies(config)
    if config.model.resolved_compiled_tick and not policy.compiled_tick:
        raise RuntimeError("model.compiled_tick resolves on, but the tick could not be compiled (see the warning "
                           "above): the figures would be the eager tick's")
    name, vision = path_name(config), config.cache.vision
    tick = "decoder layers one C call each" in name
    named = {"tick": tick, "whole tick": "whole in one C call" in name,
             "tower": "tower layers two C calls each" in name,
             "reuse frame": tick and vision.storage_dtype == "int8" and vision.policy == "fifo"
             and policy.config.vision_frames == 1}
    ran = {"tick": policy.native_tick, "whole tick": policy.native_whole_tick, "tower": policy.native_tower,
           "reuse frame": policy.native_frame}
    if ran != named:
        raise RuntimeError(f"the policy's native layers {ran}, unlike its path's name ({named}): {name}")
    policy.compile_kernels()
    return policy


def accuracy(chunks: list[ActionChunk], oracle: list[ActionChunk]) -> dict:
    """Logit relative L2 error (mean, max) and action-bin agreement against the fp32 reference's chunks."""
    errors = [logit_rel_err(a.logits, b.logits) for a, b in zip(chunks, oracle)]
    return {"logit_rel_err_mean": float(f"{np.mean(errors):.3g}"), "logit_rel_err_max": float(f"{np.max(errors):.3g}"),
            "bins_agreement": round(float(np.mean([(a.bins == b.bins).mean() for a, b in zip(chunks, oracle)])), 4)}


def clip_figures(config: NodeConfig, frames: list[np.ndarray], instruction: str, dtype: str,
                 progress: bool = True) -> dict:
    """Per-frame work on `frames` (uint8 [S, S, 3], the clip at 10 fps): ours, int8, reference and peer side by
    side (module docstring), with accuracy against the fp32 reference on the same frames."""
    ours_config = compute_config(config, dtype)
    torch_dtype = dtype_named(ours_config.model.resolved_dtype)
    policy = eager_policy(ours_config)
    c = policy.config
    plain = load_model(c, "plain", config.model.checkpoint, config.model.seed)
    int8 = EnginePolicy(plain, engine_set(config, plain, "onnxruntime", "int8-ort", build=True), config.cache,
                        "cpu", config.reuse)
    gated = {"ours": Gated(GatedPolicy(policy, config.reuse))}
    if ours_config.model.resolved_dtype == "bf16" and int8_weights_available():
        gated["ours int8"] = Gated(GatedPolicy(eager_policy(int8_config(ours_config)), config.reuse))
    gated["onnxruntime int8"] = Gated(GatedPolicy(int8, config.reuse))
    for g in gated.values():
        g.gated.policy.update_text(instruction)
    reference = ReferencePolicy(load_model(c, "plain", config.model.checkpoint, config.model.seed), torch_dtype)
    oracle = ReferencePolicy(plain)
    peer = hf_peer(plain, oracle, instruction, dtype=torch_dtype)
    state = ego_state(c)
    timed: dict[str, list[float]] = {"reference": [], "peer": []}
    oracle_chunks: list[ActionChunk] = []

    steps: dict[str, Callable[[np.ndarray], object]] = {name: _frame_step(g, state) for name, g in gated.items()}
    steps.update({"reference": lambda image: reference.step([image], instruction, state), "peer": peer})
    order = list(steps)
    with Progress(len(frames), "bench all: per frame on the clip", enabled=progress) as bar:
        for index, image in enumerate(frames):
            oracle_chunks.append(oracle.step([image], instruction, state))
            for name in order[index % len(order):] + order[:index % len(order)]:
                t0 = time.perf_counter_ns()
                steps[name](image)
                if name in timed:
                    timed[name].append((time.perf_counter_ns() - t0) / 1e6)
            bar.update()
    reuse_mean = float(np.mean(gated["ours"].reuse[1:]))
    refreshed = max(1, round((1 - reuse_mean) * c.tokens_per_frame))
    ms = {name: statistics.median(g.ms[1:]) for name, g in gated.items()}
    ms.update({name: statistics.median(values[1:]) for name, values in timed.items()})

    def floor(name: str, weights: NodeConfig) -> dict:  # reuse_frame's at `refreshed`, against `name`'s time
        sampler = path_floor(c, "reuse_frame", weights, refreshed)
        for _ in range(FLOOR_SAMPLES):  # its shapes are known only now: a few samples, spread over some seconds
            sampler.sample()
        f = sampler.floor()
        return {**f, "contender": name, "ratio_to_floor": round(ms[name] / f["floor_ms"], 2),
                "peer_over_floor": round(ms["peer"] / f["floor_ms"], 2)}

    floors = {"floor": floor("ours", ours_config)}
    if "ours int8" in gated:
        floors["int8_floor"] = floor("ours int8", int8_config(ours_config))
    return {"frames": len(frames), "path": path_name(ours_config), "compute_dtype": ours_config.model.resolved_dtype,
            "ms": {k: round(v, 2) for k, v in ms.items()},
            "reuse_ratio_mean": round(reuse_mean, 3), **floors,
            "speedup_vs_hf": round(ms["peer"] / ms["ours"], 2),
            "speedup_vs_reference": round(ms["reference"] / ms["ours"], 2),
            "int8_speedup_vs_hf": round(ms["peer"] / min(ms[name] for name in gated if "int8" in name), 2),
            "accuracy_vs_fp32_reference": {name: accuracy(g.chunks, oracle_chunks) for name, g in gated.items()}}


def round_order(items: list, index: int) -> list:
    """items in round `index`'s order: shuffled by a generator seeded with the round (the same orders every run), so
    that what a case leaves behind (caches, threads, the floors' samples) does not fall on the same next case every
    round, as a fixed order would have it."""
    order = list(items)
    random.Random(index).shuffle(order)
    return order


def _frame_step(gated: Gated, state: np.ndarray) -> Callable[[np.ndarray], None]:
    return lambda image: gated.frame(image, state)


def int8_config(config: NodeConfig) -> NodeConfig:
    """`config` (compute_config, bf16) with its linear weights on the int8 kernel."""
    return config.replace(model=dataclasses.replace(config.model, weights="int8", compiled_tick="off"))


def _stage_cases(policy: MultiRatePolicy, image: np.ndarray, state: np.ndarray, instruction: str) -> dict:
    policy.update_text(instruction)
    policy.update_vision(image[None], None, False, None, state)  # [1, S, S, 3]
    return {"tick": lambda: policy.action_tick(state),
            "frame": lambda: policy.update_vision(image[None], None, False, None, state)}


def stage_figures(config: NodeConfig, image: np.ndarray, instruction: str, dtype: str, rounds: int = 8) -> dict:
    """The tick and the full-refresh frame (with its tick) per backend, interleaved round by round, and each eager
    stage against its floor at its own dtype and weights (bench/floor.py)."""
    eager = [compute_config(config, dtype)]
    if eager[0].model.resolved_dtype != "fp32":
        eager.append(compute_config(config, "fp32"))
    if eager[0].model.resolved_dtype == "bf16" and int8_weights_available():
        eager.append(int8_config(eager[0]))
    backends: dict[str, MultiRatePolicy] = {f"torch {path_name(e)}": eager_policy(e) for e in eager}
    c = next(iter(backends.values())).config
    plain = load_model(c, "plain", config.model.checkpoint, config.model.seed)
    for recipe in ("fp32", "int8-ort"):
        engines = engine_set(config, plain, "onnxruntime", recipe, build=True)
        backends[f"onnxruntime {recipe}"] = EnginePolicy(plain, engines, config.cache, "cpu", config.reuse)
    state = ego_state(c)
    cases = {(backend, stage): fn for backend, policy in backends.items()
             for stage, fn in _stage_cases(policy, image, state, instruction).items()}
    samplers = {f"torch {path_name(e)}: {stage}": path_floor(c, stage, e)
                for e in eager for stage in ("tick", "frame")}
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    order = [*cases, None]  # None: the floors' samples, once a round (the machine as the stages see it)
    for index in range(rounds):
        for key in round_order(order, index):  # no case always after the same one
            if key is None:
                for sampler in samplers.values():
                    sampler.sample()
                continue
            t0 = time.perf_counter_ns()
            cases[key]()
            samples[key].append((time.perf_counter_ns() - t0) / 1e6)
    ms = {f"{b}: {s}": round(statistics.median(v[1:]), 2) for (b, s), v in samples.items()}
    floors = {}
    for key, sampler in samplers.items():
        floor = sampler.floor()
        floor["stage_ms"] = ms[key]
        floor["ratio_to_floor"] = round(floor["stage_ms"] / floor["floor_ms"], 2)
        floors[key] = floor
    return {"rounds": rounds, "ms": ms, "floor": floors}
