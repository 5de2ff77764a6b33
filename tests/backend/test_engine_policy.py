"""The engine policy: MultiRatePolicy's verbs on engines. With the torch steps it equals the eager policy (fp32, to
float rounding; bins equal), with ONNX Runtime it equals the torch steps; a stage stopped between engine calls
leaves every buffer of the cache as it was; after warm-up no storage or binding pointer changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_node.backends.engine_set import exported_engines, step_specs, torch_engines
from vla_node.backends.store import EngineStore
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.engine_policy import EnginePolicy
from vla_node.runtime.policy import MultiRatePolicy, StageAborted
from vla_node.runtime.reuse import ReuseConfig

pytest.importorskip("onnxruntime", reason="onnxruntime runs the exported steps")


def frames(config, n: int, seed: int = 0):
    """n (images uint8 [C, S, S, 3], per camera the gate's tokens (None: the first frame, full), state): each frame
    repaints a few patches (the gate's tokens) and moves every pixel by up to 2 levels (drift below any gate's
    threshold: reused tokens keep their cached embeddings, the recomputed ones see it)."""
    rng = np.random.default_rng(seed)
    c = config
    grid = c.image_size // c.patch_size
    images = rng.integers(0, 256, (c.num_cameras, c.image_size, c.image_size, 3), dtype=np.uint8)
    out = []
    for i in range(n):
        tokens = None
        if i:
            noise = rng.integers(-2, 3, images.shape)
            images = np.clip(images.astype(np.int64) + noise, 0, 255).astype(np.uint8)
            tokens = []
            for cam in range(c.num_cameras):
                picked = np.sort(rng.choice(grid * grid, max(1, grid * grid // 10), replace=False))
                for t in picked:
                    r, col = divmod(int(t), grid)
                    p = c.patch_size
                    images[cam, r * p : (r + 1) * p, col * p : (col + 1) * p] = rng.integers(0, 256, (p, p, 3))
                tokens.append(torch.from_numpy(picked))
        out.append((images, tokens, rng.normal(size=c.state_dim).astype(np.float32)))
    return out


def drive(policy, config, n: int = 5, fused: bool = True):
    """Chunks of a text update, n frames (each with its tick in the frame's pass when `fused`, then a separate
    tick) and a text change."""
    chunks = []
    policy.update_text("keep the lane")
    for images, tokens, state in frames(config, n):
        update = policy.update_vision(images, tokens, False, None, state if fused else None)
        chunks.append(update.chunk if update.chunk is not None else policy.action_tick(state))
        chunks.append(policy.action_tick(state))
    policy.update_text("turn left at the light")
    chunks.append(policy.action_tick(state))
    return chunks


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def engine_policy(name: str, cache: CacheConfig, backend: str = "torch", store=None, reuse=ReuseConfig()):
    model = build_vla(preset(name), seed=0)
    specs = step_specs(model.config, reuse.shared_drift_samples, tick_in_frame=True)
    engines = (torch_engines(model, specs) if backend == "torch"
               else exported_engines(model, specs, backend, "fp32", store))
    return EnginePolicy(model, engines, cache, reuse=reuse)


@pytest.mark.parametrize("samples", [8, 0])
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_the_torch_steps_equal_the_eager_policy(name, samples):
    """Every chunk (fused and separate ticks, partial frames, a text change), every partition fp32: logits within
    1e-4 relative (the steps and the eager policy multiply different row counts: GEMM blocking differs), bins
    equal."""
    reuse = ReuseConfig(shared_drift_samples=samples)
    config = preset(name)
    eager = drive(MultiRatePolicy(build_vla(config, seed=0), CacheConfig.exact(), reuse=reuse), config)
    engines = drive(engine_policy(name, CacheConfig.exact(), reuse=reuse), config)
    for i, (a, b) in enumerate(zip(eager, engines)):
        assert relative(a.logits, b.logits) < 1e-4, i
        assert (a.bins == b.bins).all(), i


def test_the_torch_steps_follow_the_eager_policy_with_quantized_storage():
    """The node's storage (text bf16, vision int8 KIVI): the same storage code on both sides, so the chunks agree
    closely (a rounding difference can move a value across a quantization step)."""
    config = preset("small")
    eager = drive(MultiRatePolicy(build_vla(config, seed=0), CacheConfig()), config)
    engines = drive(engine_policy("small", CacheConfig()), config)
    bins = np.mean([(a.bins == b.bins).mean() for a, b in zip(eager, engines)])
    assert bins >= 0.99
    assert max(relative(a.logits, b.logits) for a, b in zip(eager, engines)) < 1e-2


def test_onnxruntime_equals_the_torch_steps(tmp_path):
    """The policy on ONNX Runtime engines (built into a store) against the same policy on the torch steps: every
    chunk's logits within 1e-4 relative, bins equal; the separate-tick path too."""
    store = EngineStore(tmp_path / "engines")
    for fused in (True, False):
        reference = drive(engine_policy("tiny", CacheConfig.exact()), preset("tiny"), fused=fused)
        got = drive(engine_policy("tiny", CacheConfig.exact(), "onnxruntime", store), preset("tiny"), fused=fused)
        for i, (a, b) in enumerate(zip(reference, got)):
            assert relative(a.logits, b.logits) < 1e-4, (fused, i)
            assert (a.bins == b.bins).all(), (fused, i)


def snapshot(policy: EnginePolicy) -> list[torch.Tensor]:
    """Every tensor a committed stage may change: partitions, prefix and text buffers, live tower and decoder
    state."""
    live = [*policy._tower[0].values(), *policy._decoder[0].values()]
    return [t.clone() for t in (*policy.text.storage_tensors(), *policy.vision.storage_tensors(),
                                *policy.action.storage_tensors(), policy._prefix_k, policy._prefix_v,
                                policy._prefix_bias, policy._text_k, policy._text_v, *live)]


@pytest.mark.parametrize("stop_at", [0.0, 0.5, 0.75])
def test_a_stage_stopped_between_engine_calls_changes_nothing(stop_at):
    """Stops before the tower (0), after it (0.5), between the decoder's pieces (0.75); the text stage stops before
    its step, before the frame's decoder or between its pieces."""
    config = preset("tiny")
    policy = engine_policy("tiny", CacheConfig())
    policy.update_text("keep the lane")
    (first, _, state), (images, tokens, _) = frames(config, 2)
    policy.update_vision(first, None, False, None, state)
    policy.action_tick(state)
    before = snapshot(policy)
    counts = (policy.frame_count, policy.state_count, policy.instruction)
    stop = lambda fraction: fraction < stop_at  # noqa: E731  (False at stop_at: the stage stops there)
    with pytest.raises(StageAborted):
        policy.update_vision(images, tokens, False, stop, state)
    with pytest.raises(StageAborted):
        policy.update_text("turn right", stop)
    with pytest.raises(StageAborted):
        policy.action_tick(state, lambda fraction: False)
    after = snapshot(policy)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert (policy.frame_count, policy.state_count, policy.instruction) == counts
    # and the policy goes on as if nothing had happened
    assert policy.update_vision(images, tokens, False, None, state).chunk is not None


def test_a_tick_run_without_committing_changes_nothing_and_equals_the_next_tick():
    """commit=False (the node's timing run of the action stage): the chunk the committed tick then gives, bit for
    bit, and every buffer, the ring count and the chunk after as without the timing run."""
    config = preset("tiny")
    timed, plain = engine_policy("tiny", CacheConfig()), engine_policy("tiny", CacheConfig())
    for policy in (timed, plain):
        policy.update_text("keep the lane")
    for images, tokens, state in frames(config, 3):
        for policy in (timed, plain):
            policy.update_vision(images, tokens, False, None, state)
        before = snapshot(timed)
        counts = (timed.frame_count, timed.state_count)
        dry = timed.action_tick(state, commit=False)
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(timed)))
        assert (timed.frame_count, timed.state_count) == counts
        committed, expected = timed.action_tick(state), plain.action_tick(state)
        for chunk in (dry, committed):
            assert torch.equal(chunk.logits, expected.logits) and np.array_equal(chunk.bins, expected.bins)


def test_after_warm_up_no_storage_or_binding_pointer_changes(tmp_path):
    """Over many frames and ticks on ONNX Runtime: the same storage pointers, and no engine binds anew after the
    first two frames (live and staged state swap: each engine holds one binding per side)."""
    config = preset("tiny")
    policy = engine_policy("tiny", CacheConfig(), "onnxruntime", EngineStore(tmp_path / "engines"))
    policy.update_text("keep the lane")
    run = frames(config, 24)
    for images, tokens, state in run[:3]:
        policy.update_vision(images, tokens, False, None, state)
        policy.action_tick(state)
    pointers = {t.data_ptr() for t in policy.storage_tensors()}
    bindings = {name: set(e.bindings) for name, e in policy.engines.engines.items()}
    for images, tokens, state in run[3:]:
        policy.update_vision(images, tokens, False, None, state)
        policy.action_tick(state)
    assert {t.data_ptr() for t in policy.storage_tensors()} == pointers
    assert {name: set(e.bindings) for name, e in policy.engines.engines.items()} == bindings


def test_configurations_the_engines_do_not_cover_are_refused_by_name():
    model = build_vla(preset("tiny").replace(vision_frames=2), seed=0)
    specs = step_specs(preset("tiny"), 8, tick_in_frame=True)
    with pytest.raises(ValueError, match="vision_frames = 2"):
        EnginePolicy(model, torch_engines(build_vla(preset("tiny"), seed=0), specs))
