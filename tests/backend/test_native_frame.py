"""backends/native_frame: a frame's decoder layers with the tick's rows in their pass (a reuse frame's, or a full
refresh's), one C call a layer, give the frame cache's own layers' bits (the same kernels in the same order), stop at
the budget as they do, and run only where the Python path is the one they copy."""

import dataclasses

import numpy as np
import pytest
import torch

from helpers.native_layers import WEIGHTS, Counted, needs_native_layers
from vla_node.backends.loading import load_model
from vla_node.backends.native_frame import NativeFrame
from vla_node.backends.tick_engine import intra_op_threads
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.model.config import preset
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reuse import ReuseConfig
from vla_node.runtime.stages import StageAborted

pytestmark = [needs_native_layers, pytest.mark.usefixtures("attention_on_the_kernel")]

CONFIG = preset("tiny").replace(image_size=64)  # 16 tokens a frame; head_dim 16
# 256 tokens of 256 values a frame, 4 heads of 64: the norms and the queries' RoPE split among the threads
WIDE = CONFIG.replace(image_size=128, patch_size=8, hidden_size=256, intermediate_size=512)
TOKENS = [torch.tensor([1, 6, 7, 12]), torch.tensor([0, 15]), torch.tensor([3, 4, 5, 9, 10, 11, 14])]


def _policy(cache: CacheConfig = CacheConfig(), reuse: ReuseConfig = ReuseConfig(), config=CONFIG,
            weights: str = "packed") -> MultiRatePolicy:
    return MultiRatePolicy(load_model(config, weights, seed=5), cache, torch.bfloat16, reuse=reuse)


def _frames(count: int, size: int = CONFIG.image_size) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    return [np.clip(base.astype(np.int16) + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
            for _ in range(count)]


def _drive(policy: MultiRatePolicy, frames: list[np.ndarray]) -> list[torch.Tensor]:
    """A full frame, then partial ones (each with its tick in the pass, ticks between, an instruction change):
    every chunk's logits, then the frame cache's state and the stored states' K/V."""
    out = []
    policy.update_text("keep the lane")
    for i, frame in enumerate(frames):
        state = np.full(CONFIG.state_dim, 0.1 * i, np.float32)
        tokens = None if i == 0 else [TOKENS[i % len(TOKENS)]]
        out.append(policy.update_vision(policy.prepare_frames([frame]), tokens, state=state).chunk.logits)
        out.append(policy.action_tick(state + 1).logits)
        if i == 2:
            policy.update_text("merge right")
    cache = policy._frame_tokens
    out.extend(getattr(cache, name) for name in ("k", "v", "q", "attn_out", "mlp_out"))
    out.extend(policy.action.read(layer)[0] for layer in range(policy.config.num_layers))
    return out


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("config", [CONFIG, WIDE], ids=["tiny", "wide"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_frames_layers_in_one_call_each_give_the_frame_caches_own_bits(threads, config, weights):
    with intra_op_threads(threads):
        reuse = ReuseConfig(shared_drift_samples=2)  # most tokens reused: their staged state is the live one's
        native, layers = (_policy(reuse=reuse, config=config, weights=weights) for _ in range(2))
        assert native._frame_tokens.native is not None, f"NativeFrame did not build for the {weights} policy"
        counted = Counted(native._frame_tokens.native, "layer")
        native._frame_tokens.use_native(counted)
        layers._frame_tokens.use_native(None)
        frames = _frames(6, config.image_size)
        got, want = _drive(native, frames), _drive(layers, frames)
    # every frame native: the partial ones, and in full the first and the one after new text
    assert counted.calls == 6 * config.num_layers
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"item {i} differs by {(a.float() - b.float()).abs().max()}"


def test_a_budget_stop_inside_a_native_frame_commits_nothing():
    native, layers = _policy(), _policy()
    layers._frame_tokens.use_native(None)
    frames = _frames(3)
    state = np.zeros(CONFIG.state_dim, np.float32)
    counted = Counted(native._frame_tokens.native, "layer")
    native._frame_tokens.use_native(counted)
    for policy in (native, layers):
        policy.update_text("go")
        policy.update_vision(policy.prepare_frames([frames[0]]), state=state)
        count, frame_count = policy.state_count, policy.frame_count
        with pytest.raises(StageAborted, match="stopped before decoder layer 1"):
            policy.update_vision(policy.prepare_frames([frames[1]]), [TOKENS[0]], state=state,
                                 check=lambda f: f < 0.75)  # the tower and half of the decoder
        assert (policy.state_count, policy.frame_count) == (count, frame_count)
    assert counted.calls == CONFIG.num_layers + 1  # the full frame, then the partial one's first layer: stopped
    a = native.update_vision(native.prepare_frames([frames[2]]), [TOKENS[1]], state=state).chunk
    b = layers.update_vision(layers.prepare_frames([frames[2]]), [TOKENS[1]], state=state).chunk
    assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("why, cache, reuse, full_frames", [
    ("float vision storage: the tick's rows see the frame by a round trip", dataclasses.replace(
        CacheConfig(), vision=VisionMemoryConfig(storage_dtype="bf16")), ReuseConfig(), 0),
    ("no shared-drift sample: the partial frames' reused rows stay as they are", CacheConfig(),
     ReuseConfig(shared_drift_samples=0), 1),
    ("a per-layer drift gate", CacheConfig(), ReuseConfig(decoder_drift_threshold=0.05), 0),
])
def test_other_paths_run_the_frame_caches_own_layers(why, cache, reuse, full_frames):
    """Where the native frame would not give the Python path's bits it does not run: not at all, or, without a
    shared-drift sample (the partial frames' reused rows stay as they are), only on full frames (every row recomputed,
    nothing to move), here the first."""
    policy = _policy(cache, reuse)
    native = policy._frame_tokens.native
    if native is not None:
        counted = Counted(native, "layer")
        policy._frame_tokens.use_native(counted)
    _drive(policy, _frames(3))
    assert (native is None and not full_frames) or counted.calls == full_frames * CONFIG.num_layers, why


def test_it_builds_only_where_every_piece_runs_on_the_kernels():
    packed = _policy()
    layers = packed.model.decoder.model.layers
    assert NativeFrame.build(layers, 16, 10, 24, packed._prefix) is not None
    assert NativeFrame.build(layers, 16, 10, 24, None) is None
    assert NativeFrame.build(layers, 16, 0, 24, packed._prefix) is None  # no extra rows
    assert MultiRatePolicy(load_model(CONFIG, "plain", seed=5), CacheConfig(), torch.float32)._frame_tokens.native \
        is None


def test_a_run_of_other_operands_is_refused_with_what_was_expected():
    policy = _policy()
    native = policy._frame_tokens.native
    policy._prefix.set_block(None, None, 4)
    x = torch.zeros(16 + 3, CONFIG.hidden_size, dtype=torch.bfloat16)
    rot = torch.zeros(19, CONFIG.head_dim, dtype=torch.bfloat16)
    rows = type("Rows", (), {"rows": torch.tensor([1, 2]), "sample": torch.tensor([2]), "at": torch.tensor([1])})
    kv = torch.zeros(CONFIG.num_layers, CONFIG.num_kv_heads, 3, CONFIG.head_dim, dtype=torch.bfloat16)
    stage = policy._frame_tokens._stage
    with pytest.raises(ValueError, match=r"3 extra rows \(expected the prefix block's 4\)"):
        native.begin(x, rot, rot, rows, torch.arange(5), rot[:5], rot[:5], stage, stage, kv, kv.clone(),
                     (policy._prefix, 24))
    policy._prefix.set_block(None, None, 3)
    with pytest.raises(ValueError, match=r"cos \(19, 16\) torch.float32 \(expected \[19, 16\] bf16\)"):
        native.begin(x, rot.float(), rot, rows, torch.arange(5), rot[:5], rot[:5], stage, stage, kv, kv.clone(),
                     (policy._prefix, 24))
    other = _policy()._prefix
    other.set_block(None, None, 3)
    with pytest.raises(ValueError, match="another prefix buffer than this one's"):
        native.begin(x, rot, rot, rows, torch.arange(5), rot[:5], rot[:5], stage, stage, kv, kv.clone(), (other, 24))
