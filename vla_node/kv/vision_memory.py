"""VisionMemory: the vision tokens of the last W frames in one KV partition (two for the tiered policy),
admitted a whole frame at a time, with a policy deciding what to evict, merge or demote.

The decisions are the pure functions of `eviction.py`; every storage move happens here, through the
partitions' verbs. admit_frame checks its inputs before it changes anything, so a bad frame leaves the
memory as it was. Storage is the partitions' (preallocated); the memory adds read buffers for attention in
the compute dtype, a log(count) bias and a similarity buffer for merging, all allocated at construction.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple

import torch

from vla_node.kv import dtypes
from vla_node.kv.attention import Segment
from vla_node.kv.dtypes import torch_dtypes
from vla_node.kv.eviction import (
    h2o_evictions,
    key_cosine,
    merged_average,
    oldest_first,
    plan_merges,
    quota_evictions,
    tier_demotions,
    window_evictions,
)
from vla_node.kv.partition import KVPartition, PartitionSpec
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.validate import choose, require

log = logging.getLogger(__name__)

COLD_TIER = 0  # tier id written into partition.tier: the main (int8) partition
HOT_TIER = 1  # the hot partition of the tiered policy
COMPUTE_DTYPES = torch_dtypes(dtypes.COMPUTE_DTYPES)


class Admission(NamedTuple):
    """Where an admitted frame's tokens went: all into partitions[segment]; token i into slots[i] (for a
    merged token, the slot it merged into)."""

    segment: int
    slots: torch.Tensor  # int64 [tokens_per_frame]
    merged: int  # tokens merged into existing slots
    evicted: int  # tokens evicted (window, scene cut, policy) by this admission
    demoted: int  # tokens moved from the hot to the cold tier


class VisionMemory:
    """Vision K/V of the last `window_frames` frames.

    `policy` is a VisionMemoryConfig, or a policy name (then tokens_per_frame and window_frames are
    required and the other knobs take their defaults). `partition` is the main partition (int8 by
    default); `hot` is the higher-precision tier, required by the 'tiered' policy only.
    Segment order everywhere (segments(), add_importance(segment=...), Admission.segment): main, hot.
    """

    def __init__(
        self,
        partition: KVPartition,
        policy: VisionMemoryConfig | str,
        tokens_per_frame: int | None = None,
        window_frames: int | None = None,
        *,
        hot: KVPartition | None = None,
        compute_dtype: torch.dtype | str = torch.float32,
    ) -> None:
        self.config = cfg = _resolve_config(partition, policy, tokens_per_frame, window_frames, hot)
        _check_partitions(cfg, partition, hot)
        if isinstance(compute_dtype, str):
            compute_dtype = choose("compute_dtype", compute_dtype, COMPUTE_DTYPES)
        require(compute_dtype in COMPUTE_DTYPES.values(), "compute_dtype", compute_dtype, "fp32, bf16 or fp16")
        self.compute_dtype = compute_dtype
        self.partitions: tuple[KVPartition, ...] = (partition,) if hot is None else (partition, hot)
        self.history: list[int] = []  # admitted frame ids inside the window, oldest first
        spec, dev = partition.spec, partition.device
        self._read_bufs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for p in self.partitions:
            if p.spec.quantized or p.spec.torch_dtype != compute_dtype:
                shape = (p.spec.n_kv_heads, p.capacity, p.spec.head_dim)
                self._read_bufs.append((torch.zeros(shape, dtype=compute_dtype, device=dev),
                                        torch.zeros(shape, dtype=compute_dtype, device=dev)))
            else:
                self._read_bufs.append(None)
        self._bias = None
        if cfg.policy == "merge":
            if cfg.proportional_attention:
                self._bias = torch.zeros(partition.capacity, dtype=torch.float32, device=dev)
            self._similarity = torch.zeros(cfg.tokens_per_frame, partition.capacity, dtype=torch.float32, device=dev)
            self._keys = torch.zeros(spec.n_kv_heads, partition.capacity, spec.head_dim, dtype=torch.float32,
                                     device=dev)
        self._admits = self._merged = self._evicted = self._demoted = self._flushes = 0
        log.info("vision memory: policy %s, %d frames x %d tokens, %s, kv %.2f MiB", cfg.policy, cfg.window_frames,
                 cfg.tokens_per_frame, " + ".join(f"{p.name} {p.spec.dtype} x {p.capacity}" for p in self.partitions),
                 sum(p.nbytes()["kv_bytes"] for p in self.partitions) / 2**20)

    @classmethod
    def build(
        cls,
        config: VisionMemoryConfig,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | str = torch.float32,
    ) -> "VisionMemory":
        """Allocate the partitions the config asks for and the memory over them."""
        main = KVPartition(PartitionSpec("vision", config.capacity, config.storage_dtype, n_layers, n_kv_heads,
                                         head_dim, key_group=config.key_group), device)
        hot = None
        if config.policy == "tiered":
            hot = KVPartition(PartitionSpec("vision_hot", config.hot_capacity, config.hot_dtype, n_layers,
                                            n_kv_heads, head_dim), device)
        return cls(main, config, hot=hot, compute_dtype=compute_dtype)

    # ------------------------------------------------------------------ admission

    def admit_frame(
        self,
        frame_id: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        scene_cut: bool = False,
        importance: torch.Tensor | None = None,
    ) -> Admission:
        """Admit a whole frame: k, v [n_layers, n_kv_heads, tokens_per_frame, head_dim] (keys after RoPE),
        positions int64[tokens_per_frame], optional initial importance [tokens_per_frame].
        scene_cut=True flushes every older frame first. Frame ids must increase (except across a scene cut)."""
        cfg = self.config
        if not isinstance(frame_id, int) or isinstance(frame_id, bool):
            raise ValueError(f"admit_frame: frame_id {frame_id!r}: expected an int")
        if self.history and frame_id <= self.history[-1] and not scene_cut:
            raise ValueError(f"admit_frame: frame_id {frame_id}: expected > {self.history[-1]} (the last admitted)")
        for p in self.partitions:  # everything checked before anything changes
            p.check_tokens(k, v, positions, frame_id, importance, n=cfg.tokens_per_frame)
        evicted = 0
        if scene_cut:
            for p in self.partitions:
                evicted += p.tokens_used
                p.clear()
            self.history.clear()
            self._flushes += 1
        self.history.append(frame_id)
        del self.history[: -cfg.window_frames]
        for p in self.partitions:
            evicted += p.evict(window_evictions(p.valid, p.frame_id, self.history[0]))
        admit = {"fifo": self._admit_fifo, "quota": self._admit_quota, "h2o": self._admit_h2o,
                 "merge": self._admit_merge, "tiered": self._admit_tiered}[cfg.policy]
        result = admit(frame_id, k, v, positions, importance)
        result = result._replace(evicted=result.evicted + evicted)
        if self._bias is not None:
            self._bias.copy_(self.partitions[0].count).clamp_(min=1).log_()  # log(count); 0 for plain tokens
        self._admits += 1
        self._merged += result.merged
        self._evicted += result.evicted
        self._demoted += result.demoted
        return result

    def _admit_fifo(self, frame_id, k, v, positions, importance) -> Admission:
        main = self.partitions[0]
        slots = main.free_slots(self.config.tokens_per_frame)
        main.write(slots, k, v, positions, frame_id, importance=importance, tier=COLD_TIER)
        return Admission(0, slots, 0, 0, 0)

    def _admit_quota(self, frame_id, k, v, positions, importance) -> Admission:
        cfg, main = self.config, self.partitions[0]
        evicted = main.evict(quota_evictions(main.valid, main.frame_id, main.importance, self.history,
                                             cfg.tokens_per_frame, cfg.quota_decay, cfg.quota_min_tokens))
        slots = main.free_slots(cfg.tokens_per_frame)
        main.write(slots, k, v, positions, frame_id, importance=importance, tier=COLD_TIER)
        return Admission(0, slots, 0, evicted, 0)

    def _admit_h2o(self, frame_id, k, v, positions, importance) -> Admission:
        cfg, main = self.config, self.partitions[0]
        protect = cfg.h2o_protect_frames
        protected = self.history[:-1][-protect:] if protect else []  # the newest frames before the incoming one
        protected_from = protected[0] if protected else frame_id
        evicted = main.evict(h2o_evictions(main.valid, main.frame_id, main.importance, cfg.tokens_per_frame,
                                           protected_from))
        slots = main.free_slots(cfg.tokens_per_frame)
        main.write(slots, k, v, positions, frame_id, importance=importance, tier=COLD_TIER)
        return Admission(0, slots, 0, evicted, 0)

    def _merge_similarity(self, k: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of the new keys to every stored key, mean over heads and layers: [tpf, C]."""
        cfg, main = self.config, self.partitions[0]
        layers = range(main.spec.n_layers) if cfg.merge_layer is None else (cfg.merge_layer,)
        sim = self._similarity.zero_()
        for layer in layers:
            key_cosine(k[layer], main.read_keys(layer, self._keys), out=sim)
        return sim.div_(len(layers))

    def _admit_merge(self, frame_id, k, v, positions, importance) -> Admission:
        cfg, main = self.config, self.partitions[0]
        n = cfg.tokens_per_frame
        plan = plan_merges(self._merge_similarity(k), main.valid, cfg.merge_threshold)
        merged = torch.nonzero(plan.merged).flatten()  # token indices merged into stored slots
        fresh = torch.nonzero(~plan.merged).flatten()  # token indices that need a slot of their own
        targets, group = torch.unique(plan.target[merged], return_inverse=True)  # [m] slots, [n_merged] in [0, m)
        old_k, old_v = main.gather(targets)  # [L, H, m, D] fp32
        old_count = main.count[targets]
        spare = main.valid.clone()
        spare[targets] = False  # never evict a slot that is being merged into
        evicted = main.evict(oldest_first(spare, main.importance, main.frame_id, fresh.numel() - main.tokens_free))
        new_slots = main.free_slots(fresh.numel())
        incoming = importance.float() if importance is not None else torch.zeros(n, device=main.device)
        merged_importance = main.importance[targets].index_add(0, group, incoming[merged])
        slots = torch.cat([targets, new_slots])
        kk = torch.cat([merged_average(old_k, old_count, k[:, :, merged], group), k[:, :, fresh].float()], dim=2)
        vv = torch.cat([merged_average(old_v, old_count, v[:, :, merged], group), v[:, :, fresh].float()], dim=2)
        count = torch.cat([old_count + torch.bincount(group, minlength=targets.numel()).to(old_count.dtype),
                           torch.ones(fresh.numel(), dtype=old_count.dtype, device=main.device)])
        main.write(slots, kk, vv, torch.cat([main.position[targets], positions[fresh]]), frame_id,
                   importance=torch.cat([merged_importance, incoming[fresh]]), count=count, tier=COLD_TIER)
        token_slots = torch.empty(n, dtype=torch.int64, device=main.device)
        token_slots[merged] = targets[group]
        token_slots[fresh] = new_slots
        return Admission(0, token_slots, merged.numel(), evicted, 0)

    def _admit_tiered(self, frame_id, k, v, positions, importance) -> Admission:
        cfg = self.config
        cold, hot = self.partitions
        n = cfg.tokens_per_frame
        demote = torch.nonzero(tier_demotions(hot.valid, hot.importance, hot.frame_id, n)).flatten()
        evicted = 0
        if demote.numel():
            dk, dv = hot.gather(demote)  # [L, H, d, D] fp32
            evicted = cold.evict(oldest_first(cold.valid, cold.importance, cold.frame_id,
                                              demote.numel() - cold.tokens_free))
            cold.write(cold.free_slots(demote.numel()), dk, dv, hot.position[demote], hot.frame_id[demote],
                       importance=hot.importance[demote], count=hot.count[demote], tier=COLD_TIER)
            hot.evict(demote)
        slots = hot.free_slots(n)
        hot.write(slots, k, v, positions, frame_id, importance=importance, tier=HOT_TIER)
        return Admission(1, slots, 0, evicted, demote.numel())

    # ------------------------------------------------------------------ attention side

    def segments(self, layer: int) -> list[Segment]:
        """One Segment per partition (main, then hot) for `layer`: K/V [n_kv_heads, capacity, head_dim] in the
        compute dtype (views of storage when it already is; otherwise this memory's read buffers, valid until
        the next segments() call), mask = the valid slots [capacity], bias = log(count) for the merge policy
        with proportional attention, else None."""
        out = []
        for i, p in enumerate(self.partitions):
            bufs = self._read_bufs[i]
            k, v, valid = p.read(layer) if bufs is None else p.read(layer, bufs[0], bufs[1])
            out.append(Segment(k, v, valid, self._bias if i == 0 else None))
        return out

    def prefix_parts(self) -> list[tuple[KVPartition, torch.Tensor | None]]:
        """(partition, bias) per partition, the bias as segments() gives it: for PrefixBuffer.load_partitions."""
        return [(p, self._bias if i == 0 else None) for i, p in enumerate(self.partitions)]

    def add_importance(self, slots_or_mask: torch.Tensor | None, scores: torch.Tensor, segment: int = 0) -> None:
        """Accumulate attention mass (e.g. attention.attention_mass after an action tick) into the importance
        of partitions[segment]'s slots; see KVPartition.add_importance for the shapes."""
        if not 0 <= segment < len(self.partitions):
            raise ValueError(f"add_importance: segment {segment}: expected 0 <= segment < {len(self.partitions)}")
        self.partitions[segment].add_importance(slots_or_mask, scores, decay=self.config.importance_decay)

    def clear(self) -> None:
        for p in self.partitions:
            p.clear()
        self.history.clear()

    @property
    def tokens_used(self) -> int:
        return sum(p.tokens_used for p in self.partitions)

    def storage_tensors(self) -> list[torch.Tensor]:
        """Every preallocated tensor of the partitions and of this memory."""
        mine = [t for pair in self._read_bufs if pair is not None for t in pair]
        if self.config.policy == "merge":
            mine += [self._similarity, self._keys] + ([self._bias] if self._bias is not None else [])
        return [t for p in self.partitions for t in p.storage_tensors()] + mine

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.config.policy,
            "frames": len(self.history),
            "tokens_used": self.tokens_used,
            "kv_bytes": sum(p.nbytes()["kv_bytes"] for p in self.partitions),
            "admitted_frames": self._admits,
            "merged_tokens": self._merged,
            "evicted_tokens": self._evicted,
            "demoted_tokens": self._demoted,
            "scene_cut_flushes": self._flushes,
            "partitions": [p.stats() for p in self.partitions],
        }


def _resolve_config(
    partition: KVPartition,
    policy: VisionMemoryConfig | str,
    tokens_per_frame: int | None,
    window_frames: int | None,
    hot: KVPartition | None,
) -> VisionMemoryConfig:
    if isinstance(policy, VisionMemoryConfig):
        sizes = {}
        for key, given in (("tokens_per_frame", tokens_per_frame), ("window_frames", window_frames)):
            configured = getattr(policy, key)
            require(given is None or configured is None or given == configured, key, given,
                    f"{configured} as in the config (or leave it out)")
            require(given is not None or configured is not None, key, None, "given here or in the config")
            sizes[key] = configured if configured is not None else given
        return dataclasses.replace(policy, **sizes)  # checks the knobs the sizes bound
    require(isinstance(policy, str), "policy", policy, "a policy name or a VisionMemoryConfig")
    require(tokens_per_frame is not None and window_frames is not None, "tokens_per_frame/window_frames",
            (tokens_per_frame, window_frames), "both given with a policy name")
    return VisionMemoryConfig(
        policy=policy,
        window_frames=window_frames,
        tokens_per_frame=tokens_per_frame,
        capacity_tokens=partition.capacity,
        storage_dtype=partition.spec.dtype,
        key_group=partition.spec.key_group,
        hot_tokens=None if hot is None else hot.capacity,
        hot_dtype="bf16" if hot is None else hot.spec.dtype,
    )


def _check_partitions(cfg: VisionMemoryConfig, main: KVPartition, hot: KVPartition | None) -> None:
    s = main.spec
    require(s.dtype == cfg.storage_dtype, "storage_dtype", cfg.storage_dtype, f"{s.dtype!r}, the partition's dtype")
    require(main.capacity >= cfg.min_capacity(), "capacity_tokens", main.capacity,
            f">= {cfg.min_capacity()} for policy {cfg.policy!r} (the partition's capacity)")
    require(cfg.merge_layer is None or cfg.merge_layer < s.n_layers, "merge_layer", cfg.merge_layer,
            f"a layer index < n_layers={s.n_layers}")
    if cfg.policy != "tiered":
        require(hot is None, "hot", "a partition", f"no hot partition with policy {cfg.policy!r}")
        return
    require(hot is not None, "hot", None, "a bf16/fp16/fp32 KVPartition with policy 'tiered'")
    assert hot is not None
    h = hot.spec
    require(not h.quantized, "hot_dtype", h.dtype, "a float dtype (bf16, fp16, fp32)")
    require((h.n_layers, h.n_kv_heads, h.head_dim) == (s.n_layers, s.n_kv_heads, s.head_dim), "hot",
            (h.n_layers, h.n_kv_heads, h.head_dim), f"the main partition's (n_layers, n_kv_heads, head_dim) = "
            f"{(s.n_layers, s.n_kv_heads, s.head_dim)}")
    require(hot.device == main.device, "hot", str(hot.device), f"on the main partition's device {main.device}")
    require(hot.capacity >= cfg.tokens_per_frame, "hot_tokens", hot.capacity,
            f">= tokens_per_frame={cfg.tokens_per_frame}")
    need = cfg.window_frames * cfg.tokens_per_frame
    require(hot.capacity + main.capacity >= need, "capacity_tokens", main.capacity,
            f">= {need - hot.capacity} (window_frames x tokens_per_frame - hot tokens)")


__all__ = ["VisionMemory", "VisionMemoryConfig", "Admission", "HOT_TIER", "COLD_TIER", "COMPUTE_DTYPES"]
