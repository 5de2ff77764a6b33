"""Building one engine: a step exported to ONNX, its recipe applied, its parity measured, its files written.

An engine folder (the engine store's, store.py) holds, for step NAME:

    NAME.fp32.onnx, NAME.fp32.json   the exported fp32 graph and its sidecar (bindings, opset, versions, parity)
    NAME.onnx                        the graph the backend runs: the fp32 one, or the recipe's (int8 Q/DQ ...)
    NAME.json                        the sidecar of NAME.onnx: the recipe, and its parity against the torch step
    NAME.plan                        (tensorrt) the serialized engine, built from NAME.onnx
    inputs.json, outputs.json        the example inputs and the torch step's outputs in polygraphy's JSON form, so
                                     `polygraphy run NAME.onnx --trt --load-inputs inputs.json --load-outputs
                                     outputs.json` checks a TensorRT build against the same references

NAME.fp32.onnx and its sidecar are copied from the store's export of the step (export_into, store.EXPORTS) when it
has one: a step is exported once for all its recipes and backends.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from vla_node.backends.engine import OnnxRuntimeEngine
from vla_node.backends.export import export_step, parity


def backend_version(backend: str) -> str:
    if backend == "onnxruntime":
        import onnxruntime

        return onnxruntime.__version__
    if backend == "tensorrt":
        from vla_node.backends.tensorrt_engine import _tensorrt

        return _tensorrt().__version__
    raise ValueError(f"backend {backend!r} is not built into an engine store: expected onnxruntime or tensorrt")


def exporter_version() -> str:
    """What an export depends on besides the step itself: the exporter, and the checker and runtime of its sidecar."""
    import onnx
    import onnxruntime
    import onnxscript

    return (f"torch {torch.__version__}; onnxscript {onnxscript.__version__}; onnx {onnx.__version__}; "
            f"onnxruntime {onnxruntime.__version__}")


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").float().numpy() if t.dtype == torch.bfloat16 else t.detach().to("cpu").numpy()


def export_into(model, spec, folder: Path) -> None:
    """`spec`'s step of `model` exported to `folder`/NAME.fp32.onnx with its sidecar NAME.fp32.json (export_step:
    checked, and its parity in ONNX Runtime measured): what every recipe and backend of the step starts from."""
    export_step(spec.build(model).eval(), spec.inputs(), spec.outputs, folder / f"{spec.name}.fp32.onnx")


def build_step(model, spec, backend: str, recipe: str, folder: Path, calibration=None, device: str = "cpu",
               exported: Path | None = None) -> None:
    """Export `spec`'s step of `model` into `folder` (or copy the export in `exported`, a folder export_into wrote
    for the same step, weights and shapes), apply `recipe`, measure the result's parity against the torch step in
    ONNX Runtime, write the polygraphy files and (tensorrt) build the plan."""
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR  # its "Saving ..." lines would drown the build's progress

    name, inputs = spec.name, spec.inputs()
    step = spec.build(model).eval()
    with torch.inference_mode():
        expected = [_numpy(t) for t in step(*inputs.values())]
    fp32 = folder / f"{name}.fp32.onnx"
    if exported is None:
        sidecar = export_step(step, inputs, spec.outputs, fp32)
    else:  # the graph, its sidecar and any external weights file
        for path in exported.iterdir():
            if path.name.startswith(f"{name}.fp32."):
                shutil.copyfile(path, folder / path.name)
        sidecar = json.loads(fp32.with_suffix(".json").read_text())
    graph = folder / f"{name}.onnx"
    if recipe == "fp32":
        shutil.copyfile(fp32, graph)
        sidecar["recipe"] = {"recipe": "fp32"}
    else:
        from vla_node.backends.quantize import quantize

        calibrated = calibration.for_step(name) if calibration is not None and recipe == "int8-trt" else None
        sidecar["recipe"] = quantize(recipe, fp32, graph, calibrated)
        engine = OnnxRuntimeEngine(graph)
        outputs = {n: torch.from_numpy(np.empty_like(a)) for n, a in zip(spec.outputs, expected)}
        engine.run({n: t.contiguous() for n, t in inputs.items()}, outputs)
        sidecar["parity_onnxruntime_vs_torch"] = parity(expected, [outputs[n].numpy() for n in spec.outputs],
                                                        spec.outputs)
    sidecar["onnx"] = graph.name
    (folder / f"{name}.json").write_text(json.dumps(sidecar, indent=2) + "\n")
    save_json([{n: _numpy(t) for n, t in inputs.items()}], str(folder / "inputs.json"))
    results = RunResults()
    results.append(("torch", [IterationResult(dict(zip(spec.outputs, expected)), runner_name="torch")]))
    results.save(str(folder / "outputs.json"))
    if backend == "tensorrt":
        from vla_node.backends.tensorrt_engine import build_engine

        build_engine(graph, folder / f"{name}.plan", folder / "timing.cache")


def load_engine(backend: str, folder: Path, name: str, threads: int = 1, device: str = "cpu"):
    """The engine in `folder` for `backend` (its files checked by the store already)."""
    if backend == "onnxruntime":
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            import onnxruntime

            available = onnxruntime.get_available_providers()
            providers = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in available]
            providers.append("CPUExecutionProvider")
        return OnnxRuntimeEngine(folder / f"{name}.onnx", threads=threads, providers=providers)
    if backend == "tensorrt":
        from vla_node.backends.tensorrt_engine import TensorRTEngine

        return TensorRTEngine(folder / f"{name}.plan", cuda_graph=True)
    raise ValueError(f"backend {backend!r}: expected onnxruntime or tensorrt")
