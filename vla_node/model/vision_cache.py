"""Partial recompute of the vision tower (Eventful Transformers style).

Per camera the cache keeps, for every token, each layer's input, K and V, and the final outputs. A frame
in which only some patches changed recomputes those tokens alone: at every layer the changed tokens'
queries attend to all tokens (the cached K/V of the unchanged ones, their own new K/V), and unchanged tokens
keep their cached outputs. With every token changed this is the full forward pass.

A refresh is staged: `refresh` computes the new rows into per-camera staging buffers and returns the
refreshed tokens' outputs; `commit` applies every staged camera at once and `discard` drops them, so the
owner commits the tower together with the decoder's KV cache (a budget stop leaves both as they were).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from vla_node.kv.attention import Segment, segmented_attention
from vla_node.model.vision import VisionTower

Check = Callable[[float], bool]  # called with the fraction done; False = stop now


class VisionStageAborted(Exception):
    pass


class VisionTokenCache:
    def __init__(self, tower: VisionTower, num_cameras: int, dtype: torch.dtype = torch.float32) -> None:
        self.tower = tower
        emb = tower.embeddings
        layers = tower.encoder.layers
        attn = layers[0].self_attn
        T, W = emb.position_embedding.num_embeddings, emb.patch_embedding.out_channels
        L, H, hd = len(layers), attn.heads, attn.head_dim
        self.tokens, self.width, self.heads, self.head_dim = T, W, H, hd
        self.k = torch.zeros(num_cameras, L, H, T, hd, dtype=dtype)  # cached keys per camera and layer
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros(num_cameras, T, W, dtype=dtype)  # post-layernorm outputs
        self.valid = [False] * num_cameras
        self._stage_k = torch.zeros(num_cameras, L, H, T, hd, dtype=dtype)
        self._stage_v = torch.zeros_like(self._stage_k)
        self._stage_out = torch.zeros(num_cameras, T, W, dtype=dtype)
        self._staged: list[torch.Tensor | None | bool] = [False] * num_cameras  # False = nothing staged
        self._keep = torch.zeros(T, dtype=torch.bool)  # cached tokens the changed ones attend to

    @torch.inference_mode()
    def refresh(self, camera: int, pixels: torch.Tensor, tokens: torch.Tensor | None,
                check: Check | None = None) -> torch.Tensor:
        """pixels [3, S, S]; tokens int64 [n] to recompute (None = all; a camera's first frame is always
        full). Stages the new rows and returns the refreshed tokens' outputs [n, W] (all T when full)."""
        if not self.valid[camera]:
            tokens = None
        emb = self.tower.embeddings
        patches = emb.patchify(pixels[None])[0]  # [T, 3*P*P]
        if tokens is not None:
            patches = patches[tokens]  # [n, 3*P*P]
        x = emb.embed_patches(patches[None], tokens)[0]  # [n, W]
        n = x.shape[0]
        if tokens is not None:
            self._keep.fill_(True)
            self._keep[tokens] = False
        n_layers = len(self.tower.encoder.layers)
        for i, layer in enumerate(self.tower.encoder.layers):
            if check is not None and not check(0.5 * i / n_layers):  # the tower is about half the stage
                raise VisionStageAborted(f"stopped before vision layer {i}")
            a = layer.self_attn
            h = layer.layer_norm1(x)
            q = a.q_proj(h).reshape(n, self.heads, self.head_dim).transpose(0, 1)  # [n, W] -> [H, n, hd]
            k = a.k_proj(h).reshape(n, self.heads, self.head_dim).transpose(0, 1)
            v = a.v_proj(h).reshape(n, self.heads, self.head_dim).transpose(0, 1)
            self._stage_k[camera, i, :, :n].copy_(k)
            self._stage_v[camera, i, :, :n].copy_(v)
            if tokens is None:
                attn = F.scaled_dot_product_attention(q, k, v)  # [H, n, hd]
            else:
                cached = Segment(self.k[camera, i], self.v[camera, i], self._keep)
                attn, _ = segmented_attention(q, [cached, Segment(k, v, None)])
            x = x + a.out_proj(attn.transpose(0, 1).reshape(n, self.width))  # [H, n, hd] -> [n, W]
            x = x + layer.mlp(layer.layer_norm2(x))
        y = self.tower.post_layernorm(x)  # [n, W]
        self._stage_out[camera, :n].copy_(y)
        self._staged[camera] = tokens
        return y

    def commit(self) -> None:
        """Apply every staged refresh."""
        for camera, tokens in enumerate(self._staged):
            if tokens is False:
                continue
            if tokens is None:
                self.k[camera].copy_(self._stage_k[camera])
                self.v[camera].copy_(self._stage_v[camera])
                self.out[camera].copy_(self._stage_out[camera])
                self.valid[camera] = True
            else:
                n = tokens.numel()
                self.k[camera].index_copy_(2, tokens, self._stage_k[camera, :, :, :n])
                self.v[camera].index_copy_(2, tokens, self._stage_v[camera, :, :, :n])
                self.out[camera].index_copy_(0, tokens, self._stage_out[camera, :n])
        self.discard()

    def discard(self) -> None:
        self._staged = [False] * len(self._staged)

    def reset(self) -> None:
        self.valid = [False] * len(self.valid)
        self.discard()
