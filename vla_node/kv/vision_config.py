"""VisionMemoryConfig: the vision memory's policy, chosen by name, and its knobs (frozen, validated)."""

from __future__ import annotations

import dataclasses
import math

from vla_node.kv.dtypes import STORAGE_DTYPES
from vla_node.validate import choose, is_int, is_number, require

POLICIES: dict[str, str] = {
    "fifo": "evict whole oldest frames; W frames kept",
    "quota": "PackCache: per-frame token quota decaying with age (with a minimum), most important tokens kept",
    "merge": "near-duplicate keys (cosine > threshold) merged into count-weighted averages",
    "h2o": "heavy hitters: evict the tokens with the least accumulated attention",
    "tiered": "W frames; hot (most important) tokens in a bf16/fp16 tier, cold ones in the int8 tier",
}
HOT_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def _positive_int(key: str, value: object) -> None:
    require(is_int(value) and value > 0, key, value, "a positive integer")


def quota_for_age(age: int, tokens_per_frame: int, decay: float, minimum: int) -> int:
    """PackCache quota: tokens kept for a frame of this age, floor(tpf * decay^age), never below `minimum`."""
    decayed = math.floor(tokens_per_frame * decay**age + 1e-9)
    return max(min(minimum, tokens_per_frame), min(decayed, tokens_per_frame))


@dataclasses.dataclass(frozen=True)
class VisionMemoryConfig:
    """Vision memory over `window_frames` frames of `tokens_per_frame` tokens.

    window_frames, tokens_per_frame: None = the model's (MultiRatePolicy fills them in, and VisionMemory from its
      own arguments); the knobs bounded by them (capacity_tokens, hot_tokens, h2o_protect_frames, a tiered
      window) are checked once both are known.

    capacity_tokens: slots of the main (int8 by default) partition; None = what the policy needs for a
      full window (fifo/merge/h2o: W x tpf, quota: the sum of the quotas, tiered: W x tpf - hot tokens).
    quota_*: quota(age) = max(min(quota_min_tokens, tpf), floor(tpf x quota_decay^age)); age 0 = newest frame.
    merge_*: a new token merges into its most similar stored token when the cosine similarity of keys
      (mean over heads, over all layers or over merge_layer) exceeds merge_threshold;
      proportional_attention adds log(count) to merged tokens' logits.
    h2o_protect_frames: the newest frames before the incoming one never lose tokens to importance
      (unless nothing else is left).
    importance_decay: importance = importance x decay + new scores, on every add_importance.
    hot_tokens / hot_dtype (tiered): slots and storage of the hot tier; None = one frame.
    """

    policy: str = "fifo"
    window_frames: int | None = None
    tokens_per_frame: int | None = None
    capacity_tokens: int | None = None
    storage_dtype: str = "int8"
    key_group: int = 64
    quota_decay: float = 0.5
    quota_min_tokens: int = 32
    merge_threshold: float = 0.95
    merge_layer: int | None = None
    proportional_attention: bool = True
    h2o_protect_frames: int = 1
    importance_decay: float = 1.0
    hot_tokens: int | None = None
    hot_dtype: str = "bf16"

    def __post_init__(self) -> None:
        choose("policy", self.policy, POLICIES)
        choose("storage_dtype", self.storage_dtype, STORAGE_DTYPES)
        choose("hot_dtype", self.hot_dtype, HOT_DTYPES)
        for key in ("window_frames", "tokens_per_frame"):
            if getattr(self, key) is not None:
                _positive_int(key, getattr(self, key))
        _positive_int("key_group", self.key_group)
        require(is_number(self.quota_decay) and 0.0 < self.quota_decay <= 1.0, "quota_decay",
                self.quota_decay, "a number in (0, 1]")
        require(is_int(self.quota_min_tokens)
                and self.quota_min_tokens >= 0, "quota_min_tokens", self.quota_min_tokens,
                "an integer >= 0 (capped at tokens_per_frame)")
        require(is_number(self.merge_threshold) and -1.0 <= self.merge_threshold <= 1.0, "merge_threshold",
                self.merge_threshold, "a cosine similarity in [-1, 1]")
        require(self.merge_layer is None or (isinstance(self.merge_layer, int) and self.merge_layer >= 0),
                "merge_layer", self.merge_layer, "none (average over layers) or a layer index >= 0")
        require(is_int(self.h2o_protect_frames)
                and self.h2o_protect_frames >= 0, "h2o_protect_frames", self.h2o_protect_frames, "an integer >= 0")
        require(is_number(self.importance_decay) and 0.0 < self.importance_decay <= 1.0,
                "importance_decay", self.importance_decay, "a number in (0, 1]")
        if self.hot_tokens is not None:
            _positive_int("hot_tokens", self.hot_tokens)
        if self.capacity_tokens is not None:
            _positive_int("capacity_tokens", self.capacity_tokens)
        if self.sized:
            self._check_sizes()

    def for_model(self, window_frames: int, tokens_per_frame: int) -> "VisionMemoryConfig":
        """This config with the model's window and frame size (checked against the knobs they bound); the knobs
        that only cap at them (quota_min_tokens, h2o_protect_frames) are clamped to them."""
        return dataclasses.replace(self, window_frames=window_frames, tokens_per_frame=tokens_per_frame,
                                   quota_min_tokens=min(self.quota_min_tokens, tokens_per_frame),
                                   h2o_protect_frames=min(self.h2o_protect_frames, window_frames - 1))

    @property
    def sized(self) -> bool:
        """Both the window and the frame size are known."""
        return self.window_frames is not None and self.tokens_per_frame is not None

    def _check_sizes(self) -> None:
        w, t = self.window_frames, self.tokens_per_frame
        require(self.h2o_protect_frames < w, "h2o_protect_frames", self.h2o_protect_frames,
                f"an integer in [0, window_frames={w})")
        if self.hot_tokens is not None:
            require(t <= self.hot_tokens < w * t, "hot_tokens", self.hot_tokens,
                    f"none (one frame) or an integer in [tokens_per_frame={t}, "
                    f"window_frames x tokens_per_frame={w * t})")
        if self.policy == "tiered":
            require(w >= 2, "window_frames", w,
                    "at least 2 with policy 'tiered' (the cold tier holds the older frames)")
        if self.capacity_tokens is not None:
            require(self.capacity_tokens >= self.min_capacity(), "capacity_tokens", self.capacity_tokens,
                    f">= {self.min_capacity()} for policy {self.policy!r} (window_frames={w}, tokens_per_frame={t})")

    def _sizes(self) -> tuple[int, int]:
        require(self.sized, "window_frames, tokens_per_frame", (self.window_frames, self.tokens_per_frame),
                "both set to compute sizes (None = the model's: give them, or let MultiRatePolicy fill them in)")
        return self.window_frames, self.tokens_per_frame

    def quota(self, age: int) -> int:
        return quota_for_age(age, self._sizes()[1], self.quota_decay, self.quota_min_tokens)

    @property
    def hot_capacity(self) -> int:
        return self._sizes()[1] if self.hot_tokens is None else self.hot_tokens

    def full_window_tokens(self) -> int:
        """Main-partition slots that hold a full window under this policy."""
        w, t = self._sizes()
        if self.policy == "quota":
            return sum(self.quota(a) for a in range(w))
        if self.policy == "tiered":
            return w * t - self.hot_capacity
        return w * t

    def min_capacity(self) -> int:
        """The fewest main-partition slots the policy can work with."""
        t = self._sizes()[1]
        if self.policy == "merge":
            return t
        if self.policy == "h2o":
            return t * (1 + self.h2o_protect_frames)
        return self.full_window_tokens()

    @property
    def capacity(self) -> int:
        return self.full_window_tokens() if self.capacity_tokens is None else self.capacity_tokens


__all__ = ["VisionMemoryConfig", "POLICIES"]
