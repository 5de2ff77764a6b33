"""The machine floor of a stage: the least time its arithmetic or its memory traffic can take on this machine.

FLOPs are those the node's eager path executes (MultiRatePolicy, default CacheConfig and ReuseConfig; checked against
the products it dispatches in tests/unit/test_bench_floor.py). A linear layer is a GEMM [M, K] x [K, N] of 2*M*K*N
FLOPs, the patch embedding too ([patches, 3*P*P] x [3*P*P, width]); an attention is two matmuls, Q K^T and P V, of
2 * rows * keys * head_dim * heads FLOPs each, over every key the kernel spans (masked slots too). Norms, RoPE,
activations, biases and residual adds are not counted. The text partition is full, and so is the state ring.

    tick         the action tick after a frame that carried its own tick (the stored states are fresh: the tick the
                 node runs between such frames, and the one `bench all` times): 1 + H*D rows (new state | the action
                 queries) through every decoder layer over the tick's prefix buffer (text | vision | state ring |
                 the block), the state embedding, the action head (lm_head) on the H*D query rows
    frame        a full refresh with its tick in the same decoder pass: the patch embedding and every tower layer on
                 every token of each camera, the projector, the decoder on the frame's rows (over text | frame; the
                 last layer only their K/V) plus the tick's rows as in `tick` and the other stored states,
                 recomputed in the same pass (the frame changes them): state_slots + H*D rows
    reuse_frame  as frame with `refreshed` tokens recomputed: the patch embedding on those; in the tower and the
                 decoder min(T, refreshed + shared-drift sample) rows run Q (tower: Q/K/V), attention over every
                 token, the output projection and the MLP (reused tokens skip attention: shared drift); the projector
                 runs on every token, and the decoder re-projects every token's K and V (T rows, every layer) from
                 its residual stream, as FrameTokenCache does

Bytes: each weight matrix used, read once (K*N elements, even when applied per camera or to two row sets), and the
decoder's K/V once per layer for every key slot of the prefix buffer; activations are assumed to stay in cache.
The floor is a roofline: the larger of FLOPs (attention included) / the matrix rate measured on the stage's own GEMM
shapes and dtype (each shape the fastest way the machine has: F.linear, or in bf16 on a CPU the oneDNN matmul on
a prepacked weight and, where it is built, the fused CPU kernels' linear, as the node's packed weights run), and
bytes / the read bandwidth of a float32 .sum() over a buffer of that many bytes (>= 8 MiB). Both from samples spread
over time (FloorSampler: each shape's best time, the highest bandwidth): `bench all` samples a stage's floor once in
every round of the stages it is compared with, and the per-frame floor five times after the clip.

With int8 weights (`weights = "int8"`: bf16 compute, weights one byte per element, their per-column scales and code
sums not counted), each GEMM shape is timed on the CPU kernels' int8 linear too (its activations quantized per row
as they come, inside the timed call) and the fastest way counts; the attention FLOPs, which stay bf16, count at the
bf16 rate of the same shapes: compute = GEMM FLOPs / int8 rate + attention FLOPs / bf16 rate.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from vla_node.model.config import ModelConfig
from vla_node.runtime.reuse import ReuseConfig

STAGES = ("tick", "frame", "reuse_frame")
MIN_LOOP_S = 0.002  # a timed loop runs at least this long
MIN_BANDWIDTH_BYTES = 8 << 20


Gemm = NamedTuple("Gemm", [("m", int), ("k", int), ("n", int), ("count", int)])  # `count` products [m, k] x [k, n]


@dataclass(frozen=True)
class StageWork:
    stage: str
    model: str
    refreshed: int | None
    gemms: tuple[Gemm, ...]  # distinct shapes, in the order first computed
    attention_flops: int
    weight_elements: int  # every weight matrix used, once
    kv_elements: int  # decoder K and V read, every key slot once per layer
    counted: str  # the rows counted, in words

    @property
    def gemm_flops(self) -> int:
        return sum(2 * g.m * g.k * g.n * g.count for g in self.gemms)

    @property
    def flops(self) -> int:
        return self.gemm_flops + self.attention_flops

    def weight_bytes(self, bytes_per_element: float) -> float:
        return self.weight_elements * bytes_per_element

    def kv_bytes(self, bytes_per_element: float) -> float:
        return self.kv_elements * bytes_per_element

    def describe(self) -> str:
        products = sum(g.count for g in self.gemms)
        return (f"{self.stage} of {self.model}: {products} GEMMs in {len(self.gemms)} shapes, "
                f"{self.gemm_flops / 1e9:.4g} GFLOP + attention {self.attention_flops / 1e9:.4g} GFLOP; "
                f"{self.weight_elements / 1e6:.4g} M weight and {self.kv_elements / 1e6:.4g} M K/V elements read once; "
                f"{self.counted}")


class _Tally:
    def __init__(self) -> None:
        self.gemms: Counter = Counter()
        self.weights: dict[str, int] = {}
        self.attention_flops = 0

    def linears(self, prefix: str, *products: tuple[str, int, int, int]) -> None:
        """(weight name, M, K, N) products; a weight used twice (per camera, per row set) is counted once."""
        for name, m, k, n in products:
            if m > 0:
                self.gemms[(m, k, n)] += 1
                self.weights[prefix + name] = k * n

    def attention(self, rows: int, keys: int, head_dim: int, heads: int) -> None:
        self.attention_flops += 2 * (2 * rows * keys * head_dim * heads)  # Q K^T and P V


def _key_slots(c: ModelConfig) -> int:
    """The tick's prefix buffer: text capacity | vision memory | state ring | the block (room for state_slots + H*D
    rows), every slot of which the attention kernel spans."""
    return c.max_text_tokens + c.vision_frames * c.tokens_per_frame + 2 * c.state_slots + c.action_tokens


def _tower(t: _Tally, c: ModelConfig, rows: int, embedded: int) -> None:
    """One camera: `embedded` patches embedded, `rows` tokens recomputed in every layer, attending to all T."""
    w, hd, mlp = c.vision_width, c.vision_width // c.vision_heads, c.vision_mlp
    t.linears("vision.", ("patch_embedding", embedded, 3 * c.patch_size ** 2, w))
    for i in range(c.vision_layers if rows else 0):
        t.linears(f"vision.{i}.", ("q_proj", rows, w, w), ("k_proj", rows, w, w), ("v_proj", rows, w, w))
        t.attention(rows, c.tokens_per_camera, hd, c.vision_heads)
        t.linears(f"vision.{i}.", ("out_proj", rows, w, w), ("fc1", rows, w, mlp), ("fc2", rows, mlp, w))


def _decoder(t: _Tally, c: ModelConfig, frame_rows: int, recomputed: int, block: int) -> None:
    """`frame_rows` vision rows whose K/V every layer projects, `recomputed` of them with Q, attention, o_proj and
    the MLP below the last layer, and the tick's `block` rows through every layer; then the state embedding and
    the action head."""
    hidden, hq, kv, mlp = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    for i in range(c.num_layers):
        rows = block + (recomputed if i < c.num_layers - 1 else 0)
        t.linears(f"decoder.{i}.", ("q_proj", rows, hidden, hq), ("k_proj", frame_rows + block, hidden, kv),
                  ("v_proj", frame_rows + block, hidden, kv))
        if rows > block:
            t.attention(recomputed, c.max_text_tokens + c.tokens_per_frame, c.head_dim, c.num_heads)  # text | frame
        t.attention(block, _key_slots(c), c.head_dim, c.num_heads)
        t.linears(f"decoder.{i}.", ("o_proj", rows, hq, hidden), ("gate_proj", rows, hidden, mlp),
                  ("up_proj", rows, hidden, mlp), ("down_proj", rows, mlp, hidden))
    t.linears("", ("state_proj", 1, c.state_dim, hidden), ("lm_head", c.action_tokens, hidden, c.vocab_size))


def stage_work(config: ModelConfig, stage: str, refreshed: int | None = None, *,
               shared_drift_samples: int = ReuseConfig().shared_drift_samples) -> StageWork:
    """The GEMMs, attention FLOPs and bytes of one stage (see the module docstring); `refreshed` (reuse_frame only):
    tokens of the frame, all cameras, that the reuse gate recomputes, 1..tokens_per_frame."""
    c = config
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: expected one of {list(STAGES)}")
    T, C, total = c.tokens_per_camera, c.num_cameras, c.tokens_per_frame
    if stage == "reuse_frame":
        if not (isinstance(refreshed, int) and not isinstance(refreshed, bool) and 1 <= refreshed <= total):
            raise ValueError(f"refreshed {refreshed!r}: expected an integer in 1..{total} (tokens_per_frame)")
    elif refreshed is not None:
        raise ValueError(f"refreshed {refreshed!r} with stage {stage!r}: expected None (it applies to reuse_frame)")
    if stage != "tick" and c.vision_frames != 1:
        raise ValueError(f"vision_frames {c.vision_frames} with stage {stage!r}: expected 1 (a frame fuses its tick "
                         "only when the vision memory holds the current frame alone)")
    frame_rows, samples = 0 if stage == "tick" else total, shared_drift_samples
    block = 1 + c.action_tokens if stage == "tick" else c.state_slots + c.action_tokens  # the tick's rows
    per_camera = ([] if stage == "tick" else [T] * C if refreshed is None
                  else [refreshed // C + (cam < refreshed % C) for cam in range(C)])  # refreshed tokens per camera
    rows = [min(T, r + samples) if r else 0 for r in per_camera]  # tower rows recomputed per camera
    recomputed = min(frame_rows, (refreshed or total) + samples)  # decoder vision rows with Q, attention, MLP
    t = _Tally()
    for r, n in zip(per_camera, rows):
        _tower(t, c, n, r)
    t.linears("projector.", ("fc1", frame_rows, c.vision_width, c.hidden_size),
              ("fc2", frame_rows, c.hidden_size, c.hidden_size))
    _decoder(t, c, frame_rows, recomputed, block)
    counted = ((f"tower rows {rows} per camera of {T}; decoder: K/V of {frame_rows} vision rows, {recomputed} with "
                f"Q/attention/MLP (shared-drift sample {samples}), " if frame_rows else "decoder: ")
               + f"{block} tick rows over {_key_slots(c)} key slots")
    kv_elements = 2 * c.num_layers * c.num_kv_heads * c.head_dim * _key_slots(c)
    gemms = tuple(Gemm(m, k, n, count) for (m, k, n), count in t.gemms.items())
    return StageWork(stage, c.name, refreshed, gemms, t.attention_flops, sum(t.weights.values()), kv_elements,
                     counted)


def _best_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Seconds per call of fn: a warm-up call, a timed call that sizes the loop, then the best of `repeats` loops
    of at least MIN_LOOP_S each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def loop(calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - start) / calls

    loop(1)
    calls = max(1, math.ceil(MIN_LOOP_S / max(loop(1), 1e-9)))
    return min(loop(calls) for _ in range(max(1, repeats)))


INT8_WAY = "cpu_kernels.linear_int8"  # _matmuls' way on the int8 linear (the int8 floor's attention leaves it out)


def _matmuls(x: torch.Tensor, w: torch.Tensor, int8: bool = False) -> dict[str, Callable[[], object]]:
    """The ways this machine multiplies x [M, K] by w [N, K]^T at their dtype: F.linear, and on a CPU where oneDNN
    runs bf16 in hardware the matmul on a prepacked weight (F.linear reorders a bf16 weight on every call: at a
    tick's 20 rows about half the prepacked matmul's rate on an AMX Xeon), and where it is built the fused CPU
    kernels' bf16 linear on its packed tiles (backends/cpu_kernels.linear); with `int8` (bf16 x and w) also the
    kernels' int8 linear on w quantized per column, where it runs and takes w (cpu_kernels.linear_int8)."""
    ways: dict[str, Callable[[], object]] = {"F.linear": lambda: F.linear(x, w)}
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        from vla_node.backends import cpu_kernels
        from vla_node.backends.packed_weights import packed_weights_available

        if packed_weights_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
            ways["prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        if cpu_kernels.linear_kernel() and cpu_kernels.linear_fits(w):
            tiles = cpu_kernels.pack_linear(w)
            ways["cpu_kernels.linear"] = lambda: cpu_kernels.linear(x, tiles, w.shape[0], None)
        if int8 and cpu_kernels.int8_linear_kernel() and cpu_kernels.int8_linear_fits(w):
            codes = cpu_kernels.pack_linear_int8(w)
            ways[INT8_WAY] = lambda: cpu_kernels.linear_int8(x, codes, w.shape[0], None)
    return ways


class MatrixRate:
    """measure_matrix_rate's figure from samples spread over time: each sample() times every GEMM shape every way
    this machine has (_matmuls, best of `repeats` loops); result() takes each shape's best time over every sample so
    far. One sample takes a fraction of a second, which a shared machine's busy moment slows by up to a fifth (the
    tick's rate on a 2-vCPU Zen 5 EPYC: 586 to 700 GFLOP/s from one run to the next); taken once per round of what
    the floor is compared with, the samples see the machine as those rounds do."""

    def __init__(self, gemms, dtype: torch.dtype, repeats: int = 5, device: str | torch.device = "cpu",
                 int8: bool = False) -> None:
        self.device, self.repeats, self.samples = torch.device(device), repeats, 0
        self._shapes = []  # (Gemm, {way: fn}, {way: best seconds})
        for m, k, n, count in gemms:
            x = torch.randn(m, k, device=self.device).to(dtype)
            w = torch.randn(n, k, device=self.device).to(dtype)
            self._shapes.append((Gemm(m, k, n, count), _matmuls(x, w, int8), {}))

    def sample(self) -> None:
        """Time every shape every way once more."""
        for _, ways, best in self._shapes:
            for way, fn in ways.items():
                best[way] = min(_best_seconds(fn, self.repeats, self.device), best.get(way, math.inf))
        self.samples += 1

    def result(self, exclude: tuple[str, ...] = ()) -> dict:
        """gflops: all the GEMM FLOPs over their total time (each shape's best time over the samples, the fastest
        way not in `exclude`, x its count); per_shape: each shape's best."""
        if not self.samples:
            raise RuntimeError("MatrixRate.result() before any sample()")
        per_shape, total_flops, total_s = [], 0, 0.0
        for (m, k, n, count), _, best in self._shapes:
            way = min((w for w in best if w not in exclude), key=best.get)
            seconds, flops = best[way], 2 * m * k * n
            per_shape.append({"m": m, "k": k, "n": n, "count": count, "us": _sig(seconds * 1e6),
                              "gflops": _sig(flops / seconds / 1e9), "by": way})
            total_flops += flops * count
            total_s += seconds * count
        return {"gflops": _sig(total_flops / total_s / 1e9), "per_shape": per_shape, "samples": self.samples}


def measure_matrix_rate(gemms, dtype: torch.dtype, repeats: int = 5, device: str | torch.device = "cpu",
                        int8: bool = False) -> dict:
    """Every distinct GEMM shape timed at `dtype` the fastest way this machine has (_matmuls: F.linear, a prepacked
    weight, the CPU kernels; with `int8` their int8 linear too), once (MatrixRate: one sample); gflops: all the
    stage's GEMM FLOPs over their total time (each shape's best time x its count)."""
    rate = MatrixRate(gemms, dtype, repeats, device, int8)
    rate.sample()
    return rate.result()


def measure_bandwidth(nbytes: int, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Read bandwidth, GB/s: the bytes of a float32 buffer of max(nbytes, 8 MiB) over the time of its .sum() (reads
    only; the one-element result is not counted), best of `repeats`."""
    device = torch.device(device)
    buffer = torch.ones(max(int(nbytes), MIN_BANDWIDTH_BYTES) // 4, dtype=torch.float32, device=device)
    seconds = _best_seconds(buffer.sum, repeats, device)
    return buffer.numel() * 4 / seconds / 1e9


def floor_ms(work: StageWork, rate_gflops: float, bandwidth_gbs: float, weight_bytes_per_element: float,
             kv_bytes_per_element: float, attention_rate_gflops: float | None = None) -> dict:
    """Roofline: compute_ms = GEMM FLOPs / rate + attention FLOPs / attention rate (default the same rate),
    memory_ms = (weight + K/V bytes) / bandwidth; the floor is the larger."""
    attention_rate = rate_gflops if attention_rate_gflops is None else attention_rate_gflops
    for name, value in (("rate_gflops", rate_gflops), ("bandwidth_gbs", bandwidth_gbs),
                        ("attention_rate_gflops", attention_rate)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} {value!r}: expected a finite number > 0")
    compute_ms = (work.gemm_flops / rate_gflops + work.attention_flops / attention_rate) / 1e6
    nbytes = work.weight_bytes(weight_bytes_per_element) + work.kv_bytes(kv_bytes_per_element)
    memory_ms = nbytes / bandwidth_gbs / 1e6
    return {"compute_ms": compute_ms, "memory_ms": memory_ms, "floor_ms": max(compute_ms, memory_ms),
            "bound": "compute" if compute_ms >= memory_ms else "memory"}


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


class FloorSampler:
    """A stage's floor (measure_floor's figures) from samples spread over time: sample() once per round of what it is
    compared with (the matrix rate as MatrixRate samples it, the bandwidth likewise: the best of all samples), then
    floor(). `int8_weights` (bf16 only): the GEMMs at the rate with the int8 linear among the ways, the attention at
    bf16's (the module docstring), both from the same samples; JSON's attention_gflops then names that rate."""

    def __init__(self, config: ModelConfig, stage: str, dtype: torch.dtype, weight_bytes_per_element: float,
                 kv_bytes_per_element: float, refreshed: int | None = None, *, repeats: int = 5,
                 device: str | torch.device = "cpu", int8_weights: bool = False) -> None:
        if int8_weights and dtype != torch.bfloat16:
            raise ValueError(f"int8 weights with dtype {dtype}: expected torch.bfloat16 (int8 weights compute in "
                             "bf16)")
        self.config, self.dtype, self.int8_weights = config, dtype, int8_weights
        self.repeats, self.device = repeats, device
        self.work = stage_work(config, stage, refreshed)
        self.bytes_per_element = (weight_bytes_per_element, kv_bytes_per_element)
        self.rate = MatrixRate(self.work.gemms, dtype, repeats, device, int8_weights)
        self.bandwidth = 0.0

    def sample(self) -> None:
        self.rate.sample()
        nbytes = self.work.weight_bytes(self.bytes_per_element[0]) + self.work.kv_bytes(self.bytes_per_element[1])
        self.bandwidth = max(self.bandwidth, measure_bandwidth(int(nbytes), self.repeats, self.device))

    def floor(self) -> dict:
        """The floor from every sample so far (JSON; `samples` says how many)."""
        work, (weight_bpe, kv_bpe) = self.work, self.bytes_per_element
        rate = self.rate.result()["gflops"]
        attention_rate = self.rate.result(exclude=(INT8_WAY,))["gflops"] if self.int8_weights else rate
        floor = floor_ms(work, rate, self.bandwidth, weight_bpe, kv_bpe, attention_rate)
        figures = dict(gflop=work.flops / 1e9, attention_gflop=work.attention_flops / 1e9,
                       weight_mb=work.weight_bytes(weight_bpe) / 1e6, kv_mb=work.kv_bytes(kv_bpe) / 1e6,
                       matrix_gflops=rate, bandwidth_gbs=self.bandwidth,
                       **({"attention_gflops": attention_rate} if self.int8_weights else {}),
                       **{key: floor[key] for key in ("compute_ms", "memory_ms", "floor_ms")})
        return {"stage": work.stage, "model": self.config.name, "dtype": str(self.dtype).removeprefix("torch."),
                "refreshed": work.refreshed, **{key: _sig(value) for key, value in figures.items()},
                "bound": floor["bound"], "samples": self.rate.samples, "counted": work.describe()}


def measure_floor(config: ModelConfig, stage: str, dtype: torch.dtype, weight_bytes_per_element: float,
                  kv_bytes_per_element: float, refreshed: int | None = None, *, repeats: int = 5,
                  device: str | torch.device = "cpu", int8_weights: bool = False) -> dict:
    """stage_work, the matrix rate for its shapes at `dtype`, the bandwidth over its bytes, and the floor (JSON), from
    one sample (FloorSampler)."""
    sampler = FloorSampler(config, stage, dtype, weight_bytes_per_element, kv_bytes_per_element, refreshed,
                           repeats=repeats, device=device, int8_weights=int8_weights)
    sampler.sample()
    return sampler.floor()
