"""BF16 weights prepacked for oneDNN, with the MLP activations fused into their matmul: the CPU's bf16 engine.

`F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every call. At the action
tick's 17 rows that reorder costs as much as the multiply (measured on an AVX512-BF16 EPYC, one thread: 103 us
against 57 us for a 512 x 512 weight). `use_packed_weights(model)` reorders every linear weight once, at load, and
fuses each MLP's activation (SigLIP's and the projector's tanh GELU, Llama's SiLU gate and its product with the up
projection) into the matmul that feeds it, so those run as one oneDNN primitive instead of a matmul plus an
elementwise pass. Each Llama attention also gets its q, k and v projections as one matmul (`qkv`), which its
project_qkv uses: alone the matmuls gain nothing, but with them q and k take one RoPE call instead of two (an
action tick's layer 212 -> 158 us; the same sums as the three projections').

The products are the same sums as `F.linear`'s, accumulated in fp32 and rounded once to bf16 (with a fused op the
activation is applied before that rounding instead of after, a difference of at most one bf16 rounding). They are
the same bits where oneDNN runs both on the same kernel (as on an AVX512-BF16 EPYC); elsewhere another kernel may
add in another order (AMX does at some shapes) and a sum on the edge between two bf16 values takes the neighbouring
one. Where oneDNN would only emulate bf16 (`ONEDNN_MAX_CPU_ISA` below AVX512_CORE_BF16) or refuse it (below
AVX-512), `packed_weights_available` says no.

The plain weights stay in the modules as parameters, so a packed model still saves, loads and deep-copies as before;
its dtype and device are fixed (bf16 on the CPU): convert before packing, not after.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from vla_node.backends import cpu_features, fp16_weights
from vla_node.model.decoder import LlamaMLP
from vla_node.model.vision import SiglipMLP

BATCH_HINT = 196  # rows oneDNN packs for (a camera's tokens); any row count works


def packed_weights_available() -> bool:
    """Whether PackedLinear works and pays here: oneDNN in this torch, bf16 multiplies in hardware as oneDNN will
    run them (`cpu_has_bf16`: the CPU's flags and ONEDNN_MAX_CPU_ISA), and a tiny packed matmul that really runs."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and fp16_weights.cpu_has_bf16() and packed_kernels_run())


@functools.cache
def packed_kernels_run() -> bool:
    """Whether oneDNN packs and multiplies a bf16 weight in this process (once, then remembered): it refuses the
    reorder where its instruction set is below AVX-512 (a RuntimeError), whatever the CPU's flags say."""
    try:
        with torch.no_grad():
            weight, x = torch.ones(8, 16, dtype=torch.bfloat16), torch.ones(3, 16, dtype=torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return y.shape == (3, 8) and bool((y == 16).all())  # sums of 16 ones: exact in bf16


class PackedLinear(nn.Module):
    """nn.Linear (bf16, CPU) with its weight prepacked for oneDNN, and optionally a fused activation: 'gelu_tanh'
    (y = gelu(x W^T + b), tanh approximation) or 'silu'. Any leading dims."""

    _ACTIVATIONS = {"none": ("none", ""), "gelu_tanh": ("gelu", "tanh"), "silu": ("swish", "")}

    def __init__(self, linear: nn.Linear, activation: str = "none") -> None:
        super().__init__()
        if activation not in self._ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(self._ACTIVATIONS)}")
        weight = linear.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"packed weights take a bf16 CPU nn.Linear, got {weight.dtype} on {weight.device}")
        self.in_features, self.out_features, self.activation = linear.in_features, linear.out_features, activation
        self.weight, self.bias = linear.weight, linear.bias  # kept for state_dict, checkpoints and copies
        self._op, self._algorithm = self._ACTIVATIONS[activation]
        self._pack()

    def _pack(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), BATCH_HINT)  # opaque

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self._op, [], self._algorithm)
        except RuntimeError as e:
            raise RuntimeError(f"packed linear {self.in_features}->{self.out_features} takes a bf16 CPU input "
                               f"[..., {self.in_features}], got {x.dtype} {tuple(x.shape)} on {x.device}: {e}") from e

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x W^T + b) * other, in one primitive (no activation)."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.bfloat16 or self.weight.device.type != "cpu":
            raise ValueError(f"packed weights stay bf16 on the CPU (got {self.weight.dtype} on "
                             f"{self.weight.device}); convert the model before use_packed_weights")
        return self

    def __deepcopy__(self, memo: dict) -> "PackedLinear":
        clone = PackedLinear.__new__(PackedLinear)
        memo[id(self)] = clone
        nn.Module.__init__(clone)
        clone.in_features, clone.out_features, clone.activation = self.in_features, self.out_features, self.activation
        clone._op, clone._algorithm = self._op, self._algorithm
        clone.weight, clone.bias = copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo)
        clone._pack()
        return clone

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bf16 packed, " \
               f"activation={self.activation}"


class PackedGeluMLP(nn.Module):
    """fc2(gelu_tanh(fc1(x))) with the GELU fused into fc1 (SigLIP's MLP, the projector)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = PackedLinear(mlp.fc1, "gelu_tanh"), PackedLinear(mlp.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class PackedSwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with the SiLU fused into gate and the product into up (Llama's MLP)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = PackedLinear(mlp.gate_proj, "silu"), PackedLinear(mlp.up_proj)
        self.down_proj = PackedLinear(mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj.times(x, self.gate_proj(x)))


class PackedQKV(nn.Module):
    """An attention's q, k and v projections (no bias) as one packed matmul: x [..., in] -> [..., q | k | v]. Holds
    no parameter (the three projections keep theirs, so checkpoints and state dicts are unchanged)."""

    def __init__(self, q: PackedLinear, k: PackedLinear, v: PackedLinear) -> None:
        super().__init__()
        if any(p.bias is not None for p in (q, k, v)):
            raise ValueError("PackedQKV takes projections without bias (Llama's)")
        self._parts = (q, k, v)
        self._pack()

    def _pack(self) -> None:
        with torch.no_grad():
            weight = torch.cat([p.weight.detach() for p in self._parts])  # [q + k + v out, in]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)  # opaque

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def __deepcopy__(self, memo: dict) -> "PackedQKV":
        return PackedQKV(*(copy.deepcopy(p, memo) for p in self._parts))


def use_packed_weights(module: nn.Module) -> nn.Module:
    """Replace, in place, every MLP under `module` (SigLIP's, the projector, Llama's) by its fused packed form and
    every other nn.Linear by a PackedLinear, and give every Llama attention its PackedQKV; returns the module.
    Every weight must be bf16 on the CPU."""
    from vla_node.model.decoder import LlamaAttention
    from vla_node.model.vla import Projector

    if not packed_weights_available():
        raise RuntimeError("packed bf16 weights need oneDNN running bf16 in hardware (AVX512_CORE_BF16 or AMX, "
                           f"as ONEDNN_MAX_CPU_ISA allows); here: {cpu_features.describe()}")
    fused = {SiglipMLP: PackedGeluMLP, Projector: PackedGeluMLP, LlamaMLP: PackedSwiGLU}

    def pack(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if type(child) in fused:
                setattr(parent, name, fused[type(child)](child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
            else:
                pack(child)

    pack(module)
    for attention in module.modules():
        if isinstance(attention, LlamaAttention):
            # a plain attribute, not a submodule: the projections stay the modules that own the weights
            object.__setattr__(attention, "qkv", PackedQKV(attention.q_proj, attention.k_proj, attention.v_proj))
    return module
