"""A step compiled ahead of time by TorchInductor (AOTInductor): one shared library per step and shape, no Python in it.

`compile_step` exports the step module (torch.export), freezes its weights into the graph (constant folding, weights
prepacked for oneDNN's matmuls where the dtype runs them) and compiles it with the machine's C++ compiler into a
package file; `InductorEngine` loads that package (a fraction of a second) and runs it behind the Engine interface.
The generated kernels are specialized to the example inputs: their shapes, dtypes and strides (a view's strides too),
the CPU's vector instructions and the intra-op thread count at compile time, so the engine checks each binding's
layout once and the store's key holds the rest (the device, the threads).

What it needs: torch's inductor and a C++ compiler on PATH (`inductor_problem` says which is missing).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from vla_node.backends.engine import _check_names, kept

# freezing: the weights become constants of the graph (folded, prepacked); cpp_wrapper: the graph's calls in C++;
# max_autotune over CPP,ATEN: each matmul the faster, timed at compile, of inductor's C++ GEMM template (AMX or
# AVX-512 micro-kernels, its epilogue fused) and oneDNN's packed linear; memory_planning: the intermediates in one
# pool instead of a malloc each. The compiled tick of `small` (2-vCPU Xeon, AMX, bf16), alternating in one process:
# autotune 0.77x the time of freezing alone, memory planning 0.97x, both 0.75x; compiling takes 35 s -> 70 s.
INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True, "max_autotune": True,
                    "max_autotune_gemm_backends": "CPP,ATEN", "memory_planning": True}
QUIET = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # no tables on stderr


def cxx() -> str:
    """The C++ compiler inductor runs on Linux: $CXX, else g++ (its config.cpp.cxx default)."""
    return os.environ.get("CXX") or "g++"


def inductor_problem() -> str | None:
    """Why a step cannot be compiled here (None: it can)."""
    if shutil.which(cxx()) is None:
        return f"no C++ compiler {cxx()!r} on PATH (set CXX, or install the Debian package g++)"
    if importlib.util.find_spec("torch._inductor") is None or not hasattr(torch._C, "_aoti"):
        return f"torch {torch.__version__} has no AOTInductor"
    return None


def layout(t: torch.Tensor) -> tuple:
    """What a compiled step assumes of a tensor: shape, strides, dtype, device."""
    return tuple(t.shape), t.stride(), t.dtype, t.device.type


def compile_step(step: nn.Module, inputs: Mapping[str, torch.Tensor], path: Path,
                 options: Mapping[str, object] = INDUCTOR_OPTIONS) -> None:
    """`step` at the example `inputs` (their layouts are the engine's bindings) compiled into the package `path` with
    inductor's `options`."""
    problem = inductor_problem()
    if problem is not None:
        raise RuntimeError(f"cannot compile {type(step).__name__}: {problem}")
    import torch._inductor  # about 2 s of imports (dynamo): only where a step is compiled

    with torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(step.eval(), tuple(inputs.values()))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs={**options, **QUIET})


class InductorEngine:
    """A compiled step package run on the caller's tensors; its outputs copied into the caller's buffers. Each set
    of bound tensors (pointers and layouts) is checked once against the layouts the step was compiled for
    (`layouts`: name -> layout(example)): a mismatch is a ValueError naming the tensor, never a wrong result. The
    package is loaded by torch's own C++ loader (a tenth of a second; torch._inductor's Python loader would first
    import dynamo, about 2 s) and run flat: tensors in, tensors out, in the step's order."""

    def __init__(self, path: str | Path, input_names: Sequence[str], output_names: Sequence[str],
                 layouts: Mapping[str, tuple]) -> None:
        # The package's AMX kernels need the kernel's permission to use the tile registers (arch_prctl), which oneDNN
        # asks for when it first runs AMX and inductor when it compiles; without it a fresh process dies of SIGILL on
        # the first tile instruction. Asking is harmless where there is no AMX (it returns False).
        torch.cpu._init_amx()
        # (package, model name in it, run single-threaded: one caller, no runner pool, runners, device index)
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)
        self.input_names, self.output_names = tuple(input_names), tuple(output_names)
        self.layouts = dict(layouts)
        self.checked: dict[tuple, bool] = {}

    def check(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> bool:
        _check_names("inputs", inputs, self.input_names)
        _check_names("outputs", outputs, self.output_names)
        for name in self.input_names:
            if layout(inputs[name]) != self.layouts[name]:
                raise ValueError(f"input {name}: shape, strides, dtype, device {layout(inputs[name])}; the step was "
                                 f"compiled for {self.layouts[name]}")
        return True

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        signature = tuple((name, t.data_ptr(), layout(t)) for name, t in (*inputs.items(), *outputs.items()))
        kept(self.checked, signature, 4, lambda: self.check(inputs, outputs))
        with torch.inference_mode():
            results = self.loader.boxed_run([inputs[name] for name in self.input_names])  # the list is consumed
        for name, value in zip(self.output_names, results):
            outputs[name].copy_(value)
