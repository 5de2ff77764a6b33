"""A vision tower layer of a refresh, partial or full, in two C calls (cpu_kernels.c: vla_tower_rows_bf16).

runtime/vision_cache.VisionTokenCache._layer takes a layer of a partial refresh (the gate's tokens and the shared-drift
sample recomputed, every other token's cached Q/K/V, attention and MLP updates moved by the sample's mean change)
through some fifteen calls from Python. NativeTower makes all but the two layer norms and their rows' gathers from C,
one call for the attention half (q|k|v matmul, the move of the cached q|k|v, the attention, the output projection,
the move of its update into the stream) and one for the MLP half (two matmuls, the move): the same kernels in the
same order on the same operands, so the same bits (tests/backend/test_native_tower.py). The norms stay torch's:
its LayerNorm's bits depend on the vector width its kernel was dispatched for. `small` on the freeway clip at 10 fps
behind the reuse gate (frame with its tick, the decoder's layers native), Zen 5 EPYC (2 vCPU, AVX512-BF16),
alternating with the tower cache's own layers in one process, 2026-12-06: 19.73 against 20.63 ms a frame (0.96x;
another run 0.99x) on one thread, 13.33 against 13.93 ms (0.96x) on two.

It applies where the tower's own path runs every piece on the CPU kernels: bf16, the q|k|v, output and MLP weights
packed for the bf16 linear kernel or (`weights = "int8"`) quantized for the int8 one, the attention on the kernel;
the tower cache runs its own layers elsewhere. A full refresh runs here too, every row picked (nothing reused: no
sample to draw, no move): `small`'s six layers on an Intel Xeon with AMX (2 vCPU), 2026-12-07, 6.20 against 6.85 ms.
"""

from __future__ import annotations

import ctypes

import torch

from vla_node.backends.native_rows import address, kernel_matmul, native_kernels, pointer, weight_of
from vla_node.backends.packed_weights import PackedGeluMLP

_P, _I = ctypes.c_void_p, ctypes.c_int64


class TowerRows(ctypes.Structure):
    """cpu_kernels.c's struct tower_rows: one half layer's call."""

    _fields_ = [("x", _P), ("tokens", _I), ("picked", _I), ("width", _I), ("heads", _I), ("dim", _I), ("inter", _I),
                ("part", _I), ("h", _P), ("w_qkv", _P), ("w_o", _P), ("w_fc1", _P), ("w_fc2", _P),
                ("b_qkv", _P), ("b_o", _P), ("b_fc1", _P), ("b_fc2", _P),
                ("rows", _P), ("sample", _P), ("at", _P), ("samples", _I),
                ("stage_qkv", _P), ("live_qkv", _P), ("stage_out", _P), ("live_out", _P),
                ("qkv", _P), ("attn", _P), ("out", _P), ("act", _P), ("threads", _I), ("scale", ctypes.c_float)]


def _packed(module, activation: str) -> dict | None:
    """kernel_matmul's weight (weight_of) and fp32 bias (or None), else None."""
    matmul = kernel_matmul(module, activation)
    return None if matmul is None else {"weight": weight_of(matmul), "bias": matmul.bias}


class NativeTower:
    """A tower cache's layers for refreshes, two C calls a layer (module docstring)."""

    def __init__(self, function, layers, weights: list[dict], tokens: int) -> None:
        a = layers[0].self_attn
        self._function, self._weights = function, weights  # the weights kept alive
        width, heads, dim = a.heads * a.head_dim, a.heads, a.head_dim
        inter = layers[0].mlp.fc1.out_features
        self.tokens, self.width = tokens, width
        self._work = {"qkv": torch.empty(tokens, 3 * width, dtype=torch.bfloat16),
                      "attn": torch.empty(tokens, width, dtype=torch.bfloat16),
                      "out": torch.empty(tokens, width, dtype=torch.bfloat16),
                      "act": torch.empty(tokens, inter, dtype=torch.bfloat16)}
        work = {name: t.data_ptr() for name, t in self._work.items()}
        self._calls = []
        for w in weights:
            packed = {}
            for name in ("qkv", "o", "fc1", "fc2"):
                bias = w[name]["bias"]
                packed.update({f"w_{name}": pointer(w[name]["weight"]),
                               f"b_{name}": None if bias is None else bias.data_ptr()})
            self._calls.append(tuple(TowerRows(tokens=tokens, width=width, heads=heads, dim=dim, inter=inter,
                                               part=part, scale=dim ** -0.5, **packed, **work) for part in (0, 1)))

    @classmethod
    def build(cls, tower) -> "NativeTower | None":
        """NativeTower over `tower`'s encoder layers, or None where it does not apply (module docstring)."""
        layers = tower.encoder.layers
        lib = native_kernels(layers[0].self_attn.head_dim)
        if lib is None:
            return None
        weights = []
        for layer in layers:
            mlp = layer.mlp
            if not isinstance(mlp, PackedGeluMLP):
                return None
            w = {"qkv": _packed(layer.self_attn.__dict__.get("qkv"), "none"),
                 "o": _packed(layer.self_attn.out_proj, "none"), "fc1": _packed(mlp.fc1, "gelu_tanh"),
                 "fc2": _packed(mlp.fc2, "none")}
            if any(v is None for v in w.values()):
                return None
            weights.append(w)
        tokens = tower.embeddings.position_embedding.num_embeddings
        return cls(lib.tower_rows[torch.bfloat16], layers, weights, tokens)

    def half(self, i: int, part: int, x: torch.Tensor, h: torch.Tensor, rows, stage: dict, live: dict) -> None:
        """Layer i's attention half (part 0) or MLP half (1) for the picked `rows` (Rows: rows, sample of at least
        one where some rows are reused, at) over the residual stream x [T, W] (bf16, contiguous; += the moved
        update): h [n, W] the rows' normed input (layer_norm1 or layer_norm2 of x[rows]); `stage` and `live` the
        camera's state by name (qkv [L, 3, H, T, hd]; attn_out, mlp_out [L, T, W]; contiguous)."""
        n = rows.rows.numel()
        if (x.shape != (self.tokens, self.width) or h.shape != (n, self.width) or x.dtype != torch.bfloat16
                or h.dtype != torch.bfloat16 or not (x.is_contiguous() and h.is_contiguous())
                or (rows.sample.numel() == 0 and n != self.tokens)):
            raise ValueError(f"a native tower half of stream {tuple(x.shape)} {x.dtype}, rows {tuple(h.shape)} "
                             f"{h.dtype} for {n} picked rows, a sample of {rows.sample.numel()}: expected bf16 "
                             f"contiguous [{self.tokens}, {self.width}] and [{n}, {self.width}], a sample of 1 or more "
                             "where some rows are reused")
        call = self._calls[i][part]
        call.x, call.h, call.picked = x.data_ptr(), h.data_ptr(), n
        call.rows, call.sample, call.at = rows.rows.data_ptr(), rows.sample.data_ptr(), rows.at.data_ptr()
        call.samples = rows.sample.numel()
        name = "mlp_out" if part else "attn_out"
        call.stage_qkv, call.live_qkv = address(stage["qkv"], i), address(live["qkv"], i)
        call.stage_out, call.live_out = address(stage[name], i), address(live[name], i)
        call.threads = torch.get_num_threads()
        if self._function(ctypes.byref(call)) == -1:
            raise MemoryError("a kernel's workspace (the attention's, the int8 linear's) could not be allocated")
