"""FP16 weights with FP32 compute on x86 CPUs (fbgemm), the CPU's answer to a half-precision engine where the CPU
has no bf16 hardware (`cpu_has_bf16`).

A small-batch matmul on a CPU without bf16 hardware is bound by reading the weights from memory: an action
tick (17 tokens) streams the whole decoder's fp32 weights every period. fbgemm's `linear_dynamic_fp16` keeps
each weight matrix packed in fp16 (half the bytes) and multiplies in fp32, so activations stay fp32 and the
only change is that every weight is rounded to fp16 once. `use_fp16_weights(module)` swaps every nn.Linear
inside a module (ours or transformers') for one.
"""

from __future__ import annotations

import torch
from torch import nn

from vla_node.backends import cpu_features


def fp16_weights_available() -> bool:
    """Whether this torch has fbgemm, whose fp16-weight matmuls Fp16WeightLinear runs (x86-64 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def cpu_has_bf16(cpuinfo: str | None = None, max_isa: str | None = None) -> bool:
    """Whether oneDNN will multiply bf16 in hardware here: the CPU has AVX512-BF16 or AMX (its /proc/cpuinfo flags,
    or the given text) and the ONEDNN_MAX_CPU_ISA limit (this process's, or the given value; '' = none) allows
    them. Without it torch emulates bf16 matmuls, several times slower than fp32, or refuses oneDNN's bf16 path."""
    return cpu_features.onednn_runs_bf16_for(cpu_features.read_cpuinfo() if cpuinfo is None else cpuinfo,
                                             cpu_features.onednn_max_isa_env() if max_isa is None else max_isa)


class Fp16WeightLinear(nn.Module):
    """nn.Linear with its weight packed in fp16 (fbgemm); input and output fp32, any leading dims."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            return torch.ops.quantized.linear_dynamic_fp16(x[None], self.packed)[0]  # [in] -> [1, in] -> [out]
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=fp16"


def use_fp16_weights(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear under `module` (in place) by an Fp16WeightLinear; returns the module."""
    if not fp16_weights_available():
        raise RuntimeError(f"fp16 weights need torch's fbgemm backend (x86 CPUs); this torch has "
                           f"{torch.backends.quantized.supported_engines}")
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if child.weight.dtype != torch.float32 or child.weight.device.type != "cpu":
                    raise ValueError(f"{name}: fp16 weights take an fp32 CPU model, got {child.weight.dtype} on "
                                     f"{child.weight.device}")
                setattr(parent, name, Fp16WeightLinear(child))
    return module
