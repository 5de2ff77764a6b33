"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).

Parameter names follow transformers' LlamaForCausalLM exactly. Batch size is 1 and has no dimension:
hidden states are [T, hidden]. Each layer is split into `project_qkv` and `finish` so the KV cache can run
its own attention between them (segmented over partitions).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vla_node.model.config import ModelConfig
from vla_node.model.tokenizer import VOCAB_SIZE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """torch's rms_norm: one kernel, normalized and scaled in fp32, rounded once to x's dtype. In fp32 that is
        HF Llama's RMSNorm bit for bit; in bf16/fp16 HF rounds the normalized value before scaling it, so the two
        can differ by one rounding (ours is nearer the exact value on average). An action tick's 17 norms: ~1 ms
        less. A weight in another dtype than x takes HF's form (normalized in fp32, rounded to x's dtype, scaled)."""
        if self.weight.dtype != x.dtype:
            return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class RotaryTable(nn.Module):
    """cos and signed sin for every position of the fixed layout, fp32, built once (HF Llama's default RoPE)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        # sin with its first half negated: HF's rotate_half(x) * sin == roll(x, hd/2) * signed_sin, bit for bit
        self.register_buffer("signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [T, hd] each, for apply_rope."""
        return self.cos[positions].to(dtype), self.signed_sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, hd], cos and signed_sin [T, hd] (RotaryTable): HF's x * cos + rotate_half(x) * sin in four
    ops instead of seven (the halves swapped by a roll, the sign carried by the table; negating a product is
    exact, so the result is the same bit for bit)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class LlamaAttention(nn.Module):
    """The decoder's head geometry (heads, KV heads, head_dim) over a residual stream of `width` (the decoder's
    hidden size, or the action expert's own)."""

    def __init__(self, config: ModelConfig, width: int) -> None:
        super().__init__()
        hd = config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.q_proj = nn.Linear(width, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(width, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, width, bias=False)


class LlamaMLP(nn.Module):
    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, intermediate, bias=False)
        self.up_proj = nn.Linear(width, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """A decoder layer; with `width` and `intermediate`, an action expert's layer at its own width (the decoder's
    head geometry, so that its queries attend over the decoder's K/V of the same layer)."""

    def __init__(self, config: ModelConfig, width: int | None = None, intermediate: int | None = None) -> None:
        super().__init__()
        width = config.hidden_size if width is None else width
        self.self_attn = LlamaAttention(config, width)
        self.mlp = LlamaMLP(width, config.intermediate_size if intermediate is None else intermediate)
        self.input_layernorm = RMSNorm(width, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(width, config.rms_eps)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Callable = apply_rope):
        """x [T, hidden] -> q [heads, T, hd], k and v [kv_heads, T, hd]; RoPE applied to q and k (by `rope`, with
        apply_rope's contract: backends/cpu_kernels.apply_rope). With packed weights (`qkv`, packed_weights.py)
        the three projections are one matmul and q, k one RoPE call."""
        a = self.self_attn
        t = x.shape[0]
        h = self.input_layernorm(x)
        qkv = a.__dict__.get("qkv")
        if qkv is not None:
            heads = qkv(h).reshape(t, a.heads + 2 * a.kv_heads, a.head_dim).transpose(0, 1)  # -> [H + 2 KV, T, hd]
            qk = rope(heads[: a.heads + a.kv_heads], cos, sin)
            return qk[: a.heads], qk[a.heads :], heads[a.heads + a.kv_heads :]
        q = a.q_proj(h).reshape(t, a.heads, a.head_dim).transpose(0, 1)  # [T, H*hd] -> [H, T, hd]
        k = a.k_proj(h).reshape(t, a.kv_heads, a.head_dim).transpose(0, 1)  # -> [KV, T, hd]
        v = a.v_proj(h).reshape(t, a.kv_heads, a.head_dim).transpose(0, 1)  # -> [KV, T, hd]
        return rope(q, cos, sin), rope(k, cos, sin), v

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Callable = apply_rope):
        """x [T, hidden] -> k and v [kv_heads, T, hd] (RoPE on k, by `rope`): all a last layer computes for tokens
        whose output nothing reads (they are only attended to)."""
        a = self.self_attn
        t = x.shape[0]
        h = self.input_layernorm(x)
        k = a.k_proj(h).reshape(t, a.kv_heads, a.head_dim).transpose(0, 1)  # [T, KV*hd] -> [KV, T, hd]
        v = a.v_proj(h).reshape(t, a.kv_heads, a.head_dim).transpose(0, 1)
        return rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], attn [heads, T, hd] -> the layer's output [T, hidden]."""
        t = x.shape[0]
        x = x + self.self_attn.o_proj(attn.transpose(0, 1).reshape(t, -1))  # [H, T, hd] -> [T, H*hd]
        return x + self.mlp(self.post_attention_layernorm(x))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [H, T, hd] over k, v [KV, S, hd] with mask [T, S] bool (True = attend) or None (causal, T == S)."""
    groups = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(groups, dim=0)  # [KV, S, hd] -> [H, S, hd]
    v = v.repeat_interleave(groups, dim=0)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB_SIZE, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)


class Decoder(nn.Module):
    """The causal LM: `model.*` and `lm_head` as in LlamaForCausalLM; `rope` is a non-persistent table."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, VOCAB_SIZE, bias=False)
        self.rope = RotaryTable(config.head_dim, config.max_positions, config.rope_theta)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full recompute. embeds [T, hidden], positions [T], mask [T, T] bool or None (causal) -> logits [T, vocab]."""
        return self.logits(self.hidden(embeds, positions, mask))

    def hidden(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope(positions, embeds.dtype)
        x = embeds
        for layer in self.model.layers:
            q, k, v = layer.project_qkv(x, cos, sin)
            x = layer.finish(x, dense_attention(q, k, v, mask))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))


def hf_llama_config(config: ModelConfig) -> dict:
    """The config.json of transformers' LlamaForCausalLM for these shapes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_positions,
        "rms_norm_eps": config.rms_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "torch_dtype": "float32",
    }
