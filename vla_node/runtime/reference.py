"""The reference policy: full recompute of every token every step, fp32 by default.

The oracle every optimisation is measured against. It keeps the same history the node keeps (the last
`vision_frames` frames and the last `state_slots` states, each in its fixed ring slot) and recomputes the
vision tower and the whole decoder sequence on every step. With the flow head, every denoising step recomputes the
whole sequence: the prefix through the decoder's layers and the expert's block through the expert's, attending
jointly layer by layer (pi0's mixture of transformers), with the tick's noise drawn as the cached policy draws it.
"""

from __future__ import annotations

import numpy as np
import torch

from vla_node.model.action_head import ActionBins, ActionChunk, check_state
from vla_node.model.decoder import dense_attention
from vla_node.model.expert import block_mask, block_positions
from vla_node.model.flow import ChunkGuide, integrate, tick_noise
from vla_node.model.tokenizer import encode
from vla_node.model.vla import VLA, block_causal_mask, preprocess_frame, to_pixels


def joint_hidden(model: VLA, prefix: torch.Tensor, prefix_positions: torch.Tensor, block: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """The whole sequence at once, each layer's decoder and expert side by side: prefix [P, hidden] through the
    decoder's layers, the expert's block [n, expert width] through the expert's, one attention over both (mask
    [P + n, P + n] bool; the prefix's rows see no block column). Returns the block's final hidden states [n, w]."""
    c = model.config
    rope = model.decoder.rope
    cos_p, sin_p = rope(prefix_positions, prefix.dtype)
    cos_b, sin_b = rope(block_positions(c), block.dtype)
    n_prefix = prefix.shape[0]
    x, y = prefix, block
    for decoder_layer, expert_layer in zip(model.decoder.model.layers, model.expert.layers):
        qp, kp, vp = decoder_layer.project_qkv(x, cos_p, sin_p)
        qb, kb, vb = expert_layer.project_qkv(y, cos_b, sin_b)
        attn = dense_attention(torch.cat([qp, qb], 1), torch.cat([kp, kb], 1), torch.cat([vp, vb], 1), mask)
        x = decoder_layer.finish(x, attn[:, :n_prefix])
        y = expert_layer.finish(y, attn[:, n_prefix:])
    return y


class ReferencePolicy:
    def __init__(self, model: VLA, dtype: torch.dtype = torch.float32, noise_seed: int = 0) -> None:
        self.model = model.to(dtype)
        self.config = model.config
        self.dtype = dtype
        self.noise_seed = noise_seed
        self.bins = ActionBins(self.config)
        c = self.config
        self.frames: list[torch.Tensor | None] = [None] * c.vision_frames  # slot -> pixels [C, 3, S, S]
        self.states: list[torch.Tensor | None] = [None] * c.state_slots  # slot -> state [state_dim]
        self.frame_count = 0
        self.state_count = 0

    def prepare_frames(self, frames: list[np.ndarray]) -> torch.Tensor:
        c = self.config
        if len(frames) != c.num_cameras:
            raise ValueError(f"{len(frames)} camera frames: expected {c.num_cameras}")
        images = np.stack([preprocess_frame(f, c.image_size) for f in frames])  # [C, S, S, 3]
        return to_pixels(images, self.dtype)

    @torch.inference_mode()
    def step(self, frames: list[np.ndarray], instruction: str, state, steps: int | None = None,
             guide: ChunkGuide | None = None) -> ActionChunk:
        """One frame and its tick. Flow head: `steps` Euler steps (default the model's flow_steps), guided toward
        `guide` (real-time chunking) where given."""
        c = self.config
        self.frames[self.frame_count % c.vision_frames] = self.prepare_frames(frames)
        self.frame_count += 1
        current = check_state(state, c.state_dim).to(self.dtype)
        if c.action_head == "flow" and c.flow_state == "suffix":
            self.state_count += 1  # the state is the expert's suffix token: no ring in the prefix
            return self.decode(encode(instruction, c.max_text_tokens), current, steps, guide)
        self.states[self.state_count % c.state_slots] = current
        self.state_count += 1
        return self.decode(encode(instruction, c.max_text_tokens), None, steps, guide)

    def decode(self, text_ids: list[int], suffix_state: torch.Tensor | None = None, steps: int | None = None,
               guide: ChunkGuide | None = None) -> ActionChunk:
        c, m = self.config, self.model
        text = torch.tensor(text_ids, dtype=torch.long)
        blocks, positions, frame_sizes = [m.embed_text(text)], [torch.arange(len(text_ids))], []
        for slot, pixels in enumerate(self.frames):
            if pixels is not None:
                tokens = m.encode_frame(pixels)  # [C*T, hidden]
                blocks.append(tokens)
                positions.append(torch.tensor(list(c.vision_positions(slot))))
                frame_sizes.append(tokens.shape[0])
        state_slots = [s for s, v in enumerate(self.states) if v is not None]
        for slot in state_slots:
            blocks.append(m.embed_state(self.states[slot]))
        positions.append(torch.tensor([c.state_base + s for s in state_slots], dtype=torch.long))
        prefix = torch.cat(blocks)  # [n_prefix, hidden]
        if c.action_head == "flow":
            mask = block_causal_mask(len(text_ids), frame_sizes, len(state_slots), 0)
            return self._flow(prefix, torch.cat(positions), mask, suffix_state, steps, guide)
        n_query = c.action_tokens
        query_positions = torch.arange(c.query_base, c.query_base + n_query)
        all_positions = torch.cat([*positions, query_positions])
        mask = block_causal_mask(len(text_ids), frame_sizes, len(state_slots), n_query)
        if c.action_decode == "parallel":
            embeds = torch.cat([prefix, m.embed_text(m.query_ids(None))])
            logits = m.decoder(embeds, all_positions, mask)[-n_query:].float()  # [H*D, vocab]
        else:
            rows = []
            bins = torch.zeros(0, dtype=torch.long)
            for i in range(n_query):
                ids = m.query_ids(bins)[: i + 1]
                embeds = torch.cat([prefix, m.embed_text(ids)])
                n = embeds.shape[0]
                row = m.decoder(embeds, all_positions[:n], mask[:n, :n])[-1].float()  # [vocab]
                rows.append(row)
                bins = torch.cat([bins, self.bins.bin_from_row(row)])
            logits = torch.stack(rows)
        bins = self.bins.bins_from_logits(logits).numpy()
        return ActionChunk(self.bins.to_values(bins), bins, logits)

    def _flow(self, prefix: torch.Tensor, positions: torch.Tensor, prefix_mask: torch.Tensor,
              suffix_state: torch.Tensor | None, steps: int | None, guide: ChunkGuide | None) -> ActionChunk:
        """The flow head's chunk: Euler steps, each a full recompute of the prefix and the expert's block."""
        c, m = self.config, self.model
        p, n = prefix.shape[0], c.flow_tokens
        mask = torch.zeros(p + n, p + n, dtype=torch.bool)
        mask[:p, :p] = prefix_mask
        mask[p:, :p] = True
        own = block_mask(c)
        mask[p:, p:] = True if own is None else own
        state_x = None if suffix_state is None else m.expert.embed_state(suffix_state)

        def velocity(x: torch.Tensor, tau: float) -> torch.Tensor:
            block = m.expert.block(x, torch.tensor(tau), state_x)
            return m.expert.velocity(joint_hidden(m, prefix, positions, block, mask))

        steps = c.flow_steps if steps is None else steps
        noise = tick_noise(c.action_horizon, c.action_dims, self.noise_seed, self.state_count - 1,
                           scale=c.flow_noise_scale).to(self.dtype)
        chunk = integrate(velocity, noise, steps, guide)
        return ActionChunk(chunk.float().numpy(), None, None, steps)
