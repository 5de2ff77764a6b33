"""backends/native_tower: a refresh's tower layers (a partial one's, or a full one's) in two C calls each (the norms
torch's) give the tower cache's own layers' bits, and run only where the Python path is the one they copy."""

import dataclasses

import numpy as np
import pytest
import torch

from helpers.native_layers import WEIGHTS, Counted, needs_native_layers
from vla_node.backends.loading import convert_weights, load_model
from vla_node.backends.tick_engine import intra_op_threads
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reuse import ReuseConfig

pytestmark = [needs_native_layers, pytest.mark.usefixtures("attention_on_the_kernel")]

CONFIG = preset("tiny").replace(image_size=64, vision_width=64, vision_heads=4)  # 16 tokens; tower head_dim 16
TOKENS = [torch.tensor([1, 6, 7, 12]), torch.tensor([0, 15]), torch.tensor([3, 4, 5, 9, 10, 11, 14])]


def _policy(reuse: ReuseConfig = ReuseConfig(shared_drift_samples=2), weights: str = "packed") -> MultiRatePolicy:
    """The policy of packed bf16 (or int8) weights, its tower's biases random (a seeded model's are zero: a lost bias
    would not show)."""
    model = build_vla(CONFIG, seed=7)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.vision.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return MultiRatePolicy(convert_weights(model, weights), CacheConfig(), torch.bfloat16, reuse=reuse)


def _drive(policy: MultiRatePolicy) -> list[torch.Tensor]:
    """A full refresh, then partial ones with their tick: every chunk's logits, then the tower cache's state."""
    rng = np.random.default_rng(2)
    base = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = []
    policy.update_text("keep the lane")
    for i in range(6):
        frame = np.clip(base.astype(np.int16) + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
        tokens = None if i == 0 else [TOKENS[i % len(TOKENS)]]
        state = np.full(CONFIG.state_dim, 0.1 * i, np.float32)
        out.append(policy.update_vision(policy.prepare_frames([frame]), tokens, state=state).chunk.logits)
    cache = policy.tower_cache
    out.extend(getattr(cache, name) for name in ("x_ref", "qkv", "attn_out", "mlp_out", "out"))
    return out


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_refreshs_tower_layers_in_two_calls_each_give_the_tower_caches_own_bits(threads, weights):
    with intra_op_threads(threads):
        native, layers = _policy(weights=weights), _policy(weights=weights)
        assert native.tower_cache.native is not None, f"NativeTower did not build for the {weights} policy"
        counted = Counted(native.tower_cache.native, "half")
        native.tower_cache.use_native(counted)
        layers.tower_cache.use_native(None)
        got, want = _drive(native), _drive(layers)
    assert counted.calls == 6 * CONFIG.vision_layers * 2  # every refresh, the first in full: two halves a layer
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"item {i} differs by {(a.float() - b.float()).abs().max()}"


def test_without_a_shared_drift_sample_a_partial_refresh_runs_the_tower_caches_own_layers():
    policy = _policy(ReuseConfig(shared_drift_samples=0))
    counted = Counted(policy.tower_cache.native, "half")
    policy.tower_cache.use_native(counted)
    _drive(policy)
    assert counted.calls == CONFIG.vision_layers * 2  # the full refresh alone: it has no reused rows to move


def test_it_builds_only_on_the_kernels_and_refuses_other_operands():
    policy = _policy()
    assert MultiRatePolicy(load_model(CONFIG, "plain", seed=7), CacheConfig(), torch.float32).tower_cache.native \
        is None
    native = policy.tower_cache.native
    rows = type("Rows", (), {"rows": torch.tensor([1, 2]), "sample": torch.tensor([2]), "at": torch.tensor([1])})
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    state = {name: getattr(policy.tower_cache, name)[0] for name in ("qkv", "attn_out", "mlp_out")}
    with pytest.raises(ValueError, match=r"rows \(3, 64\) torch.bfloat16 for 2 picked rows.* \[2, 64\]"):
        native.half(0, 0, x, torch.zeros(3, 64, dtype=torch.bfloat16), rows, state, state)


def test_bench_names_the_native_layers_that_run_and_refuses_a_name_they_do_not_match(monkeypatch):
    """bench all's path name says which native layers run (`small`, bf16, packed), and its eager policy is an error,
    not a mislabelled figure, where one of them did not build."""
    from vla_node.backends import native_tick, native_tower
    from vla_node.bench import per_frame
    from vla_node.config import NodeConfig

    base = NodeConfig()
    small = base.replace(model=dataclasses.replace(base.model, weights="packed", dtype="bf16"))  # tiny's tower heads
    config = per_frame.compute_config(small, "bf16")  # (8 wide) are not the attention kernel's
    name = per_frame.path_name(config)
    assert "decoder layers one C call each" in name and "tower layers two C calls each" in name
    assert "the tick with fresh states whole in one C call" in name
    policy = per_frame.eager_policy(config)
    assert (policy.native_tick, policy.native_whole_tick, policy.native_frame, policy.native_tower) == (True,) * 4
    build = native_tick.NativeTick.__dict__["build"]
    monkeypatch.setattr(native_tick.NativeTick, "build", classmethod(lambda cls, *args: None))
    with pytest.raises(RuntimeError, match=r"native layers \{'tick': True, 'whole tick': False, 'tower': True, "):
        per_frame.eager_policy(config)
    monkeypatch.setattr(native_tick.NativeTick, "build", build)  # (undo() would undo attention_on_the_kernel too)
    monkeypatch.setattr(native_tower.NativeTower, "build", classmethod(lambda cls, tower: None))
    with pytest.raises(RuntimeError, match=r"native layers \{'tick': True, 'whole tick': True, 'tower': False, "
                                           r"'reuse frame': True\}"):
        per_frame.eager_policy(config)
