"""BF16 weights prepacked (for oneDNN, or the fused CPU kernels' linear), with the MLP activations fused into their
matmul: the CPU's bf16 engine.

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

A packed matmul pads its rows up to a multiple of the bucket (16, a tile's rows, where oneDNN runs AMX; 8 elsewhere)
unless the row count was declared exact at warm-up. oneDNN compiles a kernel per row count on first use (a 512 ->
1536 matmul: 1.65 ms a call over 197 new row counts, 0.24 ms for the same again, on a Xeon with AMX, one thread) and
keeps 1024 in its cache; a reuse frame's row counts change from frame to frame (the refreshed tokens), so a run kept
compiling: 30 clip frames took 61.3 ms each unpadded against 45.2 ms padded. Without AMX the same holds (an AVX512-BF16
EPYC, Zen 5: a new row count about 2.5 ms at 69 rows against 0.25 ms again; the bench's 30 clip frames interleaved
with transformers and the reference, runs alternating, speedup_vs_hf 5.35 unpadded (the mean of 5 runs), 5.82 padded
to 4 rows (2), 5.86 to 8 (4), 5.71 to 16 (5), 5.52 to 32 (2)).
warm_row_buckets compiles every bucket at start, and the row counts every frame or tick repeats (a tick's block, a
frame's tokens: MultiRatePolicy.compile_kernels names them) run unpadded, their kernels compiled then too: padding
those cost a tick 12.0 against 10.9 ms. Nothing is compiled after warm-up: promoting a count at run time once it
recurred (an earlier form) filled each matmul's exact slots with reuse frames' counts that recurred by chance, and
each promotion compiled a kernel per matmul shape in the frame that ran it (200 freeway frames at 25 fps through a new
policy, five runs each: p95 43.7 against 40.1 ms, p99 48.6 against 45.1 ms, the median 36.6 against 36.0 ms). A padded
row's result is dropped (rows are independent).

Where the fused CPU kernels' bf16 linear runs (`kernel_matmuls`: built with AVX512-BF16, oneDNN not on AMX or the kernel
on AMX tiles itself, at most two threads), each weight is packed for it instead (PackedMatmul) and none of the above
applies: it compiles nothing per row count, so nothing is padded or warmed. oneDNN's kernel for a tick's 17 rows reached
about 70% of its rate at 196 rows, and about half of it with the weights coming from memory, as a tick's do (48 MB of
decoder weights cycle through a 32 MB L3); the kernel keeps its rate at every row count and prefetches the weight
stream. A Zen 5 EPYC, one thread, 8 layers of `small`'s tick matmuls in turn (their weights from memory): 2.16 ms
against oneDNN's 3.46 (17 rows), 1.16 against 2.25 (1 row), 8.26 against 9.71 (80 rows), 19.3 against 20.3 (196 rows).

With `int8` (`weights = "int8"`), every weight whose K is a multiple of 4 is quantized per output column for the
kernels' int8 linear (cpu_kernels.linear_int8: each row of activations quantized as it comes, the products summed
exactly in int32 on AVX512-VNNI, or on AMX tiles where the CPU has AMX-INT8): half the bytes and, on a Zen 4 EPYC,
one thread, 1.8x the bf16 kernel's speed at a tick's and a frame's shapes (about 410 against 225 GOP/s). It costs
accuracy: over 30 freeway frames the actions' logits 5.8% from the fp32 reference against 4.0% with bf16 weights
(ONNX Runtime's int8-ort 5.9%), the bins agreeing 92.5% against 94.4%; `auto` never picks it.

The plain weights stay in the modules as parameters, so a packed model still saves, loads and deep-copies as before;
its dtype and device are fixed (bf16 on the CPU): convert before packing, not after.
"""

from __future__ import annotations

import copy
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch
from torch import nn

from vla_node.backends import cpu_features, cpu_kernels, fp16_weights
from vla_node.model.decoder import LlamaMLP
from vla_node.model.vision import SiglipEmbeddings, SiglipMLP

BATCH_HINT = 196  # rows oneDNN packs for (a camera's tokens); any row count works
AMX_ROW_BUCKET = 16  # where oneDNN runs AMX, rows are padded up to a multiple of this (a tile's rows)
ROW_BUCKET = 8  # elsewhere (AVX512-BF16), to a multiple of this
KERNEL_MAX_THREADS = 2  # the most intra-op threads kernel_matmuls() was measured faster on than oneDNN


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


def int8_weights_available() -> bool:
    """Whether use_packed_weights(int8=True) works here: packed weights do, and the int8 linear kernel runs."""
    return packed_weights_available() and cpu_kernels.int8_linear_kernel()


def warm_workers() -> int:
    """Threads for warm_row_buckets: one per CPU this process may run on, at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def bucket_step() -> int:
    """Rows per bucket of the packed matmuls in this process: AMX_ROW_BUCKET where oneDNN runs AMX, else ROW_BUCKET."""
    return AMX_ROW_BUCKET if cpu_features.onednn_runs_amx() else ROW_BUCKET


def kernel_matmuls() -> bool:
    """Whether a weight packed now runs on cpu_kernels' bf16 linear kernel rather than oneDNN: where the kernel is
    built (AVX512-BF16), oneDNN would not run AMX (its tiles beat the vector kernel) or the kernel runs on AMX tiles
    itself (cpu_kernels.amx_tiles: as fast as oneDNN's or faster at every shape of `small`; on an AMX Xeon's two
    threads, a warm clip frame 28.3 against 30.5 ms, alternating in one process) and the process has at most
    KERNEL_MAX_THREADS intra-op threads, among which the kernel splits its column tiles (two threads of a Zen 4 EPYC:
    a warm reuse frame of `small` 30.8 ms against 36.0 ms on oneDNN's threaded primitive with its rows padded; more
    threads are unmeasured, and oneDNN, which splits rows too, keeps them).
    One thread on a Zen 5 EPYC, us, kernel against oneDNN: a tick's 17 rows x 512 -> 1536 61 against 73 with the
    weight in cache, 104 against 166 just read from memory (1536 -> 512: 57 / 104 against 72 / 227); a frame's 80
    and 196 rows 3 to 10% faster."""
    return (cpu_kernels.linear_kernel() and (cpu_kernels.amx_tiles() or not cpu_features.onednn_runs_amx())
            and torch.get_num_threads() <= KERNEL_MAX_THREADS)


class RowBuckets:
    """A packed matmul's input rows padded up to a multiple of `step` (bucket_step() by default; 1 pads nothing),
    but for the row counts declared `exact` at warm-up (module docstring), through a scratch buffer kept between
    calls (grown to the largest bucket seen; rows past the input's are stale and their results dropped)."""

    def __init__(self, width: int, step: int | None = None) -> None:
        self.width = width
        self.step = bucket_step() if step is None else step
        self._scratch = torch.zeros(0, width, dtype=torch.bfloat16)
        self.exact: set[int] = set()  # row counts that run unpadded (warm_row_buckets)

    def buckets(self, max_rows: int) -> range:
        return range(self.step, -(-max_rows // self.step) * self.step + 1, self.step)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width] -> itself where its rows fill buckets, else [bucket rows, width] with x's rows first."""
        n = x.numel() // self.width
        bucket = -(-n // self.step) * self.step
        if bucket == n or n in self.exact or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return x  # (a wrong input goes on to the primitive, which names it)
        if self._scratch.shape[0] < bucket:
            self._scratch = torch.zeros(bucket, self.width, dtype=torch.bfloat16)
        rows = self._scratch[:bucket]
        rows[:n].copy_(x.reshape(n, self.width))  # [..., width] -> [n, width]
        return rows

    def run(self, x: torch.Tensor, matmul) -> torch.Tensor:
        """matmul(rows) [rows, out] on x's rows, padded; returns [..., out]."""
        rows = self.pad(x)
        if rows is x:
            return matmul(x)
        y = matmul(rows)
        n = x.numel() // self.width
        return y[:n].view(*x.shape[:-1], y.shape[-1])  # [bucket, out] -> [..., out]


class PackedMatmul:
    """rows -> op(rows W^T + b) on a weight [N, K] packed once for the matmul that runs here: with `int8`, cpu_kernels'
    int8 linear (the weight quantized per output column, the rows per row as they come) where the weight fits it;
    else cpu_kernels' bf16 linear where kernel_matmuls() says so when it is packed, else oneDNN's primitive on its
    prepacked layout (ops: 'none', 'silu', 'gelu_tanh', or 'mul' by `other`); `rows` are its input's row buckets
    (oneDNN's: the kernels compile nothing per row count, so they pad nothing)."""

    _ONEDNN_OPS = {"none": ("none", ""), "gelu_tanh": ("gelu", "tanh"), "silu": ("swish", "")}

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int8: bool = False) -> None:
        self.out_features, width = weight.shape
        self.int8 = int8 and cpu_kernels.int8_linear_fits(weight)
        self.kernel = self.int8 or (kernel_matmuls() and cpu_kernels.linear_fits(weight))
        with torch.no_grad():
            if self.kernel:
                pack = cpu_kernels.pack_linear_int8 if self.int8 else cpu_kernels.pack_linear
                self.weight = pack(weight.detach())
                self.bias = None if bias is None else bias.detach().float()
            else:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)  # opaque
                self.bias = bias
        self.rows = RowBuckets(width, 1 if self.kernel else None)

    def __call__(self, rows: torch.Tensor, op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        if self.int8:
            return cpu_kernels.linear_int8(rows, self.weight, self.out_features, self.bias, op, other)
        if self.kernel:
            return cpu_kernels.linear(rows, self.weight, self.out_features, self.bias, op, other)
        if op == "mul":
            return torch.ops.mkldnn._linear_pointwise.binary(rows, other, self.weight, self.bias, "mul")
        name, algorithm = self._ONEDNN_OPS[op]
        return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, name, [], algorithm)


class PackedLinear(nn.Module):
    """nn.Linear (bf16, CPU) with its weight prepacked (PackedMatmul), and optionally a fused activation:
    'gelu_tanh' (y = gelu(x W^T + b), tanh approximation) or 'silu'; `int8`: on the int8 linear kernel (PackedMatmul).
    Any leading dims."""

    ACTIVATIONS = ("none", "gelu_tanh", "silu")

    def __init__(self, linear: nn.Linear, activation: str = "none", int8: bool = False) -> None:
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(self.ACTIVATIONS)}")
        weight = linear.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"packed weights take a bf16 CPU nn.Linear, got {weight.dtype} on {weight.device}")
        self.in_features, self.out_features, self.activation = linear.in_features, linear.out_features, activation
        self.int8 = int8
        self.weight, self.bias = linear.weight, linear.bias  # kept for state_dict, checkpoints and copies
        self._pack()

    def _pack(self) -> None:
        self.matmul = PackedMatmul(self.weight, self.bias, self.int8)
        self._rows = self.matmul.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            if self.matmul.kernel:
                return self.matmul(x, self.activation)  # nothing padded
            return self._rows.run(x, lambda rows: self.matmul(rows, self.activation))
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(f"packed linear {self.in_features}->{self.out_features} takes a bf16 CPU input "
                               f"[..., {self.in_features}], got {x.dtype} {tuple(x.shape)} on {x.device}: {e}") from e

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x W^T + b) * other, in one primitive (no activation; rows as given: PackedSwiGLU buckets them)."""
        return self.matmul(x, "mul", other)

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
        clone.int8 = self.int8
        clone.weight, clone.bias = copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo)
        clone._pack()
        return clone

    def extra_repr(self) -> str:
        kind = "int8 (cpu_kernels int8 linear)" if self.matmul.int8 else \
            f"bf16 packed ({'cpu_kernels linear' if self.matmul.kernel else 'oneDNN'})"
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={kind}, " \
               f"activation={self.activation}"


class PackedGeluMLP(nn.Module):
    """fc2(gelu_tanh(fc1(x))) with the GELU fused into fc1 (SigLIP's MLP, the projector)."""

    def __init__(self, mlp: nn.Module, int8: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = PackedLinear(mlp.fc1, "gelu_tanh", int8), PackedLinear(mlp.fc2, int8=int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1._rows.run(x, lambda rows: self.fc2(self.fc1(rows)))  # padded once for both


class PackedSwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with the SiLU fused into gate and the product into up (Llama's MLP)."""

    def __init__(self, mlp: nn.Module, int8: bool = False) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = PackedLinear(mlp.gate_proj, "silu", int8), PackedLinear(mlp.up_proj, int8=int8)
        self.down_proj = PackedLinear(mlp.down_proj, int8=int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate_proj._rows.run(x, lambda rows: self.down_proj(self.up_proj.times(rows, self.gate_proj(rows))))


class PackedQKV(nn.Module):
    """An attention's q, k and v projections as one packed matmul: x [..., in] -> [..., q | k | v], with their biases
    where all three have one (SigLIP's) or none (Llama's). Holds no parameter (the three projections keep theirs, so
    checkpoints and state dicts are unchanged)."""

    def __init__(self, q: PackedLinear, k: PackedLinear, v: PackedLinear) -> None:
        super().__init__()
        if len({p.bias is None for p in (q, k, v)}) > 1:
            raise ValueError("PackedQKV takes three projections with a bias each or none")
        self._parts = (q, k, v)
        self._pack()

    def _pack(self) -> None:
        with torch.no_grad():
            weight = torch.cat([p.weight.detach() for p in self._parts])  # [q + k + v out, in]
            biases = [p.bias for p in self._parts]
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])  # [q + k + v out]
        self.matmul = PackedMatmul(weight, self.bias, self._parts[0].int8)
        self._rows = self.matmul.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows.run(x, self.matmul)

    def __deepcopy__(self, memo: dict) -> "PackedQKV":
        return PackedQKV(*(copy.deepcopy(p, memo) for p in self._parts))


def warm_row_buckets(module: nn.Module, max_rows: int, exact: Iterable[int] = (), workers: int = 1) -> int:
    """Compile, for every packed matmul under `module` (its attentions' PackedQKV too), each row bucket's kernel up to
    max_rows rows, and declare the `exact` row counts (those between buckets) to run unpadded, compiling theirs, so
    that no frame pays for a kernel. oneDNN keeps a compiled kernel by its shapes and post-ops, not by the weights
    it multiplies, so of the matmuls that share those (`_kernel_key`: a decoder's layers, a tower's) one runs each
    row count and the others only declare theirs. `workers` threads run the compiling matmuls (torch releases the
    interpreter lock inside them; oneDNN's kernel cache is shared and thread-safe): small's 193 kernels on an AMX
    Xeon's 2 vCPUs, three runs each, 0.47-0.61 s with 2 against 0.72-0.85 s with 1; in the demo's node 0.53 and
    0.60 against 1.23 and 1.14 s; padded to 8 rows, 301 kernels on a Zen 5 EPYC (AVX512-BF16), 0.15-0.22 s with 2.
    Returns the kernels compiled."""
    mlps = [m for m in module.modules() if isinstance(m, (PackedGeluMLP, PackedSwiGLU))]
    inside = {id(linear) for mlp in mlps for linear in mlp.children()}
    warmed = mlps + [m for m in module.modules() if isinstance(m, PackedLinear) and id(m) not in inside]
    warmed += [m.__dict__[name] for m in module.modules() for name in ("qkv", "packed_patches") if name in m.__dict__]
    runs: dict[tuple, set[int]] = {}  # per kernel key, the row counts one of its matmuls runs
    work: list[tuple[nn.Module, int, int]] = []  # (matmul, its input width, rows): every count declared first
    for matmul in warmed:
        rows = _row_buckets(matmul)
        if rows.step == 1:
            continue  # cpu_kernels' linear: nothing compiled per row count, nothing padded
        between = sorted(n for n in set(exact) - rows.exact if n % rows.step)
        for inner in _inner_row_buckets(matmul):  # a fused MLP's second matmul takes the first's rows as they are
            inner.exact.update(between)
        ran = runs.setdefault(_kernel_key(matmul), set())
        for n in [*rows.buckets(max_rows), *between]:
            if n not in ran:
                work.append((matmul, rows.width, n))
                ran.add(n)

    def compile_one(item: tuple[nn.Module, int, int]) -> None:
        matmul, width, n = item
        with torch.inference_mode():
            matmul(torch.zeros(n, width, dtype=torch.bfloat16))

    if workers > 1 and len(work) > 1:
        # oneDNN keys a kernel by the thread count it was created for, and a new thread's OpenMP count is the
        # machine's: each worker takes this thread's, so the stages find its kernels
        threads = torch.get_num_threads()
        with ThreadPoolExecutor(min(workers, len(work)), thread_name_prefix="warm-kernels",
                                initializer=torch.set_num_threads, initargs=(threads,)) as pool:
            list(pool.map(compile_one, work))  # re-raises the first error
    else:
        for item in work:
            compile_one(item)
    return sum(len(ran) for ran in runs.values())


def _kernel_key(matmul: nn.Module) -> tuple:
    """What a packed matmul's compiled kernels depend on: its kind and, per matmul inside it, the widths, the fused
    activation and whether it adds a bias (PackedLinear packs every weight of one shape alike)."""
    parts = matmul._parts if isinstance(matmul, PackedQKV) else [matmul] if isinstance(matmul, PackedLinear) \
        else list(matmul.children())  # a fused MLP's PackedLinears
    return type(matmul), tuple((p.in_features, p.out_features, p.activation, p.bias is not None) for p in parts)


def _row_buckets(matmul: nn.Module) -> RowBuckets:
    first = {PackedGeluMLP: "fc1", PackedSwiGLU: "gate_proj"}.get(type(matmul))
    return (getattr(matmul, first) if first else matmul)._rows


def _inner_row_buckets(matmul: nn.Module) -> list[RowBuckets]:
    """The row buckets a matmul's rows meet: its own, and in a fused MLP the second matmul's too."""
    second = {PackedGeluMLP: "fc2", PackedSwiGLU: "down_proj"}.get(type(matmul))
    return [_row_buckets(matmul), *([getattr(matmul, second)._rows] if second else [])]


def use_packed_weights(module: nn.Module, int8: bool = False) -> nn.Module:
    """Replace, in place, every MLP under `module` (SigLIP's, the projector, Llama's) by its fused packed form and
    every other nn.Linear by a PackedLinear, and give every attention (Llama's, SigLIP's) its PackedQKV; returns the
    module. Every weight must be bf16 on the CPU. `int8`: every weight that fits it on the int8 linear kernel
    (int8_weights_available)."""
    from vla_node.model.decoder import LlamaAttention
    from vla_node.model.vision import SiglipAttention
    from vla_node.model.vla import Projector

    if not packed_weights_available():
        raise RuntimeError("packed bf16 weights need oneDNN running bf16 in hardware (AVX512_CORE_BF16 or AMX, "
                           f"as ONEDNN_MAX_CPU_ISA allows); here: {cpu_features.describe()}")
    if int8 and not cpu_kernels.int8_linear_kernel():
        raise RuntimeError(f"int8 weights need the fused CPU kernels' int8 linear (AVX512-VNNI and AVX512-BF16; "
                           f"kernels: {cpu_kernels.status()}); here: {cpu_features.describe()}")
    fused = {SiglipMLP: PackedGeluMLP, Projector: PackedGeluMLP, LlamaMLP: PackedSwiGLU}

    def pack(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if type(child) in fused:
                setattr(parent, name, fused[type(child)](child, int8))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, int8=int8))
            else:
                pack(child)

    pack(module)
    for attention in module.modules():
        if isinstance(attention, (LlamaAttention, SiglipAttention)):
            # a plain attribute, not a submodule: the projections stay the modules that own the weights
            object.__setattr__(attention, "qkv", PackedQKV(attention.q_proj, attention.k_proj, attention.v_proj))
    for embeddings in module.modules():
        if isinstance(embeddings, SiglipEmbeddings):  # the patch embedding's conv as the matmul embed_patches runs
            object.__setattr__(embeddings, "packed_patches", _packed_patches(embeddings.patch_embedding, int8))
    return module


def _packed_patches(conv: nn.Conv2d, int8: bool) -> PackedLinear:
    """A patch embedding's conv weight [W, C, P, P] as a PackedLinear of [W, C*P*P] (a copy: the conv keeps its own)."""
    flat = nn.Linear(conv.weight[0].numel(), conv.out_channels, bias=conv.bias is not None, dtype=conv.weight.dtype)
    with torch.no_grad():
        flat.weight.copy_(conv.weight.reshape(conv.out_channels, -1))  # [W, C, P, P] -> [W, C*P*P]
        if conv.bias is not None:
            flat.bias.copy_(conv.bias)
    return PackedLinear(flat.requires_grad_(False), int8=int8)
