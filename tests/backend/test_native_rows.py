"""backends/native_rows: the action tick's block through each decoder layer in one C call gives the policy's own
layers' bits (the same kernels in the same order), stops at the budget as they do, and applies only where every
piece of a layer runs on the CPU kernels."""

import numpy as np
import pytest
import torch

from helpers.native_layers import WEIGHTS, needs_native_layers
from vla_node.backends import cpu_kernels
from vla_node.backends.loading import load_model
from vla_node.backends.native_rows import NativeRows
from vla_node.backends.tick_engine import intra_op_threads
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.stages import StageAborted

pytestmark = [needs_native_layers, pytest.mark.usefixtures("attention_on_the_kernel")]

CONFIG = preset("tiny").replace(image_size=64)  # 16 tokens a frame; head_dim 16


def _policies(weights: str = "packed") -> tuple[MultiRatePolicy, MultiRatePolicy]:
    """Two policies of the same weights (packed bf16, or int8): the first's tick on NativeRows (a tick with fresh
    states whole on NativeTick, the head of the others on NativeHead), the second's on its own layers and the Python
    head."""
    native, layers = (MultiRatePolicy(load_model(CONFIG, weights, seed=3), CacheConfig(), torch.bfloat16)
                      for _ in range(2))
    assert native._native_rows is not None, f"NativeRows did not build for the {weights} policy"
    layers._native_rows = layers._native_tick = layers._native_head = None
    return native, layers


def _frames(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    frames = []
    for i in range(count):  # a drifting scene: some patches change, most are reused
        frame = base.copy()
        frame[(i * 16) % 64 : (i * 16) % 64 + 16, :32] = rng.integers(0, 256, (16, 32, 3), dtype=np.uint8)
        frames.append(frame)
    return frames


def _drive(policy: MultiRatePolicy, frames: list[np.ndarray]) -> list:
    """Frames with their tick in the pass, ticks after them (the first fused with the stale states, then plain),
    an instruction change: every chunk, then the stored states' K/V and the prefix buffer."""
    out = []
    policy.update_text("keep the lane")
    for i, frame in enumerate(frames):
        state = np.full(CONFIG.state_dim, 0.1 * i, np.float32)
        out.append(policy.update_vision(policy.prepare_frames([frame]), state=state).chunk)
        out.extend(policy.action_tick(state + 0.01 * j) for j in range(3))
        if i == 1:
            policy.update_text("turn left at the light")
            out.extend(policy.action_tick(state) for _ in range(2))
    for layer in range(CONFIG.num_layers):
        k, v, valid = policy.action.read(layer)
        out.append((k, v, valid))
    out.append((policy._prefix.k, policy._prefix.v))
    return out


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_ticks_block_in_one_call_a_layer_gives_the_layers_own_bits(threads, weights):
    with intra_op_threads(threads):
        native, layers = _policies(weights)
        frames = _frames(4)
        got, want = _drive(native, frames), _drive(layers, frames)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(a, tuple):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"K/V item {i} differs"
        else:
            assert torch.equal(a.logits, b.logits), f"chunk {i}: logits differ by {(a.logits - b.logits).abs().max()}"
            assert np.array_equal(a.bins, b.bins), f"chunk {i}: bins differ"


def test_a_budget_stop_between_layers_commits_nothing_and_the_next_tick_is_unchanged():
    native, layers = _policies()
    state = np.zeros(CONFIG.state_dim, np.float32)
    frame = _frames(1)[0]
    asked = []
    for policy in (native, layers):
        policy.update_text("go")
        policy.update_vision(policy.prepare_frames([frame]), state=state)
        policy.action_tick(state)
        count = policy.state_count
        fractions = []
        with pytest.raises(StageAborted, match="stopped before decoder layer 1"):
            policy.action_tick(state, check=lambda f: fractions.append(f) or f < 0.5)
        asked.append(fractions)
        assert policy.state_count == count
    assert asked[0] == asked[1] == [0.0, 0.5]
    a, b = native.action_tick(state + 1), layers.action_tick(state + 1)
    assert torch.equal(a.logits, b.logits)


def test_it_applies_only_where_every_piece_of_a_layer_runs_on_the_kernels():
    packed = MultiRatePolicy(load_model(CONFIG, "packed", seed=3), CacheConfig(), torch.bfloat16)
    assert NativeRows.build(packed.model.decoder.model.layers, packed._prefix) is not None
    assert NativeRows.build(packed.model.decoder.model.layers, None) is None  # no prefix buffer
    fp32 = MultiRatePolicy(load_model(CONFIG, "plain", seed=3), CacheConfig(), torch.float32)
    assert fp32._native_rows is None
    if cpu_kernels.int8_linear_kernel():  # the C layer calls the int8 linear for int8 weights
        int8 = MultiRatePolicy(load_model(CONFIG, "int8", seed=3), CacheConfig(), torch.bfloat16)
        assert int8._native_rows is not None
    del packed.model.decoder.model.layers[0].self_attn.__dict__["qkv"]  # three projections: not one packed matmul
    assert NativeRows.build(packed.model.decoder.model.layers, packed._prefix) is None


def test_a_block_other_than_the_one_set_is_refused_with_what_was_expected():
    native, _ = _policies()
    rows = native._native_rows
    native._prefix.set_block(None, None, 3)
    x = torch.zeros(5, CONFIG.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.zeros(5, CONFIG.head_dim, dtype=torch.bfloat16)
    k = torch.zeros(CONFIG.num_layers, CONFIG.num_kv_heads, 5, CONFIG.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a block of \(5, 64\) torch.bfloat16 rows.* expected the 3 bf16 rows"):
        rows.run(x, cos, sin, k, k.clone())
    native._prefix.set_block(None, None, 5)
    with pytest.raises(ValueError, match=r"K/V out \(2, 2, 5, 16\) torch.float32: expected .* \[2, 2, 5, 16\] bf16"):
        rows.run(x, cos, sin, k.float(), k.float())
    rows.run(x, cos, sin, k, k.clone())  # the block set_block said: runs
