"""The cudagraph backend: a torch step captured once per set of buffers as a CUDA graph, replayed per call.

The caller's input and output tensors are the graph's static buffers: the capture records the step reading the
inputs' addresses and copying its results into the outputs', so a call is one `replay()` (no Python per op, no
allocation). A graph is kept per set of buffers (at most `max_graphs`): a caller alternating between two sets (a
live and a staged state that swap on commit) captures each once. CUDA only; not run in this project's
CI (no GPU): `.ci/gpu` compares it with the eager step.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from vla_node.backends.engine import buffer_signature, kept


class CudaGraphEngine:
    def __init__(self, step: nn.Module, input_names: Sequence[str], output_names: Sequence[str],
                 warmup_calls: int = 2, max_graphs: int = 4) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend 'cudagraph': no CUDA GPU visible to torch {torch.__version__}; pick "
                               "onnxruntime or torch")
        self.step = step.eval()
        self.input_names, self.output_names = tuple(input_names), tuple(output_names)
        self.warmup_calls, self.max_graphs = warmup_calls, max_graphs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # buffer_signature -> its graph

    def _call(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        results = self.step(*(inputs[n] for n in self.input_names))
        for name, value in zip(self.output_names, results):
            outputs[name].copy_(value)

    def _capture(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> torch.cuda.CUDAGraph:
        for name, t in [*inputs.items(), *outputs.items()]:
            if not t.is_cuda:
                raise ValueError(f"{name}: a CUDA tensor expected, got one on {t.device}")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(self.warmup_calls):  # lazy initialisation (cuBLAS handles, allocator) outside capture
                self._call(inputs, outputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            self._call(inputs, outputs)
        return graph

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        kept(self.graphs, buffer_signature(inputs, outputs), self.max_graphs,
             lambda: self._capture(inputs, outputs)).replay()
