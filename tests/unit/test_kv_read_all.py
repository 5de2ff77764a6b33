"""The hot path's whole-layer reads equal the per-layer ones bit for bit: KVPartition.read_all against read(),
PrefixBuffer.load_partitions against load(), load_states against per-layer state segments, and shift_reused with its
fp32 scratch against the plain copy-then-add it replaces."""

import pytest
import torch

from vla_node.kv.attention import Segment
from vla_node.kv.partition import KVPartition, PartitionSpec
from vla_node.kv.prefix import PrefixBuffer
from vla_node.runtime.vision_cache import shift_reused

L, KV, HD = 3, 2, 8


def filled(name: str, capacity: int, dtype: str, seed: int, key_group: int = 4) -> KVPartition:
    """A partition with every other slot written (random K/V), the rest never written."""
    g = torch.Generator().manual_seed(seed)
    p = KVPartition(PartitionSpec(name, capacity, dtype, L, KV, HD, key_group=key_group))
    slots = torch.arange(0, capacity, 2)
    n = slots.numel()
    k, v = torch.randn(L, KV, n, HD, generator=g) * 3, torch.randn(L, KV, n, HD, generator=g)
    p.write(slots, k, v, slots, 0)
    return p


@pytest.mark.parametrize("storage", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_read_all_equals_read_of_every_layer(storage, out_dtype):
    """Capacity 11 with key groups of 4: two whole groups and a partial one; outputs as views into a wider buffer."""
    p = filled("vision", 11, storage, seed=1)
    wide_k = torch.full((L, KV, 20, HD), float("nan"), dtype=out_dtype)
    wide_v = torch.full_like(wide_k, float("nan"))
    valid = p.read_all(wide_k[:, :, 5:16], wide_v[:, :, 5:16])
    assert valid is p.valid
    for layer in range(L):
        k, v = torch.zeros(KV, 11, HD, dtype=out_dtype), torch.zeros(KV, 11, HD, dtype=out_dtype)
        p.read(layer, k, v)
        assert torch.equal(wide_k[layer, :, 5:16], k) and torch.equal(wide_v[layer, :, 5:16], v)
    assert wide_k[:, :, :5].isnan().all() and wide_k[:, :, 16:].isnan().all()  # nothing outside the views


def test_read_all_through_a_staging_of_fewer_layers_than_the_partition():
    """A partition larger than read_all's 1 MiB staging goes through it a few layers at a time."""
    p = KVPartition(PartitionSpec("vision", 1024, "int8", 4, 2, 128, key_group=64))  # 1 MiB per layer in fp32
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(4, 2, 1024, 128, generator=g), torch.randn(4, 2, 1024, 128, generator=g)
    p.write(torch.arange(1024), k, v, torch.arange(1024), 0)
    assert p._deq.shape[0] == 1
    out_k = torch.zeros(4, 2, 1024, 128, dtype=torch.bfloat16)
    out_v = torch.zeros_like(out_k)
    p.read_all(out_k, out_v)
    for layer in range(4):
        k1, v1 = torch.zeros(2, 1024, 128, dtype=torch.bfloat16), torch.zeros(2, 1024, 128, dtype=torch.bfloat16)
        p.read(layer, k1, v1)
        assert torch.equal(out_k[layer], k1) and torch.equal(out_v[layer], v1)


def test_read_all_names_the_shape_it_expects():
    p = filled("text", 6, "int8", seed=3)
    with pytest.raises(ValueError, match=r"text.read_all: out_k .* expected a float tensor \[3, 2, 6, 8\]"):
        p.read_all(torch.zeros(2, KV, 6, HD), torch.zeros(L, KV, 6, HD))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_partitions_equals_load_of_the_read_segments(dtype):
    text, vision = filled("text", 6, "bf16", seed=4), filled("vision", 9, "int8", seed=5)
    bias = torch.log(torch.arange(1.0, 10.0))
    per_layer, whole = (PrefixBuffer(L, KV, HD, 15, 3, 4, dtype) for _ in range(2))

    def segments(layer):
        out = []
        for p, b in ((text, None), (vision, bias)):
            k, v = torch.zeros(KV, p.capacity, HD, dtype=dtype), torch.zeros(KV, p.capacity, HD, dtype=dtype)
            k, v, valid = p.read(layer, k, v)
            out.append(Segment(k, v, valid, b))
        return out

    per_layer.load(segments)
    whole.load_partitions([(text, None), (vision, bias)])
    for name in ("k", "v", "bias"):
        assert torch.equal(getattr(whole, name), getattr(per_layer, name)), name
    with pytest.raises(ValueError, match="prefix partitions hold 6 tokens: expected 15"):
        whole.load_partitions([(text, None)])


def test_load_states_then_attend_equals_attending_with_each_layers_states():
    g = torch.Generator().manual_seed(6)
    states = filled("action", 3, "fp32", seed=7)
    text = filled("text", 6, "bf16", seed=8)
    a, b = (PrefixBuffer(L, KV, HD, 6, 3, 4, torch.bfloat16) for _ in range(2))
    for buf in (a, b):
        buf.load_partitions([(text, None)])
        buf.set_block(torch.ones(4, 3, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool).tril(), 4)
    b.load_states(states)
    for layer in range(L):
        q = torch.randn(2 * KV, 4, HD, generator=g).bfloat16()
        k, v = torch.randn(KV, 4, HD, generator=g).bfloat16(), torch.randn(KV, 4, HD, generator=g).bfloat16()
        ring_k, ring_v = torch.zeros(KV, 3, HD, dtype=torch.bfloat16), torch.zeros(KV, 3, HD, dtype=torch.bfloat16)
        states.read(layer, ring_k, ring_v)
        assert torch.equal(b.attend(layer, q, k, v, None), a.attend(layer, q, k, v, Segment(ring_k, ring_v)))
    with pytest.raises(ValueError, match="state partition of 6 slots: expected 3"):
        b.load_states(text)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [0, 2])
def test_shift_reused_with_its_scratch_equals_copy_then_add(dtype, dim):
    """The move computed in fp32 and rounded once, with or without the scratch, is what out.copy_(old).add_(move)
    gives; the recomputed rows are the new ones."""
    g = torch.Generator().manual_seed(9)
    shape = [3, 4, 20, 8] if dim == 2 else [20, 16]
    rows, sample = torch.tensor([1, 4, 5, 9, 12, 17]), torch.tensor([4, 12])
    old = torch.randn(shape, generator=g).to(dtype)
    new = torch.randn([*shape[:dim], rows.numel(), *shape[dim + 1 :]], generator=g).to(dtype)
    at = torch.searchsorted(rows, sample)
    move = (new.index_select(dim, at).float() - old.index_select(dim, sample).float()).mean(dim, keepdim=True)
    expected = old.clone()
    expected.add_(move)
    expected.index_copy_(dim, rows, new)
    for at_given, scratch in ((None, None), (at, torch.zeros(old.numel() + 5))):
        out = torch.full_like(old, float("nan"))
        shift_reused(out, old, new, rows, sample, dim, at_given, scratch)
        assert torch.equal(out, expected)
