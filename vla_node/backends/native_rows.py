"""The action tick's block through the decoder in one C call a layer (cpu_kernels.c: vla_decoder_rows_bf16).

The eager tick runs its block (the new state | the stale states recomputed | the H*D queries: 17 to 20 rows of
`small`) through a decoder layer as some twenty calls from Python: a norm, the q|k|v matmul, RoPE, four K/V copies,
the attention over the prefix buffer, the output projection, an add, a norm, three matmuls of the MLP and an add,
each with its checks, views and allocations. The kernels take about 2.5 ms of a 4 ms tick; the calls around them most
of the rest. NativeRows makes those calls from C instead: the same kernels in the same order on the same operands,
so the same bits as the policy's own layers (tests/backend/test_native_rows.py), the budget still checked between
layers, in Python (`before_layer`). `small`'s tick on a Zen 5 EPYC (2 vCPU, AVX512-BF16), alternating with the
layers' own calls in one process, 2026-12-06: 3.19 against 4.34 ms on one thread (0.73x), 2.33 against 3.27 ms on
two (0.71x).

It applies where every piece of a layer runs on the CPU kernels already: bf16 compute, the linear weights packed
for the bf16 linear kernel or (`weights = "int8"`) quantized for the int8 one (no bias), the norms KernelRMSNorm, the
prefix buffer's attention on the kernel; `NativeRows.build` returns None elsewhere and the policy runs its layers as
before.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

from vla_node.backends import cpu_kernels
from vla_node.backends.packed_weights import PackedLinear, PackedMatmul, PackedQKV, PackedSwiGLU
from vla_node.kv.prefix import PrefixBuffer

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Weight(ctypes.Structure):
    """cpu_kernels.c's struct weight: a PackedMatmul's weight as the native layers take it (weight_of)."""

    _fields_ = [("packed", _P), ("scale", _P), ("sums", _P)]


def weight_of(matmul: PackedMatmul) -> Weight:
    """The C layers' operands of a kernel matmul's weight: its packed bf16 weight, or its int8 codes, scales and code
    sums (cpu_kernels.c: layer_linear runs the kernel PackedMatmul runs); the matmul kept alive beside them."""
    w = matmul.weight
    weight = (Weight(w.codes.data_ptr(), w.scale.data_ptr(), w.sums.data_ptr()) if matmul.int8
              else Weight(w.data_ptr(), None, None))
    weight.matmul = matmul
    return weight


def pointer(operand: torch.Tensor | Weight) -> int:
    """The address a C layer's field takes: a tensor's data, or a Weight's struct."""
    return ctypes.addressof(operand) if isinstance(operand, Weight) else operand.data_ptr()


class DecoderRows(ctypes.Structure):
    """cpu_kernels.c's struct decoder_rows: one layer's call."""

    _fields_ = [("x", _P), ("n", _I), ("width", _I), ("heads", _I), ("kv_heads", _I), ("dim", _I), ("inter", _I),
                ("norm_in", _P), ("norm_post", _P),
                ("w_qkv", _P), ("w_o", _P), ("w_gate", _P), ("w_up", _P), ("w_down", _P),
                ("cos", _P), ("sin", _P),
                ("stage_k", _P), ("stage_v", _P), ("stage_head", _I), ("stage_row", _I),
                ("buffer_k", _P), ("buffer_v", _P), ("buffer_head", _I), ("buffer_row", _I), ("keys", _I),
                ("block_at", _I), ("bias", _P), ("bias_row", _I),
                ("h", _P), ("qkv", _P), ("qk", _P), ("attn", _P), ("act", _P), ("prod", _P), ("y", _P),
                ("threads", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def address(t: torch.Tensor, i: int) -> int:
    """The address of t[i] (its first dim's stride apart)."""
    return t.data_ptr() + i * t.stride(0) * t.element_size()


def kernel_matmul(module, activation: str = "none") -> PackedMatmul | None:
    """The PackedMatmul of a PackedLinear or PackedQKV (which fuses no activation) with `activation` fused, where it
    runs on the bf16 or the int8 linear kernel, else None."""
    if not isinstance(module, (PackedLinear, PackedQKV)) or getattr(module, "activation", "none") != activation:
        return None
    matmul = module.matmul
    return matmul if matmul.kernel else None


def kernel_linear(module, activation: str = "none") -> Weight | None:
    """kernel_matmul's weight (weight_of) where the matmul has no bias, else None."""
    matmul = kernel_matmul(module, activation)
    return weight_of(matmul) if matmul is not None and matmul.bias is None else None


def native_kernels(head_dim: int) -> cpu_kernels.Kernels | None:
    """The loaded kernels where a native layer's pieces all run: the bf16 linear and the attention kernel, for heads
    of `head_dim` (RoPE's bound too), else None."""
    lib = cpu_kernels.library()
    runs = (lib is not None and cpu_kernels.linear_kernel() and cpu_kernels.attention_kernel() is not None
            and cpu_kernels.attention_fits(head_dim) and head_dim <= cpu_kernels.MAX_HEAD_DIM)
    return lib if runs else None


def attends_on_kernel(prefix: PrefixBuffer | None) -> bool:
    """Whether the tick's prefix buffer attends by the attention kernel (bf16, on the CPU, not SDPA)."""
    return (prefix is not None and prefix.k.dtype == torch.bfloat16 and prefix.k.device.type == "cpu"
            and prefix.kernel is not None and not prefix.fused)


def layer_weights(layer) -> dict[str, torch.Tensor | Weight] | None:
    """A decoder layer's operands for the C call, or None where one of its pieces does not run on the kernels."""
    a, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not isinstance(mlp, PackedSwiGLU):
        return None
    if (any(type(n) is not cpu_kernels.KernelRMSNorm or n.weight.dtype != torch.bfloat16 for n in norms)
            or norms[0].eps != norms[1].eps):  # the C layer takes one eps for both
        return None
    weights = {"w_qkv": kernel_linear(a.__dict__.get("qkv")), "w_o": kernel_linear(a.o_proj),
               "w_gate": kernel_linear(mlp.gate_proj, "silu"), "w_up": kernel_linear(mlp.up_proj),
               "w_down": kernel_linear(mlp.down_proj)}
    if any(w is None for w in weights.values()):
        return None
    return {**weights, "norm_in": norms[0].weight.detach(), "norm_post": norms[1].weight.detach()}


class NativeRows:
    """A block of rows over a PrefixBuffer through every decoder layer, one C call a layer (module docstring)."""

    def __init__(self, function, layers, prefix: PrefixBuffer, weights: list[dict[str, torch.Tensor | Weight]]) -> None:
        first = layers[0]
        a = first.self_attn
        self._function, self.prefix, self._weights = function, prefix, weights  # the weights kept alive
        self.layers = len(layers)
        width, heads, kv, dim = first.input_layernorm.weight.shape[0], a.heads, a.kv_heads, a.head_dim
        inter = first.mlp.up_proj.out_features
        self.shape = (width, kv, dim)
        rows = prefix.block_tokens
        # workspaces for the largest block (cpu_kernels.c's struct decoder_rows says each one's layout)
        self._x = torch.empty(rows, width, dtype=torch.bfloat16)
        work = {"h": (rows, width), "qkv": (rows, (heads + 2 * kv) * dim), "qk": (heads + kv, rows, dim),
                "attn": (rows, heads * dim), "act": (rows, inter), "prod": (rows, inter), "y": (rows, width)}
        self._work = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in work.items()}
        k, v = prefix.k, prefix.v  # [L, KV, slots, dim]
        self.calls: list[DecoderRows] = []  # a layer's call each (NativeTick copies them)
        for i, w in enumerate(weights):
            call = DecoderRows(x=self._x.data_ptr(), width=width, heads=heads, kv_heads=kv, dim=dim, inter=inter,
                               buffer_k=k[i].data_ptr(), buffer_v=v[i].data_ptr(), buffer_head=k.stride(1),
                               buffer_row=k.stride(2), keys=k.shape[2],
                               block_at=prefix.prefix_tokens + prefix.state_slots, bias=prefix.bias.data_ptr(),
                               bias_row=prefix.bias.stride(0), eps=layers[i].input_layernorm.eps, scale=dim ** -0.5,
                               **{name: pointer(t) for name, t in {**w, **self._work}.items()})
            self.calls.append(call)

    @classmethod
    def build(cls, layers, prefix: PrefixBuffer | None) -> "NativeRows | None":
        """NativeRows over `layers` (the decoder's) and `prefix`, or None where it does not apply (module
        docstring): the policy then runs its own layers."""
        lib = native_kernels(layers[0].self_attn.head_dim)
        if lib is None or not attends_on_kernel(prefix):
            return None
        weights = [layer_weights(layer) for layer in layers]
        if any(w is None for w in weights):
            return None
        return cls(lib.decoder_rows[torch.bfloat16], layers, prefix, weights)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor,
            before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The block x [n, width] (bf16; its rows set_block'ed in the prefix buffer) through every layer: its K/V
        into out_k, out_v [L, KV, n, dim] (bf16, last dim contiguous, one layout) and the buffer's block slots, as
        the policy's _run_block over the prefix does; cos, sin [n, dim] its rotary rows; before_layer(i) is called
        before layer i (the policy's budget check: it raises to stop). Returns the final hidden states [n, width]: a
        view of a workspace that the next run overwrites."""
        n, (width, kv, dim) = x.shape[0], self.shape
        kv_shape = (self.layers, kv, n, dim)
        if (n != self.prefix.block or x.dtype != torch.bfloat16 or x.shape != (n, width)
                or any(t.dtype != torch.bfloat16 or t.shape != (n, dim) for t in (cos, sin))
                or any(t.dtype != torch.bfloat16 or t.shape != kv_shape for t in (out_k, out_v))
                or out_k.stride() != out_v.stride() or out_k.stride(3) != 1):
            raise ValueError(f"a block of {tuple(x.shape)} {x.dtype} rows, rotary {tuple(cos.shape)} {cos.dtype}, K/V "
                             f"out {tuple(out_k.shape)} {out_k.dtype}: expected the {self.prefix.block} bf16 rows "
                             f"[n, {width}] set_block said, rotary [n, {dim}] and K/V out {list(kv_shape)} bf16 of one "
                             f"layout, last dim contiguous")
        self._x[:n].copy_(x)
        cos, sin = cos.contiguous(), sin.contiguous()
        threads = torch.get_num_threads()
        for i, call in enumerate(self.calls):
            if before_layer is not None:
                before_layer(i)
            call.n, call.cos, call.sin, call.threads = n, cos.data_ptr(), sin.data_ptr(), threads
            call.stage_k, call.stage_v = address(out_k, i), address(out_v, i)
            call.stage_head, call.stage_row = out_k.stride(1), out_k.stride(2)
            if self._function(ctypes.byref(call)) == -1:
                raise MemoryError("a kernel's workspace (the attention's, the int8 linear's) could not be allocated")
        return self._x[:n]
