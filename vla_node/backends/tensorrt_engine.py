"""The TensorRT engine: one code path for TensorRT 10.3 (JetPack 6) and 11.x, imported only when used.

Built from a step's ONNX (opset <= 20, decomposed attention) as a strongly typed network: the precision comes from
the graph's own types, INT8 from symmetric Q/DQ nodes (zero points 0), never from builder flags or calibrators
(TensorRT 11 has neither). A timing cache beside the engine makes rebuilds fast. At run time the I/O is bound by
name (`set_tensor_address`) to the caller's CUDA tensors and run with `execute_async_v3` on a side stream,
optionally captured once as a CUDA graph (addresses and shapes fixed) and replayed per call.

Not run in this project's CI: TensorRT needs an NVIDIA GPU and its libraries (tests skip with the reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from vla_node.backends.engine import buffer_signature

WORKSPACE_BYTES = 1 << 30


class TensorRTUnavailable(RuntimeError):
    """TensorRT or a CUDA GPU is not there: one line saying which."""


def _tensorrt():
    try:
        import tensorrt as trt
    except ImportError as e:
        raise TensorRTUnavailable(f"backend 'tensorrt': the tensorrt package is not installed ({e}); install "
                                  "`.[tensorrt]` on a machine with an NVIDIA GPU, or pick onnxruntime") from None
    if not torch.cuda.is_available():
        raise TensorRTUnavailable(f"backend 'tensorrt': no CUDA GPU visible to torch {torch.__version__} (TensorRT "
                                  f"{trt.__version__} is installed); pick onnxruntime or torch")
    return trt


def build_engine(onnx_path: str | Path, engine_path: str | Path, timing_cache: str | Path | None = None) -> Path:
    """Parse the ONNX, build a strongly typed engine, write it (and the updated timing cache)."""
    trt = _tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # ignored by 11.x
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT {trt.__version__} could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    cache_path = Path(timing_cache) if timing_cache is not None else None
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path and cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT {trt.__version__} failed to build an engine from {onnx_path} (see its log)")
    engine_path = Path(engine_path)
    engine_path.write_bytes(bytes(serialized))
    if cache_path is not None:
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return engine_path


class TensorRTEngine:
    """A built engine run on the caller's CUDA tensors, bound by name; `cuda_graph=True` captures the first call's
    execution as a CUDA graph and replays it while the same buffers are passed."""

    def __init__(self, engine_path: str | Path, cuda_graph: bool = False) -> None:
        trt = _tensorrt()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{engine_path}: not an engine of TensorRT {trt.__version__} for this GPU (rebuild)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.input_names = tuple(n for n in names if is_input[n])
        self.output_names = tuple(n for n in names if not is_input[n])
        self.stream = torch.cuda.Stream()
        self.cuda_graph = cuda_graph
        self._graph: torch.cuda.CUDAGraph | None = None
        self._bound: tuple | None = None

    def _bind(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        for name in self.input_names + self.output_names:
            tensor = inputs[name] if name in inputs else outputs[name]
            if not tensor.is_cuda or not tensor.is_contiguous():
                raise ValueError(f"{name}: a contiguous CUDA tensor expected, got {tensor.device}")
            if name in inputs:
                self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        self._bound = buffer_signature(inputs, outputs)
        self._graph = None

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        if buffer_signature(inputs, outputs) != self._bound:
            self._bind(inputs, outputs)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if self._graph is not None:
                self._graph.replay()
            elif self.cuda_graph:
                self.context.execute_async_v3(self.stream.cuda_stream)  # first call: outside capture (lazy init)
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph, stream=self.stream):
                    self.context.execute_async_v3(self.stream.cuda_stream)
            elif not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed (see its log)")
        torch.cuda.current_stream().wait_stream(self.stream)
