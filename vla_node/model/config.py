"""Model configuration: frozen, validated, with named presets (tiny, small, base)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from vla_node.validate import choose, is_number, require

ActionDecode = Literal["parallel", "autoregressive"]
ActionHead = Literal["bins", "flow"]
FlowState = Literal["prefix", "suffix"]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the VLA: SigLIP-style vision tower, projector, Llama-style decoder, and an action head: `bins`
    (256 bins per dim, decoded by the decoder) or `flow` (a flow-matching action expert, pi0 style: per decoder
    layer its own weights at expert_hidden_size, the decoder's head geometry, integrating a velocity field over
    flow_steps Euler steps; the state a prefix token as for bins, or a suffix token of the expert's block).

    Sequence layout (fixed positions per slot, so positions stay bounded in a node that runs for hours):
    text slots [0, max_text_tokens), then `vision_frames` frame slots of `num_cameras * tokens_per_camera`
    tokens, then `state_slots` state tokens (one per action tick, a ring), then the H*D action queries.
    """

    name: str = "custom"
    # vision tower
    image_size: int = 224
    patch_size: int = 16
    vision_width: int = 384
    vision_layers: int = 6
    vision_heads: int = 6
    vision_mlp: int = 1536
    vision_eps: float = 1e-6
    num_cameras: int = 1
    # decoder
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 1536
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    # sequence layout
    max_text_tokens: int = 48
    vision_frames: int = 1
    state_slots: int = 4
    state_dim: int = 4
    # action head: H steps x D dims, 256 bins each, ranges per dim
    action_horizon: int = 8
    action_dims: int = 2
    action_bins: int = 256
    action_low: tuple[float, ...] = (-1.0, -1.0)
    action_high: tuple[float, ...] = (1.0, 1.0)
    action_decode: ActionDecode = "parallel"
    action_head: ActionHead = "bins"
    # flow head: the action expert (its own width, the decoder's heads and head_dim) and its integrator
    expert_hidden_size: int = 256
    expert_intermediate_size: int = 768
    flow_steps: int = 10
    flow_state: FlowState = "prefix"
    flow_noise_scale: float = 1.0  # the noise's standard deviation: about the actions' own scale (pi0 normalizes the
                                   # actions to unit scale instead; a model trained on small actions takes a small one)

    def __post_init__(self) -> None:
        positive = (
            "image_size patch_size vision_width vision_layers vision_heads vision_mlp num_cameras hidden_size "
            "num_layers num_heads num_kv_heads intermediate_size max_text_tokens vision_frames state_slots "
            "state_dim action_horizon action_dims action_bins expert_hidden_size expert_intermediate_size "
            "flow_steps"
        ).split()
        for key in positive:
            value = getattr(self, key)
            require(isinstance(value, int) and value > 0, f"model.{key}", value, "a positive integer")
        require(self.image_size % self.patch_size == 0, "model.patch_size", self.patch_size,
                f"a divisor of image_size {self.image_size}")
        require(self.vision_width % self.vision_heads == 0, "model.vision_heads", self.vision_heads,
                f"a divisor of vision_width {self.vision_width}")
        require(self.hidden_size % self.num_heads == 0, "model.num_heads", self.num_heads,
                f"a divisor of hidden_size {self.hidden_size}")
        require((self.hidden_size // self.num_heads) % 2 == 0, "model.num_heads", self.num_heads,
                "a head count giving an even head_dim (RoPE rotates pairs)")
        require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
                f"a divisor of num_heads {self.num_heads}")
        require(self.max_text_tokens >= 2, "model.max_text_tokens", self.max_text_tokens, ">= 2 (BOS + text)")
        require(self.action_bins <= 256, "model.action_bins", self.action_bins, "<= 256 (the vocabulary holds 256 bin tokens)")
        require(len(self.action_low) == self.action_dims, "model.action_low", self.action_low,
                f"{self.action_dims} values (one per action dim)")
        require(len(self.action_high) == self.action_dims, "model.action_high", self.action_high,
                f"{self.action_dims} values (one per action dim)")
        for key in ("rms_eps", "vision_eps", "rope_theta", "flow_noise_scale"):
            value = getattr(self, key)
            require(is_number(value)
                    and value > 0, f"model.{key}", value, "a finite number > 0")
        for i, (lo, hi) in enumerate(zip(self.action_low, self.action_high)):
            require(math.isfinite(lo), f"model.action_low[{i}]", lo, "a finite number")
            require(math.isfinite(hi), f"model.action_high[{i}]", hi, "a finite number")
            require(lo < hi, f"model.action_high[{i}]", hi, f"> action_low[{i}] = {lo}")
        require(self.action_decode in ("parallel", "autoregressive"), "model.action_decode",
                self.action_decode, "'parallel' or 'autoregressive'")
        require(self.action_head in ("bins", "flow"), "model.action_head", self.action_head, "'bins' or 'flow'")
        require(self.flow_state in ("prefix", "suffix"), "model.flow_state", self.flow_state,
                "'prefix' or 'suffix'")

    # derived sizes ---------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tokens_per_camera(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_frame(self) -> int:
        return self.num_cameras * self.tokens_per_camera

    @property
    def action_tokens(self) -> int:
        return self.action_horizon * self.action_dims

    @property
    def flow_tokens(self) -> int:
        """The action expert's block: the state token (flow_state = 'suffix'), then one token per horizon step."""
        return self.action_horizon + (self.flow_state == "suffix")

    @property
    def vocab_size(self) -> int:
        from vla_node.model.tokenizer import VOCAB_SIZE

        return VOCAB_SIZE

    # fixed position layout -------------------------------------------------------------------------
    @property
    def vision_base(self) -> int:
        return self.max_text_tokens

    @property
    def state_base(self) -> int:
        return self.vision_base + self.vision_frames * self.tokens_per_frame

    @property
    def query_base(self) -> int:
        return self.state_base + self.state_slots

    @property
    def max_positions(self) -> int:
        return self.query_base + max(self.action_tokens, self.flow_tokens)

    def vision_positions(self, frame_slot: int) -> range:
        start = self.vision_base + frame_slot * self.tokens_per_frame
        return range(start, start + self.tokens_per_frame)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # unit tests: every shape tiny, odd sizes where it catches bugs
    "tiny": ModelConfig(
        name="tiny", image_size=32, patch_size=16, vision_width=32, vision_layers=2, vision_heads=4,
        vision_mlp=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_text_tokens=24, vision_frames=1, state_slots=2, action_horizon=4, action_dims=2,
        expert_hidden_size=32, expert_intermediate_size=64,
    ),
    # the CPU default: 224 px frames, 16 px patches, a ~25 M parameter decoder (a ~5 M parameter expert)
    "small": ModelConfig(name="small"),
    # ~0.5 B parameters, for GPUs
    "base": ModelConfig(
        name="base", image_size=224, patch_size=14, vision_width=768, vision_layers=12, vision_heads=12,
        vision_mlp=3072, hidden_size=1280, num_layers=24, num_heads=16, num_kv_heads=4,
        intermediate_size=3456, max_text_tokens=64, expert_hidden_size=640, expert_intermediate_size=1728,
    ),
}


def preset(name: str, action_head: str = "bins") -> ModelConfig:
    """A preset's shapes with either action head (the expert's width is in every preset: half the decoder's)."""
    return choose("model.preset", name, PRESETS).replace(action_head=action_head)
