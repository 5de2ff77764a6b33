"""The one table of dtype names: what a launch file, a partition and a step may say, and the torch dtype each
means. Importing it does not import torch (a launch file is checked without it); `torch_dtype` does."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")  # what the model computes in
STORAGE_DTYPES = (*COMPUTE_DTYPES, "int8")  # what a KV partition stores (int8: KIVI)
SCALE_DTYPES = ("fp16", "fp32")  # an int8 partition's scales


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a name in TORCH_NAMES means (KeyError on any other)."""
    import torch

    return getattr(torch, TORCH_NAMES[name])


def torch_dtypes(names: tuple[str, ...]) -> dict[str, torch.dtype]:
    """name -> torch dtype for some of the names, for `validate.choose`."""
    return {name: torch_dtype(name) for name in names}


