"""The precision recipes of an exported fp32 step (export.py): what `NAME.onnx` of an engine folder is.

    fp32       the exported graph itself
    int8-ort   what runs fastest in ONNX Runtime on a CPU: dynamic quantization, every MatMul / Gemm / Conv weight
               int8 per output channel (symmetric), activations quantized to u8 per call (DynamicQuantizeLinear ->
               MatMulInteger / ConvInteger); needs no calibration (a calibration set given is not used). Weights
               are 7-bit (reduce_range) on an x86 CPU with AVX2 but no VNNI, whose u8 x s8 kernels sum pairs in
               int16 and could saturate at 8 bits; with VNNI (or off x86) they are full int8.
    int8-trt   TensorRT's form, explicit quantization: static Q/DQ (QuantizeLinear -> DequantizeLinear) on the
               inputs of every MatMul / Gemm / Conv with a weight, activations and weights both signed int8,
               symmetric (zero points 0), weights per output channel (kept fp32 behind their own Q/DQ pair, which
               TensorRT quantizes at build: the form every TensorRT version takes), activations per tensor from the
               calibration set (calibration.py). Everything else (softmax, RMSNorm / LayerNorm, RoPE, the
               attention MatMuls of two activations, the residual adds) stays float, and outputs are not
               re-quantized. It also runs in ONNX Runtime's CPU provider, which is how its accuracy is measured here
               (slowly: ORT's CPU kernels do not fuse s8 x s8 Q/DQ, so it is not a CPU recipe).

Why dynamic for int8-ort: measured on the `small` preset's steps (bench.engines.step_inputs, 1 intra-op thread,
ONNX Runtime 1.32, 15 interleaved rounds, median ms) on an `AMD EPYC` (lscpu's model name; 2 vCPUs with AVX-512
VNNI and BF16: Zen 4 or later), MatMul / Gemm / Conv weights only, per-channel s8 weights in each:

    variant                                  tick ms   frame ms   tick logits max rel err vs fp32
    fp32                                      14.43     141.97    -
    dynamic (u8 per call, MatMulInteger)       6.60      60.01    0.093
    static QOperator u8/s8 (QGemm...)          7.05      59.80    0.087
    static QDQ u8/s8                           6.40     110.71    0.083

Static QDQ ties the tick (its Gemms fuse into QGemm) but doubles the frame: the vision tower's MatMuls with
per-channel weights are not fused and run as DequantizeLinear + fp32 MatMul. QOperator ties the frame and loses the
tick by 7%. Dynamic is the fastest frame + tick (66.6 ms vs 66.9 and 117.1), within noise of the best on each, and
needs no calibration set. A second run on a loaded machine gave the same picture (p10 ms, dynamic / QOperator /
QDQ: tick 6.31 / 6.73 / 6.23, frame 118.5 / 117.6 / 214.0).

Why MinMax for int8-trt's activation ranges (not Percentile): on the measured steps neither was better beyond noise
(small tick logits' max relative error 0.115 MinMax / 0.103 Percentile, frame_k 0.046 / 0.050, means over 4
held-out inputs, 16 calibration samples; tiny tick 0.015 / 0.017), and MinMax never clips a calibrated value
(transformer activations carry a few large outlier channels that a percentile cut saturates), is a plain min / max
per tensor that calibration.py stores in ranges.json (so the graph is made from the set's files, not recomputed),
and does not depend on a histogram's bins.

Accuracy vs the torch fp32 step (max relative error, worst output; calibration from perturbed step_inputs, held-out
inputs alike): small tick logits 0.100 int8-ort / 0.100 int8-trt, small frame 0.043 / 0.046, small text 0.048 /
0.057; tiny about 0.01 for both (tests/backend/test_quantize.py prints them). A static graph clips inputs beyond
the calibrated ranges: the set must come from the inputs the node really sees.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from vla_node.backends.calibration import (
    CALIBRATION_BATCH,
    QUANTIZED_OPS,
    CalibrationData,
    CalibrationError,
    calibrated_tensors,
    quantized_weights,
    weight_scales,
)

RECIPES = ("fp32", "int8-ort", "int8-trt")
CALIBRATE_COMMAND = "vla-node calibrate"


def _u8s8_saturates(cpuinfo: str | None = None) -> bool:
    """Whether ONNX Runtime's u8 x s8 integer GEMM can saturate on this CPU: x86 with AVX2 but neither AVX-512 VNNI
    nor AVX-VNNI (its kernels then add pairs of products in int16). `cpuinfo`: /proc/cpuinfo text (this machine's
    when None)."""
    from vla_node.backends import cpu_features

    flags = cpu_features.cpu_flags(cpu_features.read_cpuinfo() if cpuinfo is None else cpuinfo)
    return "avx2" in flags and not ({"avx512_vnni", "avx_vnni"} & flags)


class _NoPreprocessAdvice(logging.Filter):
    """Drops ONNX Runtime's 'Please consider (to run) pre-processing before quantization' warning (logged on the
    root logger): its shape inference and fusions are for dynamic-shape graphs; the exported steps' are static."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Please consider")


@contextlib.contextmanager
def _quiet_quantizer():
    root, advice = logging.getLogger(), _NoPreprocessAdvice()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)


def quantize(recipe: str, fp32_onnx: str | Path, out_onnx: str | Path,
             calibration: CalibrationData | None = None) -> dict:
    """Write the `recipe` form of the fp32 graph `fp32_onnx` to `out_onnx`, check it (onnx.checker) and return what
    was done: the recipe, how activations and weights are quantized, which nodes were quantized (per op type) and
    the result's op counts. int8-trt takes its activation ranges from `calibration` (read_calibration, or one step
    of it: for_step): the step whose recorded inputs are the graph's."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    fp32_onnx, out_onnx = Path(fp32_onnx), Path(out_onnx)
    if not fp32_onnx.is_file():
        raise FileNotFoundError(f"fp32 ONNX {fp32_onnx} does not exist (export the step first)")
    if out_onnx.resolve() == fp32_onnx.resolve():
        raise ValueError(f"quantize {recipe}: the output {out_onnx} is the fp32 input; write it to another path")
    if recipe == "int8-trt" and calibration is None:
        raise ValueError(f"recipe int8-trt needs a calibration set (its activation scales are static): run "
                         f"`{CALIBRATE_COMMAND}` first and pass the set")
    out_onnx.parent.mkdir(parents=True, exist_ok=True)
    if recipe == "fp32":
        shutil.copyfile(fp32_onnx, out_onnx)
        description = {"recipe": "fp32", "activations": "fp32", "weights": "fp32", "calibration": None}
    elif recipe == "int8-ort":
        with _quiet_quantizer():
            description = _int8_ort(fp32_onnx, out_onnx)
    else:
        with _quiet_quantizer():
            description = _int8_trt(fp32_onnx, out_onnx, calibration)
    return {**description, **_check_and_count(recipe, fp32_onnx, out_onnx)}


def _int8_ort(fp32_onnx: Path, out_onnx: Path) -> dict:
    """Dynamic quantization: ONNX Runtime rewrites each Gemm as a MatMul over the transposed weight and quantizes
    every MatMul with a constant weight (MatMulConstBOnly) and every Conv."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    reduce_range = _u8s8_saturates()
    quantize_dynamic(str(fp32_onnx), str(out_onnx), op_types_to_quantize=["MatMul", "Conv"], per_channel=True,
                     reduce_range=reduce_range, weight_type=QuantType.QInt8)
    return {"recipe": "int8-ort", "format": "dynamic (DynamicQuantizeLinear -> MatMulInteger / ConvInteger)",
            "activations": "u8, asymmetric, per tensor, computed per call",
            "weights": f"s8 symmetric per output channel ({7 if reduce_range else 8}-bit)",
            "reduce_range": reduce_range, "calibration": None}


def _takes_calibration_cache() -> bool:
    from onnxruntime.quantization import quantize_static

    return "calibration_cache_path" in inspect.signature(quantize_static).parameters


def _check_weights(fp32_onnx: Path, calibration: CalibrationData, step: str) -> None:
    """The set's weight scales (when stored) must be the graph's: else it was recorded for other weights."""
    stored = calibration.weight_scales(step)
    if stored is None:
        return
    current = weight_scales(fp32_onnx)
    for name in sorted(set(current) | set(stored)):
        ours, theirs = current.get(name), stored.get(name)
        if ours is None or theirs is None:
            why = f"the set has no weight {name}" if theirs is None else f"the graph has no weight {name}"
        elif theirs["shape"] != ours["shape"] or not np.allclose(theirs["scales"], ours["scales"], rtol=1e-6, atol=0):
            why = f"weight {name} has other scales"
        else:
            continue
        raise CalibrationError(f"calibration set {calibration.folder} step {step} does not fit {fp32_onnx} ({why}): "
                               f"it was recorded for other weights; rerun `{CALIBRATE_COMMAND}` with this model")


def _int8_trt(fp32_onnx: Path, out_onnx: Path, calibration: CalibrationData) -> dict:
    """Static symmetric s8/s8 Q/DQ of the weight-bearing MatMul / Gemm / Conv nodes, MinMax activation ranges: the
    set's stored ranges of this graph when it has them, else ONNX Runtime's calibrator over the set's samples."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    model = onnx.load(str(fp32_onnx))
    initializers = {i.name for i in model.graph.initializer}
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
              if i.name not in initializers}
    step = calibration.step_of(inputs)
    _check_weights(fp32_onnx, calibration, step)
    nodes = [node.name for node, _, _ in quantized_weights(model)]
    if not nodes:
        raise ValueError(f"{fp32_onnx}: no MatMul / Gemm / Conv with a weight initializer to quantize")
    options = {"ActivationSymmetric": True, "WeightSymmetric": True, "AddQDQPairToWeight": True,
               "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OPS),
               "CalibMaxIntermediateOutputs": CALIBRATION_BATCH}
    common = {"quant_format": QuantFormat.QDQ, "activation_type": QuantType.QInt8, "weight_type": QuantType.QInt8,
              "per_channel": True, "reduce_range": False, "nodes_to_quantize": nodes,
              "op_types_to_quantize": list(QUANTIZED_OPS), "calibrate_method": CalibrationMethod.MinMax,
              "extra_options": options}
    stored = calibration.activation_ranges(step)
    if stored is not None:
        missing = sorted(set(calibrated_tensors(model)) - set(stored))
        if missing:
            raise CalibrationError(f"calibration set {calibration.folder} step {step}: no activation range for "
                                   f"{missing[0]} of {fp32_onnx} (the ranges were computed on another graph); rerun "
                                   f"`{CALIBRATE_COMMAND}`")
    if stored is not None and _takes_calibration_cache():
        from onnxruntime.quantization.calibrate import TensorsData, save_tensors_data

        ranges_from = "stored (ranges.json)"
        with tempfile.TemporaryDirectory(prefix="vla-quantize-") as tmp:
            cache = Path(tmp) / "ranges.json"
            save_tensors_data(TensorsData(CalibrationMethod.MinMax,
                                          {n: (np.float32(r["min"]), np.float32(r["max"])) for n, r in stored.items()}),
                              cache)
            quantize_static(str(fp32_onnx), str(out_onnx), None, calibration_cache_path=str(cache), **common)
    else:
        ranges_from = "ONNX Runtime's calibrator over the samples"
        quantize_static(str(fp32_onnx), str(out_onnx), calibration.reader(step), **common)
    return {"recipe": "int8-trt", "format": "QDQ (QuantizeLinear -> DequantizeLinear before each quantized input)",
            "activations": "s8 symmetric per tensor (zero point 0), static", "weights": "s8 symmetric per output "
            "channel (zero point 0), fp32 behind a Q/DQ pair", "calibrate_method": "MinMax",
            "ranges_from": ranges_from, "calibration": calibration.digest, "calibration_step": step,
            "calibration_samples": calibration.count(step)}


def _check_and_count(recipe: str, fp32_onnx: Path, out_onnx: Path) -> dict:
    """onnx.checker on the result; which weight nodes were quantized (per op type), which stayed float, and the
    result's op counts."""
    import onnx

    result = onnx.load(str(out_onnx))
    onnx.checker.check_model(result)
    ops = collections.Counter(node.op_type for node in result.graph.node)
    weight_nodes = quantized_weights(onnx.load(str(fp32_onnx)))
    if recipe == "int8-trt":
        producers = {out: node.op_type for node in result.graph.node for out in node.output}
        by_name = {node.name: node for node in result.graph.node}
        done = [n for n, _, _ in weight_nodes
                if n.name in by_name and producers.get(by_name[n.name].input[1]) == "DequantizeLinear"]
    elif recipe == "int8-ort":  # MatMulInteger / ConvInteger named after the node (a Gemm after its MatMul form)
        integer = {node.name for node in result.graph.node if node.op_type in ("MatMulInteger", "ConvInteger")}
        done = [n for n, _, _ in weight_nodes if {f"{n.name}_quant", f"{n.name}_MatMul_quant"} & integer]
    else:
        done = []
    quantized = collections.Counter(n.op_type for n in done)
    float_left = [n.name for n, _, _ in weight_nodes if n not in done] if recipe != "fp32" else []
    return {"quantized": dict(sorted(quantized.items())), "weight_nodes_left_float": float_left,
            "opset": max(o.version for o in result.opset_import if o.domain in ("", "ai.onnx")),
            "ops": dict(sorted(ops.items()))}
