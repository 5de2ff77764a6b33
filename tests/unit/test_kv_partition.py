"""KVPartition: preallocated storage, all-or-nothing writes, INT8 KIVI accuracy and size, metadata verbs."""

from __future__ import annotations

import pytest
import torch

from vla_node.kv.partition import KVPartition, PartitionSpec
from vla_node.validate import ConfigError

L, H, D = 3, 2, 16


def make(dtype: str = "int8", capacity: int = 100, key_group: int = 32, **kw) -> KVPartition:
    return KVPartition(PartitionSpec("vision", capacity, dtype, L, H, D, key_group=key_group, **kw))


def tokens(n: int, seed: int = 0, spread: float = 1.0, layers: int = L) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, H, n, D, generator=g) * spread, torch.randn(layers, H, n, D, generator=g) * spread


def snapshot(p: KVPartition) -> list[torch.Tensor]:
    return [t.clone() for t in p.storage_tensors()]


def assert_unchanged(p: KVPartition, before: list[torch.Tensor]) -> None:
    for a, b in zip(p.storage_tensors(), before):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_spec_validation_names_key_value_and_did_you_mean():
    with pytest.raises(ConfigError, match=r"kv.vision.dtype = 'int4'.*int8"):
        PartitionSpec("vision", 10, "int4", L, H, D)
    with pytest.raises(ConfigError, match=r"did you mean 'bf16'"):
        PartitionSpec("vision", 10, "bf61", L, H, D)
    with pytest.raises(ConfigError, match=r"kv.vision.capacity = 0: expected a positive integer"):
        PartitionSpec("vision", 0, "fp16", L, H, D)
    with pytest.raises(ConfigError, match=r"scale_dtype"):
        PartitionSpec("vision", 10, "int8", L, H, D, scale_dtype="int8")


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_float_round_trip_and_views(dtype):
    p = make(dtype)
    k, v = tokens(7)
    slots = torch.tensor([3, 0, 99, 50, 51, 52, 10])
    p.write(slots, k, v, torch.arange(7) + 100, 4)
    rk, rv, valid = p.read(2)
    assert rk.data_ptr() == p.k[2].data_ptr()  # a view of the storage, no copy
    tol = 0 if dtype == "fp32" else 1e-2
    assert torch.allclose(rk[:, slots].float(), k[2], atol=tol, rtol=tol)
    assert torch.allclose(rv[:, slots].float(), v[2], atol=tol, rtol=tol)
    assert valid.sum() == 7 and bool(valid[slots].all())
    assert p.position[slots].tolist() == list(range(100, 107)) and set(p.frame_id[slots].tolist()) == {4}
    out_k, out_v = torch.empty(H, 100, D), torch.empty(H, 100, D)
    p.read(2, out_k, out_v)
    assert torch.equal(out_k, rk.float())


def test_int8_write_read_is_within_half_a_step():
    p = make("int8", capacity=130, key_group=32)
    k, v = tokens(70, spread=3.0)
    slots = torch.arange(20, 90)  # starts and ends inside groups
    p.write(slots, k, v, torch.arange(70), 1)
    gk, gv = p.gather(slots)
    assert bool(((gk - k).abs() <= p.key_step(slots) * 0.5 * (1 + 1e-5) + 1e-6).all())
    assert bool(((gv - v).abs() <= p.value_step(slots) * 0.5 * (1 + 1e-5) + 1e-6).all())
    for layer in range(L):
        for dtype in (torch.float32, torch.bfloat16):
            out_k, out_v = torch.empty(H, 130, D, dtype=dtype), torch.empty(H, 130, D, dtype=dtype)
            rk, rv, valid = p.read(layer, out_k, out_v)
            assert rk is out_k and rv is out_v and int(valid.sum()) == 70
            tol = 0 if dtype == torch.float32 else 0.05
            assert torch.allclose(rk[:, slots].float(), gk[layer], atol=tol, rtol=tol)
            assert torch.allclose(rv[:, slots].float(), gv[layer], atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="needs out_k/out_v"):
        p.read(0)


@pytest.mark.parametrize("capacity", [130, 96, 20])  # a partial last group, whole groups only, one partial group
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_whole_partition_write_equals_the_general_path(capacity, dtype):
    """Every slot written in slot order takes the fast path; the same tokens written in another slot order take
    the general one (gather, overlay, scatter). Codes, scales and zero points must agree bit for bit, also over
    a partition that held other tokens before."""
    k, v = tokens(capacity, seed=3, spread=2.5)
    k, v = k.to(dtype), v.to(dtype)
    order = torch.randperm(capacity, generator=torch.Generator().manual_seed(0))
    fast, general = make("int8", capacity), make("int8", capacity)
    for p in (fast, general):
        old_k, old_v = tokens(capacity, seed=4, spread=9.0)
        p.write(torch.arange(capacity), old_k, old_v, torch.arange(capacity), 0)
    fast.write(torch.arange(capacity), k, v, torch.arange(capacity), 1)
    general.write(order, k[:, :, order], v[:, :, order], order, 1)
    for a, b in zip(fast.storage_tensors(), general.storage_tensors()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    gk, _ = fast.gather(torch.arange(capacity))
    assert bool(((gk - k.float()).abs() <= fast.key_step(torch.arange(capacity)) * 0.5 * (1 + 1e-5) + 1e-6).all())


def test_int8_partial_group_writes_keep_old_members_exact_when_in_range():
    p = make("int8", capacity=64, key_group=32)
    k, v = tokens(20, seed=1, spread=2.0)
    p.write(torch.arange(20), k, v, torch.arange(20), 1)
    codes, before = p.k.clone(), p.gather(torch.arange(20))[0]
    small = torch.zeros(L, H, 5, D)  # inside every channel's range: old codes and scales must not move
    p.write(torch.arange(20, 25), small, small, torch.arange(5), 2)
    assert torch.equal(p.k[:, :, :20], codes[:, :, :20])
    assert torch.equal(p.gather(torch.arange(20))[0], before)
    # a value outside the range re-quantizes the group; old members stay within half a (new) step
    big = torch.full((L, H, 1, D), 50.0)
    p.write(torch.tensor([25]), big, big, torch.tensor([0]), 3)
    after = p.gather(torch.arange(20))[0]
    old_err = (before - k).abs()
    assert bool(((after - k).abs() <= old_err + p.key_step(torch.arange(20)) * 0.5 * (1 + 1e-5) + 1e-5).all())
    assert torch.allclose(p.gather(torch.tensor([25]))[0], big, atol=float(p.key_step(torch.tensor([25])).max()))


def test_int8_vision_partition_is_at_most_055_of_fp16_scales_included():
    for head_dim in (64, 128):
        for capacity in (784, 196 * 8):
            kw = dict(capacity=capacity, n_layers=8, n_kv_heads=2, head_dim=head_dim)
            i8 = KVPartition(PartitionSpec("vision", dtype="int8", **kw)).nbytes()
            f16 = KVPartition(PartitionSpec("vision", dtype="fp16", **kw)).nbytes()
            assert i8["scales"] > 0 and i8["kv_bytes"] == i8["data"] + i8["scales"]
            assert i8["metadata"] == f16["metadata"] > 0  # counted separately
            assert i8["kv_bytes"] <= 0.55 * f16["kv_bytes"], (head_dim, capacity, i8, f16)


def _bad_writes(p: KVPartition):
    n = 4
    k, v = tokens(n)
    good = dict(slots=torch.arange(n), k=k, v=v, positions=torch.arange(n), frame_id=1)
    bad = {
        "short k": dict(k=k[:, :, :3]),
        "wrong layers": dict(k=torch.zeros(L + 1, H, n, D)),
        "int k": dict(k=k.to(torch.int32)),
        "duplicate slots": dict(slots=torch.tensor([1, 2, 2, 3])),
        "slot out of range": dict(slots=torch.tensor([0, 1, 2, p.capacity])),
        "negative slot": dict(slots=torch.tensor([-1, 1, 2, 3])),
        "int32 slots": dict(slots=torch.arange(n, dtype=torch.int32)),
        "nan in v": dict(v=torch.where(torch.arange(D) == 3, float("nan"), v)),
        "inf in k": dict(k=torch.where(torch.arange(D) == 0, float("inf"), k)),
        "huge for fp16": dict(k=k * 1e6),
        "float positions": dict(positions=torch.arange(n).float()),
        "positions length": dict(positions=torch.arange(n + 1)),
        "frame id str": dict(frame_id="7"),
        "frame id length": dict(frame_id=torch.arange(n + 1)),
        "count zero": dict(count=torch.zeros(n, dtype=torch.int32)),
        "count above int32": dict(count=torch.full((n,), 2**32 + 1, dtype=torch.int64)),
        "frame id above int64": dict(frame_id=2**63),
        "importance shape": dict(importance=torch.zeros(n, 2)),
        "tier": dict(tier=1000),
    }
    for name, change in bad.items():
        args = {**good, **change}
        kwargs = {key: args.pop(key) for key in ("count", "importance", "tier") if key in args}
        yield name, args, kwargs


@pytest.mark.parametrize("dtype", ["int8", "fp16", "bf16", "fp32"])
def test_write_is_all_or_nothing(dtype):
    p = make(dtype, capacity=40, key_group=8)
    k, v = tokens(30, seed=5)
    p.write(torch.arange(30), k, v, torch.arange(30), 0)
    p.add_importance(None, torch.rand(40))
    for name, args, kwargs in _bad_writes(p):
        if name == "huge for fp16" and dtype in ("bf16", "fp32"):
            continue  # fine for those storages
        before = snapshot(p)
        try:
            p.write(args["slots"], args["k"], args["v"], args["positions"], args["frame_id"], **kwargs)
        except ValueError:
            pass
        else:
            pytest.fail(f"{dtype} write with {name} did not raise")
        assert_unchanged(p, before)


def test_slots_metadata_and_verbs():
    p = make("int8", capacity=10, key_group=4)
    assert p.tokens_used == 0 and p.capacity == 10
    k, v = tokens(6)
    p.write(p.free_slots(6), k, v, torch.arange(6), 3, importance=torch.arange(6).float(),
            count=torch.tensor([1, 2, 1, 1, 1, 5], dtype=torch.int32), tier=1)
    assert p.tokens_used == 6 and p.count[:6].tolist() == [1, 2, 1, 1, 1, 5] and set(p.tier[:6].tolist()) == {1}
    assert p.free_slots(4).tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="asked for 5 free slots, 4 free"):
        p.free_slots(5)
    assert p.evict(torch.tensor([1, 3, 7])) == 2  # slot 7 was free
    assert p.tokens_used == 4 and p.free_slots(3).tolist() == [1, 3, 6]
    assert p.importance[1] == 0 and p.count[1] == 0
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[0, 1]] = True
    p.add_importance(mask, torch.full((10,), 2.0))  # slot 1 is invalid: unchanged
    assert p.importance[:3].tolist() == [2.0, 0.0, 2.0]
    p.add_importance(torch.tensor([2, 5]), torch.tensor([1.0, 1.0]), decay=0.5)
    assert p.importance[2].item() == pytest.approx(2.0) and p.importance[5].item() == pytest.approx(3.5)
    stats = p.stats()
    assert stats["tokens_used"] == 4 and stats["writes"] == 1 and stats["tokens_evicted"] == 2
    p.clear()
    assert p.tokens_used == 0 and p.stats()["tokens_evicted"] == 6


def test_overwriting_valid_slots_and_steady_state_allocates_no_storage():
    p = make("int8", capacity=96, key_group=32)
    ptrs = [t.data_ptr() for t in p.storage_tensors()]
    shapes = [t.shape for t in p.storage_tensors()]
    for step in range(30):
        k, v = tokens(24, seed=step)
        slots = (torch.arange(24) * 3 + step) % 96
        p.write(slots, k, v, torch.arange(24), step)
        gk, gv = p.gather(slots)
        assert bool(((gk - k).abs() <= p.key_step(slots) * 0.5 * (1 + 1e-5) + 1e-6).all())
        if step % 3 == 0:
            p.evict(slots[:8])
    assert [t.data_ptr() for t in p.storage_tensors()] == ptrs
    assert [t.shape for t in p.storage_tensors()] == shapes and p.capacity == 96


def test_read_validates_layer_and_buffers():
    p = make("fp16")
    with pytest.raises(ValueError, match="layer 3: expected 0 <= layer < 3"):
        p.read(3)
    with pytest.raises(ValueError, match="out_k"):
        p.read(0, torch.empty(H, 99, D), torch.empty(H, 99, D))


@pytest.mark.parametrize("dtype", ["int8", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("capacity", [100, 96])  # the last key group partial (100 = 3 x 32 + 4) or not
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_round_trip_is_what_a_whole_write_then_read_returns_without_touching_storage(dtype, capacity, compute):
    p = make(dtype, capacity)
    k, v = (t.to(compute) for t in tokens(capacity, seed=4, spread=3.0))
    before = snapshot(p)
    out = [torch.zeros(H, capacity, D, dtype=compute) for _ in range(4)]
    for layer in range(L):
        p.round_trip(k[layer], v[layer], out[0], out[1])
        assert_unchanged(p, before)
        p.write(torch.arange(capacity), k, v, torch.arange(capacity), 0)
        p.read(layer, out[2], out[3])
        assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3]), layer
        p.clear()
        before = snapshot(p)
    with pytest.raises(ValueError, match="round_trip"):
        p.round_trip(k[0, :, :10], v[0], out[0], out[1])
