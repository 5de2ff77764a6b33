"""The action tick whole in one C call (cpu_kernels.c: vla_tick_rows_bf16), where NativeRows runs its layers.

With NativeRows a tick's layers are one C call each, but the steps around them still run from Python, some twenty
torch calls: the state's embedding, the query rows' lookup and the concatenation, the rotary rows, the final norm,
the LM head, the argmax over the bins, the bins' values. Each is microseconds warm, but a tick follows a frame or
the idle time between ticks, whose work has evicted the interpreter's and the dispatcher's code and data: measured
after a frame on a Zen 5 EPYC (2 vCPU), 2026-12-07, the final norm and the LM head alone took 242 us against 40 warm.
NativeTick makes those steps in the same C call as the layers: the same kernels in the same order on the same
operands, so the same bits as the policy's own tick (tests/backend/test_native_tick.py); the budget is asked before
each layer through a callback, as NativeRows' before_layer.

It runs the tick the node runs between frames that carried their tick: the parallel bins head, the stored states
fresh (a stale ring is recomputed in the tick's block by the policy's _fused_tick, on NativeRows). NativeHead is its
last step alone, the bins head on the query rows' final hidden states, which the tick in a frame's pass (and the
fused tick) runs after its layers. The LM head must be packed for the bf16 linear kernel or (`weights = "int8"`)
quantized for the int8 one, without a bias, and the final norm be a bf16 KernelRMSNorm (NativeHead), the state
projection on a kernel too, with or without a bias (NativeTick); `build` returns None elsewhere.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import torch

from vla_node.backends import cpu_kernels
from vla_node.backends.native_rows import DecoderRows, NativeRows, address, kernel_matmul, weight_of
from vla_node.model.action_head import ActionBins
from vla_node.model.config import ModelConfig
from vla_node.model.tokenizer import ACT, BIN_BASE

_P, _I = ctypes.c_void_p, ctypes.c_int64
STOP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)  # stop(layer): nonzero stops before it
STOPPED = -3  # vla_tick_rows_bf16's return where stop said to stop


class TickHead(ctypes.Structure):
    """cpu_kernels.c's struct tick_head."""

    _fields_ = [("x", _P), ("queries", _I), ("width", _I), ("norm", _P), ("eps", ctypes.c_float), ("w_head", _P),
                ("vocab", _I), ("h", _P), ("head", _P), ("logits", _P), ("bin_base", _I), ("bins", _I), ("dims", _I),
                ("low", _P), ("step", _P), ("out_bins", _P), ("values", _P), ("threads", _I)]


class TickRows(ctypes.Structure):
    """cpu_kernels.c's struct tick_rows."""

    _fields_ = [("layers", _P), ("count", _I), ("n", _I), ("threads", _I), ("cos", _P), ("sin", _P),
                ("state", _P), ("state_dim", _I), ("w_state", _P), ("b_state", _P), ("state_row", _P),
                ("query", _P), ("head", TickHead), ("stop", STOP), ("stopped", _I)]


class NativeHead:
    """The bins head in one C call (cpu_kernels.c: vla_tick_head_bf16): the query rows' final hidden states [H*D,
    hidden] (bf16) -> the final norm, the LM head, the logits (fp32) into `logits`, the bins and their values; the
    bits of Decoder.logits and ActionBins (bins_from_logits, to_values). For the tick in a frame's pass, whose rows
    run on NativeFrame or the layers' own calls, and inside NativeTick."""

    def __init__(self, function, model, config: ModelConfig, logits: torch.Tensor, bins: ActionBins) -> None:
        decoder = model.decoder
        head = kernel_matmul(decoder.lm_head)
        queries = config.action_tokens
        self._function = function
        self._h = torch.empty(queries, config.hidden_size, dtype=torch.bfloat16)
        self._head = torch.empty(queries, config.vocab_size, dtype=torch.bfloat16)
        self._bins = np.zeros(queries, np.int64)
        self._values = np.zeros(queries, np.float32)
        self._shape = (config.action_horizon, config.action_dims)
        weight = weight_of(head)
        self._keep = (weight, bins.low, bins.width, logits)  # what the call's addresses point into (low, width: [D])
        self.call = TickHead(
            queries=queries, width=config.hidden_size, norm=decoder.model.norm.weight.data_ptr(),
            eps=decoder.model.norm.eps, w_head=ctypes.addressof(weight), vocab=config.vocab_size,
            h=self._h.data_ptr(), head=self._head.data_ptr(), logits=logits.data_ptr(), bin_base=BIN_BASE,
            bins=config.action_bins, dims=config.action_dims, low=bins.low.ctypes.data, step=bins.width.ctypes.data,
            out_bins=self._bins.ctypes.data, values=self._values.ctypes.data)

    @classmethod
    def build(cls, model, config: ModelConfig, logits: torch.Tensor, bins: ActionBins) -> "NativeHead | None":
        """The head of `model` (a bins head) with its logits into `logits` [H*D, vocab] (fp32, contiguous), or None
        where a piece of it does not run on the kernels (the LM head packed for the bf16 linear kernel without a
        bias, the final norm a bf16 KernelRMSNorm)."""
        lib = cpu_kernels.library()
        head, norm = kernel_matmul(model.decoder.lm_head), model.decoder.model.norm
        if (lib is None or config.action_head != "bins" or head is None or head.bias is not None
                or type(norm) is not cpu_kernels.KernelRMSNorm or norm.weight.dtype != torch.bfloat16):
            return None
        want = (config.action_tokens, config.vocab_size)
        if logits.dtype != torch.float32 or logits.shape != want or not logits.is_contiguous():
            raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype}: expected contiguous fp32 logits "
                             f"{list(want)}")
        return cls(lib.tick_head[torch.bfloat16], model, config, logits, bins)

    def outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """The last call's bins [H, D] int64 and values [H, D] float32, as new arrays."""
        return self._bins.reshape(self._shape).copy(), self._values.reshape(self._shape).copy()

    def run(self, hidden: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The head on `hidden` [H*D, hidden] (bf16, contiguous): logits into `logits`; returns (bins, values)."""
        if hidden.dtype != torch.bfloat16 or hidden.shape != self._h.shape or not hidden.is_contiguous():
            raise ValueError(f"query rows {tuple(hidden.shape)} {hidden.dtype}: expected contiguous bf16 "
                             f"{list(self._h.shape)}")
        self.call.x, self.call.threads = hidden.data_ptr(), torch.get_num_threads()
        done = self._function(ctypes.byref(self.call))
        if done == -1:
            raise MemoryError("the int8 linear's workspace could not be allocated")
        if done != 0:
            raise RuntimeError("vla_tick_head_bf16 did not run: the library was not built for this CPU")
        return self.outputs()


class NativeTick:
    """The fresh-state parallel tick in one C call (module docstring): run() writes the state's embedding into
    `state_row` [1, hidden], the block's K/V into out_k, out_v and the prefix buffer's block slots, and the head's
    outputs as its NativeHead's run does."""

    def __init__(self, function, rows: NativeRows, head: NativeHead, model, config: ModelConfig, out_k: torch.Tensor,
                 out_v: torch.Tensor) -> None:
        self._function, self._head, self.layers = function, head, rows.layers
        n = 1 + config.action_tokens
        self._calls = (DecoderRows * rows.layers)(*rows.calls)  # copies: the stage addresses are the tick's own
        for i, call in enumerate(self._calls):
            call.stage_k, call.stage_v = address(out_k, i), address(out_v, i)
            call.stage_head, call.stage_row = out_k.stride(1), out_k.stride(2)
        state = weight_of(kernel_matmul(model.state_proj))
        self.state_row = torch.empty(1, config.hidden_size, dtype=torch.bfloat16)
        self._state = torch.empty(config.state_dim, dtype=torch.bfloat16)
        query = model.decoder.model.embed_tokens.weight.detach()
        # per ring slot, the block's rotary rows: the state at its slot's position, the queries at theirs
        positions = [torch.tensor([config.state_base + slot, *range(config.query_base, config.query_base + n - 1)])
                     for slot in range(config.state_slots)]
        self._rotary = [tuple(t.contiguous() for t in model.decoder.rope(p, torch.bfloat16)) for p in positions]
        self._keep = (rows, state, query)  # what the call's addresses point into
        self._call = TickRows(
            layers=ctypes.addressof(self._calls), count=rows.layers, n=n, state=self._state.data_ptr(),
            state_dim=config.state_dim, w_state=ctypes.addressof(state),
            b_state=None if state.matmul.bias is None else state.matmul.bias.data_ptr(),
            state_row=self.state_row.data_ptr(),
            query=address(query, ACT), head=head.call)  # (a copy of the head's call: its x is this call's rows)
        self._prefix, self._n = rows.prefix, n
        self._stop, self._no_stop = STOP(self._stop_at), STOP()  # the callback, and a NULL one
        self._before_layer: Callable[[int], None] | None = None
        self._raised: BaseException | None = None

    @classmethod
    def build(cls, rows: NativeRows | None, head: NativeHead | None, model, config: ModelConfig, out_k: torch.Tensor,
              out_v: torch.Tensor) -> "NativeTick | None":
        """NativeTick over `rows` (the policy's NativeRows) and `head` (its NativeHead) for `model`'s parallel bins
        head, its block's K/V into out_k, out_v [L, KV, 1 + H*D, dim]; None where it does not apply (module
        docstring)."""
        lib = cpu_kernels.library()
        if rows is None or head is None or lib is None or config.action_decode != "parallel":
            return None
        embed = model.decoder.model.embed_tokens.weight
        if kernel_matmul(model.state_proj) is None or embed.dtype != torch.bfloat16 or not embed.is_contiguous():
            return None
        n = 1 + config.action_tokens
        kv_shape = (config.num_layers, config.num_kv_heads, n, config.head_dim)
        if (any(t.dtype != torch.bfloat16 or t.shape != kv_shape for t in (out_k, out_v))
                or out_k.stride() != out_v.stride() or out_k.stride(3) != 1):
            raise ValueError(f"tick K/V out {tuple(out_k.shape)} {out_k.dtype}: expected {list(kv_shape)} bf16 of one "
                             f"layout, last dim contiguous")
        return cls(lib.tick_rows[torch.bfloat16], rows, head, model, config, out_k, out_v)

    def _stop_at(self, layer: int) -> int:
        """The C call's stop(layer): before_layer(layer), its exception kept for run() to raise (an exception may
        not cross the C frames)."""
        try:
            self._before_layer(layer)
            return 0
        except BaseException as error:  # re-raised by run()
            self._raised = error
            return 1

    def run(self, state: torch.Tensor, slot: int,
            before_layer: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The tick of `state` [state_dim] (bf16) into ring slot `slot`, over the prefix buffer set_block'ed for its
        1 + H*D rows with the ring loaded; before_layer(i) is called before layer i (the budget check: it raises to
        stop, and nothing after it runs). Returns (bins [H, D] int64, their values [H, D] float32), new arrays."""
        if self._prefix.block != self._n or state.dtype != torch.bfloat16 or state.shape != self._state.shape:
            raise ValueError(f"a tick of state {tuple(state.shape)} {state.dtype} over a block of "
                             f"{self._prefix.block} rows: expected a bf16 state {list(self._state.shape)} and the "
                             f"{self._n} rows of the tick set_block'ed")
        call = self._call
        self._state.copy_(state)
        call.cos, call.sin = (t.data_ptr() for t in self._rotary[slot])
        call.threads = torch.get_num_threads()
        self._before_layer, self._raised = before_layer, None
        call.stop = self._stop if before_layer is not None else self._no_stop
        done = self._function(ctypes.byref(call))
        self._before_layer = None
        if done == STOPPED:
            raise self._raised
        if done == -1:
            raise MemoryError("a kernel's workspace (the attention's, the int8 linear's) could not be allocated")
        if done != 0:
            raise RuntimeError(f"vla_tick_rows_bf16 returned {done}: expected 0 (built for this CPU)")
        return self._head.outputs()
