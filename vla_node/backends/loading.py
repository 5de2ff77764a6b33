"""Model loading: a preset or a checkpoint, built once at its run-time shapes, its linear weights in the format
the launch file resolved (plain, fbgemm fp16, packed bf16, int8 on the CPU kernels' int8 linear)."""

from __future__ import annotations

import torch

from vla_node.backends.cpu_kernels import use_cpu_kernels
from vla_node.backends.fp16_weights import use_fp16_weights
from vla_node.backends.packed_weights import use_packed_weights
from vla_node.model.checkpoint import load_checkpoint
from vla_node.model.config import ModelConfig
from vla_node.model.vla import VLA, build_vla

WEIGHT_FORMATS = ("plain", "fp16", "packed", "int8")


def load_model(config: ModelConfig, weights: str, checkpoint: str | None = None, seed: int = 0) -> VLA:
    """The model at `config`'s shapes (a preset's, or the checkpoint's with run-time changes such as
    vision_frames), from the checkpoint's weights or seeded random ones, its linear layers stored as `weights`:
    'fp16' (fbgemm, fp32 compute), 'packed' (oneDNN bf16), 'int8' (packed, each weight that fits it quantized per
    output column for the int8 linear kernel, bf16 compute) or 'plain' (as they are; the policy casts them to its
    compute dtype). The flow head's action expert keeps plain linear layers: real-time chunking differentiates
    through it (neither fbgemm's nor oneDNN's packed kernels have a backward), and its matrices are small."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {WEIGHT_FORMATS}")
    model = build_vla(config, seed=seed) if checkpoint is None else load_checkpoint(checkpoint, config)
    return convert_weights(model, weights)


def convert_weights(model: VLA, weights: str) -> VLA:
    """`model`'s linear layers stored as `weights` (in place; 'packed' and 'int8' also cast the model to bf16), the
    action expert's excepted (see load_model), and its RMSNorms the fused CPU kernel's where it runs
    (cpu_kernels.py)."""
    if weights == "plain":
        return model
    expert, model.expert = model.expert, None
    if weights == "fp16":
        use_fp16_weights(model)
    else:
        use_packed_weights(model.to(torch.bfloat16), int8=weights == "int8")
    use_cpu_kernels(model)
    model.expert = expert
    return model if weights == "fp16" else model.to(torch.bfloat16)
