"""The engines one policy runs: every step at every static shape it needs, for one backend and recipe.

A policy's steps (step_specs):

    text               the instruction at the text partition's capacity (TextStep)
    tick               the parallel action tick, fused form (TickStep; the bins head)
    flow-tick-N        the flow head's tick in N Euler steps (FlowTickStep), N over the model's flow_steps and the
                       degrade ladder's denoising step counts; in place of tick, and never in the frame's pass (a flow
                       model has no decoder-tick-* steps)
    tower-K            every camera through the vision tower, K tokens recomputed per camera (TowerPartialStep;
                       K = tokens per camera is the full refresh)
    decoder-K-a, -b    the frame through the decoder, K tokens recomputed (DecoderPartialStep; K = frame tokens is
                       the full refresh), cut in two at decoder_cut (a budget check between the pieces: the first
                       passes the residual stream to the second, DecoderRestStep)
    decoder-tick-K-a, -b  the same with the action tick's rows in the frame's pass (one read of the weights for both)

K runs over a few capacities (CAPACITY_FRACTIONS of the tokens, plus the shared-drift sample): the host pads a
frame's refreshed tokens to the smallest that holds them.

Backends: `torch` runs the step modules eagerly (TorchEngine: nothing to build); `onnxruntime` exports each step
to ONNX (export.py), applies the recipe (quantize.py) and loads it from the engine store (store.py), building
what is missing unless told not to; `tensorrt` builds its plan from the same ONNX (tensorrt_engine.py); `cudagraph`
captures the torch step on CUDA (cudagraph_engine.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from vla_node.backends.engine import Engine, TorchEngine
from vla_node.backends.flow_step import FlowTickStep, flow_bias, flow_outputs, state_bias, state_positions
from vla_node.backends.steps import TextStep, TickStep, text_bias, tick_bias
from vla_node.backends.store import EXPORTS, EngineKey, EngineStore, device_description, weights_digest
from vla_node.model.config import ModelConfig
from vla_node.model.vla import VLA

BACKENDS = ("torch", "onnxruntime", "tensorrt", "cudagraph")
STEPS_VERSION = 1  # in every engine's key: bump when a step's arithmetic changes (same shapes, other results)
CAPACITY_FRACTIONS = (0.25, 0.5)  # partial-refresh capacities below the full refresh, as fractions of the tokens


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One step at one static shape: how to build its module, example inputs (their shapes and dtypes are the
    engine's bindings) and its output names."""

    name: str
    build: Callable[[VLA], nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]  # seeded example inputs (valid indices and biases)
    outputs: tuple[str, ...]
    options: str = ""  # what else the module's arithmetic depends on (the engine store's key holds it)

    def shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple((n, tuple(t.shape)) for n, t in self.inputs().items())


def capacities(tokens: int, samples: int) -> tuple[int, ...]:
    """The partial-refresh capacities of a block of `tokens`: each fraction's tokens plus the sample, and the full
    refresh (all tokens), ascending and distinct."""
    partial = {min(tokens, math.ceil(f * tokens) + samples) for f in CAPACITY_FRACTIONS}
    return tuple(sorted(partial | {tokens}))


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kv(c: ModelConfig, tokens: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(c.num_layers, c.num_kv_heads, tokens, c.head_dim, generator=g) * 0.5  # [L, KV, n, hd]


def step_specs(c: ModelConfig, samples: int, tick_in_frame: bool,
               denoising_steps: Sequence[int] = ()) -> dict[str, StepSpec]:
    """Every step a policy of model `c` runs: text, tick, and the tower and decoder at each capacity (with the
    tick's rows in the decoder's pass when `tick_in_frame`). `samples`: the shared-drift sample per refresh.
    The flow head: flow-tick-N for N in (c.flow_steps, *denoising_steps) in place of tick, and no tick rows in the
    decoder's pass (`tick_in_frame` does not apply); `denoising_steps` is ignored for the bins head."""
    from vla_node.backends.decoder_partial_step import DecoderPartialStep, DecoderRestStep, decoder_rows, piece_names
    from vla_node.backends.tower_partial_step import TOWER_OUTPUTS, TowerPartialStep, tower_rows

    Tt, S, Q = c.max_text_tokens, c.state_slots, c.action_tokens
    Tc, T = c.tokens_per_camera, c.tokens_per_frame
    P = Tt + T
    text_valid = torch.arange(Tt) < min(9, Tt)
    text_bias_row = torch.zeros(Tt).masked_fill_(~text_valid, float("-inf"))

    def text_inputs() -> dict[str, torch.Tensor]:
        g = _seeded(0)
        return {"ids": torch.randint(0, 256, (Tt,), generator=g), "positions": torch.arange(Tt),
                "bias": text_bias(int(text_valid.sum()), Tt)}

    def tick_rows_inputs(g: torch.Generator, prefix_bias: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"state_x": torch.randn(S, c.hidden_size, generator=g),
                "tick_positions": tick_positions(c, 0),
                "tick_bias": tick_bias(prefix_bias, torch.ones(S - 1, dtype=torch.bool), Q)}

    def tick_inputs() -> dict[str, torch.Tensor]:
        g = _seeded(1)
        rows = tick_rows_inputs(g, torch.zeros(P))
        return {"state_x": rows["state_x"], "positions": rows["tick_positions"], "prefix_k": _kv(c, P, g),
                "prefix_v": _kv(c, P, g), "bias": rows["tick_bias"]}

    options = f"steps v{STEPS_VERSION}; shared-drift samples {samples}"  # samples 0 and 1: same shapes
    specs = {"text": StepSpec("text", TextStep, text_inputs, ("text_k", "text_v"), f"steps v{STEPS_VERSION}")}
    if c.action_head == "flow":
        for steps in flow_step_counts(c, denoising_steps):
            specs[f"flow-tick-{steps}"] = flow_tick_spec(c, steps)
    else:
        specs["tick"] = StepSpec("tick", TickStep, tick_inputs, ("logits", "state_k", "state_v"),
                                 f"steps v{STEPS_VERSION}")
    C, Lv, W, Hv = c.num_cameras, c.vision_layers, c.vision_width, c.vision_heads
    for k in capacities(Tc, samples):
        def tower_inputs(k: int = k) -> dict[str, torch.Tensor]:
            g = _seeded(2)
            gate = None if k == Tc else [torch.arange(0, Tc, max(1, Tc // max(1, k - samples)))[: k - samples]] * C
            rows, sample_at, weight = tower_rows(gate if gate is not None else [None] * C, Tc, k, samples)
            state = {"x0": torch.randn(C, Tc, W, generator=g),
                     **{n: torch.randn(C, Lv, Hv, Tc, W // Hv, generator=g) for n in ("q", "k", "v")},
                     **{n: torch.randn(C, Lv, Tc, W, generator=g) * 0.1 for n in ("attn_out", "mlp_out")}}
            return {"pixels": torch.rand(C, 3, c.image_size, c.image_size, generator=g) * 2 - 1, "rows": rows,
                    "sample_at": sample_at, "sample_weight": weight, **state}

        specs[f"tower-{k}"] = StepSpec(f"tower-{k}", lambda m, k=k: TowerPartialStep(m, k, samples), tower_inputs,
                                       TOWER_OUTPUTS, options)
    L, H, hd, hidden = c.num_layers, c.num_heads, c.head_dim, c.hidden_size
    cut = decoder_cut(c)
    rows_in_frame = tick_in_frame and c.action_head == "bins"  # the flow tick never joins the frame's pass
    for k in capacities(T, samples):
        for tick in (False, True) if rows_in_frame else (False,):
            def decoder_inputs(k: int = k, tick: bool = tick, first: bool = True) -> dict[str, torch.Tensor]:
                g = _seeded(3)
                gate = None if k == T else torch.arange(0, T, max(1, T // max(1, k - samples)))[: k - samples]
                rows, sample_at, weight = decoder_rows(gate, T, k, samples)
                E = S + Q if tick else 0
                start = {"tower_out": torch.randn(C, Tc, W, generator=g)} if first else \
                    {"x_in": torch.randn(T + 1 + E, hidden, generator=g)}
                inputs = {**start, "positions": torch.tensor(list(c.vision_positions(0))),
                          "text_k": _kv(c, Tt, g), "text_v": _kv(c, Tt, g), "text_bias": text_bias_row.clone(),
                          "rows": rows, "sample_at": sample_at, "sample_weight": weight,
                          "q": torch.randn(L - 1, H, T, hd, generator=g),
                          "attn_out": torch.randn(L - 1, T, hidden, generator=g) * 0.1,
                          "mlp_out": torch.randn(L - 1, T, hidden, generator=g) * 0.1}
                if tick:
                    rows_in = tick_rows_inputs(g, torch.cat([text_bias_row, torch.zeros(T)]))
                    if not first:
                        del rows_in["state_x"]
                    inputs.update(rows_in)
                return inputs

            base = f"decoder-tick-{k}" if tick else f"decoder-{k}"
            pieces = [(0, cut), (cut, L)]
            for part, (start, end) in zip("ab", pieces):
                name = f"{base}-{part}"
                _, outputs = piece_names(start, end, L, tick)
                if start == 0:
                    build = (lambda m, k=k, tick=tick, end=end: DecoderPartialStep(m, k, samples, tick, (0, end)))
                else:
                    build = (lambda m, k=k, tick=tick, start=start: DecoderRestStep(m, k, samples, tick, start))
                specs[name] = StepSpec(name, build,
                                       lambda k=k, tick=tick, first=start == 0: decoder_inputs(k, tick, first),
                                       outputs, options)
    return specs


def flow_step_counts(c: ModelConfig, denoising_steps: Sequence[int] = ()) -> tuple[int, ...]:
    """The Euler step counts a flow model's engines are built for: its flow_steps, then `denoising_steps` (the
    degrade ladder's), each once, in that order."""
    for steps in denoising_steps:
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            raise ValueError(f"denoising steps {steps!r} in {tuple(denoising_steps)}: expected integers >= 1")
    return tuple(dict.fromkeys((c.flow_steps, *denoising_steps)))


def flow_tick_spec(c: ModelConfig, steps: int) -> StepSpec:
    """flow-tick-`steps`: the flow head's tick in `steps` Euler steps (FlowTickStep), its seeded inputs a tick over a
    full prefix (a 9-token instruction) with every stored state valid."""
    Tt, S = c.max_text_tokens, c.state_slots
    P = Tt + c.tokens_per_frame
    text_bias_row = torch.zeros(Tt).masked_fill_(torch.arange(Tt) >= min(9, Tt), float("-inf"))
    prefix_bias = torch.cat([text_bias_row, torch.zeros(c.tokens_per_frame)])  # [P]: the frame's slots all valid

    def inputs() -> dict[str, torch.Tensor]:
        g = _seeded(4)
        prefix = {"prefix_k": _kv(c, P, g), "prefix_v": _kv(c, P, g)}
        noise = torch.randn(c.action_horizon, c.action_dims, generator=g)
        if c.flow_state == "suffix":
            return {"state": torch.randn(c.state_dim, generator=g), **prefix, "noise": noise,
                    "expert_bias": flow_bias(c, prefix_bias, None)}
        stored_valid = torch.ones(S - 1, dtype=torch.bool)
        return {"state_x": torch.randn(S, c.hidden_size, generator=g), "positions": state_positions(c, 0), **prefix,
                "bias": state_bias(prefix_bias, stored_valid), "noise": noise,
                "expert_bias": flow_bias(c, prefix_bias, stored_valid)}

    name = f"flow-tick-{steps}"
    options = f"steps v{STEPS_VERSION}; flow steps {steps}; flow_state {c.flow_state}"
    return StepSpec(name, lambda m: FlowTickStep(m, steps), inputs, flow_outputs(c), options)


def decoder_cut(c: ModelConfig) -> int:
    """The decoder's budget check: its layers run as two engines, [0, cut) and [cut, L)."""
    return max(1, c.num_layers // 2)


def other_slots(state_slots: int, slot: int) -> torch.Tensor:
    """The ring slots other than `slot`, in the tick block's order: ring order after it (slot + 1, ..., slot + S - 1
    mod S), int64 [S - 1]."""
    return torch.tensor([(slot + i) % state_slots for i in range(1, state_slots)], dtype=torch.long)


def tick_positions(c: ModelConfig, slot: int) -> torch.Tensor:
    """The tick block's positions [S + Q]: the new state's ring slot, then the other slots' (other_slots), then the
    action queries'."""
    others = other_slots(c.state_slots, slot).tolist()
    return torch.tensor([c.state_base + slot, *(c.state_base + o for o in others),
                         *range(c.query_base, c.query_base + c.action_tokens)])


@dataclasses.dataclass
class EngineSet:
    """Built engines by step name, with what they are (backend, recipe) and how they were made."""

    backend: str
    recipe: str
    engines: dict[str, Engine]
    folders: dict[str, Path] = dataclasses.field(default_factory=dict)  # store folders (exported backends)

    def __getitem__(self, step: str) -> Engine:
        return self.engines[step]


def torch_engines(model: VLA, specs: Mapping[str, StepSpec], device: str = "cpu") -> EngineSet:
    """The step modules themselves, eagerly, on `device`: the reference every other backend is checked against."""
    engines = {}
    for name, spec in specs.items():
        engines[name] = TorchEngine(spec.build(model).to(device), list(spec.inputs()), spec.outputs)
    return EngineSet("torch", "fp32", engines)


def build_command(launch: str | None, backend: str, recipe: str) -> str:
    where = f"--launch {launch}" if launch else "--launch FILE"
    return f"vla-node build-engines {where} --backend {backend} --recipe {recipe}"


def exported_engines(model: VLA, specs: Mapping[str, StepSpec], backend: str, recipe: str, store: EngineStore,
                     *, build: bool = True, threads: int = 1, calibration=None, device: str = "cpu",
                     launch: str | None = None, progress: Callable[[str], None] | None = None) -> EngineSet:
    """Every step of `specs` from the engine store, built (export, recipe, parity, polygraphy files) where missing
    or stale; with build=False a missing engine is an EngineStoreError naming the command that builds it."""
    from vla_node.backends.build import backend_version, build_step, export_into, exporter_version, load_engine

    digest = weights_digest(model)
    version = backend_version(backend)
    where = device_description(device)
    exports, exporter = EngineStore(store.root / EXPORTS), exporter_version()
    engines, folders = {}, {}
    for index, (name, spec) in enumerate(specs.items()):
        key = EngineKey(step=name, recipe=recipe, backend=backend, backend_version=version, device=where,
                        weights=digest, shapes=spec.shapes(), options=spec.options,
                        calibration=calibration.step_digest(name) if recipe == "int8-trt" and calibration else None)
        export_key = dataclasses.replace(key, recipe="export", backend="onnx", backend_version=exporter,
                                         calibration=None)
        started = time.monotonic()
        built = []

        def make(folder: Path, spec: StepSpec = spec, export_key: EngineKey = export_key) -> None:
            built.append(True)
            # one export per step, weights and shapes, shared by every recipe and backend built from it (the
            # exports' store has a lock of its own: taking it inside this store's build lock cannot deadlock)
            exported = exports.get(export_key, lambda out: export_into(model, spec, out), "")
            build_step(model, spec, backend, recipe, folder, calibration, device, exported)

        folder = store.get(key, make if build else None, build_command(launch, backend, recipe))
        if progress is not None:
            what = f"built in {time.monotonic() - started:.1f} s" if built else "up to date"
            progress(f"[{index + 1}/{len(specs)}] {name} ({backend}, {recipe}): {what} ({folder.name})")
        engines[name] = load_engine(backend, folder, name, threads, device)
        folders[name] = folder
    return EngineSet(backend, recipe, engines, folders)

