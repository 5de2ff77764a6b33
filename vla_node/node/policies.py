"""The node's policies, on the backend resolved once at start: the first of `model.backend` and its `fallback`
order that this machine and configuration can run.

    torch        the eager policy (runtime/policy.py): every configuration, weights as the launch file says
    onnxruntime  the engine policy (runtime/engine_policy.py) on ONNX Runtime (its CPU provider; on a GPU its
                 TensorRT and CUDA providers, never tried here), the engines from the store (engines/), built at
                 start where missing or stale
    tensorrt     the engine policy on TensorRT engines (a CUDA GPU and the tensorrt package)
    cudagraph    the engine policy on the torch steps captured as CUDA graphs (a CUDA GPU)

A backend this machine cannot run (no package, no GPU) or that does not cover the configuration is skipped with
its reason (the health topic and report.json say what runs and why); an engine that cannot be had (not built
with building refused, a failed build) is a one-line error at start.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Callable

import torch

from vla_node.backends.engine_set import EngineSet, exported_engines, step_specs, torch_engines
from vla_node.backends.loading import convert_weights, load_model
from vla_node.backends.store import EngineStore, EngineStoreError, weights_digest
from vla_node.config import NodeConfig
from vla_node.kv.dtypes import torch_dtype
from vla_node.model.config import ModelConfig, preset
from vla_node.model.vla import VLA
from vla_node.runtime.engine_policy import EnginePolicy, unsupported
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.validate import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    backend: str
    recipe: str  # engines: the recipe; torch: the weight format (fp32, fp16 weights, packed bf16 ...)
    skipped: tuple[str, ...] = ()  # the backends tried first, each with why it could not run


def _unavailable(backend: str, device: str) -> str | None:
    """Why this machine cannot run `backend` (None: it can)."""
    if backend == "torch":
        return None
    if backend == "onnxruntime":
        try:
            import onnxruntime
        except ImportError as e:
            return f"onnxruntime is not installed ({e})"
        if device == "cpu" or "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            return None
        return f"this onnxruntime has no CUDA execution provider (model.device = {device!r})"
    if not torch.cuda.is_available() or not device.startswith("cuda"):
        return f"needs a CUDA GPU and model.device = 'cuda' (device {device!r}, CUDA available: " \
               f"{torch.cuda.is_available()})"
    if backend == "tensorrt":
        try:
            import tensorrt  # noqa: F401
        except ImportError as e:
            return f"the tensorrt package is not installed ({e})"
    return None


def resolve_backend(config: NodeConfig) -> BackendChoice:
    """The first backend of model.backend, *model.fallback this machine and configuration can run."""
    section = config.model
    skipped = []
    for backend in dict.fromkeys((section.backend, *section.fallback)):
        why = _unavailable(backend, section.device)
        if why is None and backend == "tensorrt" and "int8-ort" in (section.recipe, config.scheduler.smaller_recipe):
            why = "int8-ort is ONNX Runtime's dynamic quantization (tensorrt runs fp32 or int8-trt)"
        if why is None and backend != "torch":
            why = unsupported(section.model_config(), config.cache, config.reuse)
        if why is None:
            recipe = {"torch": f"{section.resolved_weights} weights", "cudagraph": "fp32"}.get(backend, section.recipe)
            return BackendChoice(backend, recipe, tuple(skipped))
        skipped.append(f"{backend}: {why}")
    raise ConfigError(f"model.backend {section.backend!r} with fallback {list(section.fallback)}: none can run here "
                      f"({'; '.join(skipped)})")


def engine_set(config: NodeConfig, model: VLA, backend: str, recipe: str, *, build: bool | None = None,
               launch: str | None = None, progress=None) -> EngineSet:
    """The engines of `model` for the node's configuration on `backend` with `recipe`."""
    section = config.model
    specs = step_specs(model.config, config.reuse.shared_drift_samples, tick_in_frame=True,
                       denoising_steps=config.scheduler.denoising_steps)
    if backend == "torch":
        return torch_engines(model, specs, section.device)
    if backend == "cudagraph":
        from vla_node.backends.cudagraph_engine import CudaGraphEngine

        engines = {name: CudaGraphEngine(spec.build(model).to(section.device), list(spec.inputs()), spec.outputs)
                   for name, spec in specs.items()}  # the steps' own buffers too (query ids, row indices)
        return EngineSet("cudagraph", "fp32", engines)
    calibration = None
    if recipe == "int8-trt":
        from vla_node.backends.calibration import find_calibration

        calibration = find_calibration(section.calibration, model)
    build = section.build_engines if build is None else build
    try:
        return exported_engines(model, specs, backend, recipe, EngineStore(section.engines_dir), build=build,
                                threads=intra_op_threads(section) or 1, calibration=calibration, device=section.device,
                                launch=launch, progress=progress or _log_progress)
    except EngineStoreError as e:
        raise ConfigError(str(e)) from None


def intra_op_threads(section) -> int:
    """model.threads as a count: its own, or where 'auto' is left unresolved (the node resolves it at start) the
    threads this process runs torch with; 0 stays torch's default."""
    return torch.get_num_threads() if section.threads == "auto" else section.threads


def _log_progress(line: str) -> None:
    print(f"engines: {line}", file=sys.stderr, flush=True)


def smaller_shapes(config: NodeConfig, main: ModelConfig) -> ModelConfig:
    """The smaller engine's model: scheduler.smaller_preset with the main model's action head (a flow node degrades
    to a smaller flow model) and its text capacity (every instruction the main engine takes fits it too)."""
    return preset(config.scheduler.smaller_preset, action_head=main.action_head).replace(
        max_text_tokens=main.max_text_tokens)


def build_policies(config: NodeConfig, choice: BackendChoice | None = None,
                   launch: str | None = None) -> tuple[MultiRatePolicy, MultiRatePolicy | None, BackendChoice]:
    """The main engine's policy and the smaller engine's: with `scheduler.smaller_preset` that preset (given the main
    engine's action head and text capacity: smaller_shapes), with
    `scheduler.smaller_recipe` the same model in that recipe (degrade by precision); on the resolved backend. The
    eager backend's tick compiled where model.compiled_tick resolves on (the choice's recipe then says so)."""
    section = config.model
    choice = choice or resolve_backend(config)
    if choice.skipped:
        log.warning("backend %s (%s); skipped: %s", choice.backend, choice.recipe, "; ".join(choice.skipped))
    dtype = torch_dtype(section.resolved_dtype)
    weights = section.weight_format if choice.backend == "torch" else "plain"
    compile_tick = choice.backend == "torch" and section.resolved_compiled_tick

    def load(shapes: ModelConfig, checkpoint: str | None) -> tuple[VLA, PlainWeights | None]:
        model = load_model(shapes, "plain", checkpoint, section.seed)
        if choice.backend != "torch":
            return model, None
        plain = None
        if compile_tick:  # keyed by the plain decoder's weights, before conversion
            plain = PlainWeights(weights_digest(model.decoder), lambda: load_model(shapes, "plain", checkpoint,
                                                                                  section.seed))
        return convert_weights(model, weights), plain

    def policy_for(model: VLA, plain: PlainWeights | None) -> MultiRatePolicy:
        if choice.backend == "torch":
            policy = MultiRatePolicy(model, config.cache, dtype, section.device, config.reuse)
            if plain is not None:
                attach_compiled_tick(config, policy, plain, launch)
            return policy
        engines = engine_set(config, model, choice.backend, choice.recipe, launch=launch)
        return EnginePolicy(model, engines, config.cache, section.device, config.reuse)

    main, plain = load(section.model_config(), section.checkpoint)
    policy = policy_for(main, plain)
    small = None
    if config.scheduler.smaller_preset is not None:
        small = policy_for(*load(smaller_shapes(config, policy.config), None))
    elif config.scheduler.smaller_recipe is not None:  # degrade by precision: the same model, another recipe
        if choice.backend in ("torch", "cudagraph"):
            raise ConfigError(f"scheduler.smaller_recipe = {config.scheduler.smaller_recipe!r}: backend "
                              f"{choice.backend!r} runs no recipes (onnxruntime or tensorrt do)")
        engines = engine_set(config, main, choice.backend, config.scheduler.smaller_recipe, launch=launch)
        small = EnginePolicy(main, engines, config.cache, section.device, config.reuse)  # the weights shared
    if policy.compiled_tick:
        choice = dataclasses.replace(choice, recipe=f"{choice.recipe}, compiled tick (AOTInductor)")
    return policy, small, choice


@dataclasses.dataclass(frozen=True)
class PlainWeights:
    """What a compiled tick is keyed by and built from: the digest of the model's plain decoder weights, and how to
    load the plain model again (only when it must be compiled)."""

    decoder_digest: str
    load: Callable[[], VLA]


def attach_compiled_tick(config: NodeConfig, policy: MultiRatePolicy, plain: PlainWeights, launch: str | None
                         ) -> None:
    """The compiled tick (backends/tick_engine.py) attached to `policy`, from the store, compiled where missing.
    Where it cannot be had: with compiled_tick 'on' a ConfigError saying why; with 'auto' a warning, and the eager
    tick runs (policy.compiled_tick says which)."""
    from vla_node.backends.inductor_engine import inductor_problem
    from vla_node.backends.tick_engine import tick_engine
    from vla_node.runtime.compiled_tick import tick_buffers, unsupported

    section = config.model
    problem = inductor_problem() or unsupported(policy)
    engine = None
    if problem is None:
        try:
            engine = tick_engine(EngineStore(section.engines_dir), plain.decoder_digest, plain.load,
                                 tick_buffers(policy)[0],
                                 intra_op_threads(section) or torch.get_num_threads(), section.build_engines,
                                 f"vla-node build-engines --launch {launch or 'FILE'}", _log_progress)
        except EngineStoreError as e:
            raise ConfigError(str(e)) from None
        except Exception as e:  # a compiler's failure: 'auto' runs the eager tick, 'on' fails
            if section.compiled_tick == "on":
                raise
            problem = f"compiling it failed: {type(e).__name__}: {e}"
    if engine is None:
        if section.compiled_tick == "on":
            raise ConfigError(f"model.compiled_tick = 'on': {problem}")
        log.warning("model.compiled_tick = 'auto': the eager tick runs (%s)", problem)
        return
    policy.use_compiled_tick(engine)


def build_launch_engines(config: NodeConfig, launch: str | None = None, progress=_log_progress) -> BackendChoice:
    """Build (or check) every engine the node of `config` would run on its resolved backend, the smaller engine's
    too, with progress: what `vla-node build-engines`, the demo and the node benchmark run before a node starts, so
    that it starts from a built store: for the eager backend its compiled tick where compiled_tick resolves on.
    Returns the backend choice."""
    section = config.model
    choice = resolve_backend(config)
    if choice.backend == "torch" and section.resolved_compiled_tick:
        progress(f"the eager policy's compiled tick ({section.model_config().name}) in {section.engines_dir}/")
        return build_policies(config.replace(model=dataclasses.replace(section, build_engines=True)),
                              choice, launch)[2]
    if choice.backend in ("torch", "cudagraph"):
        return choice  # nothing stored: the eager policy, or torch steps captured at start
    main = load_model(section.model_config(), "plain", section.checkpoint, section.seed)
    builds = [("main", main, choice.recipe)]
    if config.scheduler.smaller_preset is not None:
        shapes = smaller_shapes(config, main.config)
        builds.append(("smaller", load_model(shapes, "plain", seed=section.seed), choice.recipe))
    elif config.scheduler.smaller_recipe is not None:
        builds.append(("smaller", main, config.scheduler.smaller_recipe))
    for role, model, recipe in builds:
        progress(f"{role} engine ({model.config.name}): {choice.backend}, {recipe} in {section.engines_dir}/")
        engine_set(config, model, choice.backend, recipe, build=True, launch=launch,
                   progress=lambda line: progress(f"  {line}"))
    return choice
