"""SigLIP-style vision tower. Parameter names follow transformers' SiglipVisionModel exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vla_node.model.config import ModelConfig


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(3, config.vision_width, config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding(config.tokens_per_camera, config.vision_width)

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> patches [N, T, 3*P*P] in the conv weight's (c, y, x) order."""
        n, c, s, _ = pixels.shape
        p = self.patch_size
        g = s // p
        x = pixels.reshape(n, c, g, p, g, p)  # [N, C, gy, P, gx, P]
        return x.permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)  # [N, T, C*P*P]

    def embed_patches(self, patches: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """patches [N, T', 3*P*P] (token ids `index` [T'] or all) -> embeddings [N, T', W]."""
        packed = self.__dict__.get("packed_patches")  # packed weights' matmul of the patch weight (packed_weights.py)
        if packed is not None:
            x = packed(patches)
        else:
            w = self.patch_embedding.weight.reshape(self.patch_embedding.out_channels, -1)  # [W, C*P*P]
            x = F.linear(patches, w, self.patch_embedding.bias)
        pos = self.position_embedding.weight if index is None else self.position_embedding.weight[index]
        return x + pos

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)  # [N, W, g, g]
        x = x.flatten(2).transpose(1, 2)  # [N, T, W]
        return x + self.position_embedding.weight


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention q [..., Tq, hd] over k, v [..., T, hd] -> [..., Tq, hd], softmax in fp32. Two matmuls
    and a softmax: on a CPU about twice as fast as torch's SDPA at the tower's shapes (196 tokens, hd 64)."""
    logits = torch.matmul(q, k.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5)  # [..., Tq, T]
    return torch.matmul(torch.softmax(logits, dim=-1).to(v.dtype), v)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax_attention as torch's SDPA computes it (its flash kernel, fp32 logits): on a CPU with AMX, bf16, 1.7x
    (69 query rows) to 3.8x (196) faster at the tower's shapes, and nearer the exact value. 3-D inputs get a batch
    dim: SDPA runs only 4-D ones on its flash kernel (3-D on its matmul path: 3.6x slower here)."""
    if q.dim() == 3:
        return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # [H, n, hd] -> [1, H, n, hd] and back
    return F.scaled_dot_product_attention(q, k, v)


class SiglipAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        w = config.vision_width
        self.heads = config.vision_heads
        self.head_dim = w // config.vision_heads
        self.q_proj = nn.Linear(w, w)
        self.k_proj = nn.Linear(w, w)
        self.v_proj = nn.Linear(w, w)
        self.out_proj = nn.Linear(w, w)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        return x.reshape(n, t, self.heads, self.head_dim).transpose(1, 2)  # [N, T, W] -> [N, heads, T, hd]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, heads, Tq, hd] over k, v [N, heads, T, hd] -> [N, Tq, W] (after out_proj)."""
        out = softmax_attention(q, k, v)  # [N, heads, Tq, hd]
        n, _, tq, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(n, tq, -1))  # -> [N, Tq, W]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(self.split(self.q_proj(x)), self.split(self.k_proj(x)), self.split(self.v_proj(x)))


class SiglipMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.vision_width, config.vision_mlp)
        self.fc2 = nn.Linear(config.vision_mlp, config.vision_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.vision_width, eps=config.vision_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.vision_width, eps=config.vision_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SiglipEncoderLayer(config) for _ in range(config.vision_layers)])


class VisionTower(nn.Module):
    """pixels [N, 3, S, S] in [-1, 1] -> tokens [N, T, vision_width] (post-layernormed, no pooling head)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.vision_width, eps=config.vision_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def hf_siglip_config(config: ModelConfig) -> dict:
    """The config.json of transformers' SiglipVisionModel for these shapes."""
    return {
        "architectures": ["SiglipVisionModel"],
        "model_type": "siglip_vision_model",
        "hidden_size": config.vision_width,
        "intermediate_size": config.vision_mlp,
        "num_hidden_layers": config.vision_layers,
        "num_attention_heads": config.vision_heads,
        "num_channels": 3,
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": config.vision_eps,
        "attention_dropout": 0.0,
        "vision_use_head": False,
        "torch_dtype": "float32",
    }
