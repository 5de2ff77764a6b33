"""The pure steps (text, full frame, tick): each equal to what the cached policy computes (fp32, to float rounding),
exported to ONNX at opset 20 and checked, ONNX Runtime equal to the torch step, and both engines running into the
caller's buffers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vla_node.backends.engine import OnnxRuntimeEngine, TorchEngine
from vla_node.backends.export import export_step
from vla_node.backends.steps import FrameStep, TextStep, TickStep, frame_bias, text_bias, tick_bias
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla, to_pixels
from vla_node.runtime.policy import MultiRatePolicy

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle of the exported graph")
onnx = pytest.importorskip("onnx", reason="onnx checks the exported graph")
NAMES = ["state_x", "positions", "prefix_k", "prefix_v", "bias"]
OUTPUTS = ("logits", "state_k", "state_v")


def tick_inputs(policy: MultiRatePolicy, state: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The step's inputs for the policy's next tick, read from its cache (the prefix buffer as loaded)."""
    c, model = policy.config, policy.model
    slot = policy.state_count % c.state_slots
    others = [s for s in range(c.state_slots) if s != slot]
    p = policy._prefix.prefix_tokens
    with torch.inference_mode():
        state_x = torch.cat([model.embed_state(torch.from_numpy(state)), policy._state_embeds[others]])
        positions = torch.tensor([c.state_base + slot] + [c.state_base + s for s in others]
                                 + list(range(c.query_base, c.query_base + c.action_tokens)))
        bias = tick_bias(policy._prefix.bias[0, :p], policy.action.valid[others], c.action_tokens)
        return (state_x.clone(), positions, policy._prefix.k[:, :, :p].clone(), policy._prefix.v[:, :, :p].clone(),
                bias)


def ticks(name: str, n: int = 3):
    """(policy, step inputs, the policy's chunk) for n ticks after as many frames, every partition fp32."""
    model = build_vla(preset(name), seed=0)
    policy = MultiRatePolicy(model, CacheConfig.exact())
    c = policy.config
    policy.update_text("keep lane")
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        policy.update_vision(policy.prepare_frames([rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)]))
        state = rng.normal(size=c.state_dim).astype(np.float32)
        inputs = tick_inputs(policy, state)
        out.append((inputs, policy.action_tick(state)))
    return policy, out


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_the_tick_step_equals_the_cached_policys_tick(name):
    policy, runs = ticks(name)
    step = TickStep(policy.model).eval()
    for i, (inputs, chunk) in enumerate(runs):
        with torch.inference_mode():
            logits, state_k, state_v = step(*inputs)
        scale = chunk.logits.abs().max().item()
        assert (logits - chunk.logits).abs().max().item() <= 1e-4 * scale, i  # fp32, another GEMM row count
        np.testing.assert_array_equal(policy.bins.bins_from_logits(logits).numpy(), chunk.bins)
        assert state_k.shape == (policy.config.num_layers, policy.config.num_kv_heads, policy.config.state_slots,
                                 policy.config.head_dim)


def test_the_exported_tick_step_is_checked_and_onnx_runtime_equals_torch(tmp_path):
    policy, runs = ticks("tiny", n=2)
    step = TickStep(policy.model)
    inputs, _ = runs[-1]
    sidecar = export_step(step, dict(zip(NAMES, inputs)), OUTPUTS, tmp_path / "tick.onnx")
    assert sidecar["opset"] == 20 and [i["name"] for i in sidecar["inputs"]] == NAMES
    assert [o["name"] for o in sidecar["outputs"]] == list(OUTPUTS)
    assert json.loads((tmp_path / "tick.json").read_text()) == sidecar
    for name, figures in sidecar["parity_onnxruntime_vs_torch"].items():  # fp32: within 1e-4 of the magnitude
        assert figures["max_rel"] <= 1e-4, (name, figures)
    graph = onnx.load(str(tmp_path / "tick.onnx"))
    assert not {n.op_type for n in graph.graph.node} & {"Attention", "ScaledDotProductAttention"}  # decomposed


def test_engines_run_into_the_callers_buffers_and_agree(tmp_path):
    """torch and ONNX Runtime engines write into the same preallocated outputs; over several ticks no buffer moves
    and both agree (fp32, bins equal)."""
    policy, runs = ticks("tiny", n=3)
    step = TickStep(policy.model)
    export_step(step, dict(zip(NAMES, runs[0][0])), OUTPUTS, tmp_path / "tick.onnx")
    engines = {"torch": TorchEngine(step, NAMES, OUTPUTS), "onnxruntime": OnnxRuntimeEngine(tmp_path / "tick.onnx")}
    assert engines["onnxruntime"].input_names == tuple(NAMES)
    inputs = {name: t.clone() for name, t in zip(NAMES, runs[0][0])}  # the runtime's buffers, bound once
    outputs = {kind: {name: torch.empty_like(t) for name, t in zip(OUTPUTS, step(*runs[0][0]))} for kind in engines}
    pointers = {kind: {n: t.data_ptr() for n, t in out.items()} for kind, out in outputs.items()}
    for tick_inputs, _ in runs:
        for name, t in zip(NAMES, tick_inputs):
            inputs[name].copy_(t)
        for kind, engine in engines.items():
            engine.run(inputs, outputs[kind])
        a, b = outputs["torch"], outputs["onnxruntime"]
        for name in OUTPUTS:
            assert (a[name] - b[name]).abs().max().item() <= 1e-4 * max(1.0, a[name].abs().max().item()), name
        np.testing.assert_array_equal(policy.bins.bins_from_logits(a["logits"]).numpy(),
                                      policy.bins.bins_from_logits(b["logits"]).numpy())
    assert {kind: {n: t.data_ptr() for n, t in out.items()} for kind, out in outputs.items()} == pointers


def test_an_engine_refuses_buffers_it_cannot_bind(tmp_path):
    policy, runs = ticks("tiny", n=1)
    step = TickStep(policy.model)
    export_step(step, dict(zip(NAMES, runs[0][0])), OUTPUTS, tmp_path / "tick.onnx")
    engine = OnnxRuntimeEngine(tmp_path / "tick.onnx")
    inputs = dict(zip(NAMES, runs[0][0]))
    outputs = {name: torch.empty_like(t) for name, t in zip(OUTPUTS, step(*runs[0][0]))}
    with pytest.raises(ValueError, match="expected exactly"):
        engine.run({k: v for k, v in inputs.items() if k != "bias"}, outputs)
    with pytest.raises(ValueError, match="logits: a contiguous tensor on cpu"):
        engine.run(inputs, {**outputs, "logits": outputs["logits"].t()})


FRAME_NAMES = ["pixels", "positions", "text_k", "text_v", "bias"]
FRAME_OUTPUTS = ("frame_embeds", "frame_k", "frame_v")


def frame_inputs(policy: MultiRatePolicy, images: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The frame step's inputs for a full refresh of `images` (uint8 [C, S, S, 3]) into frame slot 0."""
    c = policy.config
    with torch.inference_mode():
        layers = [policy.text.read(layer) for layer in range(c.num_layers)]
        text_k = torch.stack([k for k, _, _ in layers]).clone()  # [L x [KV, Tt, hd]] -> [L, KV, Tt, hd]
        text_v = torch.stack([v for _, v, _ in layers]).clone()
        return (to_pixels(images, torch.float32), torch.tensor(list(c.vision_positions(0))), text_k, text_v,
                frame_bias(layers[0][2].clone(), c.tokens_per_frame))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_the_frame_step_equals_the_policys_full_refresh(name):
    """vision_frames = 1: the frame's K/V as the cache stores them after a full refresh (fp32 storage)."""
    model = build_vla(preset(name), seed=0)
    policy = MultiRatePolicy(model, CacheConfig.exact())
    c = policy.config
    policy.update_text("keep lane")
    images = policy.prepare_frames([np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)])
    inputs = frame_inputs(policy, images)
    policy.update_vision(images)
    with torch.inference_mode():
        _, frame_k, frame_v = FrameStep(model).eval()(*inputs)
        partition = policy.vision.partitions[0]
        stored = [partition.read(layer) for layer in range(c.num_layers)]
    slots = stored[0][2].nonzero().flatten()
    assert slots.numel() == c.tokens_per_frame
    for got, index in ((frame_k, 0), (frame_v, 1)):
        expected = torch.stack([s[index] for s in stored])[:, :, slots]  # [L, KV, F, hd]
        assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_the_exported_frame_step_runs_in_onnx_runtime_as_in_torch(tmp_path):
    model = build_vla(preset("tiny"), seed=0)
    policy = MultiRatePolicy(model, CacheConfig.exact())
    policy.update_text("keep lane")
    images = policy.prepare_frames([np.random.default_rng(2).integers(0, 256, (48, 64, 3), dtype=np.uint8)])
    sidecar = export_step(FrameStep(model), dict(zip(FRAME_NAMES, frame_inputs(policy, images))), FRAME_OUTPUTS,
                          tmp_path / "frame.onnx")
    assert sidecar["opset"] == 20
    for name, figures in sidecar["parity_onnxruntime_vs_torch"].items():
        assert figures["max_rel"] <= 1e-4, (name, figures)


def test_the_text_step_equals_the_policys_text_partition_and_exports(tmp_path):
    model = build_vla(preset("tiny"), seed=0)
    policy = MultiRatePolicy(model, CacheConfig.exact())
    c = policy.config
    policy.update_text("keep lane")
    n = len(policy.text_ids)
    ids = torch.full((c.max_text_tokens,), 0, dtype=torch.long)
    ids[:n] = torch.tensor(policy.text_ids)
    inputs = {"ids": ids, "positions": torch.arange(c.max_text_tokens), "bias": text_bias(n, c.max_text_tokens)}
    step = TextStep(model)
    with torch.inference_mode():
        text_k, text_v = step.eval()(*inputs.values())
        stored = [policy.text.read(layer) for layer in range(c.num_layers)]
    for got, index in ((text_k, 0), (text_v, 1)):
        expected = torch.stack([s[index] for s in stored])[:, :, :n]  # [L, KV, n, hd]
        assert (got[:, :, :n] - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert torch.isfinite(text_k).all()  # padding rows attend to the instruction, never to nothing
    sidecar = export_step(step, inputs, ("text_k", "text_v"), tmp_path / "text.onnx")
    for name, figures in sidecar["parity_onnxruntime_vs_torch"].items():
        assert figures["max_rel"] <= 1e-4, (name, figures)
