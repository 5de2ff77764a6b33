"""The eager policy's action tick run by a compiled engine of TickStep (backends/tick_engine.py: AOTInductor).

MultiRatePolicy keeps its books (partitions, ring, reuse, the tick's prefix buffer); only the tick's block changes
hands: instead of the decoder's layers op by op in Python, one engine call runs TickStep's fused block (the new
state | the other S - 1 stored states, recomputed | the H*D queries) over the prefix buffer's text and vision K/V,
read in place (views, no copy). What the eager tick returns is returned the same: the queries' bins (logits into the
policy's buffer), the new state's K/V and, when the stored states are stale (a commit since the last tick), the
valid ones' recomputed K/V for the commit. When they are not stale the recomputed rows equal the stored ones to
float rounding and are not written. A budget check runs before the call (the block is one call: no check inside).

Covers the bins head with parallel decoding over the prefix buffer (cache.tick_prefix, no importance tracking):
`unsupported` says why another configuration cannot use it.
"""

from __future__ import annotations

import numpy as np
import torch

from vla_node.backends.engine import Engine
from vla_node.backends.engine_set import other_slots, tick_positions
from vla_node.backends.steps import tick_bias
from vla_node.backends.tick_engine import INPUTS, OUTPUTS
from vla_node.runtime.stages import Check, stop


def unsupported(policy) -> str | None:
    """Why `policy` (a MultiRatePolicy) cannot run its tick as a compiled TickStep (None: it can)."""
    c = policy.config
    checks = [(policy.device.type == "cpu", f"device {policy.device} (the tick is compiled for the CPU)"),
              (c.action_head == "bins", f"action_head = {c.action_head!r} (the compiled tick is the bins head's)"),
              (c.action_decode == "parallel", f"action_decode = {c.action_decode!r} (expected parallel)"),
              (policy._prefix is not None, "no tick prefix buffer (cache.tick_prefix = false, or a vision policy "
                                           "that tracks attention: h2o, quota, tiered)")]
    failed = [why for ok, why in checks if not ok]
    return None if not failed else "; ".join(failed)


def tick_buffers(policy) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The engine's inputs and outputs as `policy` binds them: the prefix K/V are views of its prefix buffer's
    [0, P) (their strides are the buffer's), the rest its own buffers at the compute dtype (bias and logits fp32)."""
    c, prefix, dtype = policy.config, policy._prefix, policy.dtype
    P, S, Q = prefix.prefix_tokens, c.state_slots, c.action_tokens
    L, KV, hd = c.num_layers, c.num_kv_heads, c.head_dim
    inputs = {"state_x": torch.zeros(S, c.hidden_size, dtype=dtype), "positions": torch.zeros(S + Q, dtype=torch.long),
              "prefix_k": prefix.k[:, :, :P], "prefix_v": prefix.v[:, :, :P],  # [L, KV, P + S + N, hd] -> [.., P, ..]
              "bias": torch.zeros(S + Q, P + S + Q)}
    outputs = {"logits": torch.zeros(Q, c.vocab_size), "state_k": torch.zeros(L, KV, S, hd, dtype=dtype),
               "state_v": torch.zeros(L, KV, S, hd, dtype=dtype)}
    return inputs, outputs


class CompiledTick:
    """TickStep's inputs filled from `policy`'s books, the engine run, its outputs returned as _decode_tick's."""

    def __init__(self, policy, engine: Engine) -> None:
        why = unsupported(policy)
        if why is not None:
            raise ValueError(f"a compiled tick does not cover {why}: run the eager tick")
        if set(engine.input_names) != set(INPUTS) or set(engine.output_names) != set(OUTPUTS):
            raise ValueError(f"engine of inputs {engine.input_names} and outputs {engine.output_names}: expected "
                             f"TickStep's {INPUTS} and {OUTPUTS}")
        self.policy, self.engine = policy, engine
        c = policy.config
        S = c.state_slots
        with policy.device:
            self.inputs, self.outputs = tick_buffers(policy)
            # per ring slot of the new state: the other slots in the block's order, the block's positions
            self.others = [other_slots(S, slot) for slot in range(S)]
            self.positions = [tick_positions(c, slot) for slot in range(S)]
            self.rows = torch.arange(1, S)  # the other states' rows in the block

    def tick(self, x_state: torch.Tensor, slot: int, stale: bool, check: Check | None):
        """x_state [1, hidden]: the new state's embedding, for ring slot `slot`. Returns (bins [H, D], the new
        state's K and V [L, KV, 1, hd], the other valid states' (slots, K, V, positions) when `stale`, else None)."""
        p, c = self.policy, self.policy.config
        inputs, outputs, others = self.inputs, self.outputs, self.others[slot]
        valid = p._others.index_select(0, others)  # [S - 1] the other slots holding a state
        inputs["state_x"][0].copy_(x_state[0])
        inputs["state_x"][1:].copy_(p._state_embeds.index_select(0, others))
        inputs["positions"].copy_(self.positions[slot])
        inputs["bias"].copy_(tick_bias(p._prefix.bias[0, : p._prefix.prefix_tokens], valid, c.action_tokens))
        stop(check, 0.0, "stopped before the compiled tick")
        self.engine.run(inputs, outputs)
        p._logits.copy_(outputs["logits"])
        bins: np.ndarray = p.bins.bins_from_logits(p._logits).cpu().numpy()
        k, v = outputs["state_k"], outputs["state_v"]
        refreshed = None
        if stale:
            at, kept = self.rows[valid], others[valid]
            refreshed = (kept, k[:, :, at], v[:, :, at], c.state_base + kept)
        return bins, k[:, :, :1], v[:, :, :1], refreshed
