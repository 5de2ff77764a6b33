"""Node configuration: one frozen dataclass per section, loaded from a TOML launch file.

Every key is validated at load; a bad value fails with a message naming the key, the value and what is
allowed, an unknown key with a did-you-mean.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from vla_node.kv.cache_config import CacheConfig

BACKENDS = ("torch", "onnxruntime", "tensorrt", "cudagraph")  # as backends/engine_set.BACKENDS (checked by a test)
RECIPES = ("fp32", "int8-ort", "int8-trt")  # the engines' recipes (backends/quantize.RECIPES)
from vla_node.model.config import PRESETS, ModelConfig
from vla_node.runtime.reuse import ReuseConfig
from vla_node.sched.ladder import Level
from vla_node.sched.scheduler import SchedulerConfig, check_min_level, scheduler_levels
from vla_node.validate import ConfigError, choose, from_dict, is_number, require
from vla_node.wire.openpi import OpenpiConfig
from vla_node.wire.protocol import CameraSpec, ProtocolLimits
from vla_node.wire.transport import TransportConfig, is_loopback_host

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCH_DIR = REPO_ROOT / "launch"
CHECKPOINTS_DIR = REPO_ROOT / "checkpoints"  # trained checkpoints kept with the code (checkpoints/README.md)
MAX_LAUNCH_BYTES = 1 << 20  # a launch file is a few kB; refuse anything larger before reading it
MAX_NESTING = 16  # tables and arrays nested deeper than this (a launch file nests 3) are refused


@dataclass(frozen=True)
class ModelSection:
    """Which model the node runs and how."""

    preset: str = "small"  # tiny | small | base (ignored when checkpoint is set)
    checkpoint: str | None = None  # a checkpoint directory written by `vla-node init`
    seed: int = 0  # weights seed for a preset
    # the action head of a preset: bins (256 bins per dim, decoded by the decoder) | flow (a flow-matching action
    # expert, pi0 style); unset: bins, or the checkpoint's own (which must then agree)
    action_head: str | None = None
    dtype: str = "fp32"  # compute dtype: fp32 | bf16 | fp16 | auto (bf16 on a GPU or a CPU with bf16 hardware, else fp32)
    # weight storage of every linear layer: fp32 (the compute dtype) | fp16 (fp32 compute, x86 CPU) | packed (bf16
    # compute on a CPU with bf16 hardware: prepacked for oneDNN, MLP activations fused) | int8 (packed, bf16 compute,
    # each matmul on the CPU kernels' int8 linear: weights per output column, activations per row as they come;
    # AVX512-VNNI and -BF16) | auto (fp16 with fp32 compute on an x86 CPU, packed with bf16 compute on a
    # CPU that has it; else the compute dtype; never int8, which trades accuracy for speed)
    weights: str = "fp32"
    device: str = "cpu"  # torch device: cpu | cuda | cuda:N
    # torch: the eager policy (every configuration; weights as `weights` says) | onnxruntime | tensorrt | cudagraph:
    # the policy's steps as engines (runtime/engine_policy.py), resolved once at start, the first of backend and
    # `fallback` that this machine and configuration can run
    backend: str = "torch"
    fallback: tuple[str, ...] = ()  # tried in order when `backend` cannot run here (e.g. ["onnxruntime", "torch"])
    recipe: str = "fp32"  # engines' precision: fp32 | int8-ort (ONNX Runtime's dynamic int8) | int8-trt (s8 Q/DQ)
    engines_dir: str = "engines"  # the engine store (relative paths: to the working directory)
    calibration: str = "calib"  # int8-trt: where `vla-node calibrate` writes its sets (calib/<model-hash>/)
    build_engines: bool = True  # build missing or stale engines at start (false: refuse, naming the command)
    # torch intra-op threads; 0 = torch's default; auto: every CPU where the publisher may run at SCHED_FIFO (its
    # ticks preempt the worker's threads), else 1 (node/realtime.py resolve_threads, at the node's start)
    threads: int | str = 1
    instruction: str = "keep the lane and follow traffic"  # used until the first instruction arrives
    vision_frames: int | None = None  # frames kept in the vision memory; None: the model's (positions only)
    # the eager policy's action tick as one compiled call (TickStep by AOTInductor, kept in engines_dir, compiled at
    # start where missing): on | off | auto (on with packed weights where oneDNN runs AMX and the CPU kernels do not,
    # where it measured faster; the fp32 tick with fp16 weights measured slower compiled: the compiled step reads fp32
    # weights). Bins head, backend torch
    compiled_tick: str = "off"

    def __post_init__(self) -> None:
        if self.checkpoint is None:
            choose("model.preset", self.preset, PRESETS)
        require(self.action_head in (None, "bins", "flow"), "model.action_head", self.action_head,
                "'bins', 'flow' or unset")
        require(self.dtype in ("fp32", "bf16", "fp16", "auto"), "model.dtype", self.dtype, "fp32, bf16, fp16 or auto")
        require(self.weights in ("fp32", "fp16", "packed", "int8", "auto"), "model.weights", self.weights,
                "'fp32', 'fp16', 'packed', 'int8' or 'auto'")
        if self.weights == "fp16":
            from vla_node.backends.fp16_weights import fp16_weights_available

            require(self.resolved_dtype == "fp32" and self.device == "cpu", "model.weights", self.weights,
                    f"'fp32' with dtype {self.resolved_dtype!r} on {self.device!r} (fp16 weights take fp32 compute on "
                    "the CPU)")
            require(fp16_weights_available(), "model.weights", self.weights,
                    "'fp32' here: fp16 weights need torch's fbgemm backend (x86-64 CPUs)")
        if self.weights == "packed":
            from vla_node.backends.packed_weights import packed_weights_available

            require(self.resolved_dtype == "bf16" and self.device == "cpu", "model.weights", self.weights,
                    f"'fp32' with dtype {self.resolved_dtype!r} on {self.device!r} (packed weights take bf16 compute "
                    "on the CPU)")
            require(packed_weights_available(), "model.weights", self.weights,
                    "'fp32' here: packed bf16 weights need oneDNN and a CPU with bf16 hardware (AVX512-BF16 or AMX)")
        if self.weights == "int8":
            from vla_node.backends.packed_weights import int8_weights_available

            require(self.resolved_dtype == "bf16" and self.device == "cpu", "model.weights", self.weights,
                    f"'fp32' with dtype {self.resolved_dtype!r} on {self.device!r} (int8 weights take bf16 compute "
                    "on the CPU)")
            require(int8_weights_available(), "model.weights", self.weights,
                    "'packed' or 'fp32' here: int8 weights need the fused CPU kernels built with AVX512-VNNI and "
                    "AVX512-BF16")
            require(self.compiled_tick != "on", "model.weights", self.weights,
                    "'packed' with compiled_tick 'on' (the compiled tick has no int8 kernel)")
        for key, value in (("model.backend", self.backend), *(("model.fallback", b) for b in self.fallback)):
            choose(key, value, {b: b for b in BACKENDS})
        require(self.recipe in RECIPES, "model.recipe", self.recipe, f"one of {list(RECIPES)}")
        require(not (self.backend == "tensorrt" and self.recipe == "int8-ort"), "model.recipe", self.recipe,
                "'fp32' or 'int8-trt' with backend 'tensorrt' (int8-ort is ONNX Runtime's dynamic quantization)")
        require(isinstance(self.engines_dir, str) and self.engines_dir != "", "model.engines_dir", self.engines_dir,
                "a folder path")
        require(isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                "model.device", self.device, "'cpu', 'cuda' or 'cuda:N'")
        require(self.threads == "auto" or (isinstance(self.threads, int) and self.threads >= 0), "model.threads",
                self.threads, "an integer >= 0 or 'auto'")
        require(self.vision_frames is None or (isinstance(self.vision_frames, int) and self.vision_frames >= 1),
                "model.vision_frames", self.vision_frames, "an integer >= 1 or unset")
        require(self.compiled_tick in ("on", "off", "auto"), "model.compiled_tick", self.compiled_tick,
                "'on', 'off' or 'auto'")

    @property
    def resolved_dtype(self) -> str:
        """The compute dtype on this machine: `dtype`, or for 'auto' bf16 on a GPU or a CPU with bf16 hardware
        (AVX512-BF16, AMX), else fp32."""
        if self.dtype != "auto":
            return self.dtype
        from vla_node.backends.fp16_weights import cpu_has_bf16

        return "bf16" if self.device != "cpu" or cpu_has_bf16() else "fp32"

    @property
    def resolved_weights(self) -> str:
        """How the linear weights are stored on this machine: 'fp16' (with fp32 compute: fbgemm's), 'packed'
        (oneDNN, bf16 compute), 'int8' (the int8 linear kernel, bf16 compute) or the compute dtype."""
        if self.weights in ("fp16", "packed", "int8"):
            return self.weights
        dtype = self.resolved_dtype
        if self.weights != "auto" or self.device != "cpu":
            return dtype
        from vla_node.backends.fp16_weights import fp16_weights_available
        from vla_node.backends.packed_weights import packed_weights_available

        if dtype == "fp32" and fp16_weights_available():
            return "fp16"
        if dtype == "bf16" and packed_weights_available():
            return "packed"
        return dtype

    @property
    def weight_format(self) -> str:
        """How load_model stores the linear weights: 'fp16' (fbgemm's, fp32 compute), 'packed' (oneDNN bf16), 'int8'
        or 'plain' (in the compute dtype)."""
        weights = self.resolved_weights
        if weights in ("packed", "int8") or (weights == "fp16" and self.resolved_dtype == "fp32"):
            return weights
        return "plain"

    @property
    def resolved_compiled_tick(self) -> bool:
        """Whether the eager policy (backend torch) runs its tick compiled: compiled_tick 'on', or 'auto' with the bins
        head and packed weights on a CPU whose bf16 matmuls run on oneDNN's AMX tiles (where it was measured faster),
        unless the fused CPU kernels run on AMX tiles themselves: their tick whole in one C call (backends/native_tick)
        measured faster still (an AMX Xeon's two threads, a tick after each clip frame: 3.13 against 4.93 ms)."""
        if self.compiled_tick != "auto":
            return self.compiled_tick == "on"
        if self.weight_format != "packed" or self.model_config().action_head != "bins":
            return False
        from vla_node.backends import cpu_kernels
        from vla_node.backends.cpu_features import onednn_runs_amx

        return onednn_runs_amx() and not cpu_kernels.amx_tiles()

    def model_config(self) -> ModelConfig:
        if self.checkpoint is not None:
            from vla_node.model.checkpoint import read_config

            config = read_config(self.checkpoint)
            require(self.action_head in (None, config.action_head), "model.action_head", self.action_head,
                    f"{config.action_head!r} (the head of checkpoint {self.checkpoint}) or unset")
        else:
            config = PRESETS[self.preset].replace(action_head=self.action_head or "bins")
        return config if self.vision_frames is None else config.replace(vision_frames=self.vision_frames)


@dataclass(frozen=True)
class HealthConfig:
    period_s: float = 1.0  # health topic period
    camera_timeout_ms: float = 500.0  # a camera with no frame for this long is not alive
    min_camera_hz: float = 5.0  # a camera slower than this has rate ok = false

    def __post_init__(self) -> None:
        for key in ("period_s", "camera_timeout_ms", "min_camera_hz"):
            value = getattr(self, key)
            require(is_number(value)
                    and value > 0, f"health.{key}", value, "a finite number > 0")


@dataclass(frozen=True)
class RealtimeConfig:
    gc_freeze: bool = True  # gc.collect(); gc.freeze() after warm-up, automatic GC off in the loop
    cpu_affinity: tuple[int, ...] = ()  # CPUs for the node's processes (worker and publisher); () = leave as is
    sched_fifo_priority: int = 0  # the publisher process's SCHED_FIFO priority 1-99 where permitted; 0 = off
    worker_nice: int = 0  # the worker process's nice value (0-19): > 0 lets the publisher process preempt it

    def __post_init__(self) -> None:
        require(all(isinstance(c, int) and c >= 0 for c in self.cpu_affinity), "realtime.cpu_affinity",
                self.cpu_affinity, "a list of CPU indices >= 0")
        require(isinstance(self.sched_fifo_priority, int) and 0 <= self.sched_fifo_priority <= 99,
                "realtime.sched_fifo_priority", self.sched_fifo_priority, "an integer in [0, 99] (0 = off)")
        require(isinstance(self.worker_nice, int) and not isinstance(self.worker_nice, bool)
                and 0 <= self.worker_nice <= 19, "realtime.worker_nice", self.worker_nice,
                "an integer in [0, 19] (0 = the process's own)")


@dataclass(frozen=True)
class MetricsConfig:
    """A launch file's [metrics]: Prometheus's /metrics served at `listen` (off unless set)."""

    listen: str | None = None  # "127.0.0.1:9464"
    allow_non_loopback: bool = False

    def __post_init__(self) -> None:
        require(type(self.allow_non_loopback) is bool, "metrics.allow_non_loopback", self.allow_non_loopback,
                "true or false")
        if self.listen is not None:
            host, port = self.host_port()
            require(self.allow_non_loopback or is_loopback_host(host), "metrics.listen", self.listen,
                    "a loopback address (127.0.0.1:PORT, localhost:PORT, [::1]:PORT); set metrics.allow_non_loopback "
                    "= true to serve beyond this host")

    def host_port(self) -> tuple[str, int]:
        """'127.0.0.1:9464' -> ('127.0.0.1', 9464)."""
        host, colon, port = str(self.listen).rpartition(":")
        require(colon == ":" and host != "" and port.isdigit() and 1 <= int(port) <= 65535, "metrics.listen",
                self.listen, "HOST:PORT with a port in [1, 65535] (e.g. '127.0.0.1:9464')")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class NodeConfig:
    model: ModelSection = field(default_factory=ModelSection)
    cache: CacheConfig = field(default_factory=CacheConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    limits: ProtocolLimits = field(default_factory=ProtocolLimits)
    cameras: tuple[CameraSpec, ...] = (CameraSpec(),)
    health: HealthConfig = field(default_factory=HealthConfig)
    realtime: RealtimeConfig = field(default_factory=RealtimeConfig)
    openpi: OpenpiConfig = field(default_factory=OpenpiConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        names = [c.name for c in self.cameras]
        require(len(names) >= 1 and len(set(names)) == len(names), "cameras", names, "one or more distinct names")
        if self.openpi.listen is not None:
            unknown = [camera for _, camera in self.openpi.images if camera not in names]
            require(not unknown, "openpi.images", [list(p) for p in self.openpi.images],
                    f"cameras among {names} (unknown: {unknown})")
        model = self.model.model_config()
        require(len(self.cameras) == model.num_cameras, "cameras", names,
                f"{model.num_cameras} camera(s), as many as the model takes")
        for key in ("fallback_action", "fallback_hold"):
            value = getattr(self.scheduler, key)
            require(value is None or len(value) == model.action_dims, f"scheduler.{key}", value,
                    f"{model.action_dims} values (the model's action dims)")
        if self.scheduler.smaller_preset is not None:
            choose("scheduler.smaller_preset", self.scheduler.smaller_preset, PRESETS)
        if self.scheduler.min_level is not None:
            check_min_level(self.scheduler.min_level, node_levels(self))
        try:  # the vision memory's knobs bounded by the model's window and frame size, as the policy will see them
            self.cache.vision.for_model(model.vision_frames, model.tokens_per_frame)
        except ConfigError as e:
            raise ConfigError(f"cache.vision.{e} (model: {model.vision_frames} frame(s) of {model.tokens_per_frame} "
                              "tokens)") from None
        text_bytes = model.max_text_tokens - 1  # BOS + UTF-8 bytes (the smaller engine takes the same capacity)
        require(isinstance(self.model.instruction, str) and len(self.model.instruction.encode()) <= text_bytes,
                "model.instruction", self.model.instruction,
                f"at most {text_bytes} UTF-8 bytes (the model's text partition: {model.max_text_tokens} tokens, BOS "
                "included)")

    def replace(self, **sections) -> "NodeConfig":
        return dataclasses.replace(self, **sections)


def node_features(model: ModelConfig, smaller_engine: bool) -> dict[str, bool]:
    """What a node of `model` can degrade by (sched/ladder.py FEATURES), as its pipeline declares it."""
    return {"reuse": True, "refresh_cap": True, "vision_cache": True, "smaller_engine": smaller_engine,
            "chunk": model.action_horizon > 1}


def node_levels(config: NodeConfig) -> tuple[Level, ...]:
    """The degrade levels of the node `config` describes (a smaller engine where one is configured)."""
    model = config.model.model_config()
    return scheduler_levels(config.scheduler, node_features(model, config.scheduler.smaller_engine),
                            model.flow_steps if model.action_head == "flow" else None)


def _read_toml(path: Path) -> dict:
    """The launch file's tables; every failure (missing, too large, not UTF-8, not TOML, nested too deep for the
    parser, an integer too long to convert) is a ConfigError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_LAUNCH_BYTES:
            raise ConfigError(f"{path}: launch file of {size} bytes: expected at most {MAX_LAUNCH_BYTES}")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: launch file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the launch file ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
    too_deep = f"{path}: invalid TOML: arrays or inline tables nested too deep"
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except RecursionError:  # tomllib's recursive descent: arrays or inline tables nested hundreds deep
        raise ConfigError(too_deep) from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits (Python's int/str conversion limit)
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    if _nesting(tables) > MAX_NESTING:  # the same answer whatever the recursion limit (inductor raises it)
        raise ConfigError(too_deep)
    return tables


def _nesting(value: object) -> int:
    """How deep tables and arrays nest in `value` (a scalar 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_override(override: str) -> tuple[tuple[str, ...], object]:
    """'section.key=value' (`--set`) -> (("section", "key"), value): the value read as a TOML value (a number, true,
    a quoted string, an array), else, when it is not one, as a bare string (a path, a name)."""
    key, sep, text = override.partition("=")
    path = tuple(key.strip().split("."))
    require(sep == "=" and len(path) >= 2 and all(path), "--set", override,
            "SECTION.KEY=VALUE, e.g. reuse.threshold=4 or model.checkpoint=ckpt/tiny")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        value = text.strip()
    return path, value


def apply_overrides(data: dict, overrides: tuple[str, ...] | list[str]) -> dict:
    """The launch file's tables with each `--set` override applied (a copy); the result is validated as a whole by
    load_launch, so an unknown key or a bad value fails there, named."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for override in overrides:
        path, value = parse_override(override)
        table = data
        for depth, name in enumerate(path[:-1]):
            inner = table.get(name, {})
            require(isinstance(inner, dict), "--set", override,
                    f"a key inside a table ({'.'.join(path[:depth + 1])} is not one; [[cameras]] cannot be set)")
            table[name] = inner = dict(inner)
            table = inner
        table[path[-1]] = value
    return data


def load_launch(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> NodeConfig:
    """Read and validate a TOML launch file, with `--set SECTION.KEY=VALUE` overrides applied first."""
    path = Path(path)
    data = apply_overrides(_read_toml(path), overrides)
    try:
        return from_dict(NodeConfig, data)
    except ConfigError as e:
        where = f"{path} with --set {' '.join(overrides)}" if overrides else str(path)
        raise ConfigError(f"{where}: {e}") from None


def default_launch() -> Path:
    return LAUNCH_DIR / "cpu.toml"
