"""Scenes, digests and oracle comparisons that several test files use."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from helpers.numerics import assert_same_bins
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reference import ReferencePolicy

# decoder geometries checked against transformers: grouped-query, odd head counts
HF_CONFIGS = {
    "gqa_8q_2kv": preset("tiny").replace(hidden_size=128, num_heads=8, num_kv_heads=2, num_layers=3),
    "odd_5_heads": preset("tiny").replace(hidden_size=80, num_heads=5, num_kv_heads=5, num_layers=2),
    "odd_3q_1kv": preset("tiny").replace(hidden_size=96, num_heads=3, num_kv_heads=1, num_layers=2),
}


def moving_band_frames(n, seed=0, with_states=False):
    """n 48x64 frames: a fixed background with a band of fresh pixels that moves down frame by frame; with
    `with_states`, (frame, state [4]) pairs from the same generator."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = []
    for i in range(n):
        frame = base.copy()
        frame[(i * 7) % 40 : (i * 7) % 40 + 8] = rng.integers(0, 256, (8, 64, 3), dtype=np.uint8)
        out.append((frame, rng.normal(size=4).astype(np.float32)) if with_states else frame)
    return out


def frames_and_states(n, seed=0):
    """An iterator over n (frame, state [4]) pairs (moving_band_frames)."""
    return iter(moving_band_frames(n, seed, with_states=True))


def storage_layout(policy: MultiRatePolicy):
    """Where and how every cache tensor is stored, and every partition's capacity."""
    tensors = [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in policy.storage_tensors()]
    partitions = [policy.text, *policy.vision.partitions, policy.action]
    capacities = [(p.name, p.capacity, p.spec.capacity) for p in partitions]
    return tensors, capacities


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def assert_incremental_equals_reference(policy: MultiRatePolicy, reference: ReferencePolicy) -> None:
    """8 frames, the instruction changed before the fifth: logits within 1e-4, identical bins, every step."""
    instruction = "follow the lane"
    policy.update_text(instruction)
    for i, (frame, state) in enumerate(frames_and_states(8)):
        if i == 4:
            instruction = "exit; merge left"
            policy.update_text(instruction)
        policy.update_vision(policy.prepare_frames([frame]))
        ours = policy.action_tick(state)
        theirs = reference.step([frame], instruction, state)
        assert (ours.logits.cpu() - theirs.logits).abs().max().item() <= 1e-4, i
        assert_same_bins(ours, theirs, 1e-4)  # another computation: a near tie may pick the other bin


def hf_llama(path):
    """transformers' LlamaForCausalLM loaded from a checkpoint's decoder folder, every key matched."""
    import transformers

    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        str(path / "decoder"), output_loading_info=True, dtype=torch.float32, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.eval()


def run_reference(frames):
    """The reference on the frames, checked against the multi-rate policy with the exact (all-fp32) cache over the
    same frames (1e-4 on logits, the same bins); every frame's logits depend on the frame, and on the instruction."""
    model = build_vla(preset("tiny"), seed=0)
    policy = ReferencePolicy(model)
    state = np.zeros(4, np.float32)
    chunks = [policy.step([rgb], "keep the lane", state) for rgb in frames]
    incremental = MultiRatePolicy(model, CacheConfig.exact())
    incremental.update_text("keep the lane")
    for chunk, rgb in zip(chunks, frames):
        assert chunk.actions.shape == (4, 2) and np.isfinite(chunk.actions).all()
        assert chunk.bins.min() >= 0 and chunk.bins.max() < 256
        incremental.update_vision(incremental.prepare_frames([rgb]))
        ours = incremental.action_tick(state)
        assert (ours.logits - chunk.logits).abs().max().item() <= 1e-4
        np.testing.assert_array_equal(ours.bins, chunk.bins)
    for a, b in zip(chunks, chunks[1:]):
        assert not torch.equal(a.logits, b.logits)  # the frames differ, and so do the logits
    other = policy.step([frames[0]], "stop now", state)
    assert not torch.equal(other.logits, chunks[0].logits)
    return chunks


def tiny_tick_logits(model, dtype) -> tuple[MultiRatePolicy, np.ndarray]:
    """`model` (tiny) in a MultiRatePolicy at `dtype` over three random frames with a tick each: the policy and the
    ticks' logits [3, ...]; and the logits' relative error against a reference run is `logits_error`."""
    config = model.config
    rng = np.random.default_rng(4)
    frames = rng.integers(0, 256, (3, 1, config.image_size, config.image_size, 3), dtype=np.uint8)
    state = np.linspace(-1, 1, config.state_dim, dtype=np.float32)
    policy = MultiRatePolicy(model, dtype=dtype)
    policy.update_text("keep lane")
    logits = []
    for frame in frames:
        policy.update_vision(policy.prepare_frames(list(frame)), state=state)
        logits.append(policy.action_tick(state).logits)
    return policy, np.stack(logits)


def logits_error(logits: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))
