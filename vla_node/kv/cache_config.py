"""CacheConfig: storage per partition and how attention runs over them (frozen, validated; no torch import, so a
launch file loads without it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vla_node.kv.dtypes import STORAGE_DTYPES
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.validate import require


@dataclass(frozen=True)
class CacheConfig:
    """Storage per partition and how attention runs over them. The vision memory's window and tokens per
    frame always come from the model (vision_frames, tokens_per_frame)."""

    text_dtype: str = "bf16"
    action_dtype: str = "fp32"
    vision: VisionMemoryConfig = field(default_factory=VisionMemoryConfig)
    attention: Literal["segmented", "gather"] = "gather"  # measured faster (bench cache)
    # the tick's text + vision prefix read once per commit into one buffer (kv/prefix.py); not with the
    # policies that track attention importance (h2o, quota, tiered), which need per-partition attention
    tick_prefix: bool = True

    def __post_init__(self) -> None:
        for key in ("text_dtype", "action_dtype"):
            value = getattr(self, key)
            require(value in STORAGE_DTYPES, f"cache.{key}", value, f"one of {list(STORAGE_DTYPES)}")
        require(self.attention in ("segmented", "gather"), "cache.attention", self.attention,
                "'segmented' (log-sum-exp merge) or 'gather'")
        require(isinstance(self.tick_prefix, bool), "cache.tick_prefix", self.tick_prefix, "true or false")

    @staticmethod
    def exact() -> "CacheConfig":
        """Every partition fp32, FIFO without eviction inside the window: equals the reference path."""
        return CacheConfig(text_dtype="fp32", action_dtype="fp32", vision=VisionMemoryConfig(storage_dtype="fp32"))
