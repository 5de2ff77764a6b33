"""`vla-node bench engines`: the steps the engine policy runs, in torch and ONNX Runtime side by side in one run, on
the same seeded inputs, with parity against the torch fp32 step; and today's default (the eager policy, fp32
compute with fp16 weights) doing the same frame.

Steps timed (backends/engine_set.py): text, tick, the tower full and partial (a quarter of the tokens and the
shared-drift sample) and the decoder with the tick's rows, full and partial; and beside them the flow head's tick
(FlowTickStep, a flow model of the same preset and seed, flow_state 'prefix') at two Euler step counts, the model's
flow_steps (10) and 2 unless told (`flow_steps`). Recipes per step:
    torch-fp32          the step module eagerly, plain fp32 weights (the reference of every parity figure)
    torch-fp16-weights  the same with fbgemm's fp16 weights, where fbgemm is
    onnxruntime-fp32    the exported graph (opset 20) in ONNX Runtime's CPU provider, bound by pointer, from the
                        engine store (built by this run into a temporary store)
    onnxruntime-int8    the int8-ort recipe (backends/quantize.py) of the same graph

The flow figures (result["flow"]): per recipe, `flow_tick_ms` (flow-tick-10: the tick the node runs at the top of
its ladder), `flow_per_step_ms` = (flow-tick-10 ms - flow-tick-2 ms) / 8, the marginal cost of one Euler step (the
state rows' decoder pass and the call's fixed costs cancel in the difference), `flow_fixed_ms` = flow-tick-10 ms - 10
x flow_per_step_ms (what the tick costs besides its steps), `flow_over_bins_tick` (flow-tick-10 ms over the bins
tick's), and each step's ms and parity against torch-fp32 under `steps`, as for the bins steps.

Targets (the issue's): the ONNX Runtime int8 tick at most 0.5x the torch fp32 tick; the best backend's fused frame
(full refresh + tick: tower-full + both pieces of decoder-tick-full) faster than today's default, the eager policy's
update_vision with the tick in its pass (torch, fp32, fp16 weights), timed in the same rounds. `rss_mb`: the
resident memory of a node pipeline per backend (a fresh process each, after warm-up).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vla_node.backends import cpu_features
from vla_node.backends.engine import TorchEngine
from vla_node.backends.engine_set import StepSpec, capacities, exported_engines, flow_tick_spec, step_specs
from vla_node.backends.export import parity
from vla_node.backends.fp16_weights import fp16_weights_available, use_fp16_weights
from vla_node.backends.steps import FrameStep, TextStep, TickStep, frame_bias, text_bias, tick_bias
from vla_node.backends.store import EngineStore
from vla_node.bench.timing import time_ms
from vla_node.model.config import ModelConfig, preset
from vla_node.model.vla import build_vla

SAMPLES = 8  # the node's shared-drift sample (reuse.shared_drift_samples)
# the three whole-stage steps with seeded inputs (step_inputs): for tests and calibration checks
STEPS = {"text": (TextStep, ("text_k", "text_v")), "frame": (FrameStep, ("frame_embeds", "frame_k", "frame_v")),
         "tick": (TickStep, ("logits", "state_k", "state_v"))}


def bench_steps(c: ModelConfig) -> dict[str, str]:
    """Bench name -> engine step name."""
    tower, frame = capacities(c.tokens_per_camera, SAMPLES), capacities(c.tokens_per_frame, SAMPLES)
    return {"text": "text", "tick": "tick", "tower-full": f"tower-{tower[-1]}", "tower-partial": f"tower-{tower[0]}",
            **{f"frame-tick-{kind}-{part}": f"decoder-tick-{k}-{part}" for kind, k in (("full", frame[-1]),
                                                                                      ("partial", frame[0]))
               for part in "ab"}}


def flow_bench_counts(c: ModelConfig, flow_steps: tuple[int, int] | None = None) -> tuple[int, int]:
    """The two Euler step counts the flow tick is timed at: (the model's flow_steps, 2) unless given, high first."""
    counts = (c.flow_steps, 2) if flow_steps is None else tuple(flow_steps)
    if not (len(counts) == 2 and all(isinstance(n, int) and n >= 1 for n in counts) and counts[0] > counts[1]):
        raise ValueError(f"flow_steps {flow_steps!r}: expected two step counts (high, low), high > low >= 1")
    return counts


def flow_specs(c: ModelConfig, counts: tuple[int, int]) -> dict[str, StepSpec]:
    """Bench name (= engine step name) -> the flow tick's spec at each of `counts` (flow model `c`)."""
    return {f"flow-tick-{n}": flow_tick_spec(c, n) for n in counts}


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


def _engines(model, specs, names: dict[str, str], store: EngineStore, threads: int) -> dict[str, dict]:
    """Per bench step, the engine of every recipe."""
    fp16 = use_fp16_weights(copy.deepcopy(model)) if fp16_weights_available() else None
    wanted = {step: specs[step] for step in names.values()}
    onnx = {recipe: exported_engines(model, wanted, "onnxruntime", recipe, store, threads=threads)
            for recipe in ("fp32", "int8-ort")}
    out = {}
    for bench_name, step in names.items():
        spec = specs[step]
        engines = {"torch-fp32": TorchEngine(spec.build(model), list(spec.inputs()), spec.outputs)}
        if fp16 is not None:
            engines["torch-fp16-weights"] = TorchEngine(spec.build(fp16), list(spec.inputs()), spec.outputs)
        engines["onnxruntime-fp32"] = onnx["fp32"][step]
        engines["onnxruntime-int8"] = onnx["int8-ort"][step]
        out[bench_name] = engines
    return out


def _eager_default_frame(c: ModelConfig) -> Callable[[], None]:
    """Today's default doing one fused frame: the eager policy (fp32 compute, fp16 weights where fbgemm is), a full
    refresh with the tick in the frame's pass."""
    from vla_node.kv.cache_config import CacheConfig
    from vla_node.runtime.policy import MultiRatePolicy

    model = build_vla(c, seed=0)
    if fp16_weights_available():
        model = use_fp16_weights(model)
    policy = MultiRatePolicy(model, CacheConfig())
    policy.update_text("keep lane, follow car")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (c.num_cameras, c.image_size, c.image_size, 3), dtype=np.uint8)
    state = np.zeros(c.state_dim, np.float32)
    return lambda: policy.update_vision(images, None, False, None, state)


def _time_steps(engines: dict[str, dict], specs, names, eager: Callable[[], None], iters: int) -> tuple[dict, float]:
    """Every step's recipes and the eager default frame: rounds interleaved (a load change hits all alike); parity
    against torch-fp32 on the same inputs."""
    inputs = {b: specs[s].inputs() for b, s in names.items()}
    outputs, runs = {}, {}
    for b, recipes in engines.items():
        reference = recipes["torch-fp32"]
        with torch.inference_mode():
            results = reference.step(*inputs[b].values())
        outputs[b] = {r: {n: torch.empty_like(t) for n, t in zip(reference.output_names, results)} for r in recipes}
        for r, e in recipes.items():
            runs[(b, r)] = lambda e=e, i=inputs[b], o=outputs[b][r]: e.run(i, o)
    runs[("eager", "default")] = eager
    samples: dict[tuple, list[float]] = {key: [] for key in runs}
    for run in runs.values():
        run()  # warm-up (allocator, first-call costs)
    for _ in range(iters):
        for key, run in runs.items():
            samples[key].append(time_ms(run, 1, warmup=0)["median"])
    figures = {}
    for b, recipes in engines.items():
        names_out = recipes["torch-fp32"].output_names
        expected = [t.numpy() for t in outputs[b]["torch-fp32"].values()]
        figures[b] = {r: {"ms": round(float(np.median(samples[(b, r)])), 3),
                          "parity_vs_torch_fp32": parity(expected, [t.numpy() for t in outputs[b][r].values()],
                                                         names_out)}
                      for r in recipes}
    return figures, round(float(np.median(samples[("eager", "default")])), 3)


def node_rss_mb(preset_name: str, backend: str, engines_dir: str) -> float:
    """The resident memory of a warmed-up node pipeline on `backend`, in a fresh process (MB), as launch/cpu.toml runs
    it: what it loads from the store and is not there (the eager backend's compiled tick) it builds first."""
    code = (
        "import dataclasses, sys\n"
        "from vla_node.config import default_launch, load_launch\n"
        "from vla_node.model.config import PRESETS\n"
        "from vla_node.node.pipeline import Pipeline\n"
        "c = load_launch(default_launch())\n"
        f"c = c.replace(model=dataclasses.replace(c.model, preset={preset_name!r}, backend={backend!r}, "
        f"fallback=(), engines_dir={engines_dir!r}, build_engines=True, instruction='keep lane'))\n"
        "Pipeline(c, warm_up_rounds=1)\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS')][0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"node RSS on {backend}: {done.stderr.strip().splitlines()[-1:]}")
    return round(int(done.stdout.split()[-1]) / 1024, 1)


def run(preset_name: str = "small", iters: int = 10, threads: int = 1, json_path: str | None = None,
        rss: bool = True, flow_steps: tuple[int, int] | None = None) -> dict:
    """Time every step and recipe, the flow tick's at `flow_steps` (flow_bench_counts) beside them; print a table;
    return (and optionally write) the figures."""
    torch.set_num_threads(threads)
    config = preset(preset_name)
    model = build_vla(config, seed=0)
    specs = step_specs(config, SAMPLES, tick_in_frame=True)
    names = bench_steps(config)
    flow_config = preset(preset_name, "flow")
    counts = flow_bench_counts(flow_config, flow_steps)
    flow = flow_specs(flow_config, counts)
    flow_names = {name: name for name in flow}
    with tempfile.TemporaryDirectory(prefix="vla-bench-engines-") as tmp:
        store = EngineStore(Path(tmp) / "engines")
        engines = _engines(model, specs, names, store, threads)
        engines.update(_engines(build_vla(flow_config, seed=0), flow, flow_names, store, threads))
        timed, eager_ms = _time_steps(engines, {**specs, **flow}, {**names, **flow_names},
                                      _eager_default_frame(config), iters)
        steps = {b: timed[b] for b in names}
        memory = {}
        if rss:
            exported_engines(model, specs, "onnxruntime", "fp32", store, threads=threads)  # the node's whole set
            memory = {b: node_rss_mb(preset_name, b, str(store.root)) for b in ("torch", "onnxruntime")}
    result = {"preset": preset_name, "threads": threads, "iters": iters, "steps": steps,
              "eager_default_frame_ms": eager_ms, "rss_mb": memory,
              "flow": _flow_figures({b: timed[b] for b in flow_names}, counts, steps["tick"], flow_config),
              "cpu": cpu_features.cpu_model(), "kernels": cpu_features.describe(), "torch": torch.__version__,
              "targets": _targets(steps, eager_ms)}
    print(table(result))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _flow_figures(timed: dict, counts: tuple[int, int], bins_tick: dict, c: ModelConfig) -> dict:
    """The flow tick's figures per recipe from its two timed counts (high, low): see the module's docstring."""
    high, low = counts
    top, bottom = timed[f"flow-tick-{high}"], timed[f"flow-tick-{low}"]
    per_step = {r: round((top[r]["ms"] - bottom[r]["ms"]) / (high - low), 3) for r in top}
    return {"flow_state": c.flow_state, "counts": [high, low], "steps": timed,
            "flow_tick_ms": {r: top[r]["ms"] for r in top},
            "flow_per_step_ms": per_step,
            "flow_per_step_formula": f"(flow-tick-{high} ms - flow-tick-{low} ms) / {high - low}",
            "flow_fixed_ms": {r: round(top[r]["ms"] - high * per_step[r], 3) for r in top},
            "flow_over_bins_tick": {r: round(top[r]["ms"] / bins_tick[r]["ms"], 3) for r in top if r in bins_tick}}


def _targets(steps: dict, eager_ms: float) -> dict:
    tick = steps["tick"]
    frame_tick = {recipe: sum(steps[step][recipe]["ms"] for step in ("tower-full", "frame-tick-full-a",
                                                                      "frame-tick-full-b")) for recipe in tick}
    best = min(frame_tick, key=frame_tick.get)
    ratio = tick["onnxruntime-int8"]["ms"] / tick["torch-fp32"]["ms"]
    return {"onnxruntime_int8_tick_over_torch_fp32_tick": {"value": round(ratio, 3), "target": "<= 0.5",
                                                           "met": ratio <= 0.5},
            "frame_and_tick_ms": {k: round(v, 3) for k, v in frame_tick.items()},
            "best_frame_and_tick_over_default": {"best": best, "default": "eager policy, fp16 weights",
                                                 "value": round(frame_tick[best] / eager_ms, 3), "target": "< 1",
                                                 "met": frame_tick[best] < eager_ms}}


def table(result: dict) -> str:
    lines = [f"bench engines: {result['preset']}, {result['threads']} thread(s), {result['iters']} rounds; "
             f"{result['cpu']}; {result['kernels']}",
             f"{'step':<22}{'recipe':<20}{'ms':>9}  parity vs torch-fp32 (max relative, per output)"]
    for step, recipes in result["steps"].items():
        for recipe, f in recipes.items():
            rel = ", ".join(f"{k} {v['max_rel']:.1e}" for k, v in f["parity_vs_torch_fp32"].items())
            lines.append(f"{step:<22}{recipe:<20}{f['ms']:>9.3f}  {rel}")
    lines.append(f"{'eager default frame':<40}{result['eager_default_frame_ms']:>9.3f}  (the eager policy: full "
                 "refresh + tick, fp16 weights)")
    t = result["targets"]
    a, b = t["onnxruntime_int8_tick_over_torch_fp32_tick"], t["best_frame_and_tick_over_default"]
    lines.append(f"onnxruntime-int8 tick / torch-fp32 tick: {a['value']}x (target {a['target']}: "
                 f"{'met' if a['met'] else 'MISSED'})")
    lines.append(f"frame + tick, best ({b['best']}) / default ({b['default']}): {b['value']}x (target {b['target']}: "
                 f"{'met' if b['met'] else 'MISSED'})")
    flow = result.get("flow")  # absent from results written before the flow head
    if flow:
        high = flow["counts"][0]
        for step, recipes in flow["steps"].items():
            for recipe, f in recipes.items():
                rel = ", ".join(f"{k} {v['max_rel']:.1e}" for k, v in f["parity_vs_torch_fp32"].items())
                lines.append(f"{step:<22}{recipe:<20}{f['ms']:>9.3f}  {rel}")
        lines.append(f"flow tick, {high} steps (flow_state {flow['flow_state']}): ms | per Euler step ms "
                     f"({flow['flow_per_step_formula']}) | over the bins tick")
        for recipe, ms in flow["flow_tick_ms"].items():
            ratio = flow["flow_over_bins_tick"].get(recipe)
            lines.append(f"  {recipe:<20}{ms:>9.3f} | {flow['flow_per_step_ms'][recipe]:.3f} | "
                         f"{'-' if ratio is None else f'{ratio}x'}")
    if result["rss_mb"]:
        lines.append("node RSS after warm-up: " + ", ".join(f"{k} {v} MB" for k, v in result["rss_mb"].items()))
    return "\n".join(lines)
