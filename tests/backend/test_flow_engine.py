"""The flow head's tick as an engine step (backends/flow_step.py): FlowTickStep equal to the eager cached flow tick
(MultiRatePolicy, every partition fp32, the same noise) over frames with an instruction change, for both places of
the state; exported to ONNX and equal in ONNX Runtime; and the engine policy on torch and ONNX Runtime engines equal
to the eager policy, at every built step count, a guided tick (real-time chunking) on the eager flow tick."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.model_checks import frames_and_states
from vla_node.backends.engine_set import exported_engines, step_specs, torch_engines
from vla_node.backends.export import export_step
from vla_node.backends.flow_step import FlowTickStep, flow_bias, flow_inputs, flow_outputs, state_bias, state_positions
from vla_node.backends.store import EngineStore
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.flow import ChunkGuide, tick_noise
from vla_node.model.vla import build_vla
from vla_node.runtime.engine_policy import EnginePolicy
from vla_node.runtime.policy import MultiRatePolicy, StageAborted

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle of the exported graph")
onnx = pytest.importorskip("onnx", reason="onnx checks the exported graph")


def flow_config(state: str = "prefix"):
    return preset("tiny", "flow").replace(flow_state=state)


def step_inputs(policy: MultiRatePolicy, state: np.ndarray) -> dict[str, torch.Tensor]:
    """FlowTickStep's inputs for the policy's next tick, read from its partitions (text | vision as stored, the
    stored states' embeddings) and the noise the eager tick draws."""
    c = policy.config
    slot = policy.state_count % c.state_slots
    with torch.inference_mode():
        layers = [[policy._segment(policy.text, layer), *policy.vision.segments(layer)]
                  for layer in range(c.num_layers)]
        prefix_k = torch.stack([torch.cat([s.k for s in segs], 1) for segs in layers])  # [L, KV, P, hd]
        prefix_v = torch.stack([torch.cat([s.v for s in segs], 1) for segs in layers])
        valid = torch.cat([s.mask for s in layers[0]])  # [P]
        prefix_bias = torch.zeros(valid.shape[0]).masked_fill_(~valid, float("-inf"))
        noise = tick_noise(c.action_horizon, c.action_dims, policy.noise_seed, policy.state_count)
        s = torch.from_numpy(state)
        if c.flow_state == "suffix":
            return {"state": s, "prefix_k": prefix_k, "prefix_v": prefix_v, "noise": noise,
                    "expert_bias": flow_bias(c, prefix_bias, None)}
        others = [(slot + i) % c.state_slots for i in range(1, c.state_slots)]
        stored_valid = policy.action.valid[others].clone()
        state_x = torch.cat([policy.model.embed_state(s), policy._state_embeds[others]])  # [S, hidden]
        return {"state_x": state_x, "positions": state_positions(c, slot), "prefix_k": prefix_k,
                "prefix_v": prefix_v, "bias": state_bias(prefix_bias, stored_valid), "noise": noise,
                "expert_bias": flow_bias(c, prefix_bias, stored_valid)}


def ring(policy: MultiRatePolicy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state ring as stored: K and V [L, KV, S, hd], the valid slots [S]."""
    segments = [policy._segment(policy.action, layer) for layer in range(policy.config.num_layers)]
    return (torch.stack([s.k for s in segments]).clone(), torch.stack([s.v for s in segments]).clone(),
            policy.action.valid.clone())


def eager_run(state: str, frames: int = 5):
    """(policy, [(step inputs, eager chunk, the ring after the tick: K, V, valid)]) over `frames` frames, the
    instruction changed before the third."""
    policy = MultiRatePolicy(build_vla(flow_config(state), seed=3), CacheConfig.exact())
    out = []
    for i, (frame, s) in enumerate(frames_and_states(frames, seed=1)):
        instruction = "keep the lane" if i < 2 else "change to the left lane"
        if instruction != policy.instruction:
            policy.update_text(instruction)
        policy.update_vision(policy.prepare_frames([frame]))
        inputs = step_inputs(policy, s)
        chunk = policy.action_tick(s)
        out.append((inputs, chunk, *ring(policy)))
    return policy, out


@pytest.mark.parametrize("state", ["prefix", "suffix"])
def test_the_flow_tick_step_equals_the_eager_flow_tick(state):
    """Every tick's chunk within 1e-4 of the eager tick's (the same noise, ten steps); 'prefix': the state rows' K/V
    equal to the ring the eager tick leaves (the new state's and the other stored states', recomputed)."""
    policy, runs = eager_run(state)
    c = policy.config
    step = FlowTickStep(policy.model, c.flow_steps).eval()
    for i, (inputs, chunk, ring_k, ring_v, valid) in enumerate(runs):
        assert list(inputs) == list(flow_inputs(c))
        with torch.inference_mode():
            outputs = step(*inputs.values())
        assert len(outputs) == len(flow_outputs(c))
        assert outputs[0].dtype == torch.float32 and outputs[0].shape == (c.action_horizon, c.action_dims)
        assert float(np.abs(outputs[0].numpy() - chunk.actions).max()) <= 1e-4, i
        if state == "prefix":  # the state rows' K/V: the ring after the eager tick (the others refreshed at commit)
            slot = i % c.state_slots
            rows = [(slot + j) % c.state_slots for j in range(c.state_slots)]  # state_x's order
            assert bool(valid[slot])
            for row, ring_slot in [(row, r) for row, r in enumerate(rows) if valid[r]]:
                for got, stored in ((outputs[1], ring_k), (outputs[2], ring_v)):
                    assert (got[:, :, row] - stored[:, :, ring_slot]).abs().max().item() <= 1e-5, (i, row)


@pytest.mark.parametrize("state", ["prefix", "suffix"])
def test_the_exported_flow_tick_step_equals_torch_in_onnx_runtime(tmp_path, state):
    """Two Euler steps (each step's graph is the same; the ten-step graph's export costs ~16 s here, and its parity
    is the bench's): checked, decomposed attention, parity within 1e-4 of the magnitude in the sidecar."""
    policy, runs = eager_run(state, frames=2)
    c = policy.config
    inputs = runs[-1][0]
    sidecar = export_step(FlowTickStep(policy.model, 2), inputs, flow_outputs(c), tmp_path / "flow.onnx")
    assert sidecar["opset"] == 20 and [i["name"] for i in sidecar["inputs"]] == list(flow_inputs(c))
    assert [o["name"] for o in sidecar["outputs"]] == list(flow_outputs(c))
    assert json.loads((tmp_path / "flow.json").read_text()) == sidecar
    for name, figures in sidecar["parity_onnxruntime_vs_torch"].items():
        assert figures["max_abs"] <= 1e-4 and figures["max_rel"] <= 1e-4, (name, figures)
    graph = onnx.load(str(tmp_path / "flow.onnx"))
    assert not {n.op_type for n in graph.graph.node} & {"Attention", "ScaledDotProductAttention", "Loop", "If"}


def drive(policy, steps=(None, 5, 2), frames: int = 4, guide_from: int | None = None):
    """Chunks of a text update and `frames` frames (the state given to update_vision: a flow tick never joins the
    frame's pass), after each a tick per count of `steps`, the instruction changed before the third frame; the
    second frame refreshes two tokens only. With `guide_from`, the ticks from that frame on are guided toward the
    previous chunk (real-time chunking)."""
    chunks = []
    for i, (frame, state) in enumerate(frames_and_states(frames, seed=1)):
        instruction = "keep the lane" if i < 2 else "change to the left lane"
        if instruction != policy.instruction:
            policy.update_text(instruction)
        tokens = [torch.tensor([0, 3])] if i == 1 else None
        assert policy.update_vision(policy.prepare_frames([frame]), tokens, False, None, state).chunk is None
        for n in steps:
            guide = None
            if guide_from is not None and i >= guide_from:
                guide = ChunkGuide(torch.from_numpy(chunks[-1].actions), frozen=1, overlap=3)
            chunks.append(policy.action_tick(state, steps=n, guide=guide))
    return chunks


def flow_engine_policy(config, backend: str = "torch", store=None, denoising=(5, 2)) -> EnginePolicy:
    model = build_vla(config, seed=3)
    specs = step_specs(config, 8, tick_in_frame=True, denoising_steps=denoising)
    engines = torch_engines(model, specs) if backend == "torch" else exported_engines(model, specs, backend, "fp32",
                                                                                      store)
    return EnginePolicy(model, engines, CacheConfig.exact())


def assert_same_chunks(ours, theirs, tolerance=1e-4):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.denoising_steps == b.denoising_steps and a.bins is None and a.logits is None, i
        assert float(np.abs(a.actions - b.actions).max()) <= tolerance, i


@pytest.mark.parametrize("state", ["prefix", "suffix"])
def test_the_engine_policy_on_torch_steps_equals_the_eager_policy(state):
    config = flow_config(state)
    specs = step_specs(config, 8, tick_in_frame=True, denoising_steps=(5, 2))
    assert {n for n in specs if "tick" in n} == {"flow-tick-10", "flow-tick-5", "flow-tick-2"}
    eager = MultiRatePolicy(build_vla(config, seed=3), CacheConfig.exact())
    policy = flow_engine_policy(config)
    assert policy.flow_step_counts() == (10, 5, 2)
    ours, theirs = drive(policy), drive(eager)
    assert_same_chunks(ours, theirs)
    assert [c.denoising_steps for c in ours[:3]] == [10, 5, 2]
    assert (policy.state_count, policy.frame_count) == (eager.state_count, eager.frame_count)
    assert torch.equal(policy.action.valid, eager.action.valid)
    state_now = np.zeros(config.state_dim, np.float32)
    with pytest.raises(ValueError, match=r"denoising steps 3: no flow-tick engine .* built: 10, 5, 2"):
        policy.action_tick(state_now, steps=3)
    with pytest.raises(StageAborted, match="before the flow tick step"):
        policy.action_tick(state_now, lambda fraction: False)
    with pytest.raises(ValueError, match="commit=False"):  # a timing run is the bins tick's
        policy.action_tick(state_now, commit=False)
    assert policy.state_count == eager.state_count  # a refused or stopped tick commits nothing
    assert_same_chunks([policy.action_tick(state_now)], [eager.action_tick(state_now)])


@pytest.mark.parametrize("state", ["prefix", "suffix"])
def test_a_guided_tick_on_the_engine_policy_equals_the_guided_eager_tick(state):
    """Guided ticks from the second frame on run the eager flow tick over the engine policy's partitions (the
    ring refreshed after the engines' commits); the unguided ticks between them stay equal too."""
    config = flow_config(state)
    eager = MultiRatePolicy(build_vla(config, seed=3), CacheConfig.exact())
    policy = flow_engine_policy(config)
    steps = (None, 2)
    ours, theirs = drive(policy, steps, guide_from=1), drive(eager, steps, guide_from=1)
    assert_same_chunks(ours, theirs)
    # and unguided engine ticks after guided ones: the ring the guided ticks committed is the engines' too
    frame, s = next(frames_and_states(1, seed=5))
    for p in (policy, eager):
        p.update_vision(p.prepare_frames([frame]))
    assert_same_chunks([policy.action_tick(s), policy.action_tick(s, guide=ChunkGuide(torch.zeros(4, 2), 1, 2))],
                       [eager.action_tick(s), eager.action_tick(s, guide=ChunkGuide(torch.zeros(4, 2), 1, 2))])


def test_the_engine_policy_on_onnx_runtime_equals_it_on_the_torch_steps(tmp_path):
    """A two-step model (flow_steps = 2, the ladder's count 1: the exported graphs' size is the steps'), ONNX Runtime
    engines built into a store against the torch steps and the eager policy."""
    config = flow_config().replace(flow_steps=2)
    store = EngineStore(tmp_path / "engines")
    policy = flow_engine_policy(config, "onnxruntime", store, denoising=(1,))
    reference = flow_engine_policy(config, denoising=(1,))
    eager = MultiRatePolicy(build_vla(config, seed=3), CacheConfig.exact())
    steps = (None, 1)
    ours = drive(policy, steps)
    assert_same_chunks(ours, drive(reference, steps))
    assert_same_chunks(ours, drive(eager, steps))
    # after warm-up no storage pointer changes and each flow tick engine keeps its one binding
    pointers = {t.data_ptr() for t in policy.storage_tensors()}
    flow = {name: e for name, e in policy.engines.engines.items() if name.startswith("flow-tick-")}
    bindings = {name: set(e.bindings) for name, e in flow.items()}
    assert set(flow) == {"flow-tick-2", "flow-tick-1"} and all(len(b) == 1 for b in bindings.values())
    drive(policy, steps, frames=2)
    assert {t.data_ptr() for t in policy.storage_tensors()} == pointers
    assert {name: set(e.bindings) for name, e in flow.items()} == bindings
