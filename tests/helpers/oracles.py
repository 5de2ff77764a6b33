"""Oracles and measurements only the tests use: dense attention over concatenated segments, the shared-drift move
in torch's ops, frame ages, the gate's redundancy over a clip."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np
import torch

from vla_node.kv.attention import Segment, _as_segment
from vla_node.runtime.reuse import ReuseConfig, ReuseGate


def concat_segments(segments: Sequence[Sequence], q_len: int) -> Segment:
    """One segment equal to the concatenation of `segments` (masks/biases expanded to [q_len, L]);
    the dense oracle that segmented and gathered attention must equal."""
    segs = [_as_segment(s) for s in segments]
    k = torch.cat([s.k for s in segs], dim=1)  # [n_kv_heads, sum L, D]
    v = torch.cat([s.v for s in segs], dim=1)
    masks, biases = [], []
    for s in segs:
        length = s.k.shape[1]
        m = s.mask if s.mask is not None else torch.ones(length, dtype=torch.bool, device=s.k.device)
        masks.append(m.expand(q_len, length))
        b = s.bias if s.bias is not None else torch.zeros(length, device=s.k.device)
        biases.append(b.float().expand(q_len, length))
    any_bias = any(s.bias is not None for s in segs)
    return Segment(k, v, torch.cat(masks, dim=1), torch.cat(biases, dim=1) if any_bias else None)


def frame_ages(frame_id: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
    """Age of each slot's frame: how many admitted frames in `history` are newer (incoming frame = 0)."""
    hist = torch.tensor(list(history), dtype=torch.int64, device=frame_id.device)
    return len(history) - torch.searchsorted(hist, frame_id, right=True)


def measure_redundancy(frames: Iterable[np.ndarray], config: ReuseConfig, image_size: int | tuple[int, int] = 224,
                       patch_size: int = 16) -> dict:
    """Run a fresh gate over `frames` (uint8 RGB already at image_size), committing every plan.

    Returns the mean and 10th percentile of the reuse ratio over frames, excluding the first (always full),
    with counts of frames, full refreshes and scene cuts among those frames."""
    gate = ReuseGate(config, image_size, patch_size)
    ratios: list[float] = []
    full_refreshes = 0
    scene_cuts = 0
    for index, rgb in enumerate(frames):
        plan = gate.plan(rgb)
        gate.commit(plan, rgb)
        if index == 0:
            continue
        ratios.append(plan.reuse_ratio)
        full_refreshes += plan.full
        scene_cuts += plan.scene_cut
    if not ratios:
        raise ValueError("frames: got fewer than 2; expected at least 2 (the first frame is always a full refresh)")
    values = np.asarray(ratios)
    return {
        "frames": len(ratios),
        "mean": float(values.mean()),
        "p10": float(np.percentile(values, 10)),
        "min": float(values.min()),
        "full_refreshes": full_refreshes,
        "scene_cuts": scene_cuts,
        "config": dataclasses.asdict(config),
    }


def tick_step_case(name: str = "tiny"):
    """A TickStep over a tiny model with seeded inputs of its static shapes: (step, inputs, outputs as computed by
    torch), for backends that need no policy around them."""
    from vla_node.backends.steps import TickStep
    from vla_node.bench.engines import step_inputs
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla

    model = build_vla(preset(name), seed=0)
    step = TickStep(model).eval()
    inputs = step_inputs(model.config)["tick"]
    with torch.inference_mode():
        outputs = dict(zip(("logits", "state_k", "state_v"), step(*inputs.values())))
    return step, inputs, outputs


def torch_shift(old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, sample: torch.Tensor,
                dim: int) -> torch.Tensor:
    """runtime/vision_cache.shift_reused's torch form (no kernel), tokens along `dim`: a copy to fp32, the add, a
    copy back, the index_copy."""
    out = torch.empty_like(old)
    at = torch.searchsorted(rows, sample)
    move = (new.index_select(dim, at).float() - old.index_select(dim, sample).float()).mean(dim, keepdim=True)
    out.copy_((old.float() + move).to(old.dtype))
    return out.index_copy_(dim, rows, new)
