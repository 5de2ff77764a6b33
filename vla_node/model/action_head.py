"""Action chunks, and the binned head: 256 bins per dimension over a chunk of H steps x D dims (RT-2 / OpenVLA style).
The flow head (expert.py, flow.py) decodes continuous values: its chunks have no bins or logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vla_node.model.config import ModelConfig
from vla_node.model.tokenizer import BIN_BASE


@dataclass(frozen=True)
class ActionChunk:
    actions: np.ndarray  # [H, D] float32: bin centres, or the flow head's continuous values
    bins: np.ndarray | None  # [H, D] int64 (bins head; None: flow)
    logits: torch.Tensor | None  # [H*D, vocab] at the action query positions, fp32 (bins head; None: flow)
    denoising_steps: int | None = None  # the flow head's Euler steps (None: bins)


def check_state(state, state_dim: int) -> torch.Tensor:
    """The ego state as a [state_dim] float32 tensor; anything else (another length, NaN, Inf) is refused."""
    values = np.asarray(state, dtype=np.float32).reshape(-1)
    if values.shape != (state_dim,) or not np.isfinite(values).all():
        raise ValueError(f"state {values.tolist()}: expected {state_dim} finite numbers")
    return torch.from_numpy(values)


class ActionBins:
    """Uniform bins per action dimension; value = bin centre, so a round trip is within half a bin."""

    def __init__(self, config: ModelConfig) -> None:
        self.bins = config.action_bins
        self.horizon = config.action_horizon
        self.dims = config.action_dims
        self.low = np.asarray(config.action_low, np.float64)  # [D]
        self.high = np.asarray(config.action_high, np.float64)  # [D]
        self.width = (self.high - self.low) / self.bins  # [D]

    def to_bins(self, actions: np.ndarray) -> np.ndarray:
        """actions [..., D] floats -> bins [..., D] int64, clipped to the range."""
        scaled = (np.asarray(actions, np.float64) - self.low) / self.width
        return np.clip(np.floor(scaled), 0, self.bins - 1).astype(np.int64)

    def to_values(self, bins: np.ndarray) -> np.ndarray:
        """bins [..., D] -> bin centres [..., D] float32."""
        return (self.low + (np.asarray(bins, np.float64) + 0.5) * self.width).astype(np.float32)

    def bins_from_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [H*D, vocab] at the action query positions -> bins [H, D] (argmax over bin tokens)."""
        bin_logits = logits[:, BIN_BASE : BIN_BASE + self.bins]  # [H*D, bins]
        return bin_logits.argmax(dim=-1).reshape(self.horizon, self.dims)  # [H*D] -> [H, D]

    def bin_from_row(self, row: torch.Tensor) -> torch.Tensor:
        """logits [vocab] of one query position -> its bin [1] (autoregressive decoding)."""
        return row[BIN_BASE : BIN_BASE + self.bins].argmax().reshape(1)
