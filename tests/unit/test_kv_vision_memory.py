"""VisionMemory: one test per policy, scene cuts, tiers, transactional admission, no storage reallocation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helpers.oracles import concat_segments
from vla_node.kv.attention import dense_attention, gather_attention, segmented_attention
from vla_node.kv.partition import KVPartition, PartitionSpec
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.kv.vision_memory import VisionMemory
from vla_node.validate import ConfigError, from_dict

L, H, D = 2, 2, 16
TPF = 8


def frame(seed: int, n: int = TPF) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g), torch.arange(n) + 100


def memory(policy: str, window: int = 3, dtype: str = "int8", **kw) -> VisionMemory:
    cfg = VisionMemoryConfig(policy=policy, window_frames=window, tokens_per_frame=TPF, storage_dtype=dtype,
                             key_group=8, **kw)
    return VisionMemory.build(cfg, L, H, D)


def frames_held(mem: VisionMemory, segment: int = 0) -> dict[int, int]:
    p = mem.partitions[segment]
    ids = p.frame_id[p.valid].tolist()
    return {f: ids.count(f) for f in sorted(set(ids))}


# ---------------------------------------------------------------- config


def test_config_names_the_bad_value_and_suggests():
    with pytest.raises(ConfigError, match=r"policy = 'fifi'.*did you mean 'fifo'"):
        VisionMemoryConfig(policy="fifi")
    sized = {"window_frames": 4, "tokens_per_frame": 196}
    with pytest.raises(ConfigError, match=r"capacity_tokens = 10: expected >= 784 for policy 'fifo' \(window_frames"):
        VisionMemoryConfig(capacity_tokens=10, **sized)
    with pytest.raises(ConfigError, match=r"quota_decay = 1.5"):
        VisionMemoryConfig(quota_decay=1.5)
    with pytest.raises(ConfigError, match=r"hot_tokens = 10"):
        VisionMemoryConfig(policy="tiered", hot_tokens=10, **sized)
    with pytest.raises(ConfigError, match=r"cache.vision.h2o_protect_frmes: unknown key.*did you mean"):
        from_dict(VisionMemoryConfig, {"policy": "h2o", "h2o_protect_frmes": 2}, "cache.vision")
    cfg = from_dict(VisionMemoryConfig, {"policy": "quota", "quota_decay": 1, **sized}, "cache.vision")
    assert cfg.capacity == 196 * 4 and cfg.quota(0) == 196
    assert VisionMemoryConfig(policy="quota", **sized).capacity == 196 + 98 + 49 + 32
    with pytest.raises(ConfigError, match=r"window_frames, tokens_per_frame = \(None, None\): expected both set"):
        VisionMemoryConfig().capacity


def test_config_sizes_default_to_the_models_and_bound_knobs_once_known():
    """A launch file's cache.vision is read before the model is known: knobs bounded by the window and the frame
    size are checked when the policy fills those in (tiny: 4 tokens per frame)."""
    from vla_node.kv.cache_config import CacheConfig
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla
    from vla_node.runtime.policy import MultiRatePolicy

    vision = from_dict(VisionMemoryConfig, {"policy": "tiered", "capacity_tokens": 8, "hot_tokens": 4}, "cache.vision")
    model = build_vla(preset("tiny").replace(vision_frames=3), seed=0)
    policy = MultiRatePolicy(model, CacheConfig(vision=vision))
    assert [p.capacity for p in policy.vision.partitions] == [8, 4]
    with pytest.raises(ConfigError, match=r"capacity_tokens = 7: expected >= 8 for policy 'tiered'"):
        MultiRatePolicy(model, CacheConfig(vision=dataclasses.replace(vision, capacity_tokens=7)))


def test_constructor_with_a_policy_name_and_checks():
    part = KVPartition(PartitionSpec("vision", 3 * TPF, "int8", L, H, D, key_group=8))
    mem = VisionMemory(part, "fifo", TPF, 3)
    assert mem.config.storage_dtype == "int8" and mem.config.capacity == 3 * TPF
    with pytest.raises(ConfigError, match=r"capacity_tokens = 24: expected >= 32"):
        VisionMemory(part, "fifo", TPF, 4)
    with pytest.raises(ConfigError, match=r"hot"):
        VisionMemory(part, "tiered", TPF, 3)
    with pytest.raises(ConfigError, match=r"window_frames = 5"):
        VisionMemory(part, VisionMemoryConfig(window_frames=3, tokens_per_frame=TPF), TPF, 5)


# ---------------------------------------------------------------- policies


def test_fifo_keeps_the_last_w_frames_and_reuses_the_oldest_slots():
    mem = memory("fifo", window=3, dtype="fp32")
    placed = {}
    for f in range(6):
        k, v, pos = frame(f)
        adm = mem.admit_frame(f * 10, k, v, pos)
        placed[f * 10] = adm.slots
        assert adm.evicted == (TPF if f >= 3 else 0)
        assert frames_held(mem) == {g * 10: TPF for g in range(max(0, f - 2), f + 1)}
        if f >= 3:  # the new frame took the slots of the frame that fell out of the window
            assert sorted(adm.slots.tolist()) == sorted(placed[(f - 3) * 10].tolist())
    assert mem.history == [30, 40, 50]
    k, v, _ = frame(5)
    seg = mem.segments(1)[0]
    assert torch.equal(seg.k[:, placed[50]], k[1]) and torch.equal(seg.v[:, placed[50]], v[1])
    assert int(seg.mask.sum()) == 3 * TPF and seg.bias is None


def test_quota_respects_per_age_quotas_and_keeps_the_most_important():
    mem = memory("quota", window=4, quota_decay=0.5, quota_min_tokens=1)  # quotas 8, 4, 2, 1
    assert mem.partitions[0].capacity == 15
    importance = {}
    for f in range(7):
        k, v, pos = frame(f)
        importance[f] = torch.rand(TPF, generator=torch.Generator().manual_seed(100 + f))
        mem.admit_frame(f, k, v, pos, importance=importance[f])
        held = frames_held(mem)
        for age, fid in enumerate(reversed(mem.history)):
            assert held.get(fid, 0) == mem.config.quota(age)
    p = mem.partitions[0]
    for age, fid in enumerate(reversed(mem.history)):
        kept = p.importance[p.valid & (p.frame_id == fid)]
        top = importance[fid].topk(mem.config.quota(age)).values
        assert sorted(kept.tolist()) == pytest.approx(sorted(top.tolist()))


def test_merge_averages_duplicates_and_drops_the_token_count():
    mem = memory("merge", window=3, dtype="fp32", merge_threshold=0.99)
    k0, v0, pos = frame(0)
    mem.admit_frame(0, k0, v0, pos)
    k1, v1, _ = frame(1)
    dup = torch.tensor([0, 2, 5])  # tokens of frame 1 that repeat frame 0's keys (values differ)
    k1[:, :, dup] = k0[:, :, dup] * 1.5  # same direction: cosine 1
    adm = mem.admit_frame(1, k1, v1, pos)
    p = mem.partitions[0]
    assert adm.merged == 3 and p.tokens_used == 2 * TPF - 3
    targets = adm.slots[dup]
    assert p.count[targets].tolist() == [2, 2, 2]
    assert torch.allclose(p.k[:, :, targets], (k0[:, :, dup] + k1[:, :, dup]) / 2, atol=1e-6)
    assert torch.allclose(p.v[:, :, targets], (v0[:, :, dup] + v1[:, :, dup]) / 2, atol=1e-6)
    assert set(p.frame_id[targets].tolist()) == {1}  # refreshed by the newest member
    # a third member: the count-weighted average of all three
    k2, v2, _ = frame(2)
    k2[:, :, 0] = k0[:, :, 0] * 0.5
    adm2 = mem.admit_frame(2, k2, v2, pos)
    slot = int(adm2.slots[0])
    assert slot == int(targets[0]) and int(p.count[slot]) == 3
    assert torch.allclose(p.v[:, :, slot], (v0[:, :, 0] + v1[:, :, 0] + v2[:, :, 0]) / 3, atol=1e-6)
    # proportional attention: the segment carries log(count) and attention equals dense with that bias
    seg = mem.segments(0)[0]
    assert seg.bias[slot].item() == pytest.approx(math.log(3))
    assert float(seg.bias[p.valid & (p.count == 1)].abs().max()) == 0.0
    q = torch.randn(4, 2, D)
    whole = concat_segments([seg], 2)
    ref = dense_attention(q, whole.k, whole.v, whole.mask, whole.bias)
    assert float((segmented_attention(q, [seg])[0] - ref).abs().max()) <= 1e-5
    assert float((gather_attention(q, [seg]) - ref).abs().max()) <= 1e-5


def test_merge_on_int8_storage_and_a_small_capacity():
    cfg = VisionMemoryConfig(policy="merge", window_frames=4, tokens_per_frame=TPF, capacity_tokens=TPF + 4,
                             key_group=4, merge_threshold=0.9)
    mem = VisionMemory.build(cfg, L, H, D)
    k, v, pos = frame(0)
    mem.admit_frame(0, k, v, pos)
    for f in range(1, 6):  # a static scene: every token repeats, memory stays at one frame of slots
        adm = mem.admit_frame(f, k + 0.01 * torch.randn(k.shape), v, pos)
        assert adm.merged == TPF and mem.tokens_used == TPF
    assert mem.partitions[0].count[mem.partitions[0].valid].tolist() == [6] * TPF
    for f in range(6, 9):  # a new scene without a scene-cut flag: old slots make room, oldest first
        k2, v2, _ = frame(f)
        mem.admit_frame(f, k2, v2, pos)
        assert mem.tokens_used <= TPF + 4
    assert max(frames_held(mem)) == 8


def test_h2o_keeps_the_top_importance_tokens():
    mem = memory("h2o", window=8, capacity_tokens=3 * TPF, h2o_protect_frames=1)
    p = mem.partitions[0]
    favourite = {}
    for f in range(8):
        k, v, pos = frame(f)
        adm = mem.admit_frame(f, k, v, pos)
        favourite[f] = adm.slots[[1, 6]]
        scores = torch.full((TPF,), 0.01)
        scores[[1, 6]] = 1.0 + f  # the action queries attend to tokens 1 and 6 of every frame
        mem.add_importance(adm.slots, scores)
    assert p.tokens_used == 3 * TPF
    held = frames_held(mem)
    assert held[7] == TPF and held[6] == TPF  # the incoming frame and the protected previous one
    for f in range(6):  # from older frames only the heavy hitters survive (the newest ones first)
        if f in held:
            assert bool(p.valid[favourite[f]].all())
    kept_old = p.valid & (p.frame_id < 6)
    assert int(kept_old.sum()) == TPF and float(p.importance[kept_old].min()) >= 1.0


@pytest.mark.parametrize("policy", ["fifo", "quota", "merge", "h2o", "tiered"])
def test_scene_cut_flushes_every_older_frame(policy):
    mem = memory(policy, window=3)
    for f in range(3):
        k, v, pos = frame(f)
        mem.admit_frame(f, k, v, pos)
    assert mem.tokens_used > TPF
    k, v, pos = frame(99)
    adm = mem.admit_frame(3, k, v, pos, scene_cut=True)
    assert mem.tokens_used == TPF and mem.history == [3]
    assert adm.evicted >= 2 * TPF and mem.stats()["scene_cut_flushes"] == 1
    for p in mem.partitions:
        assert set(p.frame_id[p.valid].tolist()) <= {3}
    k, v, pos = frame(100)
    mem.admit_frame(1, k, v, pos, scene_cut=True)  # ids may restart after a cut
    assert mem.history == [1]


def test_tiered_keeps_hot_tokens_in_the_high_precision_tier():
    mem = memory("tiered", window=3, hot_tokens=12, hot_dtype="bf16")
    cold, hot = mem.partitions
    assert cold.spec.dtype == "int8" and hot.spec.dtype == "bf16" and cold.capacity == 3 * TPF - 12
    k0, v0, pos = frame(0)
    adm0 = mem.admit_frame(0, k0, v0, pos)
    assert adm0.segment == 1 and hot.tokens_used == TPF and cold.tokens_used == 0
    importance = torch.tensor([5.0, 0.1, 4.0, 0.2, 3.0, 0.3, 2.0, 0.4])
    mem.add_importance(adm0.slots, importance, segment=1)
    k1, v1, _ = frame(1)
    adm1 = mem.admit_frame(1, k1, v1, pos)
    assert adm1.demoted == 4 and hot.tokens_used == 12 and cold.tokens_used == 4
    hot_f0 = hot.valid & (hot.frame_id == 0)
    assert sorted(hot.importance[hot_f0].tolist()) == [2.0, 3.0, 4.0, 5.0]  # the important ones stay hot
    assert sorted(cold.importance[cold.valid].tolist()) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert set(hot.tier[hot.valid].tolist()) == {1} and set(cold.tier[cold.valid].tolist()) == {0}
    # demotion moved K/V and metadata: token 1 of frame 0 (importance 0.1) now lives in the int8 tier
    slot = int(torch.nonzero(cold.valid & (cold.importance < 0.15)).flatten()[0])
    gk, gv = cold.gather(torch.tensor([slot]))
    assert int(cold.position[slot]) == int(pos[1]) and int(cold.frame_id[slot]) == 0
    assert torch.allclose(gk[:, :, 0], k0[:, :, 1], atol=0.05) and torch.allclose(gv[:, :, 0], v0[:, :, 1], atol=0.05)
    # hot tokens keep bf16 precision: much closer than the int8 step
    hot_slot = int(adm0.slots[0])
    assert torch.allclose(hot.k[:, :, hot_slot].float(), k0[:, :, 0], atol=0.02)
    segs = mem.segments(0)
    assert [s.k.dtype for s in segs] == [torch.float32, torch.float32] and len(segs) == 2
    for f in range(2, 6):
        k, v, _ = frame(f)
        mem.admit_frame(f, k, v, pos)
        assert mem.tokens_used == 3 * TPF and set(frames_held(mem, 0)) | set(frames_held(mem, 1)) == {f - 2, f - 1, f}


# ---------------------------------------------------------------- transactions, allocation, attention


@pytest.mark.parametrize("policy", ["fifo", "merge", "tiered"])
def test_a_bad_frame_changes_nothing(policy):
    mem = memory(policy, window=3)
    for f in range(3):
        k, v, pos = frame(f)
        mem.admit_frame(f, k, v, pos)
    before = [t.clone() for t in mem.storage_tensors()]
    history = list(mem.history)
    k, v, pos = frame(10)
    bad = [
        dict(frame_id=3, k=k[:, :, :5], v=v, positions=pos),
        dict(frame_id=3, k=k, v=torch.full_like(v, float("nan")), positions=pos),
        dict(frame_id=3, k=k, v=v, positions=pos[:3]),
        dict(frame_id=2, k=k, v=v, positions=pos),  # not newer than the last frame
        dict(frame_id=3, k=k * 1e6, v=v, positions=pos),  # beyond the int8 tier's fp16 scale range
    ]
    for args in bad:
        with pytest.raises(ValueError):
            mem.admit_frame(**args, scene_cut=False)
        assert mem.history == history
        assert all(torch.equal(a, b) for a, b in zip(mem.storage_tensors(), before))


@pytest.mark.parametrize("policy", ["fifo", "quota", "merge", "h2o", "tiered"])
def test_steady_state_allocates_no_storage(policy):
    mem = memory(policy, window=3)
    ptrs = [t.data_ptr() for t in mem.storage_tensors()]
    shapes = [tuple(t.shape) for t in mem.storage_tensors()]
    capacities = [p.capacity for p in mem.partitions]
    base_k, base_v, pos = frame(0)
    for f in range(40):
        k, v, _ = frame(f)
        if f % 2:  # half the frames repeat the scene (merges), half are new
            k, v = base_k + 0.001 * k, base_v
        adm = mem.admit_frame(f, k, v, pos, scene_cut=(f % 17 == 16))
        mem.add_importance(adm.slots, torch.rand(TPF), segment=adm.segment)
        mem.segments(f % L)
    assert [t.data_ptr() for t in mem.storage_tensors()] == ptrs
    assert [tuple(t.shape) for t in mem.storage_tensors()] == shapes
    assert [p.capacity for p in mem.partitions] == capacities
    assert mem.stats()["admitted_frames"] == 40


def test_attention_over_the_memory_matches_dense_over_dequantized_values():
    mem = memory("fifo", window=3)
    for f in range(4):
        k, v, pos = frame(f)
        mem.admit_frame(f, k, v, pos)
    q = torch.randn(4, 3, D)
    segs = mem.segments(1)
    whole = concat_segments(segs, 3)
    ref = dense_attention(q, whole.k, whole.v, whole.mask)
    assert float((segmented_attention(q, segs)[0] - ref).abs().max()) <= 1e-5
    assert float((gather_attention(q, segs) - ref).abs().max()) <= 1e-5
    bf = VisionMemory(mem.partitions[0], mem.config, compute_dtype="bf16").segments(1)
    assert bf[0].k.dtype == torch.bfloat16 and torch.allclose(bf[0].k.float(), segs[0].k, atol=0.05)
