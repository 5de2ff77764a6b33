"""The training losses over a batch, computed by the model's own modules (the same code the reference path runs), one
sample at a time under torch.func.vmap so that the batch adds no second implementation of the model.

One sample's sequence is the reference path's, in the fixed position layout: the instruction's tokens (padded to
max_text_tokens; padding is masked out of every row, and attends only to itself so that no softmax row is empty),
the frame's tokens, the two state tokens (the node's state ring: which slot holds the newest state alternates, so
the slot is drawn at random), then

- bins: the H*D action queries (ACT tokens; with autoregressive decoding the previous bins, teacher forced). Loss:
  cross-entropy of the bin logits against a target spread over neighbouring bins (a Gaussian of BIN_SIGMA bins: the
  bins are ordered, a near miss is better than a far one).
- flow: the expert's block at flow time tau between noise (tau 0, of the model's flow_noise_scale) and the chunk
  (tau 1), x_tau = tau a + (1 - tau) e,
  through pi0's joint attention (reference.joint_hidden). Loss: the squared error of the velocity against a - e
  (conditional flow matching), tau drawn with more weight near the noise (pi0's Beta(1.5, 1)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import vmap

from vla_node.model.expert import block_mask, block_positions
from vla_node.model.tokenizer import BIN_BASE, PAD, encode
from vla_node.model.vla import VLA, block_causal_mask
from vla_node.runtime.reference import joint_hidden

BIN_SIGMA = 1.0


class Losses:
    """Loss functions for `model` over batches of: text_ids [B, T] and text_valid [B, T] (instruction_tokens),
    pixels [B, C, 3, S, S], states [B, slots, state_dim] (slot order as the ring holds them), chunks [B, H, D]."""

    def __init__(self, model: VLA) -> None:
        self.model = model
        c = model.config
        self.config = c
        n_text, n_frame, n_state = c.max_text_tokens, c.tokens_per_frame, c.state_slots
        positions = [torch.arange(n_text), torch.tensor(list(c.vision_positions(0))),
                     torch.arange(c.state_base, c.state_base + n_state)]
        self.prefix_positions = torch.cat(positions)  # [P]
        n_prefix = len(self.prefix_positions)
        if c.action_head == "bins":
            n_query = c.action_tokens
            self.positions = torch.cat([self.prefix_positions, torch.arange(c.query_base, c.query_base + n_query)])
            self.mask = block_causal_mask(n_text, [n_frame], n_state, n_query)  # [P + Q, P + Q]
        else:
            n = c.flow_tokens
            mask = torch.zeros(n_prefix + n, n_prefix + n, dtype=torch.bool)
            mask[:n_prefix, :n_prefix] = block_causal_mask(n_text, [n_frame], n_state, 0)
            mask[n_prefix:, :n_prefix] = True
            own = block_mask(c)
            mask[n_prefix:, n_prefix:] = True if own is None else own
            self.mask = mask
            self.block_positions = block_positions(c)
        self.n_text = n_text
        self.eye = torch.eye(self.mask.shape[0], dtype=torch.bool)
        self._bin_grid = torch.arange(c.action_bins, dtype=torch.float32)

    def instruction_tokens(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """text_ids [B, max_text_tokens] (BOS, bytes, PAD) and text_valid [B, max_text_tokens] bool."""
        n = self.config.max_text_tokens
        ids = torch.full((len(texts), n), PAD, dtype=torch.long)
        valid = torch.zeros(len(texts), n, dtype=torch.bool)
        for i, text in enumerate(texts):
            tokens = encode(text, n)
            ids[i, : len(tokens)] = torch.tensor(tokens)
            valid[i, : len(tokens)] = True
        return ids, valid

    def _sample_mask(self, text_valid: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([text_valid, torch.ones(self.mask.shape[0] - self.n_text, dtype=torch.bool)])
        return (self.mask & keys[None, :]) | self.eye  # padding is seen by nobody, and sees itself

    def _prefix(self, text_ids: torch.Tensor, pixels: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        m = self.model
        return torch.cat([m.embed_text(text_ids), m.encode_frame(pixels), m.state_proj(states)])  # [P, hidden]

    # ---- bins -------------------------------------------------------------------------------------------

    def bin_logits(self, text_ids, text_valid, pixels, states, query_ids) -> torch.Tensor:
        """[B, H*D, bins] logits of the bin tokens at the action queries."""
        m, c = self.model, self.config

        def one(ids, valid, px, st, queries):
            x = torch.cat([self._prefix(ids, px, st), m.embed_text(queries)])
            logits = m.decoder(x, self.positions, self._sample_mask(valid))[-c.action_tokens:]  # [H*D, vocab]
            return logits[:, BIN_BASE: BIN_BASE + c.action_bins]

        return vmap(one)(text_ids, text_valid, pixels, states, query_ids)

    def bins_loss(self, text_ids, text_valid, pixels, states, target_bins: torch.Tensor) -> torch.Tensor:
        """target_bins [B, H, D] int64."""
        c = self.config
        b = target_bins.shape[0]
        if c.action_decode == "autoregressive":
            query_ids = torch.stack([self.model.query_ids(t.reshape(-1)) for t in target_bins])  # teacher forcing
        else:
            query_ids = self.model.query_ids(None).expand(b, -1)
        logits = self.bin_logits(text_ids, text_valid, pixels, states, query_ids)  # [B, H*D, bins]
        target = target_bins.reshape(b, -1, 1).float()  # [B, H, D] -> [B, H*D, 1]
        soft = torch.softmax(-0.5 * ((self._bin_grid - target) / BIN_SIGMA) ** 2, dim=-1)  # [B, H*D, bins]
        return -(soft * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()

    # ---- flow -------------------------------------------------------------------------------------------

    def velocity(self, text_ids, text_valid, pixels, states, noisy: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """The expert's velocity [B, H, D] at noisy chunks [B, H, D] and flow times tau [B]."""
        m = self.model

        def one(ids, valid, px, st, x, t):
            block = m.expert.block(x, t, None)
            hidden = joint_hidden(m, self._prefix(ids, px, st), self.prefix_positions, block, self._sample_mask(valid))
            return m.expert.velocity(hidden)

        return vmap(one)(text_ids, text_valid, pixels, states, noisy, tau)

    def flow_loss(self, text_ids, text_valid, pixels, states, chunks: torch.Tensor,
                  generator: torch.Generator) -> torch.Tensor:
        b = chunks.shape[0]
        noise = torch.randn(chunks.shape, generator=generator) * self.config.flow_noise_scale
        beta = torch.rand(b, generator=generator) ** (1 / 1.5)  # Beta(1.5, 1) by its inverse CDF, x^1.5
        tau = 1.0 - 0.999 * beta  # more weight near the noise
        noisy = tau[:, None, None] * chunks + (1 - tau[:, None, None]) * noise
        v = self.velocity(text_ids, text_valid, pixels, states, noisy, tau)
        return F.mse_loss(v, chunks - noise)
