"""The TensorRT backend: a one-line error where TensorRT or a GPU is absent (here); where both are (a GPU machine
with TensorRT, `.ci/gpu`), the tick step's engine equals ONNX Runtime on the same inputs, with and without a CUDA
graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vla_node.backends.tensorrt_engine import TensorRTEngine, TensorRTUnavailable, build_engine

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT and a GPU are here: the parity test below runs instead")
def test_without_tensorrt_or_a_gpu_the_error_is_one_line_naming_what_is_missing(tmp_path):
    for call in (lambda: build_engine(tmp_path / "x.onnx", tmp_path / "x.plan"), lambda: TensorRTEngine("x.plan")):
        with pytest.raises(TensorRTUnavailable) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and message.startswith("backend 'tensorrt': ")
        assert ("not installed" in message) or ("no CUDA GPU" in message)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_TENSORRT, reason="needs TensorRT 10.3+ and an NVIDIA GPU (not on this machine; "
                                              "run on a GPU machine with TensorRT: .ci/gpu)")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_the_tensorrt_tick_equals_onnx_runtime(tmp_path, cuda_graph):
    from helpers.oracles import tick_step_case
    from vla_node.backends.engine import OnnxRuntimeEngine
    from vla_node.backends.export import export_step

    step, inputs, outputs = tick_step_case()
    export_step(step, inputs, tuple(outputs), tmp_path / "tick.onnx")
    engine = TensorRTEngine(build_engine(tmp_path / "tick.onnx", tmp_path / "tick.plan", tmp_path / "timing.cache"),
                            cuda_graph=cuda_graph)
    expected = {name: torch.empty_like(t) for name, t in outputs.items()}
    OnnxRuntimeEngine(tmp_path / "tick.onnx").run(inputs, expected)
    gpu_inputs = {name: t.cuda() for name, t in inputs.items()}
    got = {name: torch.empty_like(t, device="cuda") for name, t in outputs.items()}
    for _ in range(3):  # the graph replays on the same buffers
        engine.run(gpu_inputs, got)
        for name in outputs:
            scale = max(1.0, expected[name].abs().max().item())
            assert (got[name].cpu() - expected[name]).abs().max().item() <= 1e-3 * scale, name
