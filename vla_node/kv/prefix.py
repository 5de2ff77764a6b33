"""The action tick's prefix, read once per commit instead of once per tick.

Between two commits of the text or the vision memory, every action tick attends to the same text and vision
K/V. Reading them per tick means a read (and INT8 dequantization) and a partial attention per partition, per
layer, per tick: on a CPU that Python and memory traffic costs as much as a third of the tick. PrefixBuffer
copies the prefix partitions (already dequantized by their `read`) once into one buffer per layer, with room
behind it for the state ring and the block being decoded; a tick then attends with one buffer_attention call
per layer.

Layout per layer, over `total` = P + S + N slots:
    [0, P)          the prefix segments, in order (text capacity, then every vision partition's capacity)
    [P, P + S)      the state ring, copied per layer by the block (S slots, fp32 or converted)
    [P + S, total)  the block being decoded (up to N tokens)
bias [N, total] fp32: 0 (or a segment's log(count)) where a row may attend, -inf where it may not.
A block of n < N tokens attends over every slot, those past it masked (-inf): a slice of the buffer's K and V keeps
the whole buffer's stride between kv heads, and torch's batched matmul copies such an operand before multiplying
(`small`'s tick, bf16 on a Zen 5 EPYC, alternating in one process: 0.95-0.96x the sliced form's time, the same
logits).
`fused`, `kernel`: buffer_attention's (torch's SDPA where it pays, see runtime/policy.fused_attention_pays; a fused
CPU kernel, backends/cpu_kernels.attention).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from vla_node.kv.attention import AttentionKernel, Segment, buffer_attention, fill_bias
from vla_node.kv.partition import KVPartition


class PrefixBuffer:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, prefix_tokens: int, state_slots: int,
                 block_tokens: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 fused: bool = False, kernel: AttentionKernel | None = None) -> None:
        self.prefix_tokens, self.state_slots, self.block_tokens = prefix_tokens, state_slots, block_tokens
        self.fused, self.kernel = fused, kernel
        total = prefix_tokens + state_slots + block_tokens
        self.k = torch.zeros(n_layers, n_kv_heads, total, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.bias = torch.zeros(block_tokens, total, dtype=torch.float32, device=device)
        self._block = 0  # tokens in the current block (set_block)
        self._may_be_empty = True  # some row of the current block may attend to nothing

    def load(self, segments: Callable[[int], Sequence[Segment]]) -> None:
        """Copy every layer's prefix segments (k, v [KV, L_i, hd]; mask and bias [L_i] or None) into [0, P)."""
        for layer in range(self.k.shape[0]):
            offset = 0
            for seg in segments(layer):
                length = seg.k.shape[1]
                end = offset + length
                if end > self.prefix_tokens:
                    raise ValueError(f"prefix segments hold more than the {self.prefix_tokens} tokens allocated")
                self.k[layer, :, offset:end].copy_(seg.k)
                self.v[layer, :, offset:end].copy_(seg.v)
                if layer == 0:  # validity and biases are per slot, the same for every layer
                    for name, t in (("mask", seg.mask), ("bias", seg.bias)):
                        if t is not None and t.dim() != 1:
                            raise ValueError(f"prefix segment {name} of shape {list(t.shape)}: expected [{length}]")
                    fill_bias(self.bias[:, offset:end], seg.mask, seg.bias)
                offset = end
            if offset != self.prefix_tokens:
                raise ValueError(f"prefix segments hold {offset} tokens: expected {self.prefix_tokens}")

    def load_partitions(self, parts: Sequence[tuple[KVPartition, torch.Tensor | None]]) -> None:
        """load() from whole partitions, every layer at once: each (partition, bias [capacity] or None) in order into
        [0, P), its K/V dequantized or converted straight into the buffer (KVPartition.read_all), its slots masked by
        its validity. The same contents as load() over the segments of the partitions' read()."""
        offset = 0
        for partition, bias in parts:
            end = offset + partition.capacity
            if end > self.prefix_tokens:
                raise ValueError(f"prefix partitions hold more than the {self.prefix_tokens} tokens allocated")
            valid = partition.read_all(self.k[:, :, offset:end], self.v[:, :, offset:end])
            fill_bias(self.bias[:, offset:end], valid, bias)
            offset = end
        if offset != self.prefix_tokens:
            raise ValueError(f"prefix partitions hold {offset} tokens: expected {self.prefix_tokens}")

    def load_states(self, partition: KVPartition) -> None:
        """The state ring [P, P + S) of every layer at once from `partition` (its S slots, converted or dequantized as
        its read() does), for a block that then attends with states=None."""
        p, s = self.prefix_tokens, self.state_slots
        if partition.capacity != s:
            raise ValueError(f"state partition of {partition.capacity} slots: expected {s}")
        partition.read_all(self.k[:, :, p : p + s], self.v[:, :, p : p + s])

    @property
    def block(self) -> int:
        """The current block's rows (set_block)."""
        return self._block

    def set_block(self, state_mask: torch.Tensor | None, block_mask: torch.Tensor | None, n: int) -> None:
        """The next block's n rows: state_mask bool [n, S] (None = no state visible), block_mask bool [n, n]
        (None = all)."""
        if not 0 < n <= self.block_tokens:
            raise ValueError(f"block of {n} tokens: expected 1..{self.block_tokens}")
        p, s = self.prefix_tokens, self.state_slots
        self._block = n
        states = self.bias[:n, p : p + s]
        if state_mask is None:
            states.fill_(float("-inf"))
        else:
            fill_bias(states, state_mask, None)
        fill_bias(self.bias[:n, p + s : p + s + n], block_mask, None)
        self.bias[:n, p + s + n :].fill_(float("-inf"))  # the slots past the block (module docstring)
        self._may_be_empty = bool(torch.isneginf(self.bias[:n, : p + s + n]).all(dim=-1).any())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               states: Segment | None) -> torch.Tensor:
        """q [H, n, hd] of the block over the prefix, the states (their k, v [KV, S, hd], copied in for this layer;
        None: the state slots as they are, from load_states or not seen: set_block's state_mask says) and the
        block's own k, v [KV, n, hd]. Returns [H, n, hd]."""
        n = self._block
        if q.shape[1] != n or k.shape[1] != n:
            raise ValueError(f"block of {q.shape[1]} queries, {k.shape[1]} keys: set_block said {n}")
        p, s = self.prefix_tokens, self.state_slots
        if states is not None:
            self.k[layer, :, p : p + s].copy_(states.k)
            self.v[layer, :, p : p + s].copy_(states.v)
        self.k[layer, :, p + s : p + s + n].copy_(k)
        self.v[layer, :, p + s : p + s + n].copy_(v)
        return buffer_attention(q, self.k[layer], self.v[layer], self.bias[:n], check_empty=self._may_be_empty,
                                fused=self.fused, kernel=self.kernel)  # every slot, those past the block masked
