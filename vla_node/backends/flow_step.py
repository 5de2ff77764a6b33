"""The flow head's action tick as a pure, static-shape step: the state through the decoder, then a fixed number of
Euler steps of the action expert over the cached prefix, unrolled in the graph (steps.py's rules: no `.item()`, no
branch on a tensor value, no in-place write to an input; validity is an additive fp32 bias).

    flow_state 'prefix'  rows [new state | S - 1 stored states] through the decoder over the prefix (text | vision),
                         K/V only, exactly as TickStep's fused form computes them (each row sees the valid prefix
                         and itself); then the expert's block attends over [prefix | those S states | itself]
    flow_state 'suffix'  no decoder rows: the state vector is embedded by the expert (its state token heads the
                         block) and the block attends over [prefix | itself]

Each Euler step i of N (tau = i / N, dt = 1 / N) embeds the noisy chunk with its flow time, runs the expert's layers
(every layer's queries over that decoder layer's context K/V and the block's own) and adds dt times the velocity.
The noise [H, D] is an input: the host draws it with tick_noise(noise_seed, tick), as the eager policy draws it, so
both integrate from the same point. Equal, to float rounding, to MultiRatePolicy's flow tick (runtime/flow_tick.py)
with CacheConfig.exact().

Real-time chunking's guidance needs a vector-Jacobian product per step: it is not exported (the engine policy runs a
guided tick on the eager flow tick).
"""

from __future__ import annotations

import torch

from vla_node.backends.steps import DecoderBlockStep, block_attention, tick_bias
from vla_node.model.config import ModelConfig
from vla_node.model.expert import block_mask, block_positions
from vla_node.model.vla import VLA

PREFIX_INPUTS = ("state_x", "positions", "prefix_k", "prefix_v", "bias", "noise", "expert_bias")
SUFFIX_INPUTS = ("state", "prefix_k", "prefix_v", "noise", "expert_bias")


def flow_inputs(c: ModelConfig) -> tuple[str, ...]:
    """The flow tick step's input names, in call order, for model `c`'s flow_state."""
    return PREFIX_INPUTS if c.flow_state == "prefix" else SUFFIX_INPUTS


def flow_outputs(c: ModelConfig) -> tuple[str, ...]:
    """The flow tick step's output names: the chunk, and the state rows' K/V where the state is a prefix token."""
    return ("chunk", "state_k", "state_v") if c.flow_state == "prefix" else ("chunk",)


class FlowTickStep(DecoderBlockStep):
    """The flow tick with `steps` Euler steps (static: unrolled), for model.config.flow_state.

    'prefix' inputs: state_x [S, hidden] (the new state's embedding, then the stored states' in ring order after the
    new slot; invalid ones any finite value), positions [S] (int64, state_positions), prefix_k / prefix_v
    [L, KV, P, hd] (text | vision), bias [S, P + S] (state_bias), noise [H, D] fp32, expert_bias
    [n, P + S + n] (flow_bias). Outputs: chunk [H, D] fp32, state_k / state_v [L, KV, S, hd] (the new state's row
    first, as TickStep).

    'suffix' inputs: state [state_dim], prefix_k / prefix_v [L, KV, P, hd], noise [H, D] fp32, expert_bias
    [n, P + n]. Output: chunk [H, D] fp32.

    n = config.flow_tokens (the expert's block), positions block_positions(config)."""

    def __init__(self, model: VLA, steps: int) -> None:
        super().__init__(model)
        if model.expert is None:
            raise ValueError(f"model.action_head {model.config.action_head!r}: FlowTickStep needs the flow head")
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            raise ValueError(f"denoising steps {steps!r}: expected an integer >= 1")
        self.steps = steps
        self.expert = model.expert
        self.prefix_state = model.config.flow_state == "prefix"
        # tau_i = i / N as the eager integrator computes it (a double, then fp32)
        self.register_buffer("taus", torch.tensor([i / steps for i in range(steps)], dtype=torch.float32),
                             persistent=False)
        self.register_buffer("block_positions", block_positions(model.config), persistent=False)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The inputs of flow_inputs(config), in that order (see the class)."""
        return self._prefix_tick(*inputs) if self.prefix_state else self._suffix_tick(*inputs)

    def _prefix_tick(self, state_x: torch.Tensor, positions: torch.Tensor, prefix_k: torch.Tensor,
                     prefix_v: torch.Tensor, bias: torch.Tensor, noise: torch.Tensor, expert_bias: torch.Tensor):
        _, state_k, state_v = self.run_block(state_x, positions, prefix_k, prefix_v, bias, output=False)
        context_k = torch.cat([prefix_k, state_k], dim=2)  # [L, KV, P, hd] | [L, KV, S, hd] -> [L, KV, P + S, hd]
        context_v = torch.cat([prefix_v, state_v], dim=2)
        chunk = self.integrate(None, noise, context_k, context_v, expert_bias)
        return chunk, state_k, state_v

    def _suffix_tick(self, state: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, noise: torch.Tensor,
                     expert_bias: torch.Tensor):
        state_x = self.expert.embed_state(state.to(prefix_k.dtype))  # [state_dim] -> [1, expert width]
        return (self.integrate(state_x, noise, prefix_k, prefix_v, expert_bias),)

    def integrate(self, state_x: torch.Tensor | None, noise: torch.Tensor, context_k: torch.Tensor,
                  context_v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """`steps` Euler steps from noise [H, D]: x += dt * v(x, tau_i). context_k / context_v [L, KV, C, hd], bias
        [n, C + n]; state_x [1, w] (the suffix state token) or None. Returns the chunk [H, D] fp32."""
        dtype = context_k.dtype
        cos, sin = self.rope(self.block_positions, dtype)
        dt = 1.0 / self.steps
        x = noise.to(dtype)
        for i in range(self.steps):
            block = self.expert.block(x, self.taus[i], state_x)  # [n, w]
            x = x + dt * self.expert.velocity(self.run_expert(block, cos, sin, context_k, context_v, bias))
        return x.float()

    def run_expert(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                   context_v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The expert's block x [n, w] through its layers, each attending over its decoder layer's context and the
        block's own K/V. Returns the block's final hidden states [n, w]."""
        for i, layer in enumerate(self.expert.layers):
            q, k, v = layer.project_qkv(x, cos, sin)
            keys = torch.cat([context_k[i], k], dim=1)  # [KV, C, hd] | [KV, n, hd] -> [KV, C + n, hd]
            values = torch.cat([context_v[i], v], dim=1)
            x = layer.finish(x, block_attention(q, keys, values, bias))
        return x


# --- host side ----------------------------------------------------------------------------------------------
def state_positions(c: ModelConfig, slot: int) -> torch.Tensor:
    """The state rows' positions [S] (int64): the new state's ring slot, then the other slots in ring order after it
    (slot + 1, ..., slot + S - 1 mod S); tick_positions without the action queries."""
    S = c.state_slots
    return torch.tensor([c.state_base + (slot + i) % S for i in range(S)])


def state_bias(prefix_bias: torch.Tensor, stored_valid: torch.Tensor) -> torch.Tensor:
    """The state rows' bias [S, P + S] ('prefix'; host side, once per tick): each row sees the valid prefix slots
    (prefix_bias [P]) and itself, as in TickStep's fused form (tick_bias without queries); stored_valid [S - 1] is
    not needed by the rows themselves (an invalid row's K/V are masked by flow_bias) but fixes S."""
    return tick_bias(prefix_bias, stored_valid, 0)


def flow_bias(c: ModelConfig, prefix_bias: torch.Tensor, stored_valid: torch.Tensor | None) -> torch.Tensor:
    """The expert block's bias (host side, once per tick): [n, P + S + n] with the state rows (stored_valid [S - 1]
    bool: the stored states, in state_x's order, that are valid; the new state always is), [n, P + n] without
    (stored_valid None: flow_state 'suffix'). Every row sees the valid prefix slots (prefix_bias [P], 0 or -inf) and
    the states; within the block, block_mask(c) (a suffix state token sees only itself)."""
    n, p = c.flow_tokens, prefix_bias.shape[0]
    own = block_mask(c)
    allowed_own = torch.ones(n, n, dtype=torch.bool) if own is None else own
    states = 0 if stored_valid is None else stored_valid.shape[0] + 1
    if stored_valid is not None and states != c.state_slots:
        raise ValueError(f"stored_valid of {stored_valid.shape[0]} slots: expected {c.state_slots - 1} (the state "
                         "slots but the new one)")
    bias = torch.zeros(n, p + states + n, dtype=torch.float32)
    bias[:, :p] = prefix_bias
    if stored_valid is not None:
        bias[:, p + 1 : p + states].masked_fill_(~stored_valid.to(torch.bool), float("-inf"))
    bias[:, p + states :].masked_fill_(~allowed_own, float("-inf"))
    return bias
