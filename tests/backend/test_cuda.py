"""The GPU path (`[model] device = "cuda"`) against the CPU and transformers oracles; skipped where torch has no
CUDA (CI has none: `.ci/gpu` runs this file on a CUDA machine)."""

import numpy as np
import pytest
import torch

from helpers.model_checks import HF_CONFIGS as CONFIGS
from helpers.model_checks import assert_incremental_equals_reference, hf_llama, storage_layout
from helpers.model_checks import moving_band_frames as camera_frames
from helpers.node_harness import LAUNCH_DIR, check_action, running_node, tick_count
from vla_node.config import load_launch
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.vision_config import VisionMemoryConfig
from vla_node.model.checkpoint import save_checkpoint
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reference import ReferencePolicy

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"CUDA is not available to torch {torch.__version__}: the GPU path is checked on a CUDA machine (.ci/gpu)")]

CUDA_LAUNCH = LAUNCH_DIR / "tiny_cuda.toml"


@pytest.fixture(autouse=True, scope="module")
def exact_fp32():
    """fp32 means fp32 while the oracles are compared: no TF32 in matmuls or convolutions."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def drive(n: int, seed: int = 0):
    """n (frame, state) pairs: the steady-state test's moving band, a state per frame."""
    rng = np.random.default_rng(seed)
    return [(f, rng.normal(size=4).astype(np.float32)) for f in camera_frames(n, seed)]


@torch.inference_mode()
def test_decoder_on_cuda_equals_llama_on_cuda(tmp_path):
    model = build_vla(CONFIGS["gqa_8q_2kv"], seed=3)
    hf = hf_llama(save_checkpoint(model, tmp_path)).cuda()
    model = model.cuda()
    ids = torch.randint(0, 516, (37,), generator=torch.Generator().manual_seed(0)).cuda()
    ours = model.decoder(model.embed_text(ids), torch.arange(37, device="cuda"), None)
    theirs = hf(input_ids=ids[None]).logits[0]
    assert ours.device.type == "cuda"
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("decode", ["parallel", "autoregressive"])
@pytest.mark.parametrize("attention", ["segmented", "gather"])
def test_incremental_on_cuda_equals_the_cpu_reference(decode, attention):
    """fp32 everywhere: the node's GPU decoding against full recompute on the CPU, with an instruction change."""
    config = preset("tiny").replace(vision_frames=3, state_slots=2, action_decode=decode)
    cache = CacheConfig(text_dtype="fp32", action_dtype="fp32", attention=attention,
                        vision=VisionMemoryConfig(storage_dtype="fp32"))
    policy = MultiRatePolicy(build_vla(config, seed=5), cache, device="cuda")
    assert all(t.device.type == "cuda" for t in policy.storage_tensors())
    assert_incremental_equals_reference(policy, ReferencePolicy(build_vla(config, seed=5)))


def test_partial_updates_on_cuda_keep_every_storage_tensor():
    """Steady state on the GPU: ticks, partial and full vision updates and an instruction change allocate no
    cache storage (the default cache: int8 vision, gather attention, tick prefix)."""
    config = preset("tiny").replace(image_size=48, state_slots=3)  # 9 tokens a frame
    policy = MultiRatePolicy(build_vla(config, seed=3), CacheConfig(), device="cuda")
    frames = drive(8, seed=1)
    policy.update_text("keep lane")
    for frame, state in frames[:2]:
        policy.update_vision(policy.prepare_frames([frame]))
        for _ in range(config.state_slots):
            policy.action_tick(state)
    before = storage_layout(policy)
    partial = 0
    for i, (frame, state) in enumerate(frames[2:]):
        if i == 3:
            policy.update_text("merge left")
        update = policy.update_vision(policy.prepare_frames([frame]), [torch.tensor([0, 4, 8])])
        partial += update.tokens_refreshed < config.tokens_per_frame
        chunk = policy.action_tick(state)
        assert np.isfinite(chunk.actions).all()
        assert storage_layout(policy) == before, i
    assert partial >= 4  # the instruction change forces one full refresh; the others are partial


def test_bf16_on_cuda_stays_close_to_the_fp32_reference():
    """The rtx/orin launch files' numerics (bf16 compute, int8 vision, bf16 text) against the fp32 CPU reference."""
    config = preset("tiny").replace(vision_frames=1)
    reference = ReferencePolicy(build_vla(config, seed=7))
    policy = MultiRatePolicy(build_vla(config, seed=7), CacheConfig(), torch.bfloat16, "cuda")
    policy.update_text("keep lane")
    errors = []
    for frame, state in drive(6, seed=2):
        policy.update_vision(policy.prepare_frames([frame]))
        ours = policy.action_tick(state).logits.float().cpu()
        theirs = reference.step([frame], "keep lane", state).logits
        assert torch.isfinite(ours).all()
        errors.append(((ours - theirs).norm() / theirs.norm()).item())
    print(f"bf16 on cuda vs fp32 cpu reference: logit rel L2 per frame {[round(e, 4) for e in errors]}")
    assert max(errors) <= 0.05, errors


def test_node_on_cuda_publishes_every_tick_and_fresh_actions(tmp_path):
    config = load_launch(CUDA_LAUNCH)
    model = config.model.model_config()
    with running_node(CUDA_LAUNCH, tmp_path) as node:
        node.stream(1.0)  # the first frames after the handshake
        actions, sent = node.stream(3.0)
        health = node.health()
    assert health["device"] == "cuda", health
    counted = tick_count(actions, config.scheduler.period_ns)
    assert counted["received"] >= 0.99 * counted["expected"], counted
    fresh = [a.msg for a in actions if a.msg["status"] == "fresh"]
    assert len(fresh) >= 10, [a.msg["status"] for a in actions]
    assert {m["frame_seq"] for m in fresh} <= set(sent)
    for a in actions:
        check_action(a.msg, model.action_horizon, model.action_dims, [0.0] * model.action_dims)


@torch.inference_mode()
def test_the_cudagraph_engine_equals_the_eager_step_and_replays_on_the_same_buffers():
    """Every step of the tiny model's engine set: captured once, replayed three times with new input values
    written into the same buffers, equal to the eager step on each (fp32, 1e-5 relative)."""
    from vla_node.backends.cudagraph_engine import CudaGraphEngine
    from vla_node.backends.engine import TorchEngine
    from vla_node.backends.engine_set import step_specs

    model = build_vla(preset("tiny"), seed=0).cuda()
    for name, spec in step_specs(model.config, 8, tick_in_frame=True).items():
        inputs = {n: t.cuda() for n, t in spec.inputs().items()}
        eager, graph = (cls(spec.build(model).cuda(), list(inputs), spec.outputs)
                        for cls in (TorchEngine, CudaGraphEngine))
        with torch.inference_mode():
            results = spec.build(model).cuda()(*inputs.values())
        expected = {n: torch.empty_like(t) for n, t in zip(spec.outputs, results)}
        got = {n: torch.empty_like(t) for n, t in expected.items()}
        for round_ in range(3):
            for t in inputs.values():
                if t.is_floating_point() and t.dim() > 2:  # K/V, states, pixels: new values, same buffers
                    t.mul_(0.9)
            eager.run(inputs, expected)
            graph.run(inputs, got)
            for n in spec.outputs:
                scale = max(1.0, expected[n].abs().max().item())
                assert (got[n] - expected[n]).abs().max().item() <= 1e-5 * scale, (name, n, round_)


def test_the_engine_policy_on_cudagraph_follows_the_eager_policy_on_cuda():
    """The engine policy on CUDA graphs of the torch steps against the eager policy on CUDA (fp32 storage):
    bins equal, logits within 1e-4 relative, over frames with partial refreshes and ticks."""
    from vla_node.backends.cudagraph_engine import CudaGraphEngine
    from vla_node.backends.engine_set import EngineSet, step_specs
    from vla_node.runtime.engine_policy import EnginePolicy

    config = preset("tiny")
    model = build_vla(config, seed=0)
    specs = step_specs(config, 8, tick_in_frame=True)
    engines = EngineSet("cudagraph", "fp32", {n: CudaGraphEngine(s.build(model).cuda(), list(s.inputs()), s.outputs)
                                              for n, s in specs.items()})
    ours = EnginePolicy(model, engines, CacheConfig.exact(), device="cuda")
    eager = MultiRatePolicy(build_vla(config, seed=0), CacheConfig.exact(), device="cuda")
    for policy in (ours, eager):
        policy.update_text("keep lane")
    for i, (frame, state) in enumerate(drive(8)):
        tokens = None if i == 0 else [torch.tensor([i % config.tokens_per_camera])]  # partial after the first
        chunks = []
        for policy in (ours, eager):
            images = policy.prepare_frames([frame])
            policy.update_vision(images, tokens, False, None, state)
            chunks.append(policy.action_tick(state))
        a, b = chunks
        assert (a.bins == b.bins).all()
        assert float((a.logits - b.logits).abs().max() / b.logits.abs().max()) < 1e-4
