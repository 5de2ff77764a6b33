"""The reference policy: full recompute of every token every step, fp32 by default.

The oracle every optimisation is measured against. It keeps the same history the node keeps (the last
`vision_frames` frames and the last `state_slots` states, each in its fixed ring slot) and recomputes the
vision tower and the whole decoder sequence on every step.
"""

from __future__ import annotations

import numpy as np
import torch

from vla_node.model.action_head import ActionBins, ActionChunk, check_state
from vla_node.model.tokenizer import encode
from vla_node.model.vla import VLA, block_causal_mask, preprocess_frame, to_pixels


class ReferencePolicy:
    def __init__(self, model: VLA, dtype: torch.dtype = torch.float32) -> None:
        self.model = model.to(dtype)
        self.config = model.config
        self.dtype = dtype
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
    def step(self, frames: list[np.ndarray], instruction: str, state) -> ActionChunk:
        c = self.config
        self.frames[self.frame_count % c.vision_frames] = self.prepare_frames(frames)
        self.frame_count += 1
        self.states[self.state_count % c.state_slots] = check_state(state, c.state_dim).to(self.dtype)
        self.state_count += 1
        return self.decode(encode(instruction, c.max_text_tokens))

    def decode(self, text_ids: list[int]) -> ActionChunk:
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
