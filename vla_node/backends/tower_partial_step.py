"""The partial vision refresh as a pure, static-shape step: `VisionTokenCache.refresh` of every camera at once.

The configuration is the node's default: attend_all, no fresh embeddings, no drift gates, no layer budget; shared
drift with `samples` > 0, else (samples = 0) reused tokens recompute their attention with their cached query over
every token's current K/V. Without drift gates the rows recomputed are the same at every layer (the gate's tokens
and the shared-drift sample), so the host picks them (`tower_rows`) and the step receives them as fixed-size index
tensors: per camera `capacity` rows, padded with T, a scratch row the token axis carries one past the end (its
results are sliced off). A camera whose rows are all padding comes out as its cached state; rows = arange(T) is a
full refresh (a camera's first frame).

The step follows steps.py's conventions: every cache tensor is an input and its new value an output, no host sync,
no branch on a tensor value, no write into an input (gathers and scatters along the token axis, out of place),
attention written out as MatMul -> Softmax -> MatMul in 4-D.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vla_node.backends.refresh_rows import shared_sample
from vla_node.model.vla import VLA

TOWER_INPUTS = ("pixels", "rows", "sample_at", "sample_weight", "x0", "q", "k", "v", "attn_out", "mlp_out")
TOWER_OUTPUTS = ("out", "x0_new", "q_new", "k_new", "v_new", "attn_out_new", "mlp_out_new")


def _index(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """index int64 [C, m] (per camera, along `dim` of t [C, ...]) expanded to t's shape with m at `dim`."""
    view = [index.shape[0]] + [1] * (t.dim() - 1)
    view[dim] = index.shape[1]
    shape = list(t.shape)
    shape[dim] = index.shape[1]
    return index.reshape(view).expand(shape)  # [C, m] -> [C, 1.., m, 1..] -> t's shape, m at dim


def _take(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Per camera, the entries `index` [C, m] of t [C, ...] along dim (GatherElements)."""
    return torch.gather(t, dim, _index(t, index, dim))


def _put(t: torch.Tensor, index: torch.Tensor, dim: int, new: torch.Tensor) -> torch.Tensor:
    """t with, per camera, the entries `index` [C, m] along dim replaced by new (out of place: ScatterElements).
    Padding entries all land on the scratch row."""
    return torch.scatter(t, dim, _index(t, index, dim), new)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [C, H, n, hd] over k, v [C, H, T, hd] -> [C, H, n, hd]: softmax_attention's arithmetic, in fp32."""
    scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(q.shape[-1]))  # [C, H, n, T]
    return torch.matmul(torch.softmax(scores, dim=-1), v)  # [C, H, n, hd]


class TowerPartialStep(nn.Module):
    """Inputs (C cameras, T tokens per camera, W width, Lv layers, H heads, hd = W / H, K = capacity, s = samples):
    pixels f32 [C, 3, S, S] in [-1, 1]; rows int64 [C, K], per camera the tokens recomputed (the gate's and the
    sample) sorted, padded at the end with T; sample_at int64 [C, max(s, 1)], the places in `rows` of the sample;
    sample_weight f32 [C, max(s, 1)], 1 / count per sample entry and 0 for padding; x0 f32 [C, T, W] (layer 0's
    cached input); q, k, v f32 [C, Lv, H, T, hd]; attn_out, mlp_out f32 [C, Lv, T, W]. Outputs: out [C, T, W]
    (post-layernorm) and the new cache tensors, shaped as the inputs (TOWER_OUTPUTS). With samples = 0 sample_at
    and sample_weight are not read."""

    def __init__(self, model: VLA, capacity: int, samples: int) -> None:
        super().__init__()
        tower = model.vision
        self.embeddings = tower.embeddings  # the model's modules: export sees their weights as parameters
        self.layers = tower.encoder.layers
        self.post_layernorm = tower.post_layernorm
        self.tokens = model.config.tokens_per_camera
        self.heads = model.config.vision_heads
        self.capacity, self.samples = capacity, samples

    def _shift(self, old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, sample_at: torch.Tensor,
               weight: torch.Tensor, dim: int) -> torch.Tensor:
        """vision_cache.shift_reused, batched: old (T + 1 tokens along dim) moved by the weighted mean change over
        the sample (with samples > 0), then new (K tokens along dim) at rows."""
        if self.samples:
            new_s = _take(new, sample_at, dim)  # the sample's recomputed values [.., s, ..]
            old_s = _take(old, torch.gather(rows, 1, sample_at), dim)  # and their cached ones
            w = weight.reshape([weight.shape[0]] + [1] * (dim - 1) + [weight.shape[1]] + [1] * (old.dim() - dim - 1))
            # ^ [C, s] -> [C, 1.., s, 1..]
            old = old + ((new_s - old_s) * w).sum(dim, keepdim=True)
        return _put(old, rows, dim, new)

    def forward(self, pixels: torch.Tensor, rows: torch.Tensor, sample_at: torch.Tensor, sample_weight: torch.Tensor,
                x0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_out: torch.Tensor,
                mlp_out: torch.Tensor):
        C, T, W = x0.shape
        K, H = rows.shape[1], self.heads
        hd = W // H
        emb = self.embeddings
        # the rows' patch embeddings (padding entries embed patch T - 1: finite, and land on the scratch row)
        real = torch.minimum(rows, torch.full_like(rows, T - 1))  # [C, K] (Min: TensorRT clips floats only)
        patches = _take(emb.patchify(pixels), real, 1)  # [C, T, 3*P*P] -> [C, K, 3*P*P]
        x0_padded = F.pad(x0, (0, 0, 0, 1))  # [C, T + 1, W]
        fresh = emb.embed_patches(patches, real)  # [C, K, W]
        if self.samples:  # the sample's tokens are reused ones: they keep their cached embeddings (as refresh does)
            places = torch.arange(K, device=rows.device)
            sampled = ((sample_at[:, :, None] == places) & (sample_weight[:, :, None] > 0)).any(dim=1)  # [C, K]
            fresh = torch.where(sampled[:, :, None], _take(x0_padded, rows, 1), fresh)  # [C, K, W]
        x = _put(x0_padded, rows, 1, fresh)  # [C, T + 1, W]
        x0_new = x[:, :T]
        # the caches, padded by the scratch row along the token axis
        q, k, v = (F.pad(t, (0, 0, 0, 1)) for t in (q, k, v))  # [C, Lv, H, T + 1, hd]
        attn_out, mlp_out = (F.pad(t, (0, 0, 0, 1)) for t in (attn_out, mlp_out))  # [C, Lv, T + 1, W]
        news: dict[str, list[torch.Tensor]] = {name: [] for name in ("q", "k", "v", "attn_out", "mlp_out")}
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.layer_norm1(_take(x, rows, 1))  # [C, K, W]
            heads = [p(h).reshape(C, K, H, hd).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj)]
            # ^ [C, K, W] -> [C, K, H, hd] -> [C, H, K, hd]
            qi, ki, vi = (self._shift(old[:, i], new, rows, sample_at, sample_weight, 2)
                          for old, new in zip((q, k, v), heads))  # [C, H, T + 1, hd]
            if self.samples:  # shared drift: the recomputed rows attend; reused tokens' updates move
                attn = _attend(heads[0], ki[:, :, :T], vi[:, :, :T])  # [C, H, K, hd]
                new = a.out_proj(attn.transpose(1, 2).reshape(C, K, W))  # [C, H, K, hd] -> [C, K, W]
                sa = self._shift(attn_out[:, i], new, rows, sample_at, sample_weight, 1)  # [C, T + 1, W]
            else:  # attend_all: every token's (cached or new) query over every token's current K/V
                attn = _attend(qi[:, :, :T], ki[:, :, :T], vi[:, :, :T])  # [C, H, T, hd]
                sa = F.pad(a.out_proj(attn.transpose(1, 2).reshape(C, T, W)), (0, 0, 0, 1))
                # ^ [C, H, T, hd] -> [C, T, W] -> [C, T + 1, W]
            x = x + sa
            m = layer.mlp(layer.layer_norm2(_take(x, rows, 1)))  # [C, K, W]
            sm = self._shift(mlp_out[:, i], m, rows, sample_at, sample_weight, 1)  # [C, T + 1, W]
            x = x + sm
            for name, t in (("q", qi), ("k", ki), ("v", vi), ("attn_out", sa), ("mlp_out", sm)):
                news[name].append(t)
        out = self.post_layernorm(x[:, :T])  # [C, T, W]
        q_new, k_new, v_new = (torch.stack(news[n], 1)[:, :, :, :T] for n in ("q", "k", "v"))  # [C, Lv, H, T, hd]
        attn_new, mlp_new = (torch.stack(news[n], 1)[:, :, :T] for n in ("attn_out", "mlp_out"))  # [C, Lv, T, W]
        return out, x0_new, q_new, k_new, v_new, attn_new, mlp_new


def tower_rows(tokens: list[torch.Tensor | None], tokens_per_camera: int, capacity: int,
               samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host side: per camera the gate's token indices (None = all: every token, no sample; empty = none: the
    camera keeps its cached state) -> (rows int64 [C, capacity], sample_at int64 [C, max(samples, 1)],
    sample_weight f32 [C, max(samples, 1)]), with the sample `shared_sample` picks (only when the gate's rows are
    fewer than T). Raises ValueError when a camera's token is out of range or its rows exceed `capacity`."""
    T, width = tokens_per_camera, max(samples, 1)
    C = len(tokens)
    rows = torch.full((C, capacity), T, dtype=torch.long)
    sample_at = torch.zeros(C, width, dtype=torch.long)
    sample_weight = torch.zeros(C, width, dtype=torch.float32)
    mask = torch.zeros(T, dtype=torch.bool)
    for cam, gate in enumerate(tokens):
        if gate is None:
            picked, sample = torch.arange(T), torch.zeros(0, dtype=torch.long)
        else:
            picked = gate.to("cpu", torch.long).flatten().unique()  # sorted
            if picked.numel() and (picked[0] < 0 or picked[-1] >= T):
                raise ValueError(f"camera {cam}: token {int(picked[0] if picked[0] < 0 else picked[-1])} is out of "
                                 f"range for {T} tokens per camera")
            sample = picked[:0]
            if samples and 0 < picked.numel() < T:
                picked, sample = shared_sample(picked, samples, mask)
        n = picked.numel()
        if n > capacity:
            raise ValueError(f"camera {cam}: {n - sample.numel()} gate rows + {sample.numel()} sample rows = {n} "
                             f"exceed the step's capacity {capacity}")
        rows[cam, :n] = picked
        if sample.numel():
            sample_at[cam, : sample.numel()] = torch.searchsorted(picked, sample)
            sample_weight[cam, : sample.numel()] = 1.0 / sample.numel()
    return rows, sample_at, sample_weight
