"""The flow-matching action expert (pi0 / SmolVLA style): the `flow` action head.

Per decoder layer, the expert has a layer of its own (RMSNorm, q/k/v/o, SwiGLU) at its own width with the
decoder's head count, KV heads and head dimension: its queries attend over that decoder layer's K/V of the prefix
(text, vision, and the states when flow_state = 'prefix') and over the block's own K/V, bidirectionally within the
chunk. The block is one token per horizon step, embedding the noisy chunk [H, D] with the flow time tau through a
small MLP (pi0's action_time_mlp over a sinusoidal time embedding), preceded by the state token when
flow_state = 'suffix'. The velocity field is read out of the last H tokens; flow.py integrates it.

Flow time runs from tau = 0 (Gaussian noise) to tau = 1 (the chunk): x_tau = tau * chunk + (1 - tau) * noise, whose
velocity is chunk - noise (the convention of Black et al. 2025, the real-time chunking paper).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vla_node.model.config import ModelConfig
from vla_node.model.decoder import LlamaDecoderLayer, RMSNorm

MIN_PERIOD, MAX_PERIOD = 4e-3, 4.0  # pi0's sinusoidal time embedding


def time_embedding(tau: torch.Tensor, width: int) -> torch.Tensor:
    """tau [] (in [0, 1]) -> [width] fp32: sin and cos of tau over periods spaced geometrically from MIN_PERIOD to
    MAX_PERIOD (pi0's posemb_sincos)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float32, device=tau.device)
    period = MIN_PERIOD * (MAX_PERIOD / MIN_PERIOD) ** fraction  # [width / 2]
    angle = tau.float() * (2.0 * math.pi) / period  # [width / 2]
    return torch.cat([angle.sin(), angle.cos()])  # [width]


class ActionExpert(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        w = config.expert_hidden_size
        self.config = config
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, w, config.expert_intermediate_size)
                                     for _ in range(config.num_layers)])
        self.norm = RMSNorm(w, config.rms_eps)
        self.action_in_proj = nn.Linear(config.action_dims, w)
        self.action_time_mlp_in = nn.Linear(2 * w, w)
        self.action_time_mlp_out = nn.Linear(w, w)
        self.action_out_proj = nn.Linear(w, config.action_dims)
        self.state_proj = nn.Linear(config.state_dim, w) if config.flow_state == "suffix" else None

    def embed_state(self, state: torch.Tensor) -> torch.Tensor:
        """The suffix state token: state [state_dim] -> [1, expert width]."""
        return self.state_proj(state)[None, :]

    def embed_actions(self, noisy: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """noisy chunk [H, D], flow time tau [] -> action tokens [H, expert width]."""
        actions = self.action_in_proj(noisy)  # [H, w]
        times = time_embedding(tau, actions.shape[-1]).to(actions.dtype).expand_as(actions)  # [w] -> [H, w]
        x = self.action_time_mlp_in(torch.cat([actions, times], dim=-1))  # [H, 2w] -> [H, w]
        return self.action_time_mlp_out(F.silu(x))

    def block(self, noisy: torch.Tensor, tau: torch.Tensor, state_x: torch.Tensor | None) -> torch.Tensor:
        """The expert's block [flow_tokens, w]: the state token (suffix; state_x [1, w]) then the action tokens."""
        actions = self.embed_actions(noisy, tau)
        return actions if state_x is None else torch.cat([state_x, actions])

    def velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block's final hidden states [flow_tokens, w] -> the velocity field [H, D] at the action tokens."""
        return self.action_out_proj(self.norm(hidden[-self.config.action_horizon :]))


def block_mask(config: ModelConfig) -> torch.Tensor | None:
    """Within the expert's block [flow_tokens, flow_tokens] bool (True = may attend): the action tokens see the whole
    block (bidirectional, as pi0); a suffix state token sees only itself. None: all (flow_state = 'prefix')."""
    if config.flow_state == "prefix":
        return None
    n = config.flow_tokens
    mask = torch.ones(n, n, dtype=torch.bool)
    mask[0, 1:] = False
    return mask


def block_positions(config: ModelConfig) -> torch.Tensor:
    """The expert block's positions [flow_tokens] (int64): after the state ring, as the bins head's queries."""
    return torch.arange(config.query_base, config.query_base + config.flow_tokens)
