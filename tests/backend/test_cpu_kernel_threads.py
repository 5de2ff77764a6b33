"""The fused CPU kernels on torch's intra-op threads (backends/cpu_kernels.c: run_parts): the linear kernels split a
matmul's column tiles (the bf16 one its rows too where the tiles do not split evenly), the attention its kv heads,
among torch.get_num_threads() threads, each part computed as one thread computes it, so every thread count gives one
thread's bits; the library shares torch's OpenMP runtime (one libgomp loaded in the process) and, built by a compiler
without OpenMP, runs each call on its caller's thread."""

import shutil
from unittest.mock import patch

import pytest
import torch

from helpers.linear_cases import OPS, linear_inputs
from vla_node.backends import cpu_features, cpu_kernels

FLAGS = set(cpu_features.cpu_flags(cpu_features.read_cpuinfo()))
needs_threads = pytest.mark.skipif(
    cpu_kernels.compiler() is None or cpu_kernels.kernels_switched_off() or "avx512_bf16" not in FLAGS
    or not cpu_kernels.openmp_flags(cpu_kernels.compiler()),
    reason="the threaded kernels do not run here: they need a C compiler, a CPU with AVX512-BF16 and torch on "
           f"libgomp.so.1 (kernels: {cpu_kernels.status()}; {cpu_features.describe()})")
needs_vnni = pytest.mark.skipif("avx512_vnni" not in FLAGS, reason="the int8 linear kernel needs AVX512-VNNI")

# rows, in, out: a reuse frame's decoder rows (32 tiles), the tick's, grouped K/V over a frame (3 tiles: the bf16
# kernel splits its rows), 21 tiles ending in 40 columns (a masked vector), a call too small to split (one thread
# whatever the count)
SHAPES = [(89, 512, 1536), (20, 512, 1536), (216, 512, 128), (7, 512, 1000), (5, 48, 58)]


@pytest.fixture
def on_threads():
    """Set torch's intra-op threads; the suite's one thread (tests/conftest.py) restored afterwards."""
    yield torch.set_num_threads
    torch.set_num_threads(1)


def _per_thread_count(run, on_threads) -> dict[int, torch.Tensor]:
    results = {}
    for threads in (1, 2, 3):
        on_threads(threads)
        with torch.inference_mode():
            results[threads] = run()
    return results


@needs_threads
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", list(OPS))
def test_the_bf16_linear_gives_one_threads_bits_on_any_thread_count(shape, op, on_threads):
    x, weight, bias, other = linear_inputs(*shape)
    packed = cpu_kernels.pack_linear(weight)
    results = _per_thread_count(
        lambda: cpu_kernels.linear(x, packed, shape[2], bias.float(), op, other if op == "mul" else None), on_threads)
    assert torch.equal(results[1], results[2]) and torch.equal(results[1], results[3])


@needs_threads
@needs_vnni
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", list(OPS))
def test_the_int8_linear_gives_one_threads_bits_on_any_thread_count(shape, op, on_threads):
    x, weight, bias, other = linear_inputs(*shape, seed=1)
    packed = cpu_kernels.pack_linear_int8(weight)
    results = _per_thread_count(
        lambda: cpu_kernels.linear_int8(x, packed, shape[2], bias.float(), op, other if op == "mul" else None),
        on_threads)
    assert torch.equal(results[1], results[2]) and torch.equal(results[1], results[3])


@needs_threads
@pytest.mark.parametrize("shape", [(8, 2, 89, 268, 64), (8, 2, 20, 268, 64), (6, 6, 69, 196, 64), (4, 2, 3, 5, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_attention_gives_one_threads_bits_on_any_thread_count(shape, on_threads):
    """heads, kv heads, rows, keys, head_dim: a reuse frame's decoder rows, the tick's, the tower's (six kv heads on
    two and three threads), one too small to split; masked keys and a row that sees nothing."""
    heads, kv_heads, rows, keys, dim = shape
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(heads, rows, dim, generator=generator).bfloat16()
    k, v = (torch.randn(kv_heads, keys, dim, generator=generator).bfloat16() for _ in range(2))
    bias = torch.randn(rows, keys, generator=generator)
    bias[:, keys - keys // 4:] = float("-inf")
    bias[0] = float("-inf")
    results = _per_thread_count(lambda: cpu_kernels.attention(q, k, v, bias).clone(), on_threads)
    assert torch.equal(results[1], results[2]) and torch.equal(results[1], results[3])
    assert torch.equal(results[2][:, 0], torch.zeros_like(results[2][:, 0]))


@needs_threads
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["decoder", "tower-qkv", "heads", "small"])
def test_the_shared_drift_move_gives_one_threads_bits_on_any_thread_count(dtype, layout, on_threads):
    """The move splits its (outer, token) items: a decoder layer's [196, 512] with its residual stream (tokens
    split), the tower's permuted q|k|v [3, 6, 196, 64] (outer rows split, each part's own moves), per head [3, 100,
    256] (two threads split the second head's tokens, three the second's and the third's), and a move too small to
    split; torch's bits on every count."""
    from vla_node.runtime.vision_cache import shift_reused

    generator = torch.Generator().manual_seed(4)
    shape, dim = {"decoder": ((196, 512), 0), "tower-qkv": ((3, 6, 196, 64), 2), "heads": ((3, 100, 256), 1),
                  "small": ((23, 64), 0)}[layout]
    tokens = shape[dim]
    old = torch.randn(shape, generator=generator).to(dtype)
    rows = torch.randperm(tokens, generator=generator)[: tokens // 3].sort().values
    sample = rows[torch.linspace(0, rows.numel() - 1, min(8, rows.numel())).long()]  # distinct: as shared_sample
    fresh_shape = list(shape)
    fresh_shape[dim] = rows.numel()
    fresh = torch.randn(fresh_shape, generator=generator).to(dtype)
    if layout == "tower-qkv":  # [n, 3, H, hd] permuted to [3, H, n, hd], as the tower's one q|k|v matmul gives it
        fresh = fresh.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    stream = torch.randn(shape, generator=generator).to(dtype) if layout in ("decoder", "small") else None

    def run():
        out, residual = torch.empty_like(old), None if stream is None else stream.clone()
        assert cpu_kernels.shift(out, old, fresh, rows, sample, torch.searchsorted(rows, sample), dim, residual)
        return out if residual is None else torch.cat([out, residual])

    results = _per_thread_count(run, on_threads)
    assert torch.equal(results[1], results[2]) and torch.equal(results[1], results[3])
    assert "on torch's OpenMP threads" in cpu_kernels.status()  # the threaded build passed its check: it ran here
    out, residual = torch.empty_like(old), None if stream is None else stream.clone()
    with torch.inference_mode(), patch.object(cpu_kernels, "library", lambda: None):  # torch's ops
        shift_reused(out, old, fresh, rows, sample, dim, residual=residual)
    assert torch.equal(results[2], out if residual is None else torch.cat([out, residual]))


@needs_threads
def test_a_call_splits_into_as_many_parts_as_threads_and_items_allow():
    lib = cpu_kernels.library()
    assert [lib.parts(32, 2), lib.parts(32, 3), lib.parts(3, 8), lib.parts(1, 2), lib.parts(32, 1)] == [2, 3, 3, 1, 1]


@needs_threads
def test_the_library_runs_on_torchs_own_openmp_runtime():
    """Linked with -fopenmp, the library takes the libgomp.so.1 torch loaded: one OpenMP runtime in the process, so
    no second team of threads spins against torch's."""
    assert cpu_kernels.library() is not None and "on torch's OpenMP threads" in cpu_kernels.status()
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line or "libomp" in line}
    assert len(runtimes) == 1 and cpu_kernels.openmp_runtimes() == {"libgomp.so.1"}, runtimes


@needs_threads
def test_a_compiler_without_openmp_builds_kernels_that_run_on_one_thread(fresh_library, monkeypatch, tmp_path,
                                                                          on_threads):
    compiler = tmp_path / "cc-without-openmp"
    compiler.write_text("#!/bin/sh\nfor a in \"$@\"; do if [ \"$a\" = -fopenmp ]; then "
                        "echo \"cc: error: unsupported option '-fopenmp'\" >&2; exit 1; fi; done\n"
                        f"exec {shutil.which(cpu_kernels.compiler())} \"$@\"\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert cpu_kernels.library() is not None
    assert "one thread a call (built without OpenMP)" in cpu_kernels.status()
    assert cpu_kernels.library().parts(32, 2) == 1
    x, weight, bias, _ = linear_inputs(89, 512, 1536)
    packed = cpu_kernels.pack_linear(weight)
    results = _per_thread_count(lambda: cpu_kernels.linear(x, packed, 1536, bias.float()), on_threads)
    assert torch.equal(results[1], results[2])


def _fake_compiler(folder, version: str):
    compiler = folder / "cc"
    compiler.write_text(f"#!/bin/sh\necho '{version}'\n")
    compiler.chmod(0o755)
    return str(compiler)


@pytest.mark.skipif("libgomp.so.1" not in cpu_kernels.openmp_runtimes(),
                    reason="torch does not run on libgomp.so.1 here")
def test_openmp_only_from_gcc_whose_runtime_is_torchs(tmp_path):
    """clang's -fopenmp links its own libomp, a second runtime beside torch's libgomp: no OpenMP from it."""
    assert cpu_kernels.openmp_flags(_fake_compiler(tmp_path, "cc (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 "
                                                             "Free Software Foundation, Inc.")) == ("-fopenmp",)
    assert cpu_kernels.openmp_flags(_fake_compiler(tmp_path, "Debian clang version 14.0.6")) == ()
