"""DecoderPartialStep: equal (fp32, to float rounding) to FrameTokenCache.run in the node's default configuration
(attend_all, no drift gates, no layer budget; shared drift samples 8 or 0), with and without the action tick's rows
in the same pass, over a first full frame and then partial frames; a full refresh's K/V equal FrameStep's; exported
at opset 20, ONNX Runtime equal to torch; decoder_rows' rows and errors."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from vla_node.backends.decoder_partial_step import (
    DECODER_INPUTS,
    DECODER_OUTPUTS,
    DECODER_TICK_INPUTS,
    DECODER_TICK_OUTPUTS,
    DecoderPartialStep,
    decoder_rows,
)
from vla_node.backends.export import OPSET, export_step
from vla_node.backends.steps import FrameStep, block_attention, frame_bias, tick_bias
from vla_node.kv.attention import Segment
from vla_node.model.action_head import ActionBins
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.vision_cache import ExtraRows, FrameTokenCache, shared_sample

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle of the exported graph")
onnx = pytest.importorskip("onnx", reason="onnx checks the exported graph")

CONFIGS = {
    "tiny": preset("tiny"),  # 1 camera of 4 tokens
    "tiny-2cam": preset("tiny").replace(image_size=64, num_cameras=2),  # 2 cameras of 16 tokens: room for padding
    "small": preset("small"),  # 1 camera of 196 tokens
}
VALID_TEXT = 9  # of the text partition's Tt slots


@functools.cache
def model_of(name: str):
    return build_vla(CONFIGS[name], seed=0)


def close(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> bool:
    """Within tol of the expected tensor's magnitude (fp32, another GEMM row count: never bit equality)."""
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return (got - expected).abs().max().item() <= tol * expected.abs().max().item()


def frames(name: str, samples: int, tick: bool, pad: int, partial: int = 3, seed: int = 0):
    """A first full frame, then `partial` frames with some tokens' tower outputs perturbed, through FrameTokenCache
    (committed each time). Yields (step, its inputs as a dict in DECODER_(TICK_)INPUTS order, what the cache staged
    under the step's output names); the step's capacity is the rows needed plus `pad`, at most T."""
    model = model_of(name)
    c = model.config
    T, L, KV, hd, Tt, S, Q = (c.tokens_per_frame, c.num_layers, c.num_kv_heads, c.head_dim, c.max_text_tokens,
                              c.state_slots, c.action_tokens)
    g = torch.Generator().manual_seed(seed)
    text_k, text_v = torch.randn(L, KV, Tt, hd, generator=g), torch.randn(L, KV, Tt, hd, generator=g)
    text_bias = torch.full((Tt,), float("-inf"))
    text_bias[:VALID_TEXT] = 0.0
    positions = torch.tensor(list(c.vision_positions(0)))
    cache = FrameTokenCache(model.decoder.model.layers, model.decoder.rope, T, torch.float32, attend_all=True,
                            shared_drift_samples=samples, extra_rows=S + Q)

    def text(layer: int) -> Segment:  # the eager code reads the valid slots only
        return Segment(text_k[layer, :, :VALID_TEXT], text_v[layer, :, :VALID_TEXT], None)

    tower = torch.randn(c.num_cameras, c.tokens_per_camera, c.vision_width, generator=g)
    with torch.inference_mode():
        queries = model.embed_text(model.query_ids(None))  # [Q, hidden]
        for frame in range(1 + partial):
            tokens = None
            if frame:
                tokens = torch.randperm(T, generator=g)[: max(1, T // 5)]
                tower = tower.clone()
                tower.view(T, -1)[tokens] += 0.5 * torch.randn(tokens.numel(), c.vision_width, generator=g)
            needed = int((decoder_rows(tokens, T, T, samples)[0] < T).sum())
            capacity = T if tokens is None else min(T, needed + pad)
            rows, sample_at, sample_weight = decoder_rows(tokens, T, capacity, samples)
            inputs = {"tower_out": tower, "positions": positions, "text_k": text_k, "text_v": text_v,
                      "text_bias": text_bias, "rows": rows, "sample_at": sample_at, "sample_weight": sample_weight,
                      "q": cache.q.clone(), "attn_out": cache.attn_out.clone(), "mlp_out": cache.mlp_out.clone()}
            extra = None
            if tick:  # TickStep's rows: the new state in ring slot `slot`, the others after it, the queries
                slot = frame % S
                others = [s for s in range(S) if s != slot]
                stored_valid = (torch.arange(S - 1) + frame) % 3 != 1
                bias = tick_bias(torch.cat([text_bias, torch.zeros(T)]), stored_valid, Q)
                inputs.update(state_x=torch.randn(S, c.hidden_size, generator=g),
                              tick_positions=torch.tensor([c.state_base + s for s in [slot, *others]]
                                                          + list(range(c.query_base, c.query_base + Q))),
                              tick_bias=bias)

                def attend(layer, q, k_rows, v_rows, frame_k, frame_v, bias=bias):
                    keys = torch.cat([text_k[layer], frame_k, k_rows], dim=1)  # text | frame | the rows
                    values = torch.cat([text_v[layer], frame_v, v_rows], dim=1)
                    return block_attention(q, keys, values, bias)

                extra = ExtraRows(torch.cat([inputs["state_x"], queries]), inputs["tick_positions"], attend,
                                  torch.zeros(L, KV, S + Q, hd), torch.zeros(L, KV, S + Q, hd))
            x = model.project_vision(tower)
            cache.run(x, positions, tokens, text, "keep lane", extra=extra)
            staged = cache._stage  # the staged state (q, attn_out, mlp_out have no public view)
            expected = {"frame_embeds": x, "frame_k": cache.staged_k.clone(), "frame_v": cache.staged_v.clone(),
                        "q_new": staged["q"].clone(), "attn_out_new": staged["attn_out"].clone(),
                        "mlp_out_new": staged["mlp_out"].clone()}
            if tick:
                expected.update(logits=model.decoder.logits(extra.hidden[S:]), state_k=extra.out_k[:, :, :S].clone(),
                                state_v=extra.out_v[:, :, :S].clone())
            cache.commit()
            yield DecoderPartialStep(model, capacity, samples, tick).eval(), inputs, expected


CASES = [
    pytest.param("tiny-2cam", 8, True, 0, id="2cam-s8-tick"),
    pytest.param("tiny-2cam", 8, True, 3, id="2cam-s8-tick-padded"),
    pytest.param("tiny-2cam", 8, False, 3, id="2cam-s8-padded"),
    pytest.param("tiny-2cam", 0, True, 3, id="2cam-s0-tick-padded"),
    pytest.param("tiny-2cam", 0, False, 0, id="2cam-s0"),
    pytest.param("tiny", 8, True, 0, id="tiny-s8-tick"),
    pytest.param("tiny", 0, True, 1, id="tiny-s0-tick-padded"),
    pytest.param("small", 8, True, 5, id="small-s8-tick-padded"),
    pytest.param("small", 0, False, 0, id="small-s0"),
]


@pytest.mark.parametrize("name, samples, tick, pad", CASES)
def test_the_partial_step_equals_the_frame_token_cache(name, samples, tick, pad):
    bins = ActionBins(CONFIGS[name])
    names = DECODER_TICK_OUTPUTS if tick else DECODER_OUTPUTS
    capacities = []
    for i, (step, inputs, expected) in enumerate(frames(name, samples, tick, pad)):
        assert tuple(inputs) == (DECODER_TICK_INPUTS if tick else DECODER_INPUTS)
        with torch.inference_mode():
            got = dict(zip(names, step(*inputs.values()), strict=True))
        for out in names:
            assert close(got[out], expected[out]), (i, out)
        if tick:
            assert torch.equal(bins.bins_from_logits(got["logits"]), bins.bins_from_logits(expected["logits"])), i
        capacities.append(step.capacity)
    T = CONFIGS[name].tokens_per_frame
    assert capacities[0] == T  # the first frame: a full refresh, rows = arange(T)
    if name != "tiny":  # (tiny's 4 tokens: the gate's one and the sample are all of them)
        assert all(capacity < T for capacity in capacities[1:])  # the partial frames ran partial


def test_the_tick_rows_ignore_invalid_stored_states():
    """A stored state marked invalid in tick_bias changes neither the queries' logits nor the other rows' K/V."""
    name = "tiny-2cam"
    *_, (step, inputs, _) = frames(name, 8, True, 2, partial=1)
    S = CONFIGS[name].state_slots
    valid = torch.tensor([False] + [True] * (S - 2))  # stored state 1 (row 1) invalid
    T = CONFIGS[name].tokens_per_frame
    inputs["tick_bias"] = tick_bias(torch.cat([inputs["text_bias"], torch.zeros(T)]), valid,
                                    CONFIGS[name].action_tokens)
    with torch.inference_mode():
        a = dict(zip(DECODER_TICK_OUTPUTS, step(*inputs.values())))
        inputs["state_x"] = inputs["state_x"].clone()
        inputs["state_x"][1] += 3.0
        b = dict(zip(DECODER_TICK_OUTPUTS, step(*inputs.values())))
    assert torch.equal(a["logits"], b["logits"])
    keep = [s for s in range(S) if s != 1]
    assert torch.equal(a["state_k"][:, :, keep], b["state_k"][:, :, keep])
    assert not torch.equal(a["state_k"][:, :, 1], b["state_k"][:, :, 1])  # the invalid row itself did move
    for out in DECODER_OUTPUTS:
        assert torch.equal(a[out], b[out]), out  # the frame never sees the tick's rows


@pytest.mark.parametrize("name", ["tiny-2cam", "small"])
def test_a_full_refresh_equals_the_frame_step(name):
    """K = T, rows = arange(T): the frame's embeddings and K/V as FrameStep computes them from the pixels."""
    model = model_of(name)
    c = model.config
    T = c.tokens_per_frame
    step, inputs, _ = next(frames(name, 8, False, 0, partial=0))
    pixels = torch.rand(c.num_cameras, 3, c.image_size, c.image_size, generator=torch.Generator().manual_seed(3))
    pixels = pixels * 2 - 1
    with torch.inference_mode():
        inputs["tower_out"] = model.vision(pixels)
        embeds, frame_k, frame_v, *_ = step(*inputs.values())
        expected = FrameStep(model).eval()(pixels, inputs["positions"], inputs["text_k"], inputs["text_v"],
                                           frame_bias(inputs["text_bias"] == 0, T))
    for got, want in zip((embeds, frame_k, frame_v), expected, strict=True):
        assert close(got, want)


EXPORTS = [
    pytest.param("tiny-2cam", 8, True, 2, id="2cam-s8-tick"),
    pytest.param("tiny-2cam", 0, False, 2, id="2cam-s0"),
    pytest.param("tiny-2cam", 0, True, 0, id="2cam-s0-tick"),
    pytest.param("tiny", 8, False, 0, id="tiny-s8"),
    pytest.param("small", 8, True, 6, id="small-s8-tick"),
]


@pytest.mark.parametrize("name, samples, tick, pad", EXPORTS)
def test_the_exported_step_is_checked_and_onnx_runtime_equals_torch(tmp_path, name, samples, tick, pad):
    *_, (step, inputs, _) = frames(name, samples, tick, pad, partial=1)  # a partial frame's inputs
    outputs = DECODER_TICK_OUTPUTS if tick else DECODER_OUTPUTS
    start = time.perf_counter()
    sidecar = export_step(step, inputs, outputs, tmp_path / "decoder_partial.onnx")
    print(f"{name}: exported and checked in {time.perf_counter() - start:.1f} s")
    assert sidecar["opset"] <= OPSET <= 20
    assert [i["name"] for i in sidecar["inputs"]] == list(DECODER_TICK_INPUTS if tick else DECODER_INPUTS)
    assert [o["name"] for o in sidecar["outputs"]] == list(outputs)
    for out, figures in sidecar["parity_onnxruntime_vs_torch"].items():
        assert figures["max_rel"] <= 1e-4, (out, figures)
    graph = onnx.load(str(tmp_path / "decoder_partial.onnx"))
    assert [i.name for i in graph.graph.input] == [i["name"] for i in sidecar["inputs"]]  # none dropped as unused
    assert not {n.op_type for n in graph.graph.node} & {"Attention", "ScaledDotProductAttention", "NonZero"}


# decoder_rows ---------------------------------------------------------------------------------------------------
def test_decoder_rows_full_refresh():
    rows, sample_at, sample_weight = decoder_rows(None, 32, 32, 8)
    assert torch.equal(rows, torch.arange(32))
    assert sample_at.shape == (8,) and sample_weight.shape == (8,) and not sample_weight.any()
    rows, sample_at, sample_weight = decoder_rows(None, 32, 32, 0)
    assert sample_at.shape == (1,) and sample_weight.shape == (1,) and not sample_weight.any()
    with pytest.raises(ValueError, match="full refresh recomputes all 32 tokens: capacity 20"):
        decoder_rows(None, 32, 20, 8)


def test_decoder_rows_adds_the_shared_sample_and_pads():
    tokens = torch.tensor([9, 3, 3, 20])  # unsorted, a repeat
    rows, sample_at, sample_weight = decoder_rows(tokens, 32, 16, 8)
    expected, sample = shared_sample(torch.tensor([3, 9, 20]), 8, torch.zeros(32, dtype=torch.bool))
    assert torch.equal(rows[: expected.numel()], expected) and (rows[expected.numel():] == 32).all()
    assert rows.shape == (16,) and torch.equal(rows[sample_at[: sample.numel()]], sample)
    assert torch.allclose(sample_weight[: sample.numel()], torch.full((sample.numel(),), 1 / sample.numel()))
    assert not sample_weight[sample.numel():].any()
    # no sample without shared drift, nor when the gate holds every token
    rows, _, sample_weight = decoder_rows(tokens, 32, 4, 0)
    assert torch.equal(rows, torch.tensor([3, 9, 20, 32])) and not sample_weight.any()
    rows, _, sample_weight = decoder_rows(torch.arange(31, -1, -1), 32, 32, 8)
    assert torch.equal(rows, torch.arange(32)) and not sample_weight.any()
    # an empty gate: the sample alone (as FrameTokenCache.run with no tokens)
    rows, sample_at, sample_weight = decoder_rows(torch.zeros(0, dtype=torch.long), 32, 8, 8)
    assert (rows < 32).sum() == 8 and torch.equal(rows[sample_at], rows) and sample_weight.sum() == pytest.approx(1)


def test_decoder_rows_errors():
    with pytest.raises(ValueError, match=r"3 gate rows \+ 8 sample rows = 11 rows: the step's capacity is 10"):
        decoder_rows(torch.tensor([1, 2, 3]), 32, 10, 8)
    with pytest.raises(ValueError, match=r"3 gate rows \+ 0 sample rows = 3 rows: the step's capacity is 2"):
        decoder_rows(torch.tensor([1, 2, 3]), 32, 2, 0)
    with pytest.raises(ValueError, match="expected indices in 0..31"):
        decoder_rows(torch.tensor([1, 32]), 32, 10, 0)
    with pytest.raises(ValueError, match="capacity 0: expected 1..32"):
        decoder_rows(torch.tensor([1]), 32, 0, 0)
    with pytest.raises(ValueError, match="capacity 33: expected 1..32"):
        decoder_rows(torch.tensor([1]), 32, 33, 0)
    with pytest.raises(ValueError, match="samples -1"):
        decoder_rows(torch.tensor([1]), 32, 4, -1)


def test_the_step_refuses_a_capacity_out_of_range():
    model = model_of("tiny")
    with pytest.raises(ValueError, match="capacity 5: expected 1..4"):
        DecoderPartialStep(model, 5, 8, False)
    with pytest.raises(ValueError, match="samples -2"):
        DecoderPartialStep(model, 2, -2, True)
