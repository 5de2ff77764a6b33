"""Export a pure step to ONNX (torch.onnx.export, dynamo), check it, and measure its parity in ONNX Runtime.

The graph is exported at a fixed opset (<= 20: TensorRT 10.3 on JetPack 6 takes decomposed attention there) with
static shapes from the example inputs, checked with onnx.checker, run in ONNX Runtime on the same inputs and
compared with the torch step. A sidecar JSON beside the .onnx records every binding (name, shape, dtype), the opset,
the exporter and runtime versions and the parity figures, so a TensorRT machine can check its engine against the
same references.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

OPSET = 20


def parity(expected: Sequence[np.ndarray], got: Sequence[np.ndarray], names: Sequence[str]) -> dict[str, dict]:
    """Per output: the largest absolute difference and that difference over the largest magnitude."""
    figures = {}
    for name, a, b in zip(names, expected, got):
        if a.shape != b.shape:
            raise ValueError(f"output {name}: shape {b.shape} from ONNX Runtime, {a.shape} from torch")
        diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0
        scale = float(np.abs(a).max()) if a.size else 0.0
        figures[name] = {"max_abs": diff, "max_rel": diff / scale if scale > 0 else diff}
    return figures


@contextlib.contextmanager
def quiet_exporter():
    """The exporter's notes that say nothing about this graph (torchvision's ops skipped, a pytree deprecation) kept
    out of the build's progress; its errors still raise."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript")]  # onnxscript: constant folding
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            with contextlib.redirect_stdout(io.StringIO()):  # "[torch.onnx] Obtain model graph ..." lines
                yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_step(step: nn.Module, inputs: Mapping[str, torch.Tensor], output_names: Sequence[str], path: str | Path,
                opset: int = OPSET) -> dict:
    """Export `step` called with `inputs` (in order) to `path`, check it, run it in ONNX Runtime, and write the
    sidecar `path`.json. Returns the sidecar's content."""
    import onnx
    import onnxruntime as ort

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(inputs)
    args = tuple(inputs[name] for name in names)
    step = step.eval()
    with quiet_exporter():
        torch.onnx.export(step, args, str(path), dynamo=True, opset_version=opset, input_names=names,
                          output_names=list(output_names), verbose=False)
    graph = onnx.load(str(path))
    onnx.checker.check_model(graph)
    with torch.inference_mode():
        expected = [t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy() for t in step(*args)]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(list(output_names), {name: t.numpy() for name, t in inputs.items()})
    sidecar = {
        "onnx": path.name,
        "opset": max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")),
        "inputs": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                   for n, t in inputs.items()],
        "outputs": [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype)} for n, a in zip(output_names, expected)],
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "parity_onnxruntime_vs_torch": parity(expected, got, output_names),
    }
    path.with_suffix(".json").write_text(json.dumps(sidecar, indent=2) + "\n")
    return sidecar
