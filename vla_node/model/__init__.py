"""The VLA model: vision tower, projector, decoder, tokenizer, action head, checkpoints."""

from vla_node.model.action_head import ActionBins
from vla_node.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from vla_node.model.config import PRESETS, ModelConfig, preset
from vla_node.model.vla import VLA, block_causal_mask, build_vla, preprocess_frame, to_pixels

__all__ = [
    "ActionBins", "CheckpointError", "load_checkpoint", "save_checkpoint", "PRESETS", "ModelConfig", "preset",
    "VLA", "block_causal_mask", "build_vla", "preprocess_frame", "to_pixels",
]
