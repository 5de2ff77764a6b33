"""Inputs and fused ops shared by the linear kernels' tests (tests/backend/test_cpu_linear*.py)."""

import torch
import torch.nn.functional as F

# op name -> its fp64 form over the product y and `other` (cpu_kernels.LINEAR_OPS)
OPS = {"none": lambda y, other: y, "silu": lambda y, other: F.silu(y),
       "gelu_tanh": lambda y, other: F.gelu(y, approximate="tanh"), "mul": lambda y, other: y * other}


def linear_inputs(rows: int, k: int, n: int, seed: int = 0):
    """Seeded bf16 x [rows, k], weight [n, k] (scaled as an initialized layer's), bias [n] and other [rows, n]."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = (torch.randn(n, k, generator=generator) / k ** 0.5).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    other = torch.randn(rows, n, generator=generator).bfloat16()
    return x, weight, bias, other


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()
