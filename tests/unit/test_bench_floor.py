"""bench/floor.py: each stage's FLOP count against the matrix products the policy actually executes, and the
measurements' plumbing (no wall-clock speed is asserted)."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from vla_node.bench import floor as floor_module
from vla_node.bench.floor import (
    INT8_WAY,
    FloorSampler,
    MatrixRate,
    floor_ms,
    measure_bandwidth,
    measure_floor,
    measure_matrix_rate,
    stage_work,
)
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy

aten = torch.ops.aten
GEMM_OPS = {aten.linear.default: (0, 1), aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}  # (x, weight) args
MATMUL_OPS = (aten.matmul.default, aten.bmm.default)


class ExecutedProducts(TorchDispatchMode):
    """Every matrix product dispatched: linear layers as (M, K, N) shapes, batched matmuls (attention) as FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms, self.attention_flops, self.convolutions = Counter(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMM_OPS:
            x, w = (args[i] for i in GEMM_OPS[func])
            if func is aten.linear.default:  # weight [N, K]
                k, n = w.shape[1], w.shape[0]
            else:  # [K, N]
                k, n = w.shape
            self.gemms[(x.numel() // k, k, n)] += 1
        elif func in MATMUL_OPS:
            a, b = args[0], args[1]
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]).numel()
            self.attention_flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        elif func is aten.convolution.default:
            self.convolutions += 1
        return func(*args, **(kwargs or {}))


def drive(config, refreshed=None):
    """update_text (the text partition full), state_slots - 1 ticks, then under the log: a full frame with its tick,
    optionally a reuse frame with `refreshed` tokens and its tick (each recomputing the other stored states in its
    pass), and a tick after it (the states fresh). Returns the logs by stage."""
    rng = np.random.default_rng(0)
    policy = MultiRatePolicy(build_vla(config))
    policy.update_text("x" * (config.max_text_tokens - 1))
    state = np.linspace(-0.5, 0.5, config.state_dim, dtype=np.float32)
    for _ in range(config.state_slots - 1):
        policy.action_tick(state)

    def images():
        return rng.integers(0, 256, (config.num_cameras, config.image_size, config.image_size, 3), dtype=np.uint8)

    logs = {"frame": ExecutedProducts(), "reuse_frame": ExecutedProducts(), "tick": ExecutedProducts()}
    with logs["frame"]:
        update = policy.update_vision(images(), state=state)
    assert update.chunk is not None and update.full  # the tick ran in the frame's pass
    if refreshed is not None:
        C, T = config.num_cameras, config.tokens_per_camera
        per_camera = [refreshed // C + (cam < refreshed % C) for cam in range(C)]  # as stage_work splits them
        tokens = [torch.arange(r) * (T // r) if r else torch.arange(0) for r in per_camera]
        with logs["reuse_frame"]:
            update = policy.update_vision(images(), tokens, state=state)
        assert update.chunk is not None and not update.full
    assert not policy._states_stale  # the frame's pass recomputed them: the tick is the new state and the queries
    with logs["tick"]:
        policy.action_tick(state)
    return logs


def shapes(work):
    return Counter({(g.m, g.k, g.n): g.count for g in work.gemms})


TWO_CAMERAS = preset("tiny").replace(name="tiny, 2 cameras of 16 tokens", image_size=64, num_cameras=2)


@pytest.mark.parametrize("config,refreshed", [(preset("tiny"), None), (preset("small"), 20), (TWO_CAMERAS, 5),
                                              (TWO_CAMERAS, 1), (TWO_CAMERAS, 32)],
                         ids=["tiny", "small", "two cameras", "one token", "every token"])
def test_counts_match_the_executed_products(config, refreshed):
    logs = drive(config, refreshed)
    stages = [("frame", None), ("tick", None)] + ([("reuse_frame", refreshed)] if refreshed else [])
    for stage, r in stages:
        work, log = stage_work(config, stage, r), logs[stage]
        assert log.convolutions == 0  # the patch embedding runs as a GEMM (embed_patches)
        assert shapes(work) == log.gemms, stage
        assert work.attention_flops == log.attention_flops, stage
        executed = sum(2 * m * k * n * count for (m, k, n), count in log.gemms.items()) + log.attention_flops
        assert work.flops == executed, stage


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_weights_are_the_models_matrices(name):
    """frame: every linear layer's weight and the patch embedding's; tick: the decoder's, the state's, the head's."""
    model = build_vla(preset(name))
    layers = (torch.nn.Linear, torch.nn.Conv2d)
    matrices = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, layers)}
    assert stage_work(model.config, "frame").weight_elements == sum(matrices.values())
    tick = sum(v for n, v in matrices.items() if n.startswith(("decoder.", "state_proj")))
    assert stage_work(model.config, "tick").weight_elements == tick


def test_tick_rows():
    c = preset("small")
    work = stage_work(c, "tick")
    block = 1 + c.action_tokens  # the new state and the queries: the stored states are fresh
    # every decoder layer's 7 products on the block's rows (q_proj and o_proj share a shape here), the state's
    # embedding, the action head on the H*D queries
    assert sum(g.count for g in work.gemms if g.m == block) == 7 * c.num_layers
    assert {(g.m, g.k, g.n, g.count) for g in work.gemms if g.m != block} == {
        (1, c.state_dim, c.hidden_size, 1), (c.action_tokens, c.hidden_size, c.vocab_size, 1)}
    assert "tick of small" in work.describe()


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
def test_reuse_of_every_token_is_the_full_frame(name):
    """Every token refreshed: the tower and the decoder recompute every row, so the products are the frame's."""
    config = preset(name)
    frame, reuse = stage_work(config, "frame"), stage_work(config, "reuse_frame", config.tokens_per_frame)
    assert reuse.gemms == frame.gemms
    assert (reuse.flops, reuse.weight_elements, reuse.kv_elements) == (frame.flops, frame.weight_elements,
                                                                        frame.kv_elements)
    fewer = stage_work(config, "reuse_frame", 1)
    assert fewer.gemm_flops < frame.gemm_flops or config.tokens_per_frame <= 9  # tiny: 1 + the sample is all 4


def test_bad_arguments_are_named():
    c = preset("tiny")
    with pytest.raises(ValueError, match="stage 'video'"):
        stage_work(c, "video")
    for refreshed in (0, c.tokens_per_frame + 1, None, 1.5):
        with pytest.raises(ValueError, match=f"refreshed {refreshed!r}: expected an integer in 1..4"):
            stage_work(c, "reuse_frame", refreshed)
    with pytest.raises(ValueError, match="refreshed 2 with stage 'frame'"):
        stage_work(c, "frame", 2)
    with pytest.raises(ValueError, match="vision_frames 2"):
        stage_work(c.replace(vision_frames=2), "frame")
    with pytest.raises(ValueError, match="rate_gflops 0"):
        floor_ms(stage_work(c, "tick"), 0, 1.0, 4, 4)


def test_measurements_are_positive_and_finite():
    work = stage_work(preset("tiny"), "tick")
    rate = measure_matrix_rate(work.gemms, torch.float32, repeats=1)
    assert math.isfinite(rate["gflops"]) and rate["gflops"] > 0
    assert len(rate["per_shape"]) == len(work.gemms)
    assert all(s["gflops"] > 0 and s["us"] > 0 for s in rate["per_shape"])
    bandwidth = measure_bandwidth(1 << 16, repeats=1)
    assert math.isfinite(bandwidth) and bandwidth > 0


def test_floor_is_the_larger_bound():
    work = stage_work(preset("tiny"), "frame")
    memory = floor_ms(work, 1e9, 1.0, 2, 1)
    assert memory["bound"] == "memory" and memory["floor_ms"] == memory["memory_ms"] > memory["compute_ms"]
    assert memory["memory_ms"] == pytest.approx((work.weight_elements * 2 + work.kv_elements) / 1e9 * 1e3)
    compute = floor_ms(work, 1.0, 1e9, 2, 1)
    assert compute["bound"] == "compute" and compute["floor_ms"] == compute["compute_ms"] > compute["memory_ms"]
    assert compute["compute_ms"] == pytest.approx(work.flops / 1e9 * 1e3)


def test_measure_floor_is_json():
    result = measure_floor(preset("tiny"), "reuse_frame", torch.float32, 4, 1, refreshed=2, repeats=1)
    assert json.loads(json.dumps(result)) == result
    assert result["floor_ms"] == max(result["compute_ms"], result["memory_ms"]) > 0
    assert result["bound"] in ("compute", "memory") and result["refreshed"] == 2


def test_the_matrix_rate_takes_the_fastest_way_the_machine_multiplies():
    """In bf16 on a CPU whose oneDNN runs bf16 in hardware the prepacked matmul (the node's packed weights) is timed
    beside F.linear, and where it is built the fused CPU kernels' linear too; all compute the same product; each
    shape names the way its time came from."""
    from vla_node.backends import cpu_kernels
    from vla_node.backends.packed_weights import packed_weights_available
    from vla_node.bench.floor import _matmuls

    x, w = torch.randn(20, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    ways = _matmuls(x, w)
    assert set(ways) == ({"F.linear"} | ({"prepacked"} if packed_weights_available() else set())
                         | ({"cpu_kernels.linear"} if cpu_kernels.linear_kernel() else set()))
    with torch.inference_mode():
        for fn in ways.values():
            torch.testing.assert_close(fn().float(), F.linear(x, w).float(), rtol=2 ** -7, atol=1e-2)
    assert set(_matmuls(x.float(), w.float())) == {"F.linear"}
    rate = measure_matrix_rate([(20, 64, 48, 3)], torch.bfloat16, repeats=1)
    assert rate["per_shape"][0]["by"] in ways and rate["gflops"] > 0


def test_with_int8_weights_the_int8_linear_is_one_of_the_ways():
    """int8 weights: the kernels' int8 linear is timed beside the bf16 ways where it runs and takes the weight (K a
    multiple of 4); it computes the product within its quantization error."""
    from vla_node.backends import cpu_kernels
    from vla_node.bench.floor import _matmuls

    x, w = torch.randn(20, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    ways = _matmuls(x, w, int8=True)
    assert set(ways) == set(_matmuls(x, w)) | ({"cpu_kernels.linear_int8"} if cpu_kernels.int8_linear_kernel()
                                               else set())
    assert "cpu_kernels.linear_int8" not in _matmuls(x[:, :62], w[:, :62], int8=True)  # K = 62: not on that kernel
    exact = F.linear(x.double(), w.double())
    with torch.inference_mode():
        for fn in ways.values():
            assert torch.linalg.vector_norm(fn().double() - exact) / torch.linalg.vector_norm(exact) < 0.02
    if cpu_kernels.int8_linear_kernel():
        rate = measure_matrix_rate([(20, 64, 48, 1)], torch.bfloat16, repeats=1, int8=True)
        assert rate["per_shape"][0]["by"] in ways and rate["gflops"] > 0


def test_the_attention_can_count_at_its_own_rate():
    work = stage_work(preset("tiny"), "frame")
    split = floor_ms(work, 2.0, 1e9, 1, 2, attention_rate_gflops=1.0)
    assert split["compute_ms"] == pytest.approx((work.gemm_flops / 2.0 + work.attention_flops / 1.0) / 1e6)
    assert floor_ms(work, 2.0, 1e9, 1, 2)["compute_ms"] == pytest.approx(work.flops / 2.0 / 1e6)
    with pytest.raises(ValueError, match="attention_rate_gflops nan"):
        floor_ms(work, 2.0, 1e9, 1, 2, attention_rate_gflops=float("nan"))


def test_the_int8_floor_counts_one_byte_per_weight_and_names_the_attention_rate():
    from vla_node.backends import cpu_kernels

    with pytest.raises(ValueError, match="int8 weights with dtype torch.float32: expected torch.bfloat16"):
        measure_floor(preset("tiny"), "tick", torch.float32, 1, 2, int8_weights=True, repeats=1)
    if not cpu_kernels.int8_linear_kernel():
        pytest.skip(f"the int8 linear kernel does not run here ({cpu_kernels.status()})")
    sampler = FloorSampler(preset("tiny"), "tick", torch.bfloat16, 1, 2, int8_weights=True, repeats=1)
    sampler.sample()
    int8 = sampler.floor()
    bf16 = measure_floor(preset("tiny"), "tick", torch.bfloat16, 2, 2, repeats=1)
    assert json.loads(json.dumps(int8)) == int8 and "attention_gflops" not in bf16
    assert int8["attention_gflops"] > 0 and int8["weight_mb"] == pytest.approx(bf16["weight_mb"] / 2, rel=1e-3)
    # the attention's rate: the same samples' bf16 ways (the int8 linear left out)
    assert int8["attention_gflops"] == sampler.rate.result(exclude=(INT8_WAY,))["gflops"]
    assert INT8_WAY not in {s["by"] for s in sampler.rate.result(exclude=(INT8_WAY,))["per_shape"]}


def test_the_rate_is_each_shapes_best_time_over_its_samples(monkeypatch):
    """A busy moment in one sample does not set the floor: each shape's time is its best way's best over every
    sample (the loops' times scripted here: sample 1 slow, sample 2 fast for one way, sample 3 in between)."""
    work = stage_work(preset("tiny"), "tick")
    rate = MatrixRate(work.gemms, torch.float32, repeats=1)
    with pytest.raises(RuntimeError, match="before any sample"):
        rate.result()
    script = iter([2e-3, 1e-3, 1.5e-3])
    for _ in range(3):
        seconds = next(script)
        monkeypatch.setattr(floor_module, "_best_seconds", lambda fn, repeats, device, s=seconds: s)
        rate.sample()
    result = rate.result()
    assert result["samples"] == 3 and all(shape["us"] == 1000 for shape in result["per_shape"])
    assert result["gflops"] == pytest.approx(work.gemm_flops / 1e-3 / sum(g.count for g in work.gemms) / 1e9,
                                             rel=1e-3)
    one = measure_matrix_rate(work.gemms, torch.float32, repeats=1)  # one sample, as before
    assert one["samples"] == 1 and one["per_shape"][0]["us"] == 1500


def test_the_floor_sampler_takes_the_best_rate_and_bandwidth_of_its_samples(monkeypatch):
    """FloorSampler.floor() from every sample: the matrix rate's best times and the highest bandwidth seen, with
    `samples` in the JSON; one sample is measure_floor."""
    sampler = FloorSampler(preset("tiny"), "frame", torch.float32, 4, 4, repeats=1)
    for seconds, bandwidth in ((2e-3, 10.0), (1e-3, 5.0)):
        monkeypatch.setattr(floor_module, "_best_seconds", lambda fn, repeats, device, s=seconds: s)
        monkeypatch.setattr(floor_module, "measure_bandwidth", lambda nbytes, repeats, device, b=bandwidth: b)
        sampler.sample()
    result = sampler.floor()
    assert json.loads(json.dumps(result)) == result and result["samples"] == 2
    assert result["bandwidth_gbs"] == 10.0 and result["matrix_gflops"] == sampler.rate.result()["gflops"]
    expected = floor_ms(sampler.work, sampler.rate.result()["gflops"], 10.0, 4, 4)
    assert result["floor_ms"] == pytest.approx(expected["floor_ms"], rel=1e-3)
