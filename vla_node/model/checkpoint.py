"""Checkpoint directories.

    DIR/vla.json               node-level model config (ModelConfig fields) and format version
    DIR/decoder/               a transformers LlamaForCausalLM checkpoint (config.json + model.safetensors)
    DIR/vision/                a transformers SiglipVisionModel checkpoint (config.json + model.safetensors)
    DIR/heads.safetensors      projector, camera embedding, state projector
    DIR/expert/model.safetensors   the flow head's action expert (action_head = "flow" only)

Loading reads vla.json (bounded, UTF-8 JSON, validated fields), checks that the model it describes fits its weight
files before building anything, then checks every tensor's name, shape, dtype and finiteness and names the
offending tensor on any mismatch. Every failure is a CheckpointError naming the file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vla_node.model.config import ModelConfig
from vla_node.model.decoder import hf_llama_config
from vla_node.model.vision import hf_siglip_config
from vla_node.model.vla import VLA, empty_vla
from vla_node.validate import ConfigError, from_dict, show

FORMAT_VERSION = 1
MAX_CONFIG_BYTES = 1 << 20  # vla.json is a few hundred bytes
MAX_BUFFER_BYTES = 1 << 28  # tables a config implies beyond its weights (RoPE cos/sin per position): 256 MiB
WEIGHT_SLACK = 4  # the weights a config implies may take at most 4x its weight files (+ 64 MiB) before loading
PART_FILES = {"decoder": "decoder/model.safetensors", "vision": "vision/model.safetensors",
              "heads": "heads.safetensors", "expert": "expert/model.safetensors"}


def part_files(config: ModelConfig) -> dict[str, str]:
    """The weight files of a model of `config` (the expert's with the flow head only)."""
    return {part: rel for part, rel in PART_FILES.items() if part != "expert" or config.action_head == "flow"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file (or directory) and the problem."""


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _parts(model: VLA) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """file (relative) -> the state dict stored there, with the names the file uses."""
    state = {k: v for k, v in model.state_dict().items()}
    parts = {}
    for part, rel in part_files(model.config).items():
        if part == "heads":
            tensors = {k: v for k, v in state.items() if not k.startswith(("decoder.", "vision.", "expert."))}
        else:
            tensors = {k[len(part) + 1:]: v for k, v in state.items() if k.startswith(f"{part}.")}
        parts[part] = (rel, tensors)
    return parts


def save_checkpoint(model: VLA, out: str | Path) -> Path:
    out = Path(out)
    config = model.config
    for _, (rel, tensors) in _parts(model).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / rel), metadata={"format": "pt"})
    (out / "decoder" / "config.json").write_text(json.dumps(hf_llama_config(config), indent=2))
    (out / "vision" / "config.json").write_text(json.dumps(hf_siglip_config(config), indent=2))
    meta = {"format_version": FORMAT_VERSION, "model": dataclasses.asdict(config)}
    (out / "vla.json").write_text(json.dumps(meta, indent=2))
    return out


def _read_json(path: Path) -> object:
    """A JSON config file; too large, not UTF-8, not JSON or nested too deep: a CheckpointError naming it."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, expected a JSON config of at most {MAX_CONFIG_BYTES}")
    raw = path.read_bytes()
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: invalid JSON (nested too deep)") from None
    except ValueError as e:  # JSONDecodeError, or an integer too long for Python to convert
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    meta_path = path / "vla.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a checkpoint directory (missing vla.json)")
    meta = _read_json(meta_path)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: a JSON {type(meta).__name__}, expected an object with format_version "
                              f"and model")
    version = meta.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format_version {show(version)}, expected {FORMAT_VERSION}")
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{meta_path}: no 'model' table (the model's shapes), got {show(meta.get('model'))}")
    try:
        return from_dict(ModelConfig, meta["model"], "model")
    except ConfigError as e:
        raise CheckpointError(f"{meta_path}: {e}") from None


def _tensor_bytes(config: ModelConfig) -> tuple[int, int]:
    """(parameter bytes, buffer bytes) of VLA(config), from three models of one or two layers on the meta device
    (no memory, milliseconds, whatever the config claims); the layers scale linearly."""
    def sizes(decoder_layers: int, vision_layers: int) -> tuple[int, int]:
        with torch.device("meta"):
            model = VLA(dataclasses.replace(config, num_layers=decoder_layers, vision_layers=vision_layers))
        return (sum(t.numel() * t.element_size() for t in model.parameters()),
                sum(t.numel() * t.element_size() for t in model.buffers()))

    base, decoder, vision = sizes(1, 1), sizes(2, 1), sizes(1, 2)
    return tuple(b + (config.num_layers - 1) * (d - b) + (config.vision_layers - 1) * (v - b)
                 for b, d, v in zip(base, decoder, vision))


def _check_size(path: Path, config: ModelConfig, files: list[Path]) -> None:
    """Before building anything, a bound (not the exact check, which names tensors later): the config's weights may
    take at most WEIGHT_SLACK times what its weight files hold (+ 64 MiB; a damaged file may lack a few tensors),
    and its derived tables (RoPE over every position) at most MAX_BUFFER_BYTES. So a vla.json claiming a huge
    model fails at once, instead of allocating it (or building a million layers) first."""
    try:
        params, buffers = _tensor_bytes(config)
    except (RuntimeError, ValueError, OverflowError) as e:  # e.g. a storage size that overflows int64
        raise CheckpointError(f"{path}: vla.json describes a model that cannot be built ({one_line(e)})") from None
    held = sum(f.stat().st_size for f in files)
    if params > WEIGHT_SLACK * held + (64 << 20):
        raise CheckpointError(f"{path}: vla.json describes {params / 2**20:.1f} MiB of weights, more than its weight "
                              f"files hold ({held / 2**20:.1f} MiB)")
    if buffers > MAX_BUFFER_BYTES:
        raise CheckpointError(f"{path}: vla.json's model needs {buffers / 2**20:.1f} MiB of position tables, expected "
                              f"at most {MAX_BUFFER_BYTES / 2**20:.0f} MiB (max_positions {config.max_positions})")


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({one_line(e)})") from None


def load_checkpoint(path: str | Path, config: ModelConfig | None = None) -> VLA:
    """Load and validate a checkpoint directory; every tensor must match by name, shape and dtype and be finite.
    `config`: the checkpoint's own (read_config) with run-time changes that keep every weight's shape, e.g.
    vision_frames. Sizes are checked before anything is built (see _check_size)."""
    path = Path(path)
    config = read_config(path) if config is None else config
    files = part_files(config)
    for rel in files.values():
        if not (path / rel).is_file():
            raise CheckpointError(f"{path}: missing {rel}")
    _check_size(path, config, [path / rel for rel in files.values()])
    model = empty_vla(config)  # every parameter is loaded below
    expected = _parts(model)
    loaded: dict[str, torch.Tensor] = {}
    for part, (rel, want) in expected.items():
        file = path / rel
        got = _load_file(file)
        for name in sorted(want):
            if name not in got:
                raise CheckpointError(f"{file}: missing tensor {name!r} (expected shape {tuple(want[name].shape)})")
        for name in sorted(got):
            if name not in want:
                raise CheckpointError(f"{file}: unexpected tensor {show(name)}")
            if tuple(got[name].shape) != tuple(want[name].shape):
                raise CheckpointError(
                    f"{file}: tensor {name!r} has shape {tuple(got[name].shape)}, expected {tuple(want[name].shape)}"
                )
            if got[name].dtype != want[name].dtype:
                raise CheckpointError(
                    f"{file}: tensor {name!r} has dtype {got[name].dtype}, expected {want[name].dtype}")
            if got[name].is_floating_point() and not bool(torch.isfinite(got[name]).all()):
                bad = int((~torch.isfinite(got[name])).sum())
                raise CheckpointError(f"{file}: tensor {name!r} holds {bad} NaN or infinite values, expected finite")
        prefix = "" if part == "heads" else f"{part}."
        loaded.update({prefix + k: v for k, v in got.items()})
    model.load_state_dict(loaded, strict=True)
    return model.eval()
