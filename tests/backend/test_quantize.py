"""The precision recipes of the tiny preset's exported steps (text, tick, frame): fp32, int8-ort (dynamic) and
int8-trt (static symmetric Q/DQ from a calibration set recorded through StepRecorder), each checked by onnx,
run in ONNX Runtime and compared with the torch step on an input outside the calibration set.

Tolerance (stated): every output of an int8 recipe within 0.2 of the torch output's largest magnitude (max
relative error, export.parity); fp32 within 1e-4. The figures are printed (pytest -s) and land near 0.01-0.03 on
the tiny preset."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vla_node.backends.calibration import (
    CalibrationError,
    StepRecorder,
    quantized_weights,
    read_calibration,
    write_calibration,
)
from vla_node.backends.engine import OnnxRuntimeEngine, TorchEngine
from vla_node.backends.export import export_step, parity
from vla_node.backends.quantize import RECIPES, _u8s8_saturates, quantize
from vla_node.backends.store import weights_digest
from vla_node.bench.engines import STEPS, step_inputs
from vla_node.model.config import preset
from vla_node.model.vla import build_vla

ort = pytest.importorskip("onnxruntime", reason="onnxruntime quantizes and runs the graphs")
onnx = pytest.importorskip("onnx", reason="onnx checks the quantized graphs")
STEP_NAMES = ("text", "tick", "frame")
INT8_TOLERANCE = 0.2  # max relative error of every output vs the torch step (quantized: off, but not garbage)


def perturbed(base: dict[str, torch.Tensor], seed: int, amount: float) -> dict[str, torch.Tensor]:
    """The step's seeded inputs with seeded noise of `amount` (x a unit normal) on the float inputs (not the bias:
    it stays 0 / -inf)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + amount * torch.randn(t.shape, generator=g) if t.is_floating_point() and n != "bias"
            else t.clone() for n, t in base.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Every step of the tiny model exported, 4 calls of each recorded, the set written with the fp32 graphs, and
    each recipe of each step quantized."""
    model = build_vla(preset("tiny"), seed=0)
    folder = tmp_path_factory.mktemp("tiny-steps")
    base = step_inputs(model.config)
    graphs, samples = {}, {}
    for step in STEP_NAMES:
        cls, outputs = STEPS[step]
        graphs[step] = folder / f"{step}.onnx"
        export_step(cls(model), base[step], outputs, graphs[step])
        recorder = StepRecorder(TorchEngine(cls(model), list(base[step]), outputs), limit=4)
        with torch.inference_mode():
            results = recorder.step(*base[step].values())
        outs = {n: torch.empty_like(r) for n, r in zip(outputs, results)}
        for call in range(6):
            recorder.run(perturbed(base[step], call, 0.05 * (call + 1)), outs)  # recorded: the first 4
        samples[step] = recorder.samples
    model_hash = weights_digest(model)
    calibration = read_calibration(write_calibration(tmp_path_factory.mktemp("calib"), model_hash, samples,
                                                     "frames/test", graphs), model_hash)
    quantized, descriptions = {}, {}
    for step in STEP_NAMES:
        for recipe in RECIPES:
            path = folder / f"{step}.{recipe}.onnx"
            given = calibration.for_step(step) if step == "tick" else calibration  # narrowed, or found by inputs
            descriptions[step, recipe] = quantize(recipe, graphs[step], path, None if recipe == "int8-ort" else given)
            quantized[step, recipe] = path
    return {"model": model, "graphs": graphs, "samples": samples, "calibration": calibration, "hash": model_hash,
            "quantized": quantized, "descriptions": descriptions, "folder": folder}


def test_an_unknown_recipe_and_int8_trt_without_calibration_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"recipe 'int4': expected one of fp32, int8-ort, int8-trt"):
        quantize("int4", tiny["graphs"]["tick"], tmp_path / "tick.onnx", None)
    with pytest.raises(ValueError, match=r"int8-trt needs a calibration set.*run `vla-node calibrate`"):
        quantize("int8-trt", tiny["graphs"]["tick"], tmp_path / "tick.onnx", None)
    with pytest.raises(FileNotFoundError, match="export the step first"):
        quantize("int8-ort", tmp_path / "missing.onnx", tmp_path / "tick.onnx")
    with pytest.raises(CalibrationError, match="no step recorded with inputs.*vla-node calibrate"):
        quantize("int8-trt", tiny["graphs"]["frame"], tmp_path / "frame.onnx", tiny["calibration"].for_step("tick"))
    assert not (tmp_path / "tick.onnx").exists()


def test_each_recipe_runs_in_onnx_runtime_near_the_torch_step(tiny, capsys):
    figures = {}
    for step in STEP_NAMES:
        cls, outputs = STEPS[step]
        held_out = perturbed(step_inputs(tiny["model"].config)[step], 99, 0.1)  # like the recorded calls, not one
        with torch.inference_mode():
            expected = [t.float().numpy() for t in cls(tiny["model"]).eval()(*held_out.values())]
        for recipe in RECIPES:
            engine = OnnxRuntimeEngine(tiny["quantized"][step, recipe])
            got = {n: torch.empty(a.shape, dtype=torch.float32) for n, a in zip(outputs, expected)}
            engine.run(held_out, got)
            figures[step, recipe] = parity(expected, [got[n].numpy() for n in outputs], outputs)
    with capsys.disabled():
        print("\nmax relative error vs the torch step (tiny preset, held-out input):")
        for (step, recipe), f in figures.items():
            print(f"  {step:<6}{recipe:<10}" + "  ".join(f"{o} {v['max_rel']:.4f}" for o, v in f.items()))
    for (step, recipe), f in figures.items():
        limit = 1e-4 if recipe == "fp32" else INT8_TOLERANCE
        for output, v in f.items():
            assert v["max_rel"] < limit, (step, recipe, output, v)
            if recipe != "fp32":
                assert v["max_rel"] > 1e-5, (step, recipe, output, v)  # really quantized


def test_the_descriptions_say_what_was_quantized(tiny):
    for step in STEP_NAMES:
        graph = onnx.load(str(tiny["graphs"][step]))
        weights = [node.op_type for node, _, _ in quantized_weights(graph)]
        expected = {op: weights.count(op) for op in sorted(set(weights))}
        assert tiny["descriptions"][step, "fp32"]["quantized"] == {}
        for recipe in ("int8-ort", "int8-trt"):
            d = tiny["descriptions"][step, recipe]
            assert d["recipe"] == recipe and d["quantized"] == expected and d["weight_nodes_left_float"] == [], d
            assert d["opset"] <= 20  # TensorRT 10.3 takes the decomposed attention at opset <= 20
            json.dumps(d)  # a sidecar's content
        ort_ops = tiny["descriptions"][step, "int8-ort"]["ops"]
        assert ort_ops.get("MatMulInteger", 0) + ort_ops.get("ConvInteger", 0) == len(weights)
        trt = tiny["descriptions"][step, "int8-trt"]
        given = tiny["calibration"].for_step(step) if step == "tick" else tiny["calibration"]
        assert trt["calibration"] == given.digest and trt["calibration_samples"] == 4
        assert trt["ranges_from"].startswith("stored") and trt["calibration_step"] == step
    assert tiny["descriptions"]["frame", "int8-ort"]["quantized"]["Conv"] == 1  # the patch embedding
    assert tiny["descriptions"]["tick", "int8-ort"]["calibration"] is None


def _initializers(model) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def test_the_int8_trt_graph_is_symmetric_int8_qdq_with_per_channel_weights(tiny):
    for step in STEP_NAMES:
        model = onnx.load(str(tiny["quantized"][step, "int8-trt"]))
        arrays = _initializers(model)
        consumers: dict[str, list] = {}
        for node in model.graph.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node)
        quantizers = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
        dequantizers = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert quantizers and len(quantizers) == len(dequantizers), step
        for q in quantizers:  # every Q feeds exactly its DQ, with the same scale and zero point
            (dq,) = consumers[q.output[0]]
            assert dq.op_type == "DequantizeLinear" and list(dq.input[1:]) == list(q.input[1:]), (step, q.name)
        for node in quantizers + dequantizers:
            zero_point = arrays[node.input[2]]
            assert zero_point.dtype == np.int8 and not zero_point.any(), (step, node.name)
        for node in dequantizers:  # what a DQ feeds: only the quantized ops (softmax, norms stay float)
            assert {c.op_type for c in consumers[node.output[0]]} <= {"MatMul", "Gemm", "Conv"}, (step, node.name)
        stored = tiny["calibration"].weight_scales(step)
        fp32 = onnx.load(str(tiny["graphs"][step]))
        by_name = {n.name: n for n in model.graph.node}
        producer = {out: n for n in model.graph.node for out in n.output}
        for node, weight, axis in quantized_weights(fp32):
            dq = producer[by_name[node.name].input[1]]
            assert dq.op_type == "DequantizeLinear", (step, node.name)
            scale = arrays[dq.input[1]]
            channels = arrays[weight].shape[axis]
            assert scale.shape == (channels,) and channels > 1, (step, weight)
            assert next(a.i for a in dq.attribute if a.name == "axis") == axis, (step, weight)
            np.testing.assert_allclose(scale, stored[weight]["scales"], rtol=1e-6, err_msg=f"{step} {weight}")
            activation = producer[by_name[node.name].input[0]]  # the activation's DQ: scale = absmax / 127
            assert activation.op_type == "DequantizeLinear" and arrays[activation.input[1]].shape == ()
            absmax = tiny["calibration"].activation_ranges(step)[node.input[0]]["absmax"]
            np.testing.assert_allclose(arrays[activation.input[1]], absmax / 127, rtol=1e-6)


def test_int8_trt_from_the_stored_ranges_equals_calibrating_the_samples(tiny, tmp_path):
    """A set written without the graphs has no activation ranges: ONNX Runtime's calibrator runs over its samples
    and gives the same graph."""
    plain = read_calibration(write_calibration(tmp_path / "calib", tiny["hash"], {"tick": tiny["samples"]["tick"]},
                                               "frames/test"))
    description = quantize("int8-trt", tiny["graphs"]["tick"], tmp_path / "tick.onnx", plain)
    assert description["ranges_from"].startswith("ONNX Runtime's calibrator")
    ours = _initializers(onnx.load(str(tmp_path / "tick.onnx")))
    stored = _initializers(onnx.load(str(tiny["quantized"]["tick", "int8-trt"])))
    assert ours.keys() == stored.keys()
    for name in ours:
        np.testing.assert_allclose(ours[name], stored[name], rtol=1e-6, err_msg=name)


def test_a_set_recorded_for_other_weights_is_refused(tiny, tmp_path):
    other = build_vla(preset("tiny"), seed=1)
    base = step_inputs(other.config)["tick"]
    export_step(STEPS["tick"][0](other), base, STEPS["tick"][1], tmp_path / "other.onnx")
    with pytest.raises(CalibrationError, match="recorded for other weights.*vla-node calibrate"):
        quantize("int8-trt", tmp_path / "other.onnx", tmp_path / "other.int8.onnx", tiny["calibration"])


def test_int8_ort_keeps_8_bit_weights_unless_the_cpu_saturates():
    assert _u8s8_saturates("flags\t: fpu sse4_1 avx avx2 fma")  # AVX2, no VNNI: 7-bit weights
    assert not _u8s8_saturates("flags\t: fpu avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni")
    assert not _u8s8_saturates("flags\t: fpu avx2 avx_vnni")
    assert not _u8s8_saturates("Features\t: fp asimd asimddp")  # ARM: no x86 flags
