"""Checkpoint directories.

    DIR/vla.json               node-level model config (ModelConfig fields) and format version
    DIR/decoder/               a transformers LlamaForCausalLM checkpoint (config.json + model.safetensors)
    DIR/vision/                a transformers SiglipVisionModel checkpoint (config.json + model.safetensors)
    DIR/heads.safetensors      projector, camera embedding, state projector

Loading checks every tensor's name, shape and dtype and names the offending tensor on any mismatch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vla_node.model.config import ModelConfig
from vla_node.model.decoder import hf_llama_config
from vla_node.model.vision import hf_siglip_config
from vla_node.model.vla import VLA
from vla_node.validate import from_dict

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    pass


def _parts(model: VLA) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """file (relative) -> the state dict stored there, with the names the file uses."""
    state = {k: v for k, v in model.state_dict().items()}
    decoder = {k[len("decoder."):]: v for k, v in state.items() if k.startswith("decoder.")}
    vision = {k[len("vision."):]: v for k, v in state.items() if k.startswith("vision.")}
    heads = {k: v for k, v in state.items() if not k.startswith(("decoder.", "vision."))}
    return {"decoder": ("decoder/model.safetensors", decoder), "vision": ("vision/model.safetensors", vision),
            "heads": ("heads.safetensors", heads)}


def save_checkpoint(model: VLA, out: str | Path) -> Path:
    out = Path(out)
    (out / "decoder").mkdir(parents=True, exist_ok=True)
    (out / "vision").mkdir(parents=True, exist_ok=True)
    config = model.config
    for _, (rel, tensors) in _parts(model).items():
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / rel), metadata={"format": "pt"})
    (out / "decoder" / "config.json").write_text(json.dumps(hf_llama_config(config), indent=2))
    (out / "vision" / "config.json").write_text(json.dumps(hf_siglip_config(config), indent=2))
    meta = {"format_version": FORMAT_VERSION, "model": dataclasses.asdict(config)}
    (out / "vla.json").write_text(json.dumps(meta, indent=2))
    return out


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    meta_path = path / "vla.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a checkpoint directory (missing vla.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}: invalid JSON ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{meta_path}: no 'model' table (the model's shapes), got {meta.get('model')!r}")
    return from_dict(ModelConfig, meta["model"], "model")


def load_checkpoint(path: str | Path, config: ModelConfig | None = None) -> VLA:
    """Load and validate a checkpoint directory; every tensor must match by name, shape and dtype. `config`: the
    checkpoint's own (read_config) with run-time changes that keep every weight's shape, e.g. vision_frames."""
    path = Path(path)
    model = VLA(read_config(path) if config is None else config)
    expected = _parts(model)
    loaded: dict[str, torch.Tensor] = {}
    for part, (rel, want) in expected.items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"{path}: missing {rel}")
        got = load_file(str(file))
        for name in sorted(want):
            if name not in got:
                raise CheckpointError(f"{file}: missing tensor {name!r} (expected shape {tuple(want[name].shape)})")
        for name in sorted(got):
            if name not in want:
                raise CheckpointError(f"{file}: unexpected tensor {name!r}")
            if tuple(got[name].shape) != tuple(want[name].shape):
                raise CheckpointError(
                    f"{file}: tensor {name!r} has shape {tuple(got[name].shape)}, expected {tuple(want[name].shape)}"
                )
            if got[name].dtype != want[name].dtype:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {got[name].dtype}, expected {want[name].dtype}")
        prefix = "" if part == "heads" else f"{part}."
        loaded.update({prefix + k: v for k, v in got.items()})
    model.load_state_dict(loaded, strict=True)
    return model.eval()
