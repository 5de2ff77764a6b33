"""The VLA: vision tower -> projector (+ camera embedding) -> Llama decoder -> action head: binned (the decoder's
action queries) or flow (the action expert, expert.py, over the decoder's K/V).

Block-causal sequence (fixed positions per slot, see ModelConfig):
    text (causal) | frame slots (each attends to text and its own frame) |
    state slots (each attends to text, all frames and itself) | action queries (all of the above, causal)
With the flow head the action queries are replaced by the expert's block (its own weights, the same attention
pattern over everything before it, bidirectional within the block).
A frame's tokens never attend to another frame and a state token never to another state token, so each
block's K/V depend only on the text and on itself: that is what lets the KV cache keep them across frames.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_node.model.config import ModelConfig
from vla_node.model.decoder import Decoder
from vla_node.model.expert import ActionExpert
from vla_node.model.tokenizer import ACT, BIN_BASE
from vla_node.model.vision import VisionTower


class Projector(nn.Module):
    """vision tokens [.., vision_width] -> decoder embeddings [.., hidden] (LLaVA-style 2-layer MLP)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.vision_width, config.hidden_size)
        self.fc2 = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VLA(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionTower(config)
        self.projector = Projector(config)
        self.camera_embedding = nn.Parameter(torch.zeros(config.num_cameras, config.hidden_size))
        self.state_proj = nn.Linear(config.state_dim, config.hidden_size)
        self.decoder = Decoder(config)
        self.expert = ActionExpert(config) if config.action_head == "flow" else None

    @property
    def dtype(self) -> torch.dtype:
        return self.camera_embedding.dtype

    # embeddings of each block ------------------------------------------------------------------------
    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.model.embed_tokens(ids)  # [n] -> [n, hidden]

    def project_vision(self, vision_tokens: torch.Tensor) -> torch.Tensor:
        """vision tower outputs [C, T, vision_width] -> frame embeddings [C*T, hidden]."""
        x = self.projector(vision_tokens) + self.camera_embedding[:, None, :]  # [C, T, hidden]
        return x.reshape(-1, self.config.hidden_size)  # [C, T, hidden] -> [C*T, hidden]

    def encode_frame(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [C, 3, S, S] in [-1, 1] -> frame embeddings [C*T, hidden]."""
        return self.project_vision(self.vision(pixels))

    def embed_state(self, state: torch.Tensor) -> torch.Tensor:
        return self.state_proj(state)[None, :]  # [state_dim] -> [1, hidden]

    def query_ids(self, prev_bins: torch.Tensor | None) -> torch.Tensor:
        """Action query inputs [H*D]: all ACT (parallel), or ACT then the previous bins (autoregressive)."""
        n = self.config.action_tokens
        ids = torch.full((n,), ACT, dtype=torch.long)
        if prev_bins is not None and len(prev_bins) > 0:
            ids[1 : 1 + len(prev_bins)] = BIN_BASE + prev_bins.reshape(-1)[: n - 1]
        return ids


def preprocess_frame(rgb: np.ndarray, image_size: int) -> np.ndarray:
    """Any HxWx3 uint8 RGB frame -> image_size x image_size x 3 uint8 (bilinear, antialiased). The resize runs on
    the uint8 pixels (torch's fixed-point kernel: within one level of the float resize rounded, about 5x faster)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"frame of shape {rgb.shape} and dtype {rgb.dtype}: expected HxWx3 uint8 RGB")
    if rgb.shape[0] == image_size and rgb.shape[1] == image_size:
        return np.ascontiguousarray(rgb)
    if not rgb.flags.writeable:
        rgb = rgb.copy()  # a read-only view of a received buffer; torch wants writable memory
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]  # [H, W, 3] -> [1, 3, H, W] (a view)
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True, align_corners=False)
    return x[0].permute(1, 2, 0).numpy()  # [1, 3, S, S] -> [S, S, 3], a strided view (callers stack or copy it)


def to_pixels(images: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [C, S, S, 3] -> pixels [C, 3, S, S] in [-1, 1] (SigLIP normalisation: mean 0.5, std 0.5)."""
    x = torch.as_tensor(images)
    return (x.permute(0, 3, 1, 2).to(dtype) / 127.5 - 1.0).contiguous()  # [C, S, S, 3] -> [C, 3, S, S]


def block_causal_mask(n_text: int, frame_sizes: list[int], n_state: int, n_query: int) -> torch.Tensor:
    """The [T, T] bool mask (True = may attend) of the sequence text | frames | states | queries."""
    total = n_text + sum(frame_sizes) + n_state + n_query
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:n_text, :n_text] = torch.ones(n_text, n_text, dtype=torch.bool).tril()
    start = n_text
    for size in frame_sizes:
        mask[start : start + size, :n_text] = True
        mask[start : start + size, start : start + size] = True
        start += size
    for i in range(n_state):
        mask[start + i, :start] = True
        mask[start + i, start + i] = True
    q0 = start + n_state
    mask[q0:, :q0] = True
    mask[q0:, q0:] = torch.ones(n_query, n_query, dtype=torch.bool).tril()
    return mask


def init_weights(model: VLA, seed: int) -> VLA:
    """Seeded, deterministic init (same preset and seed -> identical weights in any process). The action expert's
    weights are drawn after everything else's, so that a flow model's vision tower and decoder are the bins model's
    of the same preset and seed."""
    g = torch.Generator().manual_seed(seed)
    named = sorted(model.named_parameters(), key=lambda item: (item[0].startswith("expert."), item[0]))
    with torch.no_grad():
        for name, p in named:
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1 and ("norm" in name):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


_DRAWS = ("kaiming_uniform_", "uniform_", "normal_")  # what nn.Linear, Conv2d and Embedding draw their init with


def empty_vla(config: ModelConfig) -> VLA:
    """VLA(config) with its parameters allocated but not drawn (torch's default init skipped, as transformers'
    no_init_weights does): for a model whose every parameter is set next, by init_weights or a checkpoint. The
    default draws are a third of `small`'s build (0.32 s on the AMX Xeon). Not for use from two threads at once:
    the draws are skipped process-wide while the model is built."""
    skip = {name: getattr(nn.init, name) for name in _DRAWS}
    with contextlib.ExitStack() as undo:
        for name, draw in skip.items():
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
            undo.callback(setattr, nn.init, name, draw)
        return VLA(config)


def build_vla(config: ModelConfig, seed: int = 0) -> VLA:
    return init_weights(empty_vla(config), seed).eval()
