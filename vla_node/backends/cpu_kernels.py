"""Fused CPU kernels (cpu_kernels.c) for work eager PyTorch runs as several passes over memory.

A warm reuse frame of `small` in bf16 on a CPU spends about a quarter of its time in ATen's elementwise kernels
and copies, most of it in two places: RMSNorm, which torch's CPU build runs as its decomposition (an fp32 copy,
pow, mean, add, rsqrt, two multiplies, a copy back: 232 us at 216 x 512 on an AMX Xeon, one thread), and the
shared-drift moves of the reused tokens' cached parts (runtime/vision_cache.shift_reused: a copy to fp32, an add,
a copy back and an index_copy: 368 us for a tower layer's [3, 6, 196, 64]). Here each is one pass: 74 and 77 us.
The INT8 vision partition's KIVI passes (kv/quant.py) are a third place: a frame's whole write of `small`'s K/V
([8, 2, 196, 64] each) took about 1.9 ms in torch's ops (a dozen passes, fp32 temporaries) and its read into the
tick's bf16 prefix buffer about 0.5 ms (through fp32 staging); KernelKivi does each in one pass over K and V,
about 0.6 and 0.2 ms (a warm reuse frame about 4% faster, the same bits). The decoder's attention is a fourth
(kv/attention.buffer_attention: two batched matmuls, the logits converted, scaled, biased, a softmax, converted back,
its output transposed for the output projection), and the tower's is a fifth (model/vision.softmax_attention, the
same unmasked): on a CPU with AVX512-BF16 `attention` does either in one call, its products on the bf16 dot-product
instruction (`small` on a Zen 5 EPYC, one thread, alternating in one process: see `attention`). The last is the linear
layer's matmul itself, on the same instruction where oneDNN has no AMX to run, and on AMX tiles where the CPU has them
(`linear`, `amx_tiles`; the packed weights take it: backends/packed_weights.kernel_matmuls), and, for `weights =
"int8"`, on the byte dot-product instruction (`linear_int8`, AVX512-VNNI: the weights quantized per output column, each
row of activations as it comes; twice the bf16 instruction's products a cycle on a Zen 4, about 1.8x the bf16 kernel's
speed at the node's shapes), or on AMX tiles where the CPU has AMX-INT8 (`amx_int8_tiles`: the same bits).

Threads: the linear kernels split a call's columns, the attention its kv heads, among torch.get_num_threads()
threads (a call of fewer than 2^21 multiply-adds runs on one), on torch's own OpenMP threads: where torch runs on
libgomp.so.1 the library is built with -fopenmp and takes that same runtime (openmp_flags: GCC), so nothing else spins
beside torch's threads (a pool of the library's own, tried first, ran a reuse frame in 70 ms on two threads against
40 on one: its spinning workers and OpenMP's took turns on the two cores). Every part is computed as one thread
computes it: the bits do not depend on the thread count. Two threads of a Zen 4 EPYC (2 vCPU), us against one: a
frame's 89 rows x 512 -> 1536 374 against 699, the int8 kernel's 222 against 409; the attention of 89 rows over 268
keys (8 heads on 2 kv heads) 197 against 376. Where a call's column tiles do not split evenly among the threads
and each thread has 18 rows or more, the bf16 linear gives each thread every tile of its share of the rows instead
(the same bits): two threads of a Zen 5 EPYC, a frame's K projection 216 x 512 -> 128 (3 tiles) 31-33 us against
38 by columns, 89 x 1536 -> 512 (11 tiles) 134-142 against 149-151.

The C source is built at first use with the machine's C compiler (`$CC`, else cc, gcc or clang; -O3
-march=native, -fopenmp as above where the compiler has it) into a cache directory (`$VLA_NODE_KERNEL_DIR`, else
`$XDG_CACHE_HOME/vla-node/kernels` or ~/.cache/vla-node/kernels), keyed by the source, compiler, flags and CPU, so a
cached library never runs on a CPU it was not built for; about 5 s to build (gcc 12 on a Zen 4), a millisecond to
load. Before it is used, each kernel is checked against torch on a small input. Where no compiler is found, the
build fails or the check does, or `VLA_NODE_CPU_KERNELS=0` is set, `library()` is None and torch's ops run
(`status()` says why).

Bits: the attention is not torch's (its logits stay fp32 where torch's round to bf16: nearer the exact value, see
cpu_kernels.c); the move is torch's own arithmetic (the sample's mean change summed in order, an fp32 add, one rounding)
and gives the same bits, and so does KIVI (the same fp32 steps; the fp16 scales by the CPU's F16C conversions or,
without them, integer arithmetic). The norm rounds as torch's rms_norm does except its sum of squares, which adds
in another order than torch's reduction: about one value in 10^5 lands one bf16 rounding away (in fp32, a last
bit). Only inference uses them: with gradients enabled, or under tracing or compiling, torch's ops run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from vla_node.backends import cpu_features, huge_pages
from vla_node.kv import quant
from vla_node.model import decoder
from vla_node.model.decoder import RMSNorm
from vla_node.model.vision import softmax_attention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
OPENMP = "-fopenmp"  # where torch runs on libgomp.so.1 (openmp_flags)
_KINDS = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _I, _I, ctypes.c_float],
    "shift": [_P, _P, _I, _I, _P, _I, _P, _P, _I, _P, _I, _I, _I, _P, _I],
    "rope": [_P, _I, _I, _P, _P, _I, _I, _I, _P],
    "kivi_keys": [_P, _I, _I, _I, _I, _P, _P, _P],
    "kivi_values": [_P, _I, _I, _P, _P, _P],
    "kivi_dequant": [_P, _P, _P, _I, _I, _I, _I, _P, _I],
    "attention": [_P, _I, _I, _P, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I, _I, _I],
    "linear": [_P, _I, _I, _P, _I, _I, _P, ctypes.c_int, _P, _I, _P, _I, _I],
    "pack_linear": [_P, _I, _I, _P],
    "linear_s8": [_P, _I, _I, _P, _P, _P, _I, _I, _P, ctypes.c_int, _P, _I, _P, _I, _I],
    "pack_linear_s8": [_P, _I, _I, _P, _P, _P],
    "decoder_rows": [_P],
    "frame_rows": [_P],
    "tower_rows": [_P],
    "tick_head": [_P],
    "tick_rows": [_P],
}
LINEAR_OPS = {"none": 0, "silu": 1, "mul": 2, "gelu_tanh": 3}  # cpu_kernels.c's linear ops
MAX_INNER = 4096  # cpu_kernels.c's MAX_INNER: the shared-drift move's values per token
MAX_HEAD_DIM = 512  # cpu_kernels.c's MAX_HEAD_DIM: RoPE's head_dim
_status = "not loaded yet"


class Kernels(NamedTuple):
    """The loaded library's functions by storage dtype (bf16, fp32)."""

    rms_norm: dict[torch.dtype, Callable]
    shift: dict[torch.dtype, Callable]
    rope: dict[torch.dtype, Callable]
    kivi_keys: dict[torch.dtype, Callable]  # by the input's dtype
    kivi_values: dict[torch.dtype, Callable]
    kivi_dequant: dict[torch.dtype, Callable]  # by the output's dtype
    attention: dict[torch.dtype, Callable]  # returns 0, or -2 where not built for this CPU (bf16: AVX512-BF16)
    linear: dict[torch.dtype, Callable]  # the same
    pack_linear: dict[torch.dtype, Callable]
    linear_s8: dict[torch.dtype, Callable]  # the int8 linear: returns -2 where not built (AVX512-VNNI and -BF16)
    pack_linear_s8: dict[torch.dtype, Callable]
    decoder_rows: dict[torch.dtype, Callable]  # a decoder layer of a block of rows (native_rows.py); -2 as linear
    frame_rows: dict[torch.dtype, Callable]  # a reuse frame's decoder layer with extra rows (native_frame.py); the same
    tower_rows: dict[torch.dtype, Callable]  # half a tower layer of a partial refresh (native_tower.py); the same
    tick_head: dict[torch.dtype, Callable]  # the action head on the query rows (native_tick.py); the same
    tick_rows: dict[torch.dtype, Callable]  # the action tick whole (native_tick.py); the same, -3 where stopped
    parts: Callable  # parts(items, threads): the parts a threaded call runs in (1 where built without OpenMP)
    amx: Callable  # amx(use): 1 where the bf16 linear and attention run on AMX tiles; use 0/1 switches, -1 asks
    amx_int8: Callable  # amx_int8(): 1 where the int8 linear runs on AMX tiles (amx's switch turns it off too)
    path: Path


def kernel_dir() -> Path:
    """Where built kernel libraries are cached."""
    if os.environ.get("VLA_NODE_KERNEL_DIR"):
        return Path(os.environ["VLA_NODE_KERNEL_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "vla-node" / "kernels"


def compiler() -> str | None:
    """The C compiler to build with: $CC, else the first of cc, gcc, clang on PATH."""
    found = (shutil.which(name) for name in (os.environ.get("CC"), "cc", "gcc", "clang") if name)
    return next((path for path in found if path), None)


def _cpu_identity() -> str:
    """The CPU's model and feature lines (a library built with -march=native runs only where they match; without
    /proc/cpuinfo, what the platform says)."""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = [line for line in cpu_features.read_cpuinfo().splitlines() if line.split(":")[0].strip() in keys]
    return "\n".join(dict.fromkeys(lines)) or platform.processor()  # the first processor's lines, each once


def build(cc: str, directory: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library for this source, compiler, flags and CPU: the cached one, else built now (atomically: parallel
    processes may build it at once). Raises RuntimeError with the compiler's output when the build fails."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(flags), platform.machine(),
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    path = directory / f"cpu_kernels-{key}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", partial, str(SOURCE)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} {' '.join(flags)} {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def openmp_flags(cc: str) -> tuple[str, ...]:
    """(OPENMP,) where torch runs on GNU OpenMP loaded as libgomp.so.1 and `cc` is GCC, whose -fopenmp links
    libgomp.so.1: the library then takes torch's runtime (one soname, loaded once) and its matmuls and attention
    split among torch's intra-op threads (cpu_kernels.c). Elsewhere () and each call runs on its caller's thread: a
    second OpenMP runtime (clang's libomp beside torch's libgomp) would spin its own threads against torch's."""
    if openmp_runtimes() != {"libgomp.so.1"}:
        return ()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    return (OPENMP,) if "Free Software Foundation" in version else ()


def openmp_runtimes() -> set[str]:
    """The file names of the OpenMP runtimes this process has loaded (GNU, LLVM, Intel; Linux: empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            names = {Path(line.split()[-1]).name for line in maps if "/" in line}
    except OSError:
        return set()
    return {name for name in names if name.startswith(("libgomp", "libomp", "libiomp"))}


def _load_threaded(cc: str, directory: Path) -> tuple[Kernels, tuple[str, ...]]:
    """The library built with openmp_flags(cc), loaded and checked, else (a compiler or runtime without OpenMP, or a
    threaded build that fails its check) built without them; the library and its flags."""
    flags = (*FLAGS, *openmp_flags(cc))
    try:
        return _checked(build(cc, directory, flags)), flags
    except (OSError, RuntimeError) as error:
        if flags == FLAGS:
            raise
        log.warning("cpu kernels: %s; built without OpenMP instead (one thread a call)", error)
        return _checked(build(cc, directory, FLAGS)), FLAGS


def _checked(path: Path) -> Kernels:
    lib = load(path)
    _self_check(lib)
    return lib


@functools.cache
def library() -> Kernels | None:
    """The loaded kernels, built if needed and checked against torch; None where they cannot run (status())."""
    global _status
    if kernels_switched_off():
        _status = "off (VLA_NODE_CPU_KERNELS=0)"
        return None
    cc = compiler()
    if cc is None:
        _status = "unavailable: no C compiler (set CC, or install gcc or clang)"
        return None
    try:
        lib, flags = _load_threaded(cc, kernel_dir())
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _status = f"unavailable: {error}"
        log.warning("cpu kernels %s; torch's ops run instead", _status)
        return None
    threads = "on torch's OpenMP threads" if OPENMP in flags else "one thread a call (built without OpenMP)"
    _status = f"built with {Path(cc).name} {' '.join(flags[:3])}, {threads} ({lib.path})"
    log.info("cpu kernels %s", _status)
    return lib


def load(path: Path) -> Kernels:
    """The kernels of a built library (OSError where it cannot be loaded or lacks one)."""
    loaded = ctypes.CDLL(str(path))
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        functions[name] = {}
        for dtype, kind in _KINDS.items():
            try:
                functions[name][dtype] = function = getattr(loaded, f"vla_{name}_{kind}")
            except AttributeError as error:
                raise OSError(f"{path.name} has no vla_{name}_{kind}") from error
            function.argtypes = argtypes
    try:
        parts, amx, amx_int8 = loaded.vla_parts, loaded.vla_amx, loaded.vla_amx_int8
    except AttributeError as error:
        raise OSError(f"{path.name} lacks {error.name}") from error
    parts.argtypes = [_I, _I]
    amx.argtypes, amx.restype = [ctypes.c_int], ctypes.c_int
    amx_int8.argtypes, amx_int8.restype = [], ctypes.c_int
    return Kernels(**functions, parts=parts, amx=amx, amx_int8=amx_int8, path=path)


def kernels_switched_off() -> bool:
    """Whether VLA_NODE_CPU_KERNELS=0 keeps torch's ops (for comparisons)."""
    return os.environ.get("VLA_NODE_CPU_KERNELS", "1") == "0"


def status() -> str:
    """One line for reports: whether the fused kernels run here, and how they were built or why not."""
    library()
    return _status


def _self_check(lib: Kernels) -> None:
    """Each kernel against torch on a small input; RuntimeError on a difference beyond what the docstring says."""
    generator = torch.Generator().manual_seed(0)
    for dtype in _KINDS:
        x = torch.randn(5, 40, generator=generator).to(dtype)
        weight = torch.randn(40, generator=generator).to(dtype)
        want = torch.nn.functional.rms_norm(x, (40,), weight, 1e-6).float()
        got = _rms_norm(lib, x, weight, 1e-6).float()
        if not torch.allclose(got, want, rtol=2 ** -7, atol=0):
            raise RuntimeError(f"rms_norm {dtype} differs from torch's by {(got - want).abs().max().item()}")
        # the move: a small one, and one big enough to split among threads (cpu_kernels.c: THREADED_MIN_VALUES)
        for outer, tokens, inner, threads in ((2, 7, 3, 1), (3, 130, 192, 2)):
            old = torch.randn(outer, tokens, inner, generator=generator).to(dtype)
            rows = torch.arange(0, tokens, 3)
            fresh = torch.randn(outer, rows.numel(), inner, generator=generator).to(dtype)
            at = torch.arange(1, rows.numel(), 2)[:8]  # torch sums at most 16 values in order (its mean: the same bits)
            sample = rows[at]
            move = (fresh.index_select(1, at).float() - old.index_select(1, sample).float()).mean(1, keepdim=True)
            want = (old.float() + move).to(dtype).index_copy_(1, rows, fresh)
            got = torch.empty_like(old)
            _shift(lib, got, old, fresh, _fresh_strides(fresh, 1), rows, sample, at, 1, threads=threads)
            if not torch.equal(got, want):
                raise RuntimeError(f"the shared-drift move {dtype} on {threads} thread(s) differs from torch's")
        x = torch.randn(6, 3, 34, generator=generator).to(dtype).transpose(0, 1)  # [3, 6, 34], rows 102 apart
        cos, sin = (torch.randn(6, 34, generator=generator).to(dtype) for _ in range(2))
        if not torch.equal(_rope(lib, x, cos, sin), decoder.apply_rope(x, cos, sin)):
            raise RuntimeError(f"RoPE {dtype} differs from torch's")
        with torch.no_grad():
            _check_kivi(lib, dtype, generator)
    _check_attention(lib, generator)
    _check_linear(lib, generator)
    _check_linear_int8(lib, generator)


def _check_attention(lib: Kernels, generator: torch.Generator) -> None:
    """The bf16 attention (where built) against fp64 attention over the same values: grouped heads, a bias with
    masked keys, a row that sees nothing (zeros), key counts past a block of 32; within bf16's rounding."""
    from vla_node.kv.attention import dense_attention

    q = torch.randn(4, 3, 16, generator=generator).bfloat16()
    k, v = (torch.randn(2, 37, 16, generator=generator).bfloat16() for _ in range(2))
    bias = torch.randn(3, 37, generator=generator)
    bias[:, 30:] = float("-inf")
    bias[2] = float("-inf")
    got = _attention(lib, q, k, v, bias)
    if got is None:
        return  # not built for this CPU: torch's form runs (attention_kernel() is None)
    want = dense_attention(q.double(), k.double(), v.double(), None, bias.double()).nan_to_num(0.0)
    error = ((got.double() - want).norm() / want.norm()).item()
    if error > 2 ** -7 or not torch.equal(got[:, 2], torch.zeros_like(got[:, 2])):
        raise RuntimeError(f"attention differs from fp64 attention by {error:.2e} (relative)")


def _check_linear(lib: Kernels, generator: torch.Generator) -> None:
    """The bf16 linear (where built) against fp64 for every op: 11 strided rows (two row blocks), 74 columns (a
    whole tile of 48 and a part ending in 10 of a vector's 16), a bias; within bf16's rounding. Then a call big
    enough to split (3.3 M multiply-adds, run_parts) on two threads against one: the same bits."""
    x = torch.randn(11, 40, generator=generator).bfloat16()[:, :34]
    weight, other = torch.randn(74, 34, generator=generator).bfloat16(), torch.randn(11, 74, generator=generator)
    bias = torch.randn(74, generator=generator)
    packed = _pack_linear(lib, weight)
    if packed is None:
        return  # not built for this CPU: oneDNN runs the packed matmuls (linear_kernel() is None)
    _check_ops("linear kernel", "fp64", x.double() @ weight.double().T + bias.double(), other,
               lambda op, o: _linear(lib, x, packed, 74, bias, op, o))
    x, weight = (torch.randn(rows, 512, generator=generator).bfloat16() for rows in (40, 160))
    packed = _pack_linear(lib, weight)
    if not torch.equal(_linear(lib, x, packed, 160, None, "none", None, threads=2),
                       _linear(lib, x, packed, 160, None, "none", None, threads=1)):
        raise RuntimeError("the linear kernel on two threads differs from its result on one")


def _check_linear_int8(lib: Kernels, generator: torch.Generator) -> None:
    """The int8 linear (where built) against its arithmetic in fp64 (quantized_product) for every op, on the bf16
    linear's check shapes with K a multiple of 4; within bf16's rounding."""
    x = torch.randn(11, 40, generator=generator).bfloat16()[:, :36]
    weight, other = torch.randn(74, 36, generator=generator).bfloat16(), torch.randn(11, 74, generator=generator)
    bias = torch.randn(74, generator=generator)
    packed = _pack_linear_int8(lib, weight)
    if packed is None:
        return  # not built for this CPU (int8_linear_kernel() is False)
    _check_ops("int8 linear kernel", "its fp64 arithmetic", quantized_product(x, weight) + bias.double(), other,
               lambda op, o: _linear_int8(lib, x, packed, 74, bias, op, o))


def _check_ops(kernel: str, oracle: str, product: torch.Tensor, other: torch.Tensor,
               run: Callable[[str, torch.Tensor | None], torch.Tensor]) -> None:
    """run(op, other or None) for every linear op against `product` (fp64, the bias added) with the op applied;
    RuntimeError beyond bf16's rounding (relative)."""
    for op, want in (("none", product), ("silu", F.silu(product)), ("gelu_tanh", F.gelu(product, approximate="tanh")),
                     ("mul", product * other.bfloat16().double())):
        got = run(op, other.bfloat16() if op == "mul" else None)
        error = ((got.double() - want).norm() / want.norm()).item()
        if error > 2 ** -7:
            raise RuntimeError(f"the {kernel}'s {op} differs from {oracle} by {error:.2e} (relative)")


def _check_kivi(lib: Kernels, dtype: torch.dtype, generator: torch.Generator) -> None:
    """KernelKivi against quant.py's ops on K/V of 7 slots in key groups of 4 (one whole, one partial)."""
    k, v = (torch.randn(2, 3, 7, 5, generator=generator).mul(100).to(dtype) for _ in range(2))
    stored = [torch.empty(2, 3, 7, 5, dtype=torch.int8), torch.empty(2, 3, 2, 5, dtype=torch.float16),
              torch.empty(2, 3, 2, 5, dtype=torch.float16), torch.empty(2, 3, 7, 5, dtype=torch.int8),
              torch.empty(2, 3, 7, 1, dtype=torch.float16), torch.empty(2, 3, 7, 1, dtype=torch.float16)]
    KernelKivi(lib).quantize_kv(k, v, 4, *stored)
    keys = [quant.quantize_keys(k[:, :, a:b], b - a) for a, b in ((0, 4), (4, 7))]
    want = [torch.cat([q.data for q in keys], 2), torch.cat([q.scale for q in keys], 2),
            torch.cat([q.zero for q in keys], 2), *quant.quantize_values(v)]
    if not all(torch.equal(a, b) for a, b in zip(stored, want)):
        raise RuntimeError(f"KIVI quantization of {dtype} differs from torch's")
    out_k, out_v = torch.empty(2, 3, 9, 5, dtype=dtype)[:, :, 1:8], torch.empty(2, 3, 7, 5, dtype=dtype)
    KernelKivi(lib).dequantize_kv(*stored, 4, out_k, out_v)
    want_k = torch.cat([quant.dequantize_keys(q, b - a) for q, (a, b) in zip(keys, ((0, 4), (4, 7)))], 2)
    if not (torch.equal(out_k, want_k.to(dtype)) and torch.equal(out_v, quant.dequantize(*want[3:]).to(dtype))):
        raise RuntimeError(f"KIVI dequantization into {dtype} differs from torch's")


def _rms_norm(lib: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm of contiguous x [..., cols] by weight [cols], both of one kernel dtype."""
    out = torch.empty_like(x)
    cols = x.shape[-1]
    lib.rms_norm[x.dtype](x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps)
    return out


def _shift(lib: Kernels, out: torch.Tensor, old: torch.Tensor, fresh: torch.Tensor, fresh_strides: tuple[int, int],
           rows: torch.Tensor, sample: torch.Tensor, at: torch.Tensor, dim: int,
           residual: torch.Tensor | None = None, threads: int | None = None) -> None:
    """The shared-drift move (cpu_kernels.c: SHIFT), tokens along `dim`: out and old contiguous and apart, fresh
    at its (outer, token) strides (_fresh_strides); rows, sample and at contiguous int64, in range, rows sorted and
    distinct, as pick_rows makes them; residual (or None) contiguous as out, apart from it, takes += out; on
    `threads` threads (None: torch's)."""
    lib.shift[old.dtype](old.data_ptr(), fresh.data_ptr(), *fresh_strides, rows.data_ptr(), rows.numel(),
                         sample.data_ptr(), at.data_ptr(), sample.numel(), out.data_ptr(), old.shape[:dim].numel(),
                         old.shape[dim], old.shape[dim + 1:].numel(), None if residual is None else residual.data_ptr(),
                         threads or torch.get_num_threads())


def _rope(lib: Kernels, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """cpu_kernels.c's ROPE: x [heads, rows, hd] with a contiguous last dim, cos and signed_sin [rows, hd]
    contiguous, all of one kernel dtype; a new contiguous [heads, rows, hd]."""
    heads, rows, hd = x.shape
    out = torch.empty(heads, rows, hd, dtype=x.dtype)
    lib.rope[x.dtype](x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), signed_sin.data_ptr(), heads, rows, hd,
                      out.data_ptr())
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """model/decoder.apply_rope in one pass by the fused kernel where it applies (CPU, bf16 or fp32, x [heads,
    rows, hd] with a contiguous last dim, as the heads of a matmul's output are; cos and signed_sin [rows, hd]
    contiguous, x's dtype; inference): the same bits as its three ops in about half their time, checks included
    (one Zen 4 core: a decoder layer's K of 216 rows, 2 heads, 14 us against 38; its Q of 89 rows, 8 heads, 20 us
    against 35). Elsewhere decoder.apply_rope."""
    lib = library()
    if (lib is None or x.dtype not in _KINDS or x.dim() != 3 or x.device.type != "cpu" or x.stride(2) != 1
            or x.shape[2] % 2 or x.shape[2] > MAX_HEAD_DIM
            or any(t.dtype != x.dtype or t.shape != x.shape[1:] or not t.is_contiguous() for t in (cos, signed_sin))
            or not _eager()):
        return decoder.apply_rope(x, cos, signed_sin)
    return _rope(lib, x, cos, signed_sin)


def _fresh_strides(fresh: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """A view's strides as [outer, n, inner] (its dims before `dim` flattened, those after contiguous): the outer
    and the token stride, or None where its layout has no such form (the move's fresh rows, KIVI's outputs)."""
    sizes, strides = fresh.shape, fresh.stride()
    inner = 1
    for d in range(fresh.dim() - 1, dim, -1):  # the dims after `dim`: contiguous
        if sizes[d] != 1 and strides[d] != inner:
            return None
        inner *= sizes[d]
    outer_stride, span = 0, None
    for d in range(dim - 1, -1, -1):  # the dims before `dim`: one stride when flattened
        if sizes[d] == 1:
            continue
        if span is None:
            outer_stride = strides[d]
        elif strides[d] != span:
            return None
        span = strides[d] * sizes[d]
    return outer_stride, strides[dim]


def _attention(lib: Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor | None:
    """cpu_kernels.c's attention of q [H, T, D] over k, v [KV, L, D] (bf16, last dims contiguous; bias fp32 [T, L]
    with a contiguous last dim, or None): out [H, T, D], a view of [T, H, D] storage (the output projection's input
    as it lies). None where the library was built without the kernel (no AVX512-BF16)."""
    heads, rows, dim = q.shape
    kv_heads, keys = k.shape[0], k.shape[1]
    out = torch.empty(rows, heads, dim, dtype=q.dtype)
    done = lib.attention[q.dtype](q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0),
                                  k.stride(1), None if bias is None else bias.data_ptr(),
                                  0 if bias is None else bias.stride(0), heads, kv_heads, rows, keys, dim,
                                  dim ** -0.5, out.data_ptr(), dim, heads * dim, torch.get_num_threads())
    if done == -1:
        raise MemoryError(f"the attention kernel's workspace for {keys} keys of dim {dim} could not be allocated")
    return out.transpose(0, 1) if done == 0 else None  # [T, H, D] -> [H, T, D]


@functools.cache
def attention_kernel() -> Callable | None:
    """`attention` where the kernel runs here (the library built with AVX512-BF16), else None: the callable
    kv/attention.buffer_attention takes as its `kernel`."""
    lib = library()
    if lib is None:
        return None
    probe = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    return attention if _attention(lib, probe, probe, probe, None) is not None else None


def _pack_linear(lib: Kernels, weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] bf16 in the linear kernel's tiles (cpu_kernels.c: N rounded up to 16 columns), or None where
    it is not built here."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the linear kernel takes weights [N, K] with K even (linear_fits), got {n} x {k}")
    packed = huge_pages.empty(-(-n // 16) * 16 * k, torch.bfloat16)
    done = lib.pack_linear[torch.bfloat16](weight.contiguous().data_ptr(), n, k, packed.data_ptr())
    return packed if done == 0 else None


def _operands(x: torch.Tensor, out_features: int, other: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A linear kernel's rows [M, K] of x [..., K] (a view where x's rows are evenly strided, their last dim
    contiguous), its output y [..., N] (rows N apart) and `other` as rows [M, N]."""
    k = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # [..., K] -> [M, K]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=torch.bfloat16)  # [..., N]
    if other is not None:
        other = other if other.dim() == 2 else other.reshape(rows.shape[0], out_features)  # [..., N] -> [M, N]
        if other.stride(1) != 1:
            other = other.contiguous()
    return rows, y, other


def _check_operands(lib: Kernels | None, kernel: str, k: int, out_features: int, op: str, x: torch.Tensor,
                    bias: torch.Tensor | None, other: torch.Tensor | None) -> None:
    """ValueError naming what a linear kernel of k -> out_features takes where it is not built (lib None) or x, bias
    or other is not that."""
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,) or bias.stride(0) != 1):
        raise ValueError(f"the {kernel} ({k} -> {out_features}) takes a contiguous fp32 bias [{out_features}], got "
                         f"{bias.dtype} {tuple(bias.shape)}")
    if (lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != k
            or (op == "mul") != (other is not None) or op not in LINEAR_OPS
            or (other is not None and (other.dtype != torch.bfloat16 or other.shape != (*x.shape[:-1], out_features)))):
        raise ValueError(f"the {kernel} ({k} -> {out_features}, {op}) takes a bf16 CPU x [..., {k}]"
                         f"{' and other [..., ' + str(out_features) + ']' if op == 'mul' else ''}, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}"
                         f"{'' if other is None else f', other {other.dtype} {tuple(other.shape)}'}")


def _linear(lib: Kernels, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
            op: str, other: torch.Tensor | None, threads: int | None = None) -> torch.Tensor:
    """op(x [..., K] W^T + bias) [..., N] by the kernel: x bf16 with a contiguous last dim (rows strided as they
    come), bias fp32 [N] or None, other (op 'mul') bf16 [..., N]; on `threads` threads (None: torch's)."""
    rows, y, other = _operands(x, out_features, other)
    m, k = rows.shape
    lib.linear[torch.bfloat16](rows.data_ptr(), m, rows.stride(0), packed.data_ptr(), out_features, k,
                               None if bias is None else bias.data_ptr(), LINEAR_OPS[op],
                               None if other is None else other.data_ptr(), 0 if other is None else other.stride(0),
                               y.data_ptr(), out_features, threads or torch.get_num_threads())
    return y


@functools.cache
def linear_kernel() -> bool:
    """Whether the bf16 linear kernel runs here (the library built with AVX512-BF16): backends/packed_weights then
    packs for it where oneDNN would not run AMX (see KernelMatmul there)."""
    lib = library()
    return lib is not None and _pack_linear(lib, torch.zeros(16, 2, dtype=torch.bfloat16)) is not None


def amx_tiles() -> bool:
    """Whether the bf16 linear and attention kernels run on AMX tiles here (built with AMX-BF16, the Linux kernel
    grants this process the tile registers): then they beat oneDNN's AMX primitives too (see `linear`, `attention`).
    The library answers 1 only where it was built with AVX512-BF16 too, so the linear kernel runs wherever this does."""
    lib = library()
    return lib is not None and lib.amx(-1) == 1


def linear_fits(weight: torch.Tensor) -> bool:
    """Whether the linear kernel takes this weight: bf16 [N, K] with K even (it reads x's values in pairs)."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (linear_fits) in the linear kernel's tiles: a flat bf16 tensor."""
    lib = library()
    if lib is None or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_linear takes a bf16 weight [N, K] where the kernels run ({status()}), got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    packed = _pack_linear(lib, weight)
    if packed is None:
        raise ValueError(f"the linear kernel is not built for this CPU ({cpu_features.describe()})")
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, op: str = "none",
           other: torch.Tensor | None = None) -> torch.Tensor:
    """op(x W^T + bias) with W packed by pack_linear: x bf16 [..., K] on the CPU, bias fp32 [N] or None, op one of
    LINEAR_OPS ('mul': times `other`, bf16 [..., N]); returns bf16 [..., N], every sum fp32 and rounded once.
    One thread, us against oneDNN on its prepacked weight (AVX512-BF16 EPYC, Zen 5), weights in cache / just read
    from memory: a tick's 17 rows x 512 -> 1536 61 / 104 against 73 / 166, 1536 -> 512 57 / 104 against 72 / 227,
    512 -> 512 22 / 61 against 35 / 132; 80 rows 253 against 277; 196 rows 651 against 669.
    On AMX tiles (amx_tiles), an Intel Xeon with AMX (family 6 model 207, 2 vCPU), two threads, us against oneDNN's
    AMX primitive on its prepacked weight and the kernel's own vector path: 17 rows x 512 -> 1536 61 against 81 and
    197; 1536 -> 512 55 against 78 and 208; 80 rows x 512 -> 1536 137 against 143 and 880; 196 x 384 -> 1152 209
    against 195 and 1215; 196 x 1536 -> 384 243 against 495 and 1571; 216 x 512 -> 128 28 against 80 and 199."""
    lib = library()
    k = packed.numel() // (-(-out_features // 16) * 16)  # the packed weight's [N rounded up to 16, K]
    _check_operands(lib, "linear kernel", k, out_features, op, x, bias, other)
    return _linear(lib, x, packed, out_features, bias, op, other)


class Int8Weight(NamedTuple):
    """A bf16 weight [N, K] quantized for the int8 linear kernel (pack_linear_int8): per output column c,
    w = scale[c] * q, q = round(w / scale[c]) in [-127, 127], scale[c] = max |w_c| / 127 (0 for a zero column).
    N rounded up to 16 columns (the padding's codes and scales 0)."""

    codes: torch.Tensor  # int8 [N', K] in the kernel's tiles (cpu_kernels.c: [K / 4][48 columns][4] each)
    scale: torch.Tensor  # fp32 [N']
    sums: torch.Tensor  # int32 [N']: each column's code sum (the kernel's unsigned offset comes off with it)


def _pack_linear_int8(lib: Kernels, weight: torch.Tensor) -> Int8Weight | None:
    n, k = weight.shape
    if k % 4:
        raise ValueError(f"the int8 linear kernel takes weights [N, K] with K a multiple of 4 (int8_linear_fits), "
                         f"got {n} x {k}")
    columns = -(-n // 16) * 16
    packed = Int8Weight(huge_pages.empty(columns * k, torch.int8), torch.empty(columns),
                        torch.empty(columns, dtype=torch.int32))
    done = lib.pack_linear_s8[torch.bfloat16](weight.contiguous().data_ptr(), n, k, packed.codes.data_ptr(),
                                               packed.scale.data_ptr(), packed.sums.data_ptr())
    return packed if done == 0 else None


def _linear_int8(lib: Kernels, x: torch.Tensor, packed: Int8Weight, out_features: int, bias: torch.Tensor | None,
                 op: str, other: torch.Tensor | None) -> torch.Tensor:
    """As _linear, on an Int8Weight."""
    rows, y, other = _operands(x, out_features, other)
    m, k = rows.shape
    done = lib.linear_s8[torch.bfloat16](
        rows.data_ptr(), m, rows.stride(0), packed.codes.data_ptr(), packed.scale.data_ptr(), packed.sums.data_ptr(),
        out_features, k, None if bias is None else bias.data_ptr(), LINEAR_OPS[op],
        None if other is None else other.data_ptr(), 0 if other is None else other.stride(0), y.data_ptr(),
        out_features, torch.get_num_threads())
    if done == -3:
        raise MemoryError(f"the int8 linear kernel's codes for {m} rows of {k} could not be allocated")
    return y


def amx_int8_tiles() -> bool:
    """Whether the int8 linear runs on AMX tiles here (amx_tiles, and the library built with AMX-INT8 too): the
    same bits as its AVX512-VNNI path (integer sums are exact in any order), about 1.8x its speed at a frame's
    shapes (see `linear_int8`)."""
    lib = library()
    return lib is not None and lib.amx_int8() == 1


@functools.cache
def int8_linear_kernel() -> bool:
    """Whether the int8 linear kernel runs here (the library built with AVX512-VNNI and AVX512-BF16)."""
    lib = library()
    return lib is not None and _pack_linear_int8(lib, torch.zeros(16, 4, dtype=torch.bfloat16)) is not None


def int8_linear_fits(weight: torch.Tensor) -> bool:
    """Whether the int8 linear kernel takes this weight: bf16 [N, K] with K a multiple of 4 (it reads x's codes in
    fours)."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 4 == 0


def pack_linear_int8(weight: torch.Tensor) -> Int8Weight:
    """A bf16 weight [N, K] (int8_linear_fits) quantized per output column for the int8 linear kernel."""
    lib = library()
    if lib is None or not int8_linear_fits(weight):
        raise ValueError(f"pack_linear_int8 takes a bf16 weight [N, K], K a multiple of 4, where the kernels run "
                         f"({status()}), got {weight.dtype} {tuple(weight.shape)}")
    packed = _pack_linear_int8(lib, weight)
    if packed is None:
        raise ValueError(f"the int8 linear kernel is not built for this CPU ({cpu_features.describe()})")
    return packed


def linear_int8(x: torch.Tensor, packed: Int8Weight, out_features: int, bias: torch.Tensor | None,
                op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
    """op(x W^T + bias) as `linear`, W quantized by pack_linear_int8 and each row of x quantized as it comes
    (symmetric, per row: x = s * q, s = max |x_row| / 127, q rounded to nearest even), the products summed exactly
    in int32 on the byte dot-product instruction (AVX512-VNNI), then scaled, biased and the op applied in fp32 and
    rounded once to bf16: quantized_product's arithmetic. A row with a NaN or an infinity gives NaNs. One thread on
    a Zen 4 EPYC, us against the bf16 kernel: 17 rows x 512 -> 1536 69 against 126, 85 rows x 1536 -> 512 321
    against 586, 196 rows x 384 -> 1152 421 against 774 (about 410 against 225 GOP/s). On AMX tiles (amx_int8_tiles),
    an Intel Xeon with AMX-INT8 (family 6 model 167, 2 vCPU), two threads, us against the kernel's AVX512-VNNI path
    (the same bits): 216 x 512 -> 1536 with SiLU 172 against 322, 216 x 1536 -> 512 183 against 343, 196 x 384 ->
    1536 with GELU 164 against 272, 80 x 512 -> 1536 67 against 123, a tick's 17 x 512 -> 1536 24 against 31 (the
    bf16 linear on its tiles: about 220 and 36)."""
    lib = library()
    k = packed.codes.numel() // packed.scale.numel()
    _check_operands(lib, "int8 linear kernel", k, out_features, op, x, bias, other)
    return _linear_int8(lib, x, packed, out_features, bias, op, other)


def quantized_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] W^T as the int8 linear kernel computes it, in fp64 (the oracle of its tests): each row of x and each
    column of W quantized as linear_int8 and pack_linear_int8 say, the codes multiplied exactly, then scaled."""
    def codes(values: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
        values = values.float()
        most = values.abs().amax(-1, keepdim=True)  # [rows, 1]
        scale = most / 127
        if per_row:  # the kernel multiplies by 127 / max
            q = torch.round(values * torch.where(most > 0, 127 / most, 0.0))
        else:  # the packing divides by the scale
            q = torch.where(scale > 0, torch.round(values / scale), 0.0).clamp(-127, 127)
        return q.double(), scale.double()

    qx, sx = codes(x, True)
    qw, sw = codes(weight, False)
    return (qx @ qw.T) * sx * sw.T  # [M, N]


def attention_fits(head_dim: int) -> bool:
    """Whether `attention` takes heads of this size (the kernel steps over head_dim 16 at a time)."""
    return head_dim % 16 == 0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """kv/attention.buffer_attention by the fused kernel (cpu_kernels.c) where it applies: bf16 q, k and v on the
    CPU, their last dims contiguous (k's strides v's), head_dim a multiple of 16, bias None or fp32 [T, L] with a
    contiguous last dim, inference. Returns out [H, T, D] (bf16, a view of [T, H, D] storage), or None where it does
    not apply and the caller runs torch's form. One thread on an AVX512-BF16 EPYC (Zen 5), us against torch's form:
    `small`'s tick (17 rows of 8 heads over 272 keys) 42 against 97; a reuse frame's 80 rows over 244 keys 149
    against 258; the tower's 70 rows over 196 tokens (6 heads, no grouping) 95 against 139, all 196 241 against 322.
    On a Zen 4 EPYC (its bf16 dot product one 512-bit instruction a cycle) the two products run at that rate
    (perf: Q K^T and P V about 60% of the time, the softmax about 20%, K and V's rearrangement about 10%); P V
    takes two column vectors per broadcast pair of P, 3 to 4% faster at a frame's rows (70 over 244: 261 us
    against 271) than one, the same bits. K's pairs are transposed 16 keys by 16 pairs in registers: the tower's 69
    rows over 196 tokens 90 us against 97 with the scalar rearrangement (Zen 5), the same bits.
    On AMX tiles (amx_tiles; head_dim a multiple of 32), an Intel Xeon with AMX (family 6 model 207, 2 vCPU), two
    threads, us against torch's SDPA with the same mask (oneDNN's AMX) and the kernel's own vector path: the tick's 17
    rows over 272 keys 47 against 69 and 92; 80 rows over 244 118 against 139 and 307; 216 over 268 338 against 369
    and 887; the tower's 196 tokens 266 against 280 and 601, its 70 rows 103 against 75 (SDPA's one win) and 170."""
    lib = library()
    heads, rows, dim = q.shape
    if (lib is None or not (q.dtype == k.dtype == v.dtype == torch.bfloat16) or q.device.type != "cpu"
            or k.device.type != "cpu" or v.device.type != "cpu" or not attention_fits(dim) or k.dim() != 3
            or k.shape != v.shape or k.shape[2] != dim or k.stride() != v.stride() or 0 in k.shape[:2]
            or heads % k.shape[0] or q.stride(2) != 1 or k.stride(2) != 1
            or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"
                                      or tuple(bias.shape) != (rows, k.shape[1]) or bias.stride(1) != 1))
            or not _eager()):
        return None
    return _attention(lib, q, k, v, bias)


def unmasked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """model/vision.softmax_attention (q [H, Tq, hd] over k, v [H, T, hd], unmasked) by `attention` where it applies,
    else softmax_attention: the tower's attention (runtime/vision_cache.VisionTokenCache's `attention`)."""
    out = attention(q, k, v, None) if q.dim() == 3 else None
    return softmax_attention(q, k, v) if out is None else out


def _eager() -> bool:
    """Whether this call may leave torch's ops: inference, no tracing or compiling."""
    return not (torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling())


def shift(out: torch.Tensor, old: torch.Tensor, fresh: torch.Tensor, rows: torch.Tensor, sample: torch.Tensor,
          at: torch.Tensor, dim: int, residual: torch.Tensor | None = None) -> bool:
    """runtime/vision_cache.shift_reused by the fused kernel where it applies (CPU, bf16 or fp32, a sample, every
    tensor contiguous but fresh, which may be a view: _fresh_strides; inference), with `residual` += out in the same
    pass (out's shape and dtype, contiguous, apart from out); False where it does not, having changed nothing, and
    the caller runs torch's ops."""
    lib = library()
    if (lib is None or old.dtype not in _KINDS or out.dtype != old.dtype or fresh.dtype != old.dtype
            or old.device.type != "cpu" or not sample.numel() or old.shape[dim + 1:].numel() > MAX_INNER
            or any(i.dtype != torch.int64 or not i.is_contiguous() for i in (rows, sample, at))
            or not (out.is_contiguous() and old.is_contiguous()) or out.data_ptr() == old.data_ptr()
            or (residual is not None and not (residual.dtype == out.dtype and residual.shape == out.shape
                                              and residual.is_contiguous()
                                              and residual.data_ptr() not in (out.data_ptr(), old.data_ptr())))
            or not _eager()):
        return False
    fresh_strides = _fresh_strides(fresh, dim)
    if fresh_strides is None:
        return False
    _shift(lib, out, old, fresh, fresh_strides, rows, sample, at, dim, residual)
    return True


class KernelKivi:
    """kv/quant.WholeKivi by the fused kernels: a partition's whole write quantized and its read_all dequantized in
    one pass each over K and V (the same bits as quant.py's ops: module docstring). Applies to contiguous bf16 or
    fp32 K/V (writes) and outputs (reads; views along the slots of a larger buffer too) with fp16 scales, on the
    CPU, in inference; elsewhere its methods return False and the partition runs torch's ops."""

    def __init__(self, lib: Kernels) -> None:
        self._lib = lib

    def quantize_kv(self, k, v, group, codes_k, scale_k, zero_k, codes_v, scale_v, zero_v) -> bool:
        scales = (scale_k, zero_k, scale_v, zero_v)
        if not (k.dtype in _KINDS and v.dtype == k.dtype and k.shape == v.shape
                and _kivi_layout(codes_k, scale_k, zero_k, codes_v, scale_v, zero_v, group) and _eager()
                and all(t.device.type == "cpu" and t.is_contiguous() for t in (k, v, codes_k, codes_v, *scales))):
            return False
        *lead, tokens, D = k.shape
        outer = math.prod(lead)
        self._lib.kivi_keys[k.dtype](k.data_ptr(), outer, tokens, D, group, codes_k.data_ptr(), scale_k.data_ptr(),
                                     zero_k.data_ptr())
        self._lib.kivi_values[v.dtype](v.data_ptr(), outer * tokens, D, codes_v.data_ptr(), scale_v.data_ptr(),
                                       zero_v.data_ptr())
        return True

    def dequantize_kv(self, codes_k, scale_k, zero_k, codes_v, scale_v, zero_v, group, out_k, out_v) -> bool:
        scales = (scale_k, zero_k, scale_v, zero_v)
        *lead, tokens, D = codes_k.shape
        strides = [_fresh_strides(out, out.dim() - 2) for out in (out_k, out_v)]  # (outer, token) strides
        if not (out_k.dtype in _KINDS and out_v.dtype == out_k.dtype
                and all(s is not None and (s[1] == D or tokens == 1) for s in strides)  # rows of D apart
                and out_k.shape == out_v.shape == codes_k.shape
                and _kivi_layout(codes_k, scale_k, zero_k, codes_v, scale_v, zero_v, group) and _eager()
                and all(t.device.type == "cpu" for t in (out_k, out_v, codes_k, codes_v, *scales))
                and all(t.is_contiguous() for t in (codes_k, codes_v, *scales))):
            return False
        outer = math.prod(lead)
        for codes, scale, zero, grouping, out, (stride, _) in ((codes_k, scale_k, zero_k, group, out_k, strides[0]),
                                                              (codes_v, scale_v, zero_v, 0, out_v, strides[1])):
            self._lib.kivi_dequant[out.dtype](codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), outer, tokens, D,
                                              grouping, out.data_ptr(), stride)
        return True


def _kivi_layout(codes_k, scale_k, zero_k, codes_v, scale_v, zero_v, group: int) -> bool:
    """Whether the storage is a KVPartition's int8 layout that the kernels index: int8 codes [..., C, D] (D at most
    MAX_INNER), fp16 key scale/zero [..., ceil(C / group), D] and value scale/zero [..., C, 1]."""
    *lead, tokens, D = codes_k.shape
    key_params, value_params = (*lead, -(-tokens // max(group, 1)), D), (*lead, tokens, 1)
    return (group > 0 and D <= MAX_INNER and codes_k.dtype == codes_v.dtype == torch.int8
            and codes_v.shape == codes_k.shape and scale_k.shape == zero_k.shape == key_params
            and scale_v.shape == zero_v.shape == value_params
            and all(t.dtype == torch.float16 for t in (scale_k, zero_k, scale_v, zero_v)))


def kivi_kernels() -> KernelKivi | None:
    """KernelKivi where the kernels run here, else None (a partition then runs torch's ops)."""
    lib = library()
    return None if lib is None else KernelKivi(lib)


class KernelRMSNorm(RMSNorm):
    """RMSNorm by the fused kernel where it applies (CPU, x and the weight of one kernel dtype, x contiguous,
    inference), else RMSNorm's own torch form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = library()
        if (lib is None or x.dtype not in _KINDS or self.weight.dtype != x.dtype or x.device.type != "cpu"
                or not x.is_contiguous() or not _eager()):
            return super().forward(x)
        return _rms_norm(lib, x, self.weight, self.eps)


def use_cpu_kernels(module: torch.nn.Module) -> torch.nn.Module:
    """Make every RMSNorm under `module` a KernelRMSNorm (in place, same parameters); returns the module. A no-op
    where the kernels cannot run here."""
    if library() is not None:
        for norm in module.modules():
            if type(norm) is RMSNorm:
                norm.__class__ = KernelRMSNorm
    return module
