"""Flow-matching integration: Euler steps from noise to the chunk, and real-time chunking's guided inpainting.

Flow time tau runs from 0 (noise) to 1 (the chunk); `velocity(x, tau)` is the model's field (expert.py). With
steps N, dt = 1 / N and x_{tau + dt} = x_tau + dt * v(x_tau, tau).

Real-time chunking (Black, Galliker and Levine, 2025, "Real-Time Execution of Action Chunking Flow Policies",
Algorithm 1): a chunk decoded while the previous one plays is guided toward the previous chunk's remaining steps Y
by the pseudo-inverse guidance of PiGDM. At each step the denoised estimate A1 = x + (1 - tau) v, its weighted error
e = (Y - A1) * W, and the vector-Jacobian product g = e^T dA1/dx correct the velocity: v + min(beta, (1 - tau) /
(tau r^2)) g, with r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2). W (soft_mask) is 1 for the d steps played from the
previous chunk before the new one arrives, decays exponentially over the rest of the overlap, and is 0 beyond
it. The d frozen steps are set to Y's exactly at the end (they are never played from the new chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

Velocity = Callable[[torch.Tensor, float], torch.Tensor]  # (x [H, D], tau) -> v [H, D]
GUIDANCE_CLIP = 5.0  # the paper's beta


@dataclass(frozen=True)
class ChunkGuide:
    """What real-time chunking guides a new chunk toward."""

    target: torch.Tensor  # [H, D]: the previous chunk's actions at the new chunk's steps (rows past `overlap`: any)
    frozen: int  # steps [0, frozen) are played from the previous chunk before the new one arrives
    overlap: int  # steps [0, overlap) have a previous chunk's action at all (frozen <= overlap <= H)
    beta: float = GUIDANCE_CLIP

    def __post_init__(self) -> None:
        horizon = self.target.shape[0]
        if not 0 <= self.frozen <= self.overlap <= horizon:
            raise ValueError(f"ChunkGuide frozen {self.frozen}, overlap {self.overlap}: expected "
                             f"0 <= frozen <= overlap <= {horizon} (the horizon)")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"ChunkGuide beta {self.beta!r}: expected a finite number > 0")

    @property
    def weights(self) -> torch.Tensor:
        return soft_mask(self.target.shape[0], self.frozen, self.overlap)


def tick_noise(horizon: int, dims: int, seed: int, tick: int, generator: torch.Generator | None = None,
               out: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """The Gaussian noise [H, D] fp32 a tick starts from, of standard deviation `scale` (the model's
    flow_noise_scale): a function of (seed, tick index) alone, so that a replay, the reference and the cached policy
    draw the same (into `out` where given, with a reused `generator`)."""
    generator = torch.Generator() if generator is None else generator
    # torch's CPU generator keeps 32 bits of its seed: the pair is hashed to 32 bits (SeedSequence's mixing)
    generator.manual_seed(int(np.random.SeedSequence([seed, tick]).generate_state(1)[0]))
    noise = torch.randn(horizon, dims, generator=generator, out=out)
    return noise if scale == 1.0 else noise.mul_(scale)


def soft_mask(horizon: int, frozen: int, overlap: int) -> torch.Tensor:
    """The guidance weights W [H] fp32 (the paper's eq. 5 with H - s = overlap): 1 for i < frozen, c_i (e^c_i - 1) /
    (e - 1) with c_i = (overlap - i) / (overlap - frozen + 1) for frozen <= i < overlap, 0 from overlap on."""
    i = torch.arange(horizon, dtype=torch.float32)
    c = (overlap - i) / (overlap - frozen + 1)
    w = c * torch.expm1(c) / math.expm1(1.0)
    w = torch.where(i < frozen, torch.ones_like(w), w)
    return torch.where(i < overlap, w, torch.zeros_like(w))


def guidance_weight(tau: float, beta: float) -> float:
    """min(beta, (1 - tau) / (tau r^2)), r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2); beta at tau = 0. The paper's
    weight for unit noise and actions of unit scale; with model.flow_noise_scale at the actions' own scale the same
    holds in those units (dividing actions and noise by it scales the velocity and its correction alike)."""
    if tau <= 0.0:
        return beta
    r2 = (1.0 - tau) ** 2 / (tau**2 + (1.0 - tau) ** 2)
    return min(beta, (1.0 - tau) / (tau * r2))


def guided_velocity(velocity: Velocity, x: torch.Tensor, tau: float, guide: ChunkGuide,
                    weights: torch.Tensor) -> torch.Tensor:
    """v(x, tau) corrected toward guide.target (weights [H]: guide.weights): one forward and one backward pass of
    the field. Autograd runs outside inference mode, on a copy of x; the field's weights need not require grad."""
    with torch.inference_mode(False), torch.enable_grad():
        xg = x.detach().clone().requires_grad_(True)
        v = velocity(xg, tau)
        denoised = xg + (1.0 - tau) * v  # [H, D]
        with torch.no_grad():
            error = (guide.target.to(denoised.dtype) - denoised) * weights.to(denoised.dtype)[:, None]  # [H, D]
        (g,) = torch.autograd.grad(denoised, xg, error)
    return v.detach() + guidance_weight(tau, guide.beta) * g.detach()


def check_steps(steps: object) -> int:
    """A denoising step count: an integer >= 1, else a ValueError naming it."""
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"denoising steps {steps!r}: expected an integer >= 1")
    return steps


def integrate(velocity: Velocity, noise: torch.Tensor, steps: int, guide: ChunkGuide | None = None,
              check: Callable[[float], bool] | None = None, on_stop: Callable[[int], Exception] | None = None
              ) -> torch.Tensor:
    """The chunk [H, D]: `steps` Euler steps of `velocity` from `noise` (tau 0) to tau 1; with `guide`, real-time
    chunking's guided steps and the frozen steps set to the target's. `check(fraction)` before each step: False
    raises on_stop(step)."""
    check_steps(steps)
    weights = None if guide is None else guide.weights.to(noise.device)
    dt = 1.0 / steps
    x = noise
    for i in range(steps):
        if check is not None and not check(i / steps):
            raise on_stop(i)
        tau = i / steps
        v = velocity(x, tau) if guide is None else guided_velocity(velocity, x, tau, guide, weights)
        x = x + dt * v
    if guide is not None and guide.frozen:
        x = x.clone()
        x[: guide.frozen] = guide.target[: guide.frozen].to(x.dtype)
    return x
