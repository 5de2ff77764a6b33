"""What the native layer tests share (backends/native_rows.py, native_frame.py, native_tower.py): where they run, the
weight formats they run with, and a count of a native object's calls (that the C path ran, not only its result)."""

from __future__ import annotations

import pytest

from vla_node.backends import cpu_features, cpu_kernels
from vla_node.backends.packed_weights import packed_weights_available

needs_native_layers = pytest.mark.skipif(
    not (packed_weights_available() and cpu_kernels.linear_kernel() and cpu_kernels.attention_kernel() is not None),
    reason=f"packed bf16 weights on the bf16 linear kernel, and the attention kernel, do not run here "
           f"({cpu_kernels.status()}; {cpu_features.describe()})")

# the weight formats whose matmuls the C layers run: packed bf16 (the bf16 linear) and int8 (the int8 linear), this
# where the int8 kernel runs
WEIGHTS = ["packed", pytest.param("int8", marks=pytest.mark.skipif(
    not cpu_kernels.int8_linear_kernel(), reason="the int8 linear kernel does not run here (AVX512-VNNI and -BF16)"))]


class Counted:
    """A native object (NativeFrame, NativeTower) counting its `counted` method's calls; the rest passes through."""

    def __init__(self, native, counted: str) -> None:
        self.native, self.counted, self.calls = native, counted, 0

    def __getattr__(self, name: str):
        method = getattr(self.native, name)
        if name != self.counted:
            return method

        def call(*args):
            self.calls += 1
            return method(*args)

        return call
