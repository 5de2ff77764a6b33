"""Pure, static-shape step modules over the model's weights: the arithmetic an engine runs.

Every cache tensor is an input and every new K/V row an output; validity is an additive fp32 bias (0 = attend,
-inf = masked); inside a step there is no `.item()`, `nonzero`, host sync, branch on a tensor value, in-place
write to an input or validation (the host checks its inputs before the call). Attention is written out in 4-D as
MatMul -> Add -> Softmax -> MatMul with each KV head's query heads stacked, which the ONNX exporter lowers to
plain ops (TensorRT 10.3 takes them at opset <= 20).

`DecoderBlockStep` is the shared piece: a block of rows through every decoder layer, attending to a prefix of
cached K/V plus the block's own. `TextStep` is the instruction at the text partition's capacity. `FrameStep` is a
full vision refresh (tower, projector, the frame's K/V over the text). `TickStep` is the parallel action tick in its
fused form (new state | the other stored states, recomputed | the H*D action queries) over the tick's prefix buffer
(text and vision, read once per commit): one static shape for every tick.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vla_node.model.vla import VLA


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """q [H, n, hd] over k, v [KV, S, hd] with an additive fp32 bias [n, S]; returns [H, n, hd] in q's dtype.
    4-D throughout, the g = H / KV query heads of a KV head stacked: no repeat of the KV heads."""
    heads, n, hd = q.shape
    kv_heads, length = k.shape[0], k.shape[1]
    g = heads // kv_heads
    qg = q.reshape(1, kv_heads, g * n, hd)  # [H, n, hd] -> [1, KV, g*n, hd]
    scores = torch.matmul(qg, k.reshape(1, kv_heads, length, hd).transpose(2, 3)).float()  # [1, KV, g*n, S]
    scores = scores.reshape(1, kv_heads, g, n, length) * (1.0 / math.sqrt(hd)) + bias  # -> [1, KV, g, n, S]
    p = torch.softmax(scores, dim=-1).reshape(1, kv_heads, g * n, length)  # -> [1, KV, g*n, S]
    out = torch.matmul(p.to(v.dtype), v.reshape(1, kv_heads, length, hd))  # [1, KV, g*n, hd]
    return out.reshape(heads, n, hd).to(q.dtype)  # [1, KV, g*n, hd] -> [H, n, hd]


class DecoderBlockStep(nn.Module):
    """A block of n rows through every decoder layer over a cached prefix: x [n, hidden], positions [n] (int64),
    prefix_k / prefix_v [L, KV, P, hd], bias [n, P + n] (the prefix's columns, then the block's own) ->
    (hidden [n, hidden], block_k, block_v [L, KV, n, hd] with RoPE on k)."""

    def __init__(self, model: VLA) -> None:
        super().__init__()
        self.layers = model.decoder.model.layers  # the model's ModuleList: export sees its weights as parameters
        self.rope = model.decoder.rope

    def run_block(self, x: torch.Tensor, positions: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                  bias: torch.Tensor, output: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """output=False: a block that is only attended to (text, frames): the last layer computes its K/V alone
        and no hidden state is returned."""
        cos, sin = self.rope(positions, x.dtype)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            if not output and i == len(self.layers) - 1:
                k, v = layer.project_kv(x, cos, sin)
                ks.append(k)
                vs.append(v)
                return None, torch.stack(ks), torch.stack(vs)  # [L x [KV, n, hd]] -> [L, KV, n, hd]
            q, k, v = layer.project_qkv(x, cos, sin)
            keys = torch.cat([prefix_k[i], k], dim=1)  # [KV, P, hd] | [KV, n, hd] -> [KV, P + n, hd]
            values = torch.cat([prefix_v[i], v], dim=1)
            x = layer.finish(x, block_attention(q, keys, values, bias))
            ks.append(k)
            vs.append(v)
        return x, torch.stack(ks), torch.stack(vs)  # [L x [KV, n, hd]] -> [L, KV, n, hd]


class TextStep(DecoderBlockStep):
    """The instruction through the decoder, at the text partition's full capacity Tt (static): ids [Tt] (int64; the
    padding any token id), positions [Tt], bias [Tt, Tt] (causal, and no row sees a padding slot). Outputs
    text_k / text_v [L, KV, Tt, hd]; the host keeps the valid rows. Padding rows attend to the valid prefix
    (never to nothing) and are not kept."""

    def __init__(self, model: VLA) -> None:
        super().__init__(model)
        self.embed_tokens = model.decoder.model.embed_tokens
        self.register_buffer("no_prefix", torch.zeros(len(self.layers), model.config.num_kv_heads, 0,
                                                      model.config.head_dim), persistent=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor):
        x = self.embed_tokens(ids)  # [Tt] -> [Tt, hidden]
        prefix = self.no_prefix.to(x.dtype)
        _, k, v = self.run_block(x, positions, prefix, prefix, bias, output=False)
        return k, v


class FrameStep(DecoderBlockStep):
    """A full vision refresh: every camera's pixels through the vision tower and projector, then the frame's tokens
    through the decoder over the text. Inputs: pixels [C, 3, S, S] in [-1, 1], positions [C*T] (the frame slot's),
    text_k / text_v [L, KV, Tt, hd], bias [C*T, Tt + C*T] (the text's validity, then 0: a frame sees all of
    itself). Outputs: frame_embeds [C*T, hidden] (kept by the host: a text change recomputes the frame from them),
    frame_k / frame_v [L, KV, C*T, hd]."""

    def __init__(self, model: VLA) -> None:
        super().__init__(model)
        self.vision = model.vision
        self.projector = model.projector
        self.camera_embedding = model.camera_embedding

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor,
                bias: torch.Tensor):
        tokens = self.projector(self.vision(pixels)) + self.camera_embedding[:, None, :]  # [C, T, hidden]
        embeds = tokens.reshape(-1, tokens.shape[-1])  # [C, T, hidden] -> [C*T, hidden]
        _, k, v = self.run_block(embeds, positions, text_k, text_v, bias, output=False)
        return embeds, k, v


class TickStep(DecoderBlockStep):
    """The parallel action tick, fused form: rows [new state | S - 1 stored states | H*D queries].

    Inputs: state_x [1 + S - 1, hidden] (the new state's embedding, then the stored states' embeddings, invalid
    ones any finite value), positions [n], prefix_k / prefix_v [L, KV, P, hd], bias [n, P + n]. Outputs: logits
    [H*D, vocab] at the queries, state_k / state_v [L, KV, S, hd] (the new state's row first, then the stored
    states', recomputed). Equal, to float rounding, to MultiRatePolicy's tick with the prefix buffer."""

    def __init__(self, model: VLA) -> None:
        super().__init__(model)
        c = model.config
        self.states = c.state_slots
        self.norm = model.decoder.model.norm
        self.lm_head = model.decoder.lm_head
        self.embed_tokens = model.decoder.model.embed_tokens
        self.register_buffer("query_ids", model.query_ids(None), persistent=False)  # [H*D] all ACT

    def forward(self, state_x: torch.Tensor, positions: torch.Tensor, prefix_k: torch.Tensor,
                prefix_v: torch.Tensor, bias: torch.Tensor):
        x = torch.cat([state_x, self.embed_tokens(self.query_ids)])  # [S + H*D, hidden]
        hidden, k, v = self.run_block(x, positions, prefix_k, prefix_v, bias)
        logits = self.lm_head(self.norm(hidden[self.states :])).float()  # [H*D, vocab]
        return logits, k[:, :, : self.states], v[:, :, : self.states]


def text_bias(length: int, capacity: int) -> torch.Tensor:
    """The text block's bias [Tt, Tt] (host side): causal over the `length` valid tokens; every row, padding
    included, sees only valid earlier tokens (a padding row sees the whole instruction)."""
    allowed = torch.ones(capacity, capacity, dtype=torch.bool).tril()
    allowed[:, length:] = False
    return torch.zeros(capacity, capacity, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))


def frame_bias(text_valid: torch.Tensor, frame_tokens: int) -> torch.Tensor:
    """The frame block's bias [F, Tt + F] (host side): the valid text slots (text_valid bool [Tt]) and every token
    of the frame itself."""
    bias = torch.zeros(frame_tokens, text_valid.shape[0] + frame_tokens, dtype=torch.float32)
    bias[:, : text_valid.shape[0]].masked_fill_(~text_valid, float("-inf"))
    return bias


def tick_bias(prefix_bias: torch.Tensor, stored_valid: torch.Tensor, queries: int) -> torch.Tensor:
    """The tick block's bias [S + Q, P + S + Q] (host side, once per tick): every row sees the valid prefix slots
    (prefix_bias [P], 0 or -inf); the new state (row 0) and each stored state (rows 1..S-1, valid where
    stored_valid [S - 1]) see themselves; the queries see the new state, the valid stored states and, causally,
    each other."""
    p, s = prefix_bias.shape[0], stored_valid.shape[0] + 1
    n = s + queries
    allowed = torch.zeros(n, n, dtype=torch.bool)
    allowed[:s, :s] = torch.eye(s, dtype=torch.bool)
    allowed[s:, 0] = True
    allowed[s:, 1:s] = stored_valid
    allowed[s:, s:] = torch.ones(queries, queries, dtype=torch.bool).tril()
    bias = torch.zeros(n, p + n, dtype=torch.float32)
    bias[:, :p] = prefix_bias
    bias[:, p:].masked_fill_(~allowed, float("-inf"))
    return bias
