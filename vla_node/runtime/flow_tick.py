"""The flow head's action tick over the multimodal KV cache (MultiRatePolicy.action_tick with action_head = "flow").

    1. flow_state = 'prefix': the new state token through the decoder (its K/V, attending to text, vision and
       itself), as the bins head's tick computes it; 'suffix': the expert's own state token, nothing in the decoder
    2. N Euler steps of the action expert: each step's block (the suffix state, then H action tokens) runs the
       expert's layers, every layer's queries attending over that decoder layer's cached text, vision and state K/V
       (read as the bins tick reads them: through the prefix buffer, INT8 dequantized once per commit, or the
       partitions' segments) and over the block's own K/V. Nothing is written to the partitions
    3. the policy commits the state token into its ring slot (prefix), as the bins tick does

The noise is tick_noise(noise_seed, tick index): a replay draws the same chunk. With a ChunkGuide (real-time
chunking) every step is guided (flow.py): its vector-Jacobian product needs autograd, which runs over a dense copy
of the context taken once per tick (the fast paths write their block into shared buffers, which autograd cannot
keep).
"""

from __future__ import annotations

from typing import Callable

import torch

from vla_node.kv.attention import Segment, buffer_attention, fill_bias
from vla_node.model.action_head import ActionChunk, check_state
from vla_node.model.expert import block_mask, block_positions
from vla_node.model.flow import ChunkGuide, check_steps, integrate, tick_noise
from vla_node.runtime.stages import Check, StageAborted, span


class FlowTick:
    """The flow tick's buffers and steps; `policy` (the MultiRatePolicy that builds it) owns the cache it reads."""

    def __init__(self, policy) -> None:
        self.policy = policy
        c = self.config = policy.config
        n = c.flow_tokens
        self.positions = block_positions(c)  # [n]
        self.block_mask = block_mask(c)  # [n, n] bool or None (all)
        self.state_mask = torch.zeros(n, c.state_slots, dtype=torch.bool)  # the states every block row sees
        self.noise = torch.zeros(c.action_horizon, c.action_dims)
        self.generator = torch.Generator()
        policy.model.expert.requires_grad_(False)  # guidance differentiates the field w.r.t. x only
        # guidance backpropagates through the expert: its linear layers must be torch's own (backends/loading.py
        # keeps them so; fbgemm's fp16 and oneDNN's packed kernels have no backward and would give a wrong gradient)
        self.layer_types = sorted({type(m).__name__ for m in policy.model.expert.modules()
                                   if "Linear" in type(m).__name__ and type(m) is not torch.nn.Linear})

    def tick(self, state, check: Check | None, steps: int | None, guide: ChunkGuide | None
             ) -> tuple[ActionChunk, tuple | None]:
        """The chunk, and what the policy's commit writes: (slot, the state's embedding [1, hidden], its K and V
        [L, KV, 1, hd], its position [1]) for a prefix state, None for a suffix state (nothing in the ring). Every
        write is checked before this returns."""
        p, c, m = self.policy, self.config, self.policy.model
        steps = check_steps(c.flow_steps if steps is None else steps)  # before any work
        if guide is not None and self.layer_types:
            raise ValueError(f"real-time chunking's guidance needs the expert's plain linear layers (torch.nn.Linear), "
                             f"got {self.layer_types}: load the model with backends.loading.load_model")
        if guide is not None and tuple(guide.target.shape) != (c.action_horizon, c.action_dims):
            raise ValueError(f"ChunkGuide target of shape {list(guide.target.shape)}: expected "
                             f"[{c.action_horizon}, {c.action_dims}]")
        s = check_state(state, c.state_dim).to(p.device, p.dtype)
        slot = p.state_count % c.state_slots
        prefix_state = c.flow_state == "prefix"
        first = 1 / (steps + 1) if prefix_state else 0.0  # the state's decoder pass: about one step's cost
        if prefix_state:
            x_state = m.embed_state(s)  # [1, hidden]
            position = torch.tensor([c.state_base + slot])
            k_s, v_s = p._stage_k[:, :, -1:], p._stage_v[:, :, -1:]  # [L, KV, 1, hd]
            p._others.copy_(p.action.valid)
            p._others[slot] = False  # the slot being replaced in the ring
            if p._prefix is not None:
                p._prefix.set_block(None, None, 1)
                attend = p._over_prefix(states=False)
            else:
                attend = p._over_segments(p._vision_prefix, None)
            p._run_block(x_state, position, attend, k_s, v_s, span(check, 0.0, first), output=False)
            state_x = None
        else:
            state_x = m.expert.embed_state(s)  # [1, expert width]
            k_s = v_s = position = None
        attend = self._dense_attention(slot, k_s, v_s) if guide is not None else self._attention(slot, k_s, v_s)
        cos, sin = m.decoder.rope(self.positions, p.dtype)

        def velocity(x: torch.Tensor, tau: float) -> torch.Tensor:
            block = m.expert.block(x, torch.tensor(tau, dtype=torch.float32), state_x)  # [n, expert width]
            if guide is not None:  # autograd (outside inference mode) needs tables of its own
                cos_b, sin_b = cos.clone(), sin.clone()
            else:
                cos_b, sin_b = cos, sin
            hidden = self._run_expert(block, cos_b, sin_b, attend)
            return m.expert.velocity(hidden)

        noise = tick_noise(c.action_horizon, c.action_dims, p.noise_seed, p.state_count, self.generator, self.noise,
                           c.flow_noise_scale)
        chunk = integrate(velocity, noise.to(p.device, p.dtype), steps, guide, span(check, first, 1.0),
                          lambda i: StageAborted(f"stopped before denoising step {i}"))
        result = ActionChunk(chunk.float().cpu().numpy(), None, None, steps)
        if not prefix_state:
            return result, None
        p.action.check_tokens(k_s, v_s, position, 0)
        return result, (slot, x_state, k_s, v_s, position)

    # --- the expert's attention -------------------------------------------------------------------------
    def _run_expert(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Callable) -> torch.Tensor:
        """The expert's block x [n, w] through its layers, attend(layer, q, k, v) -> [heads, n, hd]."""
        for i, layer in enumerate(self.policy.model.expert.layers):
            q, k, v = layer.project_qkv(x, cos, sin)
            x = layer.finish(x, attend(i, q, k, v))
        return x

    def _states_seen(self, slot: int) -> torch.Tensor:
        """[n, S] bool: the stored states other than `slot`, and the new state in `slot` (prefix) or none (suffix)."""
        p = self.policy
        if self.config.flow_state == "prefix":
            self.state_mask.copy_(p._others.expand_as(self.state_mask))
            self.state_mask[:, slot] = True
        return self.state_mask

    def _attention(self, slot: int, k_s: torch.Tensor | None, v_s: torch.Tensor | None) -> Callable:
        """The fast path: the prefix buffer (the new state's K/V into its ring slot there) or the segments."""
        p = self.policy
        n = self.config.flow_tokens
        prefix_state = self.config.flow_state == "prefix"
        if p._prefix is not None:
            buffer = p._prefix
            if prefix_state:
                buffer.load_states(p.action)
                at = buffer.prefix_tokens + slot
                buffer.k[:, :, at].copy_(k_s[:, :, 0])
                buffer.v[:, :, at].copy_(v_s[:, :, 0])
                buffer.set_block(self._states_seen(slot), self.block_mask, n)
            else:
                buffer.set_block(None, self.block_mask, n)
            return lambda layer, q, k, v: buffer.attend(layer, q, k, v, None)
        importance = p._importance if p._track_importance else None
        return p._over_segments(lambda layer: self._segments(layer, k_s, v_s), self.block_mask, importance)

    def _segments(self, layer: int, k_s: torch.Tensor | None, v_s: torch.Tensor | None) -> list[Segment]:
        """The context's segments of one layer: text, vision, and (prefix) the other stored states and the new one."""
        p = self.policy
        segments = p._vision_prefix(layer)
        if k_s is not None:
            old = p._segment(p.action, layer)
            segments += [Segment(old.k, old.v, p._others), Segment(k_s[layer], v_s[layer], None)]
        return segments

    def _dense_attention(self, slot: int, k_s: torch.Tensor | None, v_s: torch.Tensor | None) -> Callable:
        """The guided path: the context copied once into dense K/V [L, KV, S, hd] and a bias [n, S + n] (outside
        inference mode, so that autograd may keep them), each layer's attention one buffer_attention over the
        context and the block. Each layer is copied as soon as it is read: a partition stored in another dtype reads
        every layer into the same conversion buffers."""
        p, c = self.policy, self.config
        n = c.flow_tokens
        with torch.inference_mode(False):
            keys, values = [], []
            for layer in range(c.num_layers):
                segments = self._segments(layer, k_s, v_s)
                keys.append(torch.cat([s.k for s in segments], 1))  # [KV, S, hd]
                values.append(torch.cat([s.v for s in segments], 1))
            bias = torch.cat([fill_bias(torch.zeros(n, s.k.shape[1], device=p.device), s.mask, s.bias)
                              for s in segments] + [self._block_bias(n)], 1)  # [n, S + n]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return buffer_attention(q, torch.cat([keys[layer], k], 1), torch.cat([values[layer], v], 1), bias)

        return attend

    def _block_bias(self, n: int) -> torch.Tensor:
        bias = torch.zeros(n, n, device=self.policy.device)
        return bias if self.block_mask is None else bias.masked_fill_(~self.block_mask.to(bias.device), float("-inf"))
