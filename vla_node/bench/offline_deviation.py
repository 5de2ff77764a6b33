"""A node configuration's chunks on real footage against the reference path's, offline: the figures that offline
similarity gives, to set beside what the same configuration does in closed loop (bench/closed_loop.py).

The policy is the one the node would build from the configuration (node/policies.build_policies: its storage
precisions, weights, backend and recipe), driven frame by frame as the pipeline drives it at a given degrade level:
the reuse gate at the level's threshold scale and refresh cap, the vision update (the first frame only at
`skip_vision`), then the action tick (the flow head at the level's denoising steps). The reference path (fp32 full
recompute, the model's own denoising steps, the same noise per tick) runs the same frames, instruction and state.

    bins: logit_rel_err (||logits - ref|| / ||ref|| over the action queries, mean over frames) and
          bins_agreement (the fraction of action bins equal to the reference's)
    flow: chunk_rel_err (||chunk - ref|| / ||ref||, mean over frames) and chunk_abs_err (mean |chunk - ref|)
"""

from __future__ import annotations

import numpy as np
import torch

from vla_node.backends.loading import load_model
from vla_node.bench.reuse import logit_rel_err
from vla_node.config import NodeConfig
from vla_node.node.policies import build_policies
from vla_node.runtime.reference import ReferencePolicy
from vla_node.runtime.reuse import ReuseGate
from vla_node.sched.ladder import Knobs

INSTRUCTION = "keep the lane"
STATE = np.array([1.0, 0.0, 0.0, 0.0], np.float32)  # 20 m/s, wheels straight (env.state_vector's scale)


def offline_deviation(config: NodeConfig, frames: list[np.ndarray], knobs: Knobs = Knobs()) -> dict:
    """The configuration's deviation from the reference over `frames` (RGB uint8, any size, in order)."""
    policy, _, _ = build_policies(config)
    c = policy.config
    reference = ReferencePolicy(load_model(config.model.model_config(), "plain", config.model.checkpoint,
                                           config.model.seed))
    gate = ReuseGate(config.reuse, c.image_size, c.patch_size)
    threshold = config.reuse.threshold * knobs.reuse_threshold_scale
    cap = max(1, int(c.tokens_per_camera * knobs.max_refresh_fraction)) if knobs.max_refresh_fraction < 1 else None
    errors, agreement, abs_err = [], [], []
    with torch.inference_mode():
        policy.update_text(INSTRUCTION)
        for index, rgb in enumerate(frames):
            if knobs.run_vision or index == 0:
                images = policy.prepare_frames([rgb])  # [1, S, S, 3]
                plan = gate.plan(images[0], threshold=threshold, max_refresh=cap)
                tokens = None if plan.full else [torch.tensor(plan.refresh)]
                policy.update_vision(images, tokens, plan.scene_cut and plan.full)
                gate.commit(plan, images[0])
            ours = policy.action_tick(STATE) if c.action_head == "bins" else \
                policy.action_tick(STATE, steps=knobs.denoising_steps)
            theirs = reference.step([rgb], INSTRUCTION, STATE)
            if c.action_head == "bins":
                errors.append(logit_rel_err(ours.logits, theirs.logits))
                agreement.append(float((ours.bins == theirs.bins).mean()))
            else:
                diff = ours.actions - theirs.actions
                errors.append(float(np.linalg.norm(diff) / max(np.linalg.norm(theirs.actions), 1e-12)))
                abs_err.append(float(np.abs(diff).mean()))
    if c.action_head == "bins":
        return {"logit_rel_err": float(np.mean(errors)), "bins_agreement": float(np.mean(agreement)),
                "frames": len(frames)}
    return {"chunk_rel_err": float(np.mean(errors)), "chunk_abs_err": float(np.mean(abs_err)), "frames": len(frames)}
