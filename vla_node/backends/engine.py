"""Engines behind one small interface: `run(inputs, outputs)` into caller-owned, preallocated buffers.

An engine runs one pure step (backends/steps.py) on named tensors; the runtime owns every buffer, binds them once
and calls `run` per tick or frame (openpilot modeld's ModelState.run: named inputs bound once, one execute).

    TorchEngine        the step module itself, eager (the reference every other engine is checked against)
    OnnxRuntimeEngine  the step's exported ONNX graph in ONNX Runtime, bound by pointer (IOBinding): nothing is
                       copied or allocated per call (CPU tensors; CUDA tensors where the CUDA or TensorRT execution
                       provider runs the session, never tried here: no GPU)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence, TypeVar

import numpy as np
import torch
from torch import nn

T = TypeVar("T")
# torch dtype -> numpy dtype of an IOBinding element
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
          torch.int8: np.int8, torch.bool: np.bool_}


class Engine(Protocol):
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        """Compute the outputs of `inputs` into `outputs` (every name, the shapes and dtypes bound)."""


def buffer_signature(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> tuple:
    """(name, pointer, shape, dtype) of every bound tensor: a binding holds while this stays the same."""
    return tuple((n, t.data_ptr(), tuple(t.shape), t.dtype) for n, t in [*sorted(inputs.items()),
                                                                          *sorted(outputs.items())])


def kept(cache: dict, key: tuple, limit: int, make: Callable[[], T]) -> T:
    """cache[key], made by make() the first time it is asked for; beyond `limit` entries the oldest is dropped (what
    the engines keep per set of buffers: a binding, a CUDA graph)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        value = cache[key] = make()
    return value


def _check_names(what: str, given: Mapping[str, torch.Tensor], expected: Sequence[str]) -> None:
    if set(given) != set(expected):
        raise ValueError(f"{what} {sorted(given)}: expected exactly {sorted(expected)}")


class TorchEngine:
    """The step module run eagerly; its outputs copied into the caller's buffers."""

    def __init__(self, step: nn.Module, input_names: Sequence[str], output_names: Sequence[str]) -> None:
        self.step = step.eval()
        self.input_names, self.output_names = tuple(input_names), tuple(output_names)

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        with torch.inference_mode():
            results = self.step(*(inputs[name] for name in self.input_names))
        for name, value in zip(self.output_names, results):
            outputs[name].copy_(value)


class OnnxRuntimeEngine:
    """An exported step in ONNX Runtime, run on the caller's CPU tensors bound by pointer (IOBinding): nothing is
    copied or allocated per call. A binding is made per set of tensors (pointers, shapes, dtypes) the first time it
    is passed and kept (at most `max_bindings`): a caller alternating between two sets of buffers (a live and a
    staged state that swap on commit) binds each once. `threads`: intra-op threads (1: one core, no spinning)."""

    def __init__(self, path: str | Path, threads: int = 1, providers: Sequence[str] = ("CPUExecutionProvider",),
                 max_bindings: int = 4) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        gpu = {"CUDAExecutionProvider", "TensorrtExecutionProvider"} & set(self.session.get_providers())
        self.devices = ("cpu", "cuda") if gpu else ("cpu",)  # where the bound tensors may live
        self.max_bindings = max_bindings
        self.bindings: dict[tuple, tuple] = {}  # buffer_signature -> (its IOBinding, whether it binds CUDA memory)

    def bind(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]):
        """A new IOBinding of the caller's tensors (checked: names, device, layout, dtype)."""
        _check_names("inputs", inputs, self.input_names)
        _check_names("outputs", outputs, self.output_names)
        binding = self.session.io_binding()
        for name, tensor, bind in ([(n, inputs[n], binding.bind_input) for n in self.input_names]
                                   + [(n, outputs[n], binding.bind_output) for n in self.output_names]):
            device = tensor.device.type
            if device not in self.devices or not tensor.is_contiguous() or tensor.dtype not in _NUMPY:
                raise ValueError(f"{name}: a contiguous tensor on {'/'.join(self.devices)} of "
                                 f"{sorted(map(str, _NUMPY))} expected, got {tensor.dtype} on {tensor.device} "
                                 f"(contiguous: {tensor.is_contiguous()})")
            bind(name, device, tensor.device.index or 0, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())
        return binding

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        binding, on_gpu = kept(self.bindings, buffer_signature(inputs, outputs), self.max_bindings,
                               lambda: (self.bind(inputs, outputs),
                                        any(t.is_cuda for t in (*inputs.values(), *outputs.values()))))
        if on_gpu:  # ONNX Runtime's stream does not wait for torch's: the inputs must be written first
            torch.cuda.current_stream().synchronize()
        self.session.run_with_iobinding(binding)
        if on_gpu:
            binding.synchronize_outputs()
