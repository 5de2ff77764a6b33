"""A partial decoder refresh of the current frame as a pure, static-shape step: FrameTokenCache.run in the node's
default configuration (attend_all, no drift gates, no layer budget), optionally with the action tick's rows
decoded in the same pass.

The host picks the rows to recompute (the gate's tokens, plus with shared drift the evenly spaced sample
`shared_sample` picks: without drift gates they are the same at every layer) and passes them as fixed-size index
tensors (`decoder_rows`). Inside the step, at every layer below the last:

  - every frame token's K/V is re-projected from its current input (and the tick rows');
  - the recomputed rows' queries are computed and written over the cached ones;
  - attention: with shared drift (samples > 0) the recomputed rows alone attend (text | the frame's K/V) and the
    reused tokens' attention update moves by the sample's mean change; without (samples = 0) every token attends
    with its query as now cached (the attend_all branch);
  - the MLP for the recomputed rows; the reused tokens' MLP update kept, or moved by the sample's mean change.

The last layer computes only the frame's K/V (and finishes the tick rows). The token axis carries one scratch row
(index T) that the padding of `rows` writes into; it is sliced off. The tick rows [new state | S - 1 stored states |
H*D queries] (TickStep's layout) attend over text | the frame's K/V as computed here | their own, as `tick_bias`
says; the frame's rows never see them (their columns are -inf).
"""

from __future__ import annotations

import torch
from torch import nn

from vla_node.backends.refresh_rows import shared_sample
from vla_node.backends.steps import block_attention
from vla_node.model.decoder import apply_rope
from vla_node.model.vla import VLA

DECODER_INPUTS = ("tower_out", "positions", "text_k", "text_v", "text_bias", "rows", "sample_at", "sample_weight",
                  "q", "attn_out", "mlp_out")
DECODER_TICK_INPUTS = DECODER_INPUTS + ("state_x", "tick_positions", "tick_bias")
DECODER_OUTPUTS = ("frame_embeds", "frame_k", "frame_v", "q_new", "attn_out_new", "mlp_out_new")
DECODER_TICK_OUTPUTS = DECODER_OUTPUTS + ("logits", "state_k", "state_v")


def _write_rows(old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """old with the tokens `rows` (int64 [K], padding = T) replaced by new; tokens run along `dim` (T of old, K of
    new). Out of place: old padded by one scratch row along dim, index_copy, the scratch sliced off."""
    tokens = old.shape[dim]
    padded = torch.cat([old, torch.zeros_like(old.narrow(dim, 0, 1))], dim)  # [.., T, ..] -> [.., T + 1, ..]
    return padded.index_copy(dim, rows, new).narrow(dim, 0, tokens)  # -> [.., T, ..]


def _shift_rows(old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, sample_at: torch.Tensor,
                sample_weight: torch.Tensor) -> torch.Tensor:
    """shift_reused over the token axis 0: old [T, W] moved by the sample's weighted mean change (new at sample_at
    minus old at those tokens; padding weighs 0), then new [K, W] at rows."""
    padded = torch.cat([old, torch.zeros_like(old[:1])])  # [T, W] -> [T + 1, W]: padding rows read the scratch
    change = new.index_select(0, sample_at) - padded.index_select(0, rows.index_select(0, sample_at))  # [s, W]
    mean = (change * sample_weight[:, None]).sum(0, keepdim=True)  # [1, W]
    return (padded + mean).index_copy(0, rows, new)[: old.shape[0]]  # [T + 1, W] -> [T, W]


class DecoderPartialStep(nn.Module):
    """FrameTokenCache.run (attend_all=True, drift_threshold=None, layer_budget=None, shared_drift_samples =
    `samples`) over `capacity` recomputed rows, with the action tick's rows when `tick`. See the module docstring;
    the inputs and outputs are DECODER_INPUTS / DECODER_OUTPUTS (DECODER_TICK_* with the tick)."""

    def __init__(self, model: VLA, capacity: int, samples: int, tick: bool,
                 layers: tuple[int, int] | None = None) -> None:
        """layers: the piece [start, end) of the decoder's layers this step runs (None: all of them); a piece that
        ends before the last outputs the residual stream (`x_out`) for DecoderRestStep."""
        super().__init__()
        c = model.config
        if not 1 <= capacity <= c.tokens_per_frame:
            raise ValueError(f"capacity {capacity}: expected 1..{c.tokens_per_frame} (tokens per frame)")
        if samples < 0:
            raise ValueError(f"samples {samples}: expected >= 0")
        if c.num_layers < 2:
            raise ValueError(f"{c.num_layers} decoder layer: the cached state holds the layers below the last")
        self.capacity, self.samples, self.tick = capacity, samples, tick
        self.tokens, self.states, self.queries = c.tokens_per_frame, c.state_slots, c.action_tokens
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # the model's own modules: export sees its weights as parameters
        self.projector = model.projector
        self.camera_embedding = model.camera_embedding
        self.layers = model.decoder.model.layers
        self.num_layers = len(self.layers)
        self.start, self.end = layers or (0, self.num_layers)
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(f"layers {layers}: expected 0 <= start < end <= {self.num_layers}")
        self.rope = model.decoder.rope
        self.hidden = c.hidden_size
        n_tick = c.state_slots + c.action_tokens if tick else 0
        self.n_tick = n_tick
        # the tick rows' places in the residual stream [frame T | scratch | tick rows]
        self.register_buffer("tick_index", torch.arange(self.tokens + 1, self.tokens + 1 + n_tick), persistent=False)
        if tick:
            self.norm = model.decoder.model.norm
            self.lm_head = model.decoder.lm_head
            self.embed_tokens = model.decoder.model.embed_tokens
            self.register_buffer("query_ids", model.query_ids(None), persistent=False)  # [H*D] all ACT

    def _project_vision(self, tower_out: torch.Tensor) -> torch.Tensor:
        """model.project_vision: tower outputs [C, Tc, W] -> frame embeddings [T, hidden]."""
        x = self.projector(tower_out) + self.camera_embedding[:, None, :]  # [C, Tc, hidden]
        return x.reshape(-1, self.hidden)  # [C, Tc, hidden] -> [C*Tc, hidden]

    def _kv(self, a, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (RoPE) and V [KV, n, hd] of the normed rows h [n, hidden]."""
        k = a.k_proj(h).reshape(h.shape[0], self.kv_heads, self.head_dim).transpose(0, 1)  # [n, KV*hd] -> [KV, n, hd]
        v = a.v_proj(h).reshape(h.shape[0], self.kv_heads, self.head_dim).transpose(0, 1)  # [n, KV*hd] -> [KV, n, hd]
        return apply_rope(k, cos, sin), v

    def _queries(self, a, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries (RoPE) [H, n, hd] of the normed rows h [n, hidden]."""
        q = a.q_proj(h).reshape(h.shape[0], self.heads, self.head_dim).transpose(0, 1)  # [n, H*hd] -> [H, n, hd]
        return apply_rope(q, cos, sin)

    def _stream(self, frame: torch.Tensor, tick_rows: torch.Tensor | None) -> torch.Tensor:
        """The residual stream's layout along axis 0: the frame's T rows | one scratch row (zero; the padding of
        `rows` reads it) | the tick's E rows (left out without the tick)."""
        parts = [frame, torch.zeros_like(frame[:1])]
        return torch.cat(parts + [tick_rows] if self.tick else parts)  # [T + 1 + E, ..]

    def _keys(self, text: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """What the rows attend over: text [KV, Tt, hd] | the frame's and the tick's rows of rows [KV, T + 1 + E,
        hd] (the scratch row left out) -> [KV, Tt + T + E, hd]."""
        T = self.tokens
        return torch.cat([text, rows[:, :T]] + ([rows[:, T + 1 :]] if self.tick else []), dim=1)

    def forward(self, tower_out, positions, text_k, text_v, text_bias, rows, sample_at, sample_weight, q, attn_out,
                mlp_out, state_x=None, tick_positions=None, tick_bias=None):
        embeds = self._project_vision(tower_out)  # [T, hidden]
        tick_x = torch.cat([state_x, self.embed_tokens(self.query_ids)]) if self.tick else None  # [S + Q, hidden]
        x = self._stream(embeds, tick_x)  # [T + 1 + E, hidden]
        return (embeds, *self._run(x, positions, text_k, text_v, text_bias, rows, sample_at, sample_weight, q,
                                   attn_out, mlp_out, tick_positions, tick_bias))

    def _run(self, x, positions, text_k, text_v, text_bias, rows, sample_at, sample_weight, q, attn_out, mlp_out,
             tick_positions, tick_bias) -> tuple:
        """Layers [start, end) over the residual stream x [T + 1 + E, hidden]: their frame K/V, their new cached
        state (the layers below the last), then the stream (end < L) or the tick's outputs (end = L, tick)."""
        T, E, K = self.tokens, self.n_tick, self.capacity
        cos, sin = self.rope(self._stream(positions, tick_positions), x.dtype)  # [T + 1 + E, hd]
        # the rows whose queries, attention and MLP are computed: the recomputed ones, then the tick's
        picked = torch.cat([rows, self.tick_index]) if self.tick else rows  # [K + E]
        cos_p, sin_p = cos.index_select(0, picked), sin.index_select(0, picked)  # [K + E, hd]
        # the frame's rows see the valid text and the whole frame, never the tick's rows: [Tt + T + E]
        frame_bias = torch.cat([text_bias, torch.zeros_like(text_bias[:1]).expand(T)]
                               + ([torch.full_like(text_bias[:1], float("-inf")).expand(E)] if self.tick else []))
        n_frame = K if self.samples else T  # frame rows that attend: the recomputed ones, or every token
        bias = frame_bias.expand(n_frame, frame_bias.shape[0])  # [n_frame, Tt + T + E]
        if self.tick:
            bias = torch.cat([bias, tick_bias])  # [n_frame + E, Tt + T + E]
        ks, vs, state_ks, state_vs, qs, attn_outs, mlp_outs = [], [], [], [], [], [], []
        last = self.num_layers - 1
        for i in range(self.start, self.end):
            layer = self.layers[i]
            a = layer.self_attn
            h = layer.input_layernorm(x)  # [T + 1 + E, hidden]
            k, v = self._kv(a, h, cos, sin)  # [KV, T + 1 + E, hd]
            ks.append(k[:, :T])
            vs.append(v[:, :T])
            if self.tick:
                state_ks.append(k[:, T + 1 : T + 1 + self.states])  # [KV, S, hd]
                state_vs.append(v[:, T + 1 : T + 1 + self.states])
            keys, values = self._keys(text_k[i], k), self._keys(text_v[i], v)  # [KV, Tt + T + E, hd]
            if i == last:  # the frame needs only its K/V here; the tick's rows finish the layer
                if self.tick:
                    xe = x[T + 1 :]  # [E, hidden]
                    qe = self._queries(a, h[T + 1 :], cos[T + 1 :], sin[T + 1 :])  # [H, E, hd]
                    x = layer.finish(xe, block_attention(qe, keys, values, tick_bias))
                break
            q_rows = self._queries(a, h.index_select(0, picked), cos_p, sin_p)  # [H, K + E, hd]
            q_i = _write_rows(q[i], q_rows[:, :K], rows, 1)  # [H, T, hd]: the cached queries, the rows' anew
            qs.append(q_i)
            if self.samples:  # shared drift: the recomputed rows attend; the reused ones move by the sample's
                attn = block_attention(q_rows, keys, values, bias)  # [H, K + E, hd]
            else:  # attend_all: every token attends with its query as now cached
                attn = block_attention(torch.cat([q_i, q_rows[:, K:]], dim=1), keys, values, bias)  # [H, T + E, hd]
            out = a.o_proj(attn.transpose(0, 1).reshape(n_frame + E, -1))  # [H, n, hd] -> [n, H*hd] -> [n, hidden]
            if self.samples:
                attn_i = _shift_rows(attn_out[i], out[:K], rows, sample_at, sample_weight)  # [T, hidden]
            else:
                attn_i = out[:T]
            attn_outs.append(attn_i)
            x = x + self._stream(attn_i, out[n_frame:])  # [T + 1 + E, hidden]
            mid = layer.mlp(layer.post_attention_layernorm(x.index_select(0, picked)))  # [K + E, hidden]
            if self.samples:
                mlp_i = _shift_rows(mlp_out[i], mid[:K], rows, sample_at, sample_weight)  # [T, hidden]
            else:
                mlp_i = _write_rows(mlp_out[i], mid[:K], rows, 0)  # [T, hidden]
            mlp_outs.append(mlp_i)
            x = x + self._stream(mlp_i, mid[K:])  # [T + 1 + E, hidden]
        outputs = (torch.stack(ks), torch.stack(vs))  # [n x [KV, T, hd]] -> [n, KV, T, hd]
        if qs:
            outputs += (torch.stack(qs), torch.stack(attn_outs), torch.stack(mlp_outs))  # [m x ..] -> [m, ..]
        state = (torch.stack(state_ks), torch.stack(state_vs)) if self.tick else ()  # [n x [KV, S, hd]] -> [n, ..]
        if self.end < self.num_layers:
            return outputs + state + (x,)  # and the residual stream, for the next piece
        if not self.tick:
            return outputs
        return outputs + (self.lm_head(self.norm(x[self.states :])).float(), *state)  # logits [Q, vocab], ..


class DecoderRestStep(DecoderPartialStep):
    """The decoder layers [start, L) of a DecoderPartialStep cut in two (a budget check between the pieces): the
    residual stream `x_in` [T + 1 + E, hidden] the first piece output replaces tower_out (and state_x); the cache
    inputs are the whole tensors (the piece reads its layers). Outputs its layers' frame K/V, their cached state
    (where below the last) and, with the tick, the logits and its layers' state K/V."""

    def __init__(self, model: VLA, capacity: int, samples: int, tick: bool, start: int) -> None:
        super().__init__(model, capacity, samples, tick, layers=(start, model.config.num_layers))

    def forward(self, x_in, positions, text_k, text_v, text_bias, rows, sample_at, sample_weight, q, attn_out,
                mlp_out, tick_positions=None, tick_bias=None):
        return self._run(x_in, positions, text_k, text_v, text_bias, rows, sample_at, sample_weight, q, attn_out,
                         mlp_out, tick_positions, tick_bias)


def piece_names(start: int, end: int, layers: int, tick: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(inputs, outputs) of the decoder piece over layers [start, end) of `layers`."""
    first = start == 0
    inputs = ("tower_out",) if first else ("x_in",)
    inputs += DECODER_INPUTS[1:]
    if tick:
        inputs += ("state_x", "tick_positions", "tick_bias") if first else ("tick_positions", "tick_bias")
    outputs = (("frame_embeds",) if first else ()) + ("frame_k", "frame_v")
    if start < layers - 1:
        outputs += ("q_new", "attn_out_new", "mlp_out_new")
    if end < layers:
        outputs += ("state_k", "state_v", "x_out") if tick else ("x_out",)
    elif tick:
        outputs += ("logits", "state_k", "state_v")
    return inputs, outputs


def decoder_rows(tokens: torch.Tensor | None, frame_tokens: int, capacity: int,
                 samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host side: the gate's flat token indices (int64 [n] over C*Tc; None = every token, a full refresh) -> the
    step's (rows int64 [capacity], sample_at int64 [max(samples, 1)], sample_weight f32 [max(samples, 1)]). rows:
    the gate's tokens and, when they are fewer than frame_tokens, the sample shared_sample picks, sorted and padded
    with frame_tokens (the scratch row); sample_at: the sample's places in rows (padding 0); sample_weight: 1/count
    per sample entry, 0 for padding. Raises ValueError when the rows do not fit in `capacity`."""
    T = frame_tokens
    if not 1 <= capacity <= T:
        raise ValueError(f"capacity {capacity}: expected 1..{T} (tokens per frame)")
    if samples < 0:
        raise ValueError(f"samples {samples}: expected >= 0")
    sample_at = torch.zeros(max(samples, 1), dtype=torch.long)
    sample_weight = torch.zeros(max(samples, 1), dtype=torch.float32)
    if tokens is None:
        if capacity != T:
            raise ValueError(f"a full refresh recomputes all {T} tokens: capacity {capacity} is too small")
        return torch.arange(T), sample_at, sample_weight
    tokens = tokens.detach().flatten().long().cpu()
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= T):
        raise ValueError(f"gate tokens {int(tokens.min())}..{int(tokens.max())}: expected indices in 0..{T - 1}")
    gate = torch.unique(tokens)  # sorted, without repeats
    rows, sample = gate, gate[:0]
    if samples and gate.numel() < T:
        rows, sample = shared_sample(gate, samples, torch.zeros(T, dtype=torch.bool))
    if rows.numel() > capacity:
        raise ValueError(f"{gate.numel()} gate rows + {sample.numel()} sample rows = {rows.numel()} rows: the step's "
                         f"capacity is {capacity}")
    padded = torch.full((capacity,), T, dtype=torch.long)
    padded[: rows.numel()] = rows
    s = sample.numel()
    sample_at[:s] = torch.searchsorted(rows, sample)
    sample_weight[:s] = 1.0 / s if s else 0.0
    return padded, sample_at, sample_weight
