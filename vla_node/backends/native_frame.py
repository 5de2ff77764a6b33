"""A frame's decoder layer (a reuse frame's or a full refresh's), with the action tick's rows in its pass, in one C
call (cpu_kernels.c: vla_frame_rows_bf16).

runtime/vision_cache.FrameTokenCache.run takes a layer of a partial frame (the gate's tokens and the shared-drift
sample recomputed, the tick's rows beside them) through some thirty calls from Python: a norm, the K and V matmuls,
RoPE, the staging copies, the picked rows' gather, their query matmul and RoPE, the staged queries, the attention over
text and the frame, the tick rows' attention over the prefix buffer, the output projection, the shared-drift move,
the gather of the MLP's rows, a norm, three matmuls, the move again, two adds. NativeFrame makes those calls from C:
the same kernels in the same order on the same operands, so the same bits (tests/backend/test_native_frame.py).
`small` on the freeway clip at 10 fps behind the reuse gate, frame with its tick, Zen 5 EPYC (2 vCPU, AVX512-BF16),
alternating with the frame cache's own layers in one process, 2026-12-06: 20.98 against 23.78 ms (0.88x) and 20.25
against 22.53 ms (0.90x) on one thread, 14.16 against 16.65 ms (0.85x) on two. A full refresh is the same call with
every row picked (nothing reused: no sample to draw, no move; the Python path's one q|k|v matmul gives the three
projections' bits, column by column): the full-refresh frame with its tick, tower included (native_tower.py), on an
Intel Xeon with AMX (2 vCPU), alternating in one process, 2026-12-07: 21.32 against 26.01 ms.

It applies where the policy's own path runs every piece on the CPU kernels (NativeRows' conditions, the q, k and v
projections each on a linear kernel too), the frame's attention is gather_attention on the kernel, the tick
rows reach the prefix buffer by a plain copy (INT8 vision storage: ExtraRows.prefix), no per-layer drift gate runs and
the run is full or partial with a shared-drift sample; the frame cache runs its own layers elsewhere.
"""

from __future__ import annotations

import ctypes

import torch

from vla_node.backends.native_rows import (
    Weight,
    address,
    attends_on_kernel,
    kernel_linear,
    layer_weights,
    native_kernels,
    pointer,
)
from vla_node.kv.prefix import PrefixBuffer

_P, _I = ctypes.c_void_p, ctypes.c_int64


class FrameRows(ctypes.Structure):
    """cpu_kernels.c's struct frame_rows: one layer's call."""

    _fields_ = [("x", _P), ("tokens", _I), ("extra", _I), ("picked", _I), ("last", _I), ("width", _I),
                ("heads", _I), ("kv_heads", _I), ("dim", _I), ("inter", _I),
                ("norm_in", _P), ("norm_post", _P),
                ("w_q", _P), ("w_k", _P), ("w_v", _P), ("w_o", _P), ("w_gate", _P), ("w_up", _P), ("w_down", _P),
                ("cos", _P), ("sin", _P), ("picked_cos", _P), ("picked_sin", _P),
                ("index", _P), ("sample", _P), ("at", _P), ("samples", _I),
                ("stage_k", _P), ("stage_v", _P), ("extra_k", _P), ("extra_v", _P), ("extra_head", _I),
                ("extra_row", _I), ("stage_q", _P), ("live_q", _P), ("stage_attn", _P), ("stage_mlp", _P),
                ("live_attn", _P), ("live_mlp", _P),
                ("text_k", _P), ("text_v", _P), ("text_head", _I), ("text_row", _I), ("text_tokens", _I),
                ("buffer_k", _P), ("buffer_v", _P), ("buffer_head", _I), ("buffer_row", _I), ("keys", _I),
                ("frame_at", _I), ("block_at", _I), ("bias", _P), ("bias_row", _I),
                ("h", _P), ("k", _P), ("v", _P), ("kr", _P), ("q", _P), ("qr", _P), ("gk", _P), ("gv", _P),
                ("attn", _P), ("out", _P), ("act", _P), ("prod", _P),
                ("threads", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class NativeFrame:
    """A frame cache's layers for a run with extra rows, one C call a layer (module docstring)."""

    def __init__(self, function, layers, weights: list[dict[str, torch.Tensor | Weight]], tokens: int, extra_rows: int,
                 max_text: int, prefix: PrefixBuffer) -> None:
        a = layers[0].self_attn
        self._function, self._weights, self._prefix = function, weights, prefix  # the weights kept alive
        self.layers = len(layers)
        width, heads, kv, dim = layers[0].input_layernorm.weight.shape[0], a.heads, a.kv_heads, a.head_dim
        inter = layers[0].mlp.up_proj.out_features
        rows = tokens + extra_rows
        keys = max_text + tokens
        work = {"h": (rows, width), "k": (rows, kv * dim), "v": (rows, kv * dim), "kr": (kv, rows, dim),
                "q": (rows, max(width, heads * dim)), "qr": (heads, rows, dim), "gk": (kv, keys, dim),
                "gv": (kv, keys, dim), "attn": (rows, heads * dim), "out": (rows, width), "act": (rows, inter),
                "prod": (rows, inter)}
        self._work = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in work.items()}
        self.tokens, self.max_text = tokens, max_text
        pk = prefix.k  # [L, KV, slots, dim]
        self._calls = [FrameRows(tokens=tokens, last=int(i == len(layers) - 1), width=width, heads=heads,
                                 kv_heads=kv, dim=dim, inter=inter, buffer_k=pk[i].data_ptr(),
                                 buffer_v=prefix.v[i].data_ptr(), buffer_head=pk.stride(1), buffer_row=pk.stride(2),
                                 keys=pk.shape[2], block_at=prefix.prefix_tokens + prefix.state_slots,
                                 bias=prefix.bias.data_ptr(), bias_row=prefix.bias.stride(0),
                                 eps=layers[i].input_layernorm.eps, scale=dim ** -0.5,
                                 **{name: pointer(t) for name, t in {**w, **self._work}.items()})
                       for i, w in enumerate(weights)]

    @classmethod
    def build(cls, layers, tokens: int, extra_rows: int, max_text: int,
              prefix: PrefixBuffer | None) -> "NativeFrame | None":
        """NativeFrame over the decoder's `layers` for frames of `tokens` with up to `extra_rows` rows beside them,
        text of up to `max_text` tokens and the tick's `prefix` buffer, or None where it does not apply (module
        docstring)."""
        lib = native_kernels(layers[0].self_attn.head_dim)
        if lib is None or not attends_on_kernel(prefix) or extra_rows < 1:
            return None
        weights = []
        for layer in layers:
            w = layer_weights(layer)
            projections = [kernel_linear(getattr(layer.self_attn, name)) for name in ("q_proj", "k_proj", "v_proj")]
            if w is None or any(p is None for p in projections):
                return None
            del w["w_qkv"]  # a frame's rows take their q, k and v from the three projections
            weights.append({**w, **dict(zip(("w_q", "w_k", "w_v"), projections))})
        return cls(lib.frame_rows[torch.bfloat16], layers, weights, tokens, extra_rows, max_text, prefix)

    def begin(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows, index: torch.Tensor,
              picked_cos: torch.Tensor, picked_sin: torch.Tensor, stage: dict, live: dict, extra_k: torch.Tensor,
              extra_v: torch.Tensor, prefix: tuple[PrefixBuffer, int]) -> None:
        """A run's operands, for every layer: x [T + n_extra, hidden] the residual streams (bf16, contiguous; the
        frame's, then the extra rows'); cos, sin [T + n_extra, hd] every row's rotary rows; `rows` the picked Rows
        (rows, sample, at; a sample of at least one), `index` [n + n_extra] those rows then the extra rows, as rows of
        x, and picked_cos, picked_sin theirs; `stage` and `live` the frame cache's staged and live state by name
        (k, v [L, KV, T, hd]; q [L - 1, H, T, hd]; attn_out, mlp_out [L - 1, T, hidden]; contiguous; `live` without
        k and v); extra_k, extra_v [L, KV, n_extra, hd] (one layout) the extra rows' K/V out; `prefix` the extra
        rows' ExtraRows.prefix: (this NativeFrame's prefix buffer, its first vision slot)."""
        t, n_extra, n = self.tokens, x.shape[0] - self.tokens, rows.rows.numel()
        first = self._calls[0]
        width, kv, dim = first.width, first.kv_heads, first.dim
        operands = {"x": (x, (t + n_extra, width)), "cos": (cos, (t + n_extra, dim)), "sin": (sin, (t + n_extra, dim)),
                    "picked_cos": (picked_cos, (n + n_extra, dim)), "picked_sin": (picked_sin, (n + n_extra, dim)),
                    "extra_k": (extra_k, (self.layers, kv, n_extra, dim)),
                    "extra_v": (extra_v, (self.layers, kv, n_extra, dim))}
        heads, below = first.heads, self.layers - 1
        for name, shape in (("k", (self.layers, kv, t, dim)), ("v", (self.layers, kv, t, dim)),
                            ("q", (below, heads, t, dim)), ("attn_out", (below, t, width)),
                            ("mlp_out", (below, t, width))):
            operands.update({f"stage {name}": (stage[name], shape)})
            if name in live:
                operands.update({f"live {name}": (live[name], shape)})
        bad = [f"{name} {tuple(a.shape)} {a.dtype} (expected {list(want)} bf16)" for name, (a, want) in operands.items()
               if a.shape != want or a.dtype != torch.bfloat16
               or not (a.is_contiguous() if name[:5] != "extra" else a.stride(3) == 1)]
        if extra_k.stride() != extra_v.stride():
            bad.append("extra_k and extra_v of two layouts")
        if not 0 < n_extra <= self._work["h"].shape[0] - t or self._prefix.block != n_extra:
            bad.append(f"{n_extra} extra rows (expected the prefix block's {self._prefix.block})")
        buffer, frame_at = prefix
        if buffer is not self._prefix:
            bad.append("the extra rows attend over another prefix buffer than this one's")
        if (rows.sample.numel() == 0 and n != t) or index.shape != (n + n_extra,):
            bad.append(f"a sample of {rows.sample.numel()} (expected 1 or more where some rows are reused), index "
                       f"{tuple(index.shape)} (expected [{n + n_extra}])")
        if bad:
            raise ValueError(f"a native frame run of {n} picked rows: {'; '.join(bad)}")
        self._keep = (cos, sin, rows, index, picked_cos, picked_sin)  # alive until the next run
        for i, call in enumerate(self._calls):
            call.x, call.extra, call.picked = x.data_ptr(), n_extra, n
            call.cos, call.sin, call.picked_cos, call.picked_sin = (cos.data_ptr(), sin.data_ptr(),
                                                                   picked_cos.data_ptr(), picked_sin.data_ptr())
            call.index, call.sample, call.at = index.data_ptr(), rows.sample.data_ptr(), rows.at.data_ptr()
            call.samples = rows.sample.numel()
            call.stage_k, call.stage_v = address(stage["k"], i), address(stage["v"], i)
            call.extra_k, call.extra_v = address(extra_k, i), address(extra_v, i)
            call.extra_head, call.extra_row = extra_k.stride(1), extra_k.stride(2)
            call.frame_at = frame_at
            if i < self.layers - 1:
                call.stage_q, call.live_q = address(stage["q"], i), address(live["q"], i)
                call.stage_attn, call.live_attn = address(stage["attn_out"], i), address(live["attn_out"], i)
                call.stage_mlp, call.live_mlp = address(stage["mlp_out"], i), address(live["mlp_out"], i)

    def layer(self, i: int, text_k: torch.Tensor, text_v: torch.Tensor) -> None:
        """Layer i of the run begun, the picked rows attending over text_k, text_v [KV, n_text, hd] (bf16, one
        layout, last dim contiguous) and the frame."""
        call = self._calls[i]
        n_text = text_k.shape[1]
        if (text_k.dtype != torch.bfloat16 or text_k.stride() != text_v.stride() or text_k.stride(2) != 1
                or text_k.shape != text_v.shape or not 0 < n_text <= self.max_text):
            raise ValueError(f"text K/V {tuple(text_k.shape)} {text_k.dtype} at strides {text_k.stride()}: expected "
                             f"bf16 [KV, 1..{self.max_text}, hd] of one layout, last dim contiguous")
        call.text_k, call.text_v, call.text_tokens = text_k.data_ptr(), text_v.data_ptr(), n_text
        call.text_head, call.text_row = text_k.stride(0), text_k.stride(1)
        call.threads = torch.get_num_threads()
        if self._function(ctypes.byref(call)) == -1:
            raise MemoryError("a kernel's workspace (the attention's, the int8 linear's) could not be allocated")
