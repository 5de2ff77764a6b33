"""The tick's prefix buffer: one attention call over prefix | states | block equals the dense oracle."""

import pytest
import torch

from helpers.oracles import concat_segments
from vla_node.kv.attention import Segment, dense_attention
from vla_node.kv.prefix import PrefixBuffer


def _kv(g, n_kv, length, d):
    return torch.randn(n_kv, length, d, generator=g), torch.randn(n_kv, length, d, generator=g)


@pytest.mark.parametrize("group", [1, 4])
def test_prefix_states_and_block_equal_dense(group):
    g = torch.Generator().manual_seed(0)
    n_kv, d, states, n = 2, 8, 3, 5
    text = Segment(*_kv(g, n_kv, 6, d), torch.tensor([True] * 4 + [False] * 2))
    vision = Segment(*_kv(g, n_kv, 7, d), torch.rand(7, generator=g) < 0.7, torch.log(torch.arange(1.0, 8.0)))
    buf = PrefixBuffer(2, n_kv, d, prefix_tokens=13, state_slots=states, block_tokens=6)
    buf.load(lambda layer: [text, vision])
    ring = Segment(*_kv(g, n_kv, states, d))
    state_mask = torch.rand(n, states, generator=g) < 0.5
    block_mask = torch.ones(n, n, dtype=torch.bool).tril()
    buf.set_block(state_mask, block_mask, n)
    q = torch.randn(n_kv * group, n, d, generator=g)
    k, v = _kv(g, n_kv, n, d)
    out = buf.attend(1, q, k, v, ring)
    whole = concat_segments([text, vision, Segment(ring.k, ring.v, state_mask), Segment(k, v, block_mask)], n)
    assert (out - dense_attention(q, whole.k, whole.v, whole.mask, whole.bias)).abs().max().item() <= 1e-5
    # no states visible: the ring's slots are masked whatever they hold
    buf.set_block(None, block_mask, n)
    out = buf.attend(1, q, k, v, None)
    whole = concat_segments([text, vision, Segment(k, v, block_mask)], n)
    assert (out - dense_attention(q, whole.k, whole.v, whole.mask, whole.bias)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("fused", [False, True])
def test_a_smaller_block_after_a_larger_one_masks_the_slots_past_it(fused):
    """A block attends over every slot of the buffer (no slice of K and V to copy), so the slots past a block of n <
    N tokens hold the K/V a larger block left there: they are masked, and the result is the dense oracle's over the
    prefix and the block alone."""
    g = torch.Generator().manual_seed(1)
    n_kv, d, states = 2, 8, 2
    text = Segment(*_kv(g, n_kv, 5, d), torch.tensor([True] * 3 + [False] * 2))
    buf = PrefixBuffer(1, n_kv, d, prefix_tokens=5, state_slots=states, block_tokens=6, fused=fused)
    buf.load(lambda layer: [text])
    buf.set_block(None, None, 6)
    big_k, big_v = _kv(g, n_kv, 6, d)
    buf.attend(0, torch.randn(n_kv, 6, d, generator=g), big_k * 100, big_v * 100, None)  # fills every block slot
    for n in (3, 1):
        block_mask = torch.ones(n, n, dtype=torch.bool).tril()
        buf.set_block(None, block_mask, n)
        q = torch.randn(n_kv * 2, n, d, generator=g)
        k, v = _kv(g, n_kv, n, d)
        whole = concat_segments([text, Segment(k, v, block_mask)], n)
        oracle = dense_attention(q, whole.k, whole.v, whole.mask, whole.bias)
        assert (buf.attend(0, q, k, v, None) - oracle).abs().max().item() <= 1e-5


def test_bad_layouts_name_what_was_expected():
    buf = PrefixBuffer(1, 1, 4, prefix_tokens=3, state_slots=1, block_tokens=2)
    seg = Segment(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="more than the 3 tokens"):
        buf.load(lambda layer: [seg])
    with pytest.raises(ValueError, match="hold 2 tokens: expected 3"):
        buf.load(lambda layer: [Segment(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))])
    rows = Segment(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask of shape \[2, 3\]: expected \[3\]"):
        buf.load(lambda layer: [rows])
    with pytest.raises(ValueError, match="block of 3 tokens: expected 1..2"):
        buf.set_block(None, None, 3)
