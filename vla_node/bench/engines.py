"""`vla-node bench engines`: each pure step (text, full frame, tick) in torch and ONNX Runtime side by side, in one
run, on the same seeded inputs, with parity against the torch fp32 step.

Recipes timed per step:
    torch-fp32          the step module eagerly, plain fp32 weights (the reference of every parity figure)
    torch-fp16-weights  the same with fbgemm's fp16 weights (today's default of launch/cpu.toml), where fbgemm is
    onnxruntime-fp32    the exported graph (opset 20) in ONNX Runtime's CPU provider, bound by pointer
    onnxruntime-int8    the same graph after ONNX Runtime's dynamic quantization (int8 weights per channel,
                        activations quantized per call: what runs fastest on x86 CPUs with VNNI/AMX)

Targets (the issue's): the ONNX Runtime int8 tick at most 0.5x the torch fp32 tick; the best CPU recipe's frame
(full refresh + tick) faster than today's default (torch, fp16 weights). The inputs are seeded random tensors of
the steps' static shapes (K/V, pixels, token ids) with valid biases: the time does not depend on their values.
"""

from __future__ import annotations

import copy
import json
import platform
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vla_node.backends import cpu_features
from vla_node.backends.engine import OnnxRuntimeEngine, TorchEngine
from vla_node.backends.export import export_step, parity
from vla_node.backends.fp16_weights import fp16_weights_available, use_fp16_weights
from vla_node.backends.steps import FrameStep, TextStep, TickStep, frame_bias, text_bias, tick_bias
from vla_node.bench.timing import time_ms
from vla_node.model.config import ModelConfig, preset
from vla_node.model.vla import VLA, build_vla

STEPS = {"text": (TextStep, ("text_k", "text_v")), "frame": (FrameStep, ("frame_embeds", "frame_k", "frame_v")),
         "tick": (TickStep, ("logits", "state_k", "state_v"))}


def step_inputs(c: ModelConfig, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Seeded inputs of every step at its static shapes: a 9-token instruction, a full frame, a tick over a full
    prefix with every stored state valid."""
    g = torch.Generator().manual_seed(seed)
    L, KV, hd = c.num_layers, c.num_kv_heads, c.head_dim

    def kv(tokens: int) -> torch.Tensor:
        return torch.randn(L, KV, tokens, hd, generator=g) * 0.5

    text_tokens, prefix = c.max_text_tokens, c.max_text_tokens + c.vision_frames * c.tokens_per_frame
    n_states = c.state_slots
    return {
        "text": {"ids": torch.randint(0, 256, (text_tokens,), generator=g), "positions": torch.arange(text_tokens),
                 "bias": text_bias(9, text_tokens)},
        "frame": {"pixels": torch.rand(c.num_cameras, 3, c.image_size, c.image_size, generator=g) * 2 - 1,
                  "positions": torch.tensor(list(c.vision_positions(0))), "text_k": kv(text_tokens),
                  "text_v": kv(text_tokens),
                  "bias": frame_bias(torch.arange(text_tokens) < 9, c.tokens_per_frame)},
        "tick": {"state_x": torch.randn(n_states, c.hidden_size, generator=g),
                 "positions": torch.tensor([c.state_base + s for s in range(n_states)]
                                           + list(range(c.query_base, c.query_base + c.action_tokens))),
                 "prefix_k": kv(prefix), "prefix_v": kv(prefix),
                 "bias": tick_bias(torch.zeros(prefix), torch.ones(n_states - 1, dtype=torch.bool), c.action_tokens)},
    }


def _engines(name: str, model: VLA, inputs: dict[str, torch.Tensor], folder: Path, threads: int) -> dict:
    """The recipes of one step: engine per recipe (fp32 and int8 ONNX exported here)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    cls, outputs = STEPS[name]
    engines = {"torch-fp32": TorchEngine(cls(model), list(inputs), outputs)}
    if fp16_weights_available():
        engines["torch-fp16-weights"] = TorchEngine(cls(use_fp16_weights(copy.deepcopy(model))), list(inputs),
                                                    outputs)
    fp32 = folder / f"{name}.onnx"
    export_step(cls(model), inputs, outputs, fp32)
    int8 = folder / f"{name}.int8.onnx"
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8, per_channel=True)
    engines["onnxruntime-fp32"] = OnnxRuntimeEngine(fp32, threads=threads)
    engines["onnxruntime-int8"] = OnnxRuntimeEngine(int8, threads=threads)
    return engines


def _time_step(engines: dict, inputs: dict[str, torch.Tensor], iters: int) -> dict[str, dict]:
    """Every recipe's median ms (rounds interleaved, so a load change hits all alike) and parity against
    torch-fp32 on the same inputs."""
    reference = engines["torch-fp32"]
    with torch.inference_mode():
        results = reference.step(*inputs.values())
    outputs = {recipe: {n: torch.empty_like(t) for n, t in zip(reference.output_names, results)}
               for recipe in engines}
    runs: dict[str, Callable[[], None]] = {recipe: (lambda e=e, o=outputs[recipe]: e.run(inputs, o))
                                           for recipe, e in engines.items()}
    samples: dict[str, list[float]] = {recipe: [] for recipe in engines}
    for run in runs.values():
        run()  # warm-up (allocator, first-call costs)
    for _ in range(iters):
        for recipe, run in runs.items():
            samples[recipe].append(time_ms(run, 1, warmup=0)["median"])
    expected = [t.numpy() for t in outputs["torch-fp32"].values()]
    figures = {}
    for recipe in engines:
        got = [t.numpy() for t in outputs[recipe].values()]
        figures[recipe] = {"ms": round(float(np.median(samples[recipe])), 3),
                           "parity_vs_torch_fp32": parity(expected, got, reference.output_names)}
    return figures


def run(preset_name: str = "small", iters: int = 10, threads: int = 1, json_path: str | None = None) -> dict:
    """Time every step and recipe; print a table; return (and optionally write) the figures."""
    torch.set_num_threads(threads)
    model = build_vla(preset(preset_name), seed=0)
    inputs = step_inputs(model.config)
    steps = {}
    with tempfile.TemporaryDirectory(prefix="vla-bench-engines-") as tmp:
        for name in STEPS:
            steps[name] = _time_step(_engines(name, model, inputs[name], Path(tmp), threads), inputs[name], iters)
    result = {"preset": preset_name, "threads": threads, "iters": iters, "steps": steps,
              "cpu": platform.processor() or platform.machine(), "kernels": cpu_features.describe(),
              "torch": torch.__version__, "targets": _targets(steps)}
    print(table(result))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _targets(steps: dict) -> dict:
    tick = steps["tick"]
    frame_tick = {recipe: steps["frame"][recipe]["ms"] + tick[recipe]["ms"] for recipe in tick}
    default = "torch-fp16-weights" if "torch-fp16-weights" in frame_tick else "torch-fp32"
    best = min(frame_tick, key=frame_tick.get)
    ratio = tick["onnxruntime-int8"]["ms"] / tick["torch-fp32"]["ms"]
    return {"onnxruntime_int8_tick_over_torch_fp32_tick": {"value": round(ratio, 3), "target": "<= 0.5",
                                                           "met": ratio <= 0.5},
            "frame_and_tick_ms": {k: round(v, 3) for k, v in frame_tick.items()},
            "best_frame_and_tick_over_default": {"best": best, "default": default,
                                                 "value": round(frame_tick[best] / frame_tick[default], 3),
                                                 "target": "< 1", "met": frame_tick[best] < frame_tick[default]}}


def table(result: dict) -> str:
    lines = [f"bench engines: {result['preset']}, {result['threads']} thread(s), {result['iters']} rounds; "
             f"{result['kernels']}",
             f"{'step':<6}{'recipe':<20}{'ms':>9}  parity vs torch-fp32 (max relative, per output)"]
    for step, recipes in result["steps"].items():
        for recipe, f in recipes.items():
            rel = ", ".join(f"{k} {v['max_rel']:.1e}" for k, v in f["parity_vs_torch_fp32"].items())
            lines.append(f"{step:<6}{recipe:<20}{f['ms']:>9.3f}  {rel}")
    t = result["targets"]
    a, b = t["onnxruntime_int8_tick_over_torch_fp32_tick"], t["best_frame_and_tick_over_default"]
    lines.append(f"onnxruntime-int8 tick / torch-fp32 tick: {a['value']}x (target {a['target']}: "
                 f"{'met' if a['met'] else 'MISSED'})")
    lines.append(f"frame + tick, best ({b['best']}) / default ({b['default']}): {b['value']}x (target {b['target']}: "
                 f"{'met' if b['met'] else 'MISSED'})")
    return "\n".join(lines)
