"""Multimodal KV cache building blocks: partitions (float or INT8 KIVI), attention over partitions
(segmented with an exact log-sum-exp merge, or gathered), and the vision memory with its policies."""

from vla_node.kv.attention import (
    GatherWorkspace,
    Segment,
    attention_mass,
    concat_segments,
    dense_attention,
    gather_attention,
    merge_state,
    partial_attention,
    segmented_attention,
)
from vla_node.kv.partition import KVPartition, PartitionSpec
from vla_node.kv.vision_config import POLICIES, VisionMemoryConfig
from vla_node.kv.vision_memory import Admission, VisionMemory

__all__ = [
    "Admission",
    "GatherWorkspace",
    "KVPartition",
    "POLICIES",
    "PartitionSpec",
    "Segment",
    "VisionMemory",
    "VisionMemoryConfig",
    "attention_mass",
    "concat_segments",
    "dense_attention",
    "gather_attention",
    "merge_state",
    "partial_attention",
    "segmented_attention",
]
