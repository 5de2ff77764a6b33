"""Multi-rate decoding over the multimodal KV cache: the policy the node runs.

Three verbs at three rates, each a transactional stage (compute everything, then commit in one step; a
budget check that says stop raises StageAborted before anything is committed):

    update_text(instruction)  on an instruction change: recomputes text, then every cached frame and state
                              (they attend to the text) from their stored input embeddings
    update_vision(frames)     per camera frame: vision tower, then the frame's K/V into the vision memory;
                              the (short) state partition attends to vision, so it is recomputed too: inside
                              the next tick's block when it can be (parallel decoding with the prefix buffer,
                              one pass over the weights for both), else right after the commit. Given the
                              ego state, it also decodes that tick in the frame's own pass where it can (see
                              update_vision): one pass over the decoder's weights for a frame and its action
    action_tick(state)        per control decision: appends the state token, decodes an action chunk (the flow
                              head's tick, its Euler steps over the cache: flow_tick.py)

Block-causal order and fixed positions are the model's (see vla.py and ModelConfig): with every partition
in fp32 and no eviction, this equals the reference policy (tests/unit/test_multirate.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vla_node.backends import cpu_kernels
from vla_node.backends.cpu_features import onednn_runs_amx
from vla_node.backends.engine import Engine
from vla_node.backends.native_frame import NativeFrame
from vla_node.backends.native_rows import NativeRows
from vla_node.backends.native_tick import NativeHead, NativeTick
from vla_node.backends.native_tower import NativeTower
from vla_node.backends.packed_weights import warm_row_buckets, warm_workers
from vla_node.kv.attention import (
    AttentionKernel,
    GatherWorkspace,
    Segment,
    attention_mass,
    gather_attention,
    segmented_attention,
)
from vla_node.kv.cache_config import CacheConfig
from vla_node.kv.partition import KVPartition, PartitionSpec, resolve_device
from vla_node.kv.prefix import PrefixBuffer
from vla_node.kv.vision_memory import VisionMemory
from vla_node.model.action_head import ActionBins, ActionChunk, check_state
from vla_node.model.config import ModelConfig
from vla_node.model.flow import ChunkGuide
from vla_node.model.tokenizer import encode
from vla_node.model.vision import fused_attention, softmax_attention
from vla_node.model.vla import VLA, preprocess_frame, to_pixels
from vla_node.runtime.compiled_tick import CompiledTick
from vla_node.runtime.flow_tick import FlowTick
from vla_node.runtime.reuse import ReuseConfig
from vla_node.runtime.stages import Check, StageAborted, span, stop
from vla_node.runtime.vision_cache import ExtraRows, FrameTokenCache, VisionStageAborted, VisionTokenCache

IMPORTANCE_POLICIES = ("h2o", "quota", "tiered")


def fused_attention_pays(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the cache's attention runs as torch's SDPA (its flash kernel) instead of two batched matmuls and a
    softmax: bf16 on a CPU whose oneDNN multiplies on AMX tiles, where the kernel's products run there (an Intel
    Xeon with AMX, one thread: the tower's attention over 196 tokens 1144 -> 300 us, the decoder's over 268 slots
    2232 -> 937 us for a full frame's rows, 140 -> 116 us for a tick's). Without AMX the matmuls measured about
    twice as fast as SDPA (an AVX512-BF16 EPYC), and other devices keep the path their tests pinned. Where the fused CPU
    kernels run on AMX tiles themselves (cpu_kernels.amx_tiles), their attention takes it instead."""
    return device.type == "cpu" and dtype == torch.bfloat16 and onednn_runs_amx() and not cpu_kernels.amx_tiles()


def attention_kernels(config: ModelConfig, dtype: torch.dtype,
                      device: torch.device) -> tuple[AttentionKernel | None, bool]:
    """The fused CPU attention (backends/cpu_kernels.attention) for the decoder's attention over the tick's prefix and
    the frame's gathered keys (or None), and whether the tower's attention takes it too: bf16 on a CPU where the
    kernel runs (AVX512-BF16) and SDPA does not pay, each for heads the kernel takes."""
    on_cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16 and not fused_attention_pays(dtype, device)
    kernel = cpu_kernels.attention_kernel() if on_cpu_bf16 else None
    decoder = kernel if cpu_kernels.attention_fits(config.head_dim) else None
    return decoder, kernel is not None and cpu_kernels.attention_fits(config.vision_width // config.vision_heads)


def require_commit(commit: bool) -> None:
    """A flow tick writes its state into the tick's prefix buffer as it runs: it always commits."""
    if not commit:
        raise ValueError("action_tick(commit=False) on the flow head: only a bins tick runs without committing")


def layer_checks(check: Check | None, layers: int) -> Callable[[int], None] | None:
    """The budget check before each of `layers` decoder layers run from C (NativeRows, NativeTick): layer i asks at
    i / layers and raises StageAborted to stop; None without a check."""
    if check is None:
        return None
    return lambda i: stop(check, i / layers, f"stopped before decoder layer {i}")


def on_device(verb):
    """Run a policy verb in inference mode with its device as the default for new tensors."""

    @functools.wraps(verb)
    def wrapper(self, *args, **kwargs):
        with torch.inference_mode(), self._device_scope():
            return verb(self, *args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class VisionUpdate:
    frame_id: int
    tokens_refreshed: int  # vision tower tokens recomputed (all cameras)
    tokens_total: int
    full: bool  # the decoder's vision partition was rewritten whole (not just the changed tokens)
    chunk: ActionChunk | None = None  # the action tick decoded in the same pass (update_vision's `state`)

    @property
    def reuse_ratio(self) -> float:
        return 1.0 - self.tokens_refreshed / self.tokens_total


@dataclass(frozen=True)
class _TickRows:
    """A tick decoded in its frame's pass (MultiRatePolicy._tick_rows): what its commit needs."""

    slot: int
    position: torch.Tensor  # [1]
    old: torch.Tensor  # the other stored states' ring slots [m]
    rows: ExtraRows
    k_state: torch.Tensor  # [L, KV, 1, hd], views of rows.out_k / out_v
    v_state: torch.Tensor
    refreshed: tuple  # the other states' (slots, K, V, positions)
    prefix_exact: bool  # the frame went into the prefix buffer as stored: no load needed after the commit


class MultiRatePolicy:
    def __init__(self, model: VLA, cache: CacheConfig = CacheConfig(), dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", reuse: ReuseConfig = ReuseConfig(), noise_seed: int = 0) -> None:
        self.device = resolve_device(device)
        self.reuse_config = reuse
        self.noise_seed = noise_seed  # the flow head's: tick i starts from tick_noise(noise_seed, i)
        self.model = model.to(device=self.device, dtype=dtype)
        self.dtype = dtype
        with self.device:  # every buffer below is allocated on the device
            self._allocate(model, cache, dtype)

    def _device_scope(self):
        """The device as the default for new tensors; nothing on the CPU, where that mode costs ~20 ms a tick
        in Python overhead (it intercepts every torch call)."""
        return contextlib.nullcontext() if self.device.type == "cpu" else self.device

    def _allocate(self, model: VLA, cache: CacheConfig, dtype: torch.dtype) -> None:
        self.cache_config = cache
        c = self.config = model.config
        self.fused_attention = fused_attention_pays(dtype, self.device)
        decoder_kernel, tower_kernel = attention_kernels(c, dtype, self.device)
        self.bins = ActionBins(c)
        L, KV, hd = c.num_layers, c.num_kv_heads, c.head_dim
        # the window and frame size are the model's; the knobs bounded by them are clamped to them
        vcfg = cache.vision.for_model(c.vision_frames, c.tokens_per_frame)
        dev = self.device
        self.text = KVPartition(PartitionSpec("text", c.max_text_tokens, cache.text_dtype, L, KV, hd), dev)
        self.vision = VisionMemory.build(vcfg, L, KV, hd, device=dev, compute_dtype=dtype)
        self.action = KVPartition(PartitionSpec("action", c.state_slots, cache.action_dtype, L, KV, hd), dev)
        kivi = cpu_kernels.kivi_kernels() if dev.type == "cpu" else None  # int8 partitions' whole passes fused
        for partition in (self.text, *self.vision.partitions, self.action):
            partition.kivi = kivi
        self._read = {p.name: self._read_buffers(p) for p in (self.text, self.action)}
        # staging: the K/V a stage computes, laid out text | frames | states, committed at the end
        stage_tokens = max(c.max_text_tokens + c.vision_frames * c.tokens_per_frame + c.state_slots,
                           c.state_slots + c.action_tokens)
        self._stage_k = torch.zeros(L, KV, stage_tokens, hd, dtype=dtype)
        self._stage_v = torch.zeros_like(self._stage_k)
        self._query_k = torch.zeros(L, KV, c.action_tokens, hd, dtype=dtype)  # autoregressive query K/V
        self._query_v = torch.zeros_like(self._query_k)
        # inputs kept so that a text change can recompute what follows it
        self._frame_embeds = torch.zeros(c.vision_frames, c.tokens_per_frame, c.hidden_size, dtype=dtype)
        self._state_embeds = torch.zeros(c.state_slots, c.hidden_size, dtype=dtype)
        self._causal = torch.ones(c.max_text_tokens, c.max_text_tokens, dtype=torch.bool).tril()
        self._query_causal = torch.ones(c.action_tokens, c.action_tokens, dtype=torch.bool).tril()
        self._eye = torch.eye(c.state_slots, dtype=torch.bool)
        if cache.attention == "gather":
            # the longest key list: text | vision partitions | old states | the staged state | queries
            total = c.max_text_tokens + sum(p.capacity for p in self.vision.partitions) + c.state_slots + 1
            total += c.action_tokens
            longest_block = max(c.tokens_per_frame, c.max_text_tokens, 1 + c.action_tokens, c.state_slots)
            self._workspace = GatherWorkspace(KV, hd, total, longest_block, dtype, dev, self.fused_attention,
                                              decoder_kernel)
        self.text_ids: list[int] = []
        self.instruction: str | None = None
        self.frame_count = 0
        self.state_count = 0
        self._frame_ids: list[int] = []  # frames in the vision memory, oldest first (their slot is id % W)
        self._track_importance = vcfg.policy in IMPORTANCE_POLICIES
        self._prefix = None
        if cache.tick_prefix and not self._track_importance:
            prefix_tokens = self.text.capacity + sum(p.capacity for p in self.vision.partitions)
            self._prefix = PrefixBuffer(L, KV, hd, prefix_tokens, c.state_slots, c.state_slots + c.action_tokens, dtype,
                                        dev, self.fused_attention, decoder_kernel)
        # the tick's block through each decoder layer in one C call where every piece runs on the CPU kernels
        self._native_rows = NativeRows.build(model.decoder.model.layers, self._prefix)
        # With the prefix buffer and parallel decoding, a commit of text or vision leaves the stored states stale and
        # the next tick recomputes them inside its own block (it reads the weights once for both); otherwise
        # _refresh_states recomputes them right after the commit.
        self._fuse_states = self._prefix is not None and c.action_decode == "parallel" and c.action_head == "bins"
        self._states_stale = False
        # per count m of other valid states, the fused block's mask [1 + m + H*D, same]: the new state and each
        # recomputed state see themselves, the queries every state and, causally, each other
        self._fused_masks = [self._fused_mask(m, c.action_tokens) for m in range(c.state_slots)]
        reuse = self.reuse_config
        self.tower_cache = VisionTokenCache(self.model.vision, c.num_cameras, dtype,
                                            drift_threshold=reuse.tower_drift_threshold,
                                            layer_budget=reuse.layer_budget,
                                            shared_drift_samples=reuse.shared_drift_samples,
                                            attention=fused_attention if self.fused_attention
                                            else cpu_kernels.unmasked_attention if tower_kernel else softmax_attention)
        if tower_kernel and not self.fused_attention:  # a partial refresh's layers in two C calls each
            self.tower_cache.use_native(NativeTower.build(self.model.vision))
        self._decoder_reuse = c.vision_frames == 1 and vcfg.policy == "fifo"
        self._frame_tokens = (FrameTokenCache(self.model.decoder.model.layers, self.model.decoder.rope,
                                              c.tokens_per_frame, dtype,
                                              drift_threshold=reuse.decoder_drift_threshold,
                                              layer_budget=reuse.layer_budget,
                                              shared_drift_samples=reuse.shared_drift_samples,
                                              extra_rows=c.state_slots + c.action_tokens)
                              if self._decoder_reuse else None)
        # the tick decoded in its frame's pass (_tick_rows): the frame alone fills the vision memory, and the states
        # it recomputes are those a tick after the commit would recompute
        self._frame_tick = (self._decoder_reuse and self._fuse_states and len(self.vision.partitions) == 1
                            and self.vision.partitions[0].capacity == c.tokens_per_frame)
        # a reuse frame's layers in one C call each, where its tick rows see the frame by a copy (INT8 storage)
        if self._frame_tick and self.vision.partitions[0].spec.quantized and self._gathers_on_kernel():
            self._frame_tokens.use_native(NativeFrame.build(model.decoder.model.layers, c.tokens_per_frame,
                                                            c.state_slots + c.action_tokens, c.max_text_tokens,
                                                            self._prefix))
        self._token_slots = torch.zeros(c.tokens_per_frame, dtype=torch.long)  # frame token -> vision slot
        self._vision_keep = torch.zeros(self.vision.partitions[0].capacity, dtype=torch.bool)
        self._importance = [torch.zeros(p.capacity) for p in self.vision.partitions]  # attention mass per slot
        self._others = torch.zeros(c.state_slots, dtype=torch.bool)
        # the fused tick block (parallel decoding): state token + H*D queries
        n_tick = 1 + c.action_tokens
        self._tick_positions = torch.cat([torch.zeros(1, dtype=torch.long),
                                          torch.arange(c.query_base, c.query_base + c.action_tokens)])
        self._tick_mask = torch.ones(n_tick, n_tick, dtype=torch.bool).tril()  # queries: the state + causal
        self._tick_mask[0, 0] = True
        self._old_states = torch.zeros(n_tick, c.state_slots, dtype=torch.bool)  # row 0 stays all False
        self._logits = torch.zeros(c.action_tokens, c.vocab_size)
        # the bins head in one C call where it runs on the kernels, and the tick between frames that carried theirs
        # (the states fresh) whole in one C call, where NativeRows runs too
        self._native_head = NativeHead.build(self.model, c, self._logits, self.bins)
        self._native_tick = NativeTick.build(self._native_rows, self._native_head, self.model, c,
                                             self._stage_k[:, :, :n_tick], self._stage_v[:, :, :n_tick])
        self._flow = FlowTick(self) if c.action_head == "flow" else None
        self._compiled: CompiledTick | None = None  # use_compiled_tick

    def use_compiled_tick(self, engine: Engine) -> None:
        """Run every action tick outside a frame's pass as `engine`, a compiled TickStep over this policy's buffers
        (runtime/compiled_tick.py; built by backends/tick_engine.py). A ValueError where it does not apply."""
        self._compiled = CompiledTick(self, engine)

    @property
    def compiled_tick(self) -> bool:
        """Whether the action tick runs compiled (use_compiled_tick)."""
        return self._compiled is not None

    def _gathers_on_kernel(self) -> bool:
        """Whether a block's attention over segments is gather_attention on the fused CPU kernel (_attend)."""
        ws = getattr(self, "_workspace", None)
        return (self.cache_config.attention == "gather" and not self._track_importance and ws is not None
                and ws.kernel is not None and not ws.fused)

    @property
    def native_tick(self) -> bool:
        """Whether the tick's block runs each decoder layer in one C call (backends/native_rows.py)."""
        return self._native_rows is not None

    @property
    def native_whole_tick(self) -> bool:
        """Whether a tick with the stored states fresh runs whole in one C call (backends/native_tick.py; not where
        the tick runs compiled)."""
        return self._native_tick is not None and self._compiled is None

    @property
    def native_frame(self) -> bool:
        """Whether a frame with the tick in its pass (a reuse frame, a full refresh) runs each decoder layer in one
        C call (INT8 vision storage; backends/native_frame.py)."""
        return self._frame_tokens is not None and self._frame_tokens.native is not None

    @property
    def native_tower(self) -> bool:
        """Whether a refresh (partial or full) runs each tower layer in two C calls (backends/native_tower.py)."""
        return self.tower_cache.native is not None

    @staticmethod
    def _fused_mask(m: int, queries: int) -> torch.Tensor:
        n = 1 + m + queries
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[: 1 + m, : 1 + m] = torch.eye(1 + m, dtype=torch.bool)
        mask[1 + m :, : 1 + m] = True
        mask[1 + m :, 1 + m :] = torch.ones(queries, queries, dtype=torch.bool).tril()
        return mask

    def _read_buffers(self, p: KVPartition):
        if not p.spec.quantized and p.spec.torch_dtype == self.dtype:
            return None
        shape = (p.spec.n_kv_heads, p.capacity, p.spec.head_dim)
        return torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)

    # --- attention plumbing ---------------------------------------------------------------------------
    def _segment(self, p: KVPartition, layer: int) -> Segment:
        bufs = self._read[p.name]
        k, v, valid = p.read(layer) if bufs is None else p.read(layer, *bufs)
        return Segment(k, v, valid)

    def _attend(self, q: torch.Tensor, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cache_config.attention == "gather" and not self._track_importance:
            return gather_attention(q, segments, self._workspace), None
        return segmented_attention(q, segments)

    def _run_block(self, x: torch.Tensor, positions: torch.Tensor, attend: Callable, out_k: torch.Tensor | None,
                   out_v: torch.Tensor | None, check: Check | None, output: bool = True) -> torch.Tensor | None:
        """Run a block of n tokens through the decoder; attend(layer, q, k, v) -> [heads, n, hd] is its attention
        (over_segments or over_prefix) given the block's own q [heads, n, hd], k and v [KV, n, hd].

        x [n, hidden]; out_k/out_v [L, KV, n, hd] receive the block's K/V. Checks the budget between layers.
        Returns the final hidden states [n, hidden]; with output=False (a block that is only attended to: text,
        frames, states) the last layer computes just its K/V (no query, attention or MLP) and returns None."""
        cos, sin = self.model.decoder.rope(positions, x.dtype)
        layers = self.model.decoder.model.layers
        for i, layer in enumerate(layers):
            if check is not None and not check(i / len(layers)):
                raise StageAborted(f"stopped before decoder layer {i}")
            if not output and i == len(layers) - 1:
                k, v = layer.project_kv(x, cos, sin, cpu_kernels.apply_rope)
                out_k[i].copy_(k)
                out_v[i].copy_(v)
                return None
            q, k, v = layer.project_qkv(x, cos, sin, cpu_kernels.apply_rope)
            if out_k is not None:
                out_k[i].copy_(k)
                out_v[i].copy_(v)
            x = layer.finish(x, attend(i, q, k, v))
        return x

    def _over_segments(self, prefix: Callable[[int], list[Segment]], self_mask: torch.Tensor | None,
                       importance: list[torch.Tensor] | None = None) -> Callable:
        """Attention over the cached prefix segments plus the block itself (self_mask [n, n] bool, None = all);
        with `importance`, the attention mass each vision slot received is added to it."""
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            segments = prefix(layer)
            attn, lse = self._attend(q, [*segments, Segment(k, v, self_mask)])
            if importance is not None and lse is not None:
                for imp, seg in zip(importance, segments[1:]):  # segments 1.. are the vision memory's partitions
                    imp += attention_mass(q, seg, lse)
            return attn

        return attend

    def _over_prefix(self, states: bool) -> Callable:
        """Attention over the prefix buffer, the state ring when `states` (read into the buffer now, every layer at
        once), and the block (its masks set_block'ed)."""
        if states:
            self._prefix.load_states(self.action)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self._prefix.attend(layer, q, k, v, None)

        return attend

    def _prefix_block(self, x: torch.Tensor, positions: torch.Tensor, states: bool, out_k: torch.Tensor,
                      out_v: torch.Tensor, check: Check | None) -> torch.Tensor:
        """_run_block of the prefix buffer's block (set_block'ed) over the buffer (_over_prefix(states)): one C call a
        layer where NativeRows runs (the same bits), else the layers' own calls."""
        attend = self._over_prefix(states)  # the state ring read into the buffer where `states`
        if self._native_rows is None:
            return self._run_block(x, positions, attend, out_k, out_v, check)
        cos, sin = self.model.decoder.rope(positions, x.dtype)
        return self._native_rows.run(x, cos, sin, out_k, out_v, layer_checks(check, self._native_rows.layers))

    def _text_segment(self, layer: int) -> Segment:
        """The text partition's valid slots only: update_text writes them in order from slot 0, so a block that
        attends to text alone (a frame) skips the unused slots' logits and needs no mask."""
        seg = self._segment(self.text, layer)
        n = len(self.text_ids)
        return Segment(seg.k[:, :n], seg.v[:, :n], None)  # [KV, capacity, hd] -> [KV, n, hd]

    def _text_prefix(self, layer: int) -> list[Segment]:
        return [self._text_segment(layer)]

    def _vision_prefix(self, layer: int) -> list[Segment]:
        return [self._segment(self.text, layer), *self.vision.segments(layer)]

    def _reload_prefix_buffer(self) -> None:
        """The tick's prefix buffer read anew from the cache: _vision_prefix's segments, every layer at once."""
        self._prefix.load_partitions([(self.text, None), *self.vision.prefix_parts()])


    # --- stages ---------------------------------------------------------------------------------------
    @on_device
    def update_text(self, instruction: str, check: Check | None = None) -> None:
        """Recompute the text partition, then every cached frame and state (they attend to the text)."""
        c = self.config
        ids = encode(instruction, c.max_text_tokens)
        n = len(ids)
        k_text, v_text = self._stage_k[:, :, :n], self._stage_v[:, :, :n]
        x = self.model.embed_text(torch.tensor(ids))
        total = n + len(self._frame_ids) * c.tokens_per_frame  # the stage's parts, weighted by their tokens
        self._run_block(x, torch.arange(n), self._over_segments(lambda layer: [], self._causal[:n, :n]), k_text, v_text,
                        span(check, 0.0, n / total), output=False)
        staged_text = lambda layer: [Segment(k_text[layer], v_text[layer], None)]  # noqa: E731
        # frames, each over the new text and itself
        frames = []
        offset = c.max_text_tokens
        for index, frame_id in enumerate(self._frame_ids):
            done = n + index * c.tokens_per_frame
            slot = frame_id % c.vision_frames
            k_f = self._stage_k[:, :, offset : offset + c.tokens_per_frame]
            v_f = self._stage_v[:, :, offset : offset + c.tokens_per_frame]
            positions = torch.tensor(c.vision_positions(slot))
            self._run_block(self._frame_embeds[slot], positions, self._over_segments(staged_text, None), k_f, v_f,
                            span(check, done / total, (done + c.tokens_per_frame) / total), output=False)
            frames.append((frame_id, k_f, v_f, positions))
            offset += c.tokens_per_frame
        # commit: nothing above touched the cache
        self.text.clear()
        self.text.write(torch.arange(n), k_text, v_text, torch.arange(n), 0)
        self.vision.clear()
        for frame_id, k_f, v_f, positions in frames:
            self.vision.admit_frame(frame_id, k_f, v_f, positions)
        self.text_ids, self.instruction = ids, instruction
        self._after_commit()

    def prepare_frames(self, frames: list[np.ndarray]) -> np.ndarray:
        """Camera frames (any size) -> uint8 [C, S, S, 3] at the model's input size."""
        c = self.config
        if len(frames) != c.num_cameras:
            raise ValueError(f"{len(frames)} camera frames: expected {c.num_cameras}")
        return np.stack([preprocess_frame(f, c.image_size) for f in frames])

    @on_device
    def update_vision(self, images: np.ndarray, tokens: list[torch.Tensor | None] | None = None,
                      scene_cut: bool = False, check: Check | None = None, state=None) -> VisionUpdate:
        """images uint8 [C, S, S, 3] (prepare_frames). `tokens`: per camera, the token indices to recompute
        (from the reuse gate); None = all. Reuse happens in the vision tower always, and in the decoder's
        vision partition when it holds just the current frame (vision_frames = 1, fifo): there every token's
        K/V is re-projected from its updated residual stream, the expensive parts only for the changed tokens
        (FrameTokenCache). A scene cut is a full refresh that flushes the vision memory.

        `state` (the ego state [state_dim]): also run the action tick with it, in the frame's own decoder pass
        where the cache allows (vision_frames = 1, fifo, parallel decoding, the prefix buffer): the tick's rows
        join the frame's matmuls, one read of the weights for both. With float vision storage the result equals
        update_vision then action_tick to float rounding (the frame's and the tick's rows share one matmul); with
        INT8 storage the tick sees the frame's K/V before they are quantized (_tick_rows). Committed with the frame,
        as one transaction; the chunk is returned in VisionUpdate.chunk (None where the tick could not join, or
        nothing changed: then call action_tick)."""
        if not self.text_ids:
            raise RuntimeError("update_vision before update_text: the instruction must be set first")
        c = self.config
        tick = self._tick_rows(state) if state is not None and self._frame_tick else None
        T = c.tokens_per_camera
        pixels = to_pixels(images, self.dtype).to(self.device)  # [C, 3, S, S]
        if scene_cut or tokens is None:
            tokens = [None] * c.num_cameras
        tokens = [None if t is None else t.to(self.device) for t in tokens]
        frames = self._frame_tokens  # the decoder side of reuse (None unless vision_frames = 1 and fifo)
        partial = frames is not None and bool(self._frame_ids) and all(self.tower_cache.valid) \
            and all(t is not None for t in tokens) and frames.context == self.instruction
        try:
            # the towers take about the first half of the stage, the decoder the second
            C = c.num_cameras
            outputs = [self.tower_cache.refresh(cam, pixels[cam], tokens[cam], span(check, 0.5 * cam / C,
                                                                                     0.5 * (cam + 1) / C))
                       for cam in range(C)]
            if check is not None and not check(0.5):
                raise StageAborted("stopped after the vision tower")
            if frames is not None:
                chunk = self._update_tokens(outputs, tokens if partial else None, span(check, 0.5, 1.0), scene_cut,
                                            tick)
            else:
                chunk = None
                self._admit(self.model.project_vision(torch.stack(outputs)), scene_cut, span(check, 0.5, 1.0))
            refreshed = sum(T if t is None else math.ceil(self.tower_cache.recomputed_tokens(cam))
                            for cam, t in enumerate(tokens))
        except (StageAborted, VisionStageAborted) as e:
            self._discard_vision(tick)
            raise StageAborted(str(e)) from None
        except BaseException:
            self._discard_vision(tick)
            raise
        self.tower_cache.commit()
        self.frame_count += 1
        return VisionUpdate(self.frame_count - 1, refreshed, c.tokens_per_frame, not partial, chunk)

    def _open_prefix(self, tick: "_TickRows") -> None:
        """The prefix buffer for a tick in its frame's pass: every vision slot valid (the frame fills the partition),
        the block's rows and mask set. Undone by a load from the cache (_discard_vision)."""
        start = self.text.capacity
        self._prefix.bias[:, start : start + self.vision.partitions[0].capacity].zero_()
        self._prefix.set_block(None, self._fused_masks[tick.old.numel()], tick.rows.x.shape[0])

    def _discard_vision(self, tick: "_TickRows | None") -> None:
        """A vision stage that did not finish: drop what it staged; a tick in its pass had written the frame into the
        prefix buffer, which is read anew from the (unchanged) cache."""
        self.tower_cache.discard()
        if self._frame_tokens is not None:
            self._frame_tokens.discard()
        if tick is not None:
            self._reload_prefix_buffer()

    def _update_tokens(self, outputs: list[torch.Tensor], tokens: list[torch.Tensor] | None, check: Check | None,
                       scene_cut: bool = False, tick: "_TickRows | None" = None) -> ActionChunk | None:
        """The frame through the decoder with the FrameTokenCache (vision_frames = 1, fifo): every token's K/V is
        rewritten in the vision partition; Q/attention/MLP are recomputed for `tokens` (per camera; None = all, a
        new frame admitted as _admit does). With `tick`, its rows join the pass and the tick is committed with
        the frame: returns its chunk (None without a tick, or when nothing changed and nothing ran)."""
        c = self.config
        T = c.tokens_per_camera
        frames: FrameTokenCache = self._frame_tokens
        if tokens is not None and all(t.numel() == 0 for t in tokens):
            return None  # nothing changed: the partition and the states stay as they are, bit for bit
        x = self.model.project_vision(torch.stack(outputs))  # [C, T, W] -> [C*T, hidden]
        flat = None if tokens is None else torch.cat([cam * T + t for cam, t in enumerate(tokens)])  # [n]
        frame_id = self.frame_count if tokens is None else self._frame_ids[-1]
        slot = frame_id % c.vision_frames
        positions = torch.tensor(c.vision_positions(slot))
        if tick is not None:
            self._open_prefix(tick)
        frames.run(x, positions, flat, self._text_segment, self.instruction, check, self._attend,
                   None if tick is None else tick.rows)
        chunk = None
        if tick is not None:  # the tick's chunk, its writes checked: nothing that can fail is left for the commit
            bins = self._tick_bins(tick.rows.hidden[1 + tick.old.numel() :])
            chunk = self._tick_chunk(bins, tick.k_state, tick.v_state, tick.position, tick.refreshed)
        # commit
        if tokens is None:
            admission = self.vision.admit_frame(frame_id, frames.staged_k, frames.staged_v, positions,
                                                scene_cut=scene_cut)
            self._token_slots.copy_(admission.slots)
            self._frame_ids = [f for f in self._frame_ids if f > frame_id - c.vision_frames and not scene_cut]
            self._frame_ids.append(frame_id)
        else:
            self.vision.partitions[0].write(self._token_slots, frames.staged_k, frames.staged_v, positions, frame_id)
        self._frame_embeds[slot].copy_(x)
        frames.commit()
        self._after_commit(prefix_loaded=tick is not None and tick.prefix_exact)  # the tick's pass wrote it there
        if tick is not None:
            self._commit_tick(tick.slot, tick.rows.x[:1], tick.k_state, tick.v_state, tick.position, tick.refreshed)
        return chunk

    def _admit(self, embeds: torch.Tensor, scene_cut: bool, check: Check | None) -> int:
        c = self.config
        frame_id = self.frame_count
        slot = frame_id % c.vision_frames
        positions = torch.tensor(c.vision_positions(slot))
        k_f = self._stage_k[:, :, c.max_text_tokens : c.max_text_tokens + c.tokens_per_frame]
        v_f = self._stage_v[:, :, c.max_text_tokens : c.max_text_tokens + c.tokens_per_frame]
        self._run_block(embeds, positions, self._over_segments(self._text_prefix, None), k_f, v_f, check, output=False)
        # commit
        admission = self.vision.admit_frame(frame_id, k_f, v_f, positions, scene_cut=scene_cut)
        self._token_slots.copy_(admission.slots)
        self._frame_embeds[slot].copy_(embeds)
        self._frame_ids = [f for f in self._frame_ids if f > frame_id - c.vision_frames and not scene_cut] + [frame_id]
        self._after_commit()
        return frame_id

    def _after_commit(self, prefix_loaded: bool = False) -> None:
        """Every commit of text or vision ends here: the tick's prefix is read anew (unless it holds the commit
        already), and the stored states (they attend to text and vision) are recomputed now or marked for the next
        tick's block."""
        if self._prefix is not None and not prefix_loaded:
            self._reload_prefix_buffer()
        if self._fuse_states:
            self._states_stale = True
        else:
            self._refresh_states()

    def _refresh_states(self) -> None:
        """Recompute every stored state token (each attends to text, vision and itself); not abortable:
        it is a handful of tokens and runs right after a commit."""
        c = self.config
        valid = self.action.valid.nonzero().flatten()
        if valid.numel() == 0:
            return
        n = valid.numel()
        k_s = self._stage_k[:, :, -c.state_slots :][:, :, :n]
        v_s = self._stage_v[:, :, -c.state_slots :][:, :, :n]
        positions = c.state_base + valid
        if self._prefix is not None:
            self._prefix.set_block(None, self._eye[:n, :n], n)
            attend = self._over_prefix(states=False)
        else:
            attend = self._over_segments(self._vision_prefix, self._eye[:n, :n])
        self._run_block(self._state_embeds[valid], positions, attend, k_s, v_s, None, output=False)
        self.action.write(valid, k_s, v_s, positions, 0)

    @on_device
    def action_tick(self, state, check: Check | None = None, steps: int | None = None,
                    guide: ChunkGuide | None = None, commit: bool = True) -> ActionChunk:
        """Append the state token (ring slot) and decode an action chunk [H, D]; committed only at the end. The flow
        head integrates `steps` Euler steps (default the model's flow_steps), guided toward `guide` (real-time
        chunking) where given. commit=False (bins): the same work, nothing committed (the ring, its count and the
        stored states stay as they were): a timing run of the action stage."""
        if not self.text_ids:
            raise RuntimeError("action_tick before update_text: the instruction must be set first")
        if self._flow is not None:
            require_commit(commit)
            chunk, staged = self._flow.tick(state, check, steps, guide)
            if staged is None:  # the state was the expert's suffix token: nothing in the ring
                self.state_count += 1
            else:
                MultiRatePolicy._commit_tick(self, *staged, None)  # the eager books' commit (an EnginePolicy too)
            return chunk
        if steps is not None or guide is not None:
            raise ValueError(f"denoising steps {steps!r} / guide: the flow head's; this model's head is bins")
        c = self.config
        s = check_state(state, c.state_dim).to(self.device, self.dtype)
        slot = self.state_count % c.state_slots
        position = torch.tensor([c.state_base + slot])
        self._others.copy_(self.action.valid)
        self._others[slot] = False  # the slot being replaced in the ring
        for imp in self._importance:
            imp.zero_()
        if self.native_whole_tick and not self._states_stale:
            return self._native_action_tick(s, slot, position, check, commit)
        x = self.model.embed_state(s)  # [1, hidden]
        refreshed = None
        if c.action_decode == "parallel":
            bins, k_s, v_s, refreshed = self._decode_tick(x, position, check)
        else:
            k_s, v_s = self._stage_k[:, :, -1:], self._stage_v[:, :, -1:]
            parts = 1 + c.action_tokens  # the state's block, then one per query, a row each
            self._run_block(x, position, self._over_segments(self._vision_prefix, None), k_s, v_s,
                            span(check, 0.0, 1 / parts))

            def prefix(layer: int) -> list[Segment]:
                old = self._segment(self.action, layer)
                return [*self._vision_prefix(layer), Segment(old.k, old.v, self._others),
                        Segment(k_s[layer], v_s[layer], None)]

            bins = self._decode_queries(prefix, check)
        chunk = self._tick_chunk(bins, k_s, v_s, position, refreshed)
        if commit:
            self._commit_tick(slot, x, k_s, v_s, position, refreshed)
        return chunk

    def _native_action_tick(self, s: torch.Tensor, slot: int, position: torch.Tensor, check: Check | None,
                            commit: bool) -> ActionChunk:
        """action_tick's parallel block with the stored states fresh, whole in one C call (backends/native_tick.py):
        _decode_tick's bits, and its chunk and commit."""
        n = 1 + self.config.action_tokens
        self._old_states[1:] = self._others
        self._prefix.set_block(self._old_states, self._tick_mask, n)
        self._prefix.load_states(self.action)
        bins, values = self._native_tick.run(s, slot, layer_checks(check, self._native_tick.layers))
        k_s, v_s = self._stage_k[:, :, :1], self._stage_v[:, :, :1]
        chunk = self._tick_chunk(bins, k_s, v_s, position, None, values)
        if commit:
            self._commit_tick(slot, self._native_tick.state_row, k_s, v_s, position, None)
        return chunk

    def _tick_chunk(self, bins: np.ndarray, k_s: torch.Tensor, v_s: torch.Tensor, position: torch.Tensor,
                    refreshed: tuple | None, values: np.ndarray | None = None) -> ActionChunk:
        """The chunk of `bins` (their `values` where computed already) and self._logits, and every write of the
        tick's commit checked (a non-finite K/V raises here): all that can fail, before anything is committed."""
        if refreshed is not None:
            self.action.check_tokens(refreshed[1], refreshed[2], refreshed[3], 0)
        self.action.check_tokens(k_s, v_s, position, 0)
        logits = self._logits.to("cpu", torch.float32, copy=True)  # the buffer is reused by the next tick
        return ActionChunk(self.bins.to_values(bins) if values is None else values, bins, logits)

    def _commit_tick(self, slot: int, x: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, position: torch.Tensor,
                     refreshed: tuple | None) -> None:
        """A tick's commit (after _tick_chunk): the state token x [1, hidden] (K/V [L, KV, 1, hd]) into its ring
        slot, the other states recomputed in its block (`refreshed`: slots, K, V, positions) where they were stale."""
        if refreshed is not None:  # the other states, recomputed in the tick's block
            self.action.write(*refreshed, 0)
            self._states_stale = False
        self.action.write(torch.tensor([slot]), k_s, v_s, position, 0)
        self._state_embeds[slot].copy_(x[0])
        self.state_count += 1
        if self._track_importance:
            for i, imp in enumerate(self._importance):
                self.vision.add_importance(None, imp, segment=i)

    def _tick_bins(self, hidden: torch.Tensor) -> np.ndarray:
        """The action queries' final hidden states [H*D, hidden] -> logits into self._logits; returns bins [H, D]
        (in one C call where the head runs on the kernels: the same bits)."""
        if self._native_head is not None and hidden.dtype == torch.bfloat16 and hidden.is_contiguous():
            return self._native_head.run(hidden)[0]
        self._logits.copy_(self.model.decoder.logits(hidden))
        return self.bins.bins_from_logits(self._logits).cpu().numpy()

    def _tick_rows(self, state) -> "_TickRows":
        """The tick with `state` as rows of its frame's decoder pass: _fused_tick's block (the new state | the other
        stored states, recomputed: the frame changes them | the queries), attending to the text, the frame's K/V
        (as float storage keeps them; as computed, with INT8 storage) and itself."""
        c, m = self.config, self.model
        s = check_state(state, c.state_dim).to(self.device, self.dtype)
        slot = self.state_count % c.state_slots
        position = torch.tensor([c.state_base + slot])
        self._others.copy_(self.action.valid)
        self._others[slot] = False  # the slot being replaced in the ring
        old = self._others.nonzero().flatten()  # [m] ring slots
        n_old = old.numel()
        x = torch.cat([m.embed_state(s), self._state_embeds[old], m.embed_text(m.query_ids(None))])  # [1+m+H*D, hidden]
        old_positions = c.state_base + old
        positions = torch.cat([position, old_positions, self._tick_positions[1:]])
        n = x.shape[0]
        k, v = self._stage_k[:, :, :n], self._stage_v[:, :, :n]
        # The prefix buffer's vision part receives the frame layer by layer and the block attends over the prefix
        # buffer as _fused_tick does (_open_prefix). With float storage the frame goes in as the partition stores it
        # (converted): the very values its next load reads, so the tick equals update_vision then action_tick. INT8
        # storage would cost a quantization round trip per layer (about 5 ms a frame on a CPU): the tick sees the
        # frame's K/V as computed instead, and the buffer is loaded from the cache after the commit. A stage that
        # does not finish reloads it.
        prefix, partition = self._prefix, self.vision.partitions[0]
        start = self.text.capacity
        end = start + partition.capacity
        exact = not partition.spec.quantized

        def attend(layer: int, q, k_rows, v_rows, frame_k, frame_v) -> torch.Tensor:
            k_frame, v_frame = prefix.k[layer, :, start:end], prefix.v[layer, :, start:end]
            if exact:
                partition.round_trip(frame_k, frame_v, k_frame, v_frame)
            else:
                k_frame.copy_(frame_k)
                v_frame.copy_(frame_v)
            return prefix.attend(layer, q, k_rows, v_rows, None)

        refreshed = (old, k[:, :, 1 : 1 + n_old], v[:, :, 1 : 1 + n_old], old_positions)
        rows = ExtraRows(x, positions, attend, k, v, prefix=None if exact else (prefix, start))
        return _TickRows(slot, position, old, rows, k[:, :, :1], v[:, :, :1], refreshed, exact)

    def _decode_tick(self, x_state: torch.Tensor, position: torch.Tensor, check: Check | None):
        """Parallel decoding: the state token and the H*D queries as one block, so a tick reads the weights
        once. Row 0 (the state) attends to text, vision and itself; the queries also to the other states,
        the new state and, causally, each other. When the stored states are stale (a commit since the last
        tick), they are recomputed in the same block (_fused_tick). Returns (bins [H, D], the state's K and V
        [L, KV, 1, hd], the recomputed states' (slots, K, V, positions) to write, or None)."""
        c, m = self.config, self.model
        if self._compiled is not None:
            return self._compiled.tick(x_state, self.state_count % c.state_slots, self._states_stale, check)
        if self._states_stale:
            return self._fused_tick(x_state, position, check)
        x = torch.cat([x_state, m.embed_text(m.query_ids(None))])  # [1 + H*D, hidden]
        self._tick_positions[0] = position[0]
        self._old_states[1:] = self._others  # [1 + H*D, K]: the state row sees no other state

        def prefix(layer: int) -> list[Segment]:
            old = self._segment(self.action, layer)
            return [*self._vision_prefix(layer), Segment(old.k, old.v, self._old_states)]

        n = 1 + c.action_tokens
        k, v = self._stage_k[:, :, :n], self._stage_v[:, :, :n]
        importance = self._importance if self._track_importance else None
        if self._prefix is not None:
            self._prefix.set_block(self._old_states, self._tick_mask, n)
            h = self._prefix_block(x, self._tick_positions, True, k, v, check)
        else:
            h = self._run_block(x, self._tick_positions, self._over_segments(prefix, self._tick_mask, importance), k,
                                v, check)
        return self._tick_bins(h[1:]), k[:, :, :1], v[:, :, :1], None

    def _fused_tick(self, x_state: torch.Tensor, position: torch.Tensor, check: Check | None):
        """_decode_tick's block with the m other stored states recomputed in it: rows new state | those states |
        queries, over the prefix buffer (the stale copies in the ring are not seen)."""
        c, m = self.config, self.model
        old = self._others.nonzero().flatten()  # [m] ring slots
        n_old = old.numel()
        x = torch.cat([x_state, self._state_embeds[old], m.embed_text(m.query_ids(None))])  # [1 + m + H*D, hidden]
        old_positions = c.state_base + old
        positions = torch.cat([position, old_positions, self._tick_positions[1:]])
        n = 1 + n_old + c.action_tokens
        k, v = self._stage_k[:, :, :n], self._stage_v[:, :, :n]
        self._prefix.set_block(None, self._fused_masks[n_old], n)
        h = self._prefix_block(x, positions, False, k, v, check)
        refreshed = (old, k[:, :, 1 : 1 + n_old], v[:, :, 1 : 1 + n_old], old_positions)
        return self._tick_bins(h[1 + n_old :]), k[:, :, :1], v[:, :, :1], refreshed

    def _decode_queries(self, prefix: Callable[[int], list[Segment]], check: Check | None) -> np.ndarray:
        """Autoregressive decoding of the H*D action queries over the prefix (the state already staged);
        logits into self._logits; returns bins [H, D]."""
        c, m = self.config, self.model
        n = c.action_tokens
        positions = torch.arange(c.query_base, c.query_base + n)
        importance = self._importance if self._track_importance else None
        bins = torch.zeros(0, dtype=torch.long)
        for i in range(n):
            x = m.embed_text(m.query_ids(bins)[i : i + 1])  # [1, hidden]
            qk, qv = self._query_k, self._query_v

            def with_queries(layer: int, i: int = i) -> list[Segment]:
                return [*prefix(layer), Segment(qk[layer, :, :i], qv[layer, :, :i], None)]

            part = span(check, (i + 1) / (n + 1), (i + 2) / (n + 1))  # after the state's block
            h = self._run_block(x, positions[i : i + 1], self._over_segments(with_queries, None, importance),
                                qk[:, :, i : i + 1], qv[:, :, i : i + 1], part)
            self._logits[i].copy_(m.decoder.logits(h)[0])
            bins = torch.cat([bins, self.bins.bin_from_row(self._logits[i])])
        return bins.reshape(c.action_horizon, c.action_dims).cpu().numpy()  # [H*D] -> [H, D]

    def compile_kernels(self, workers: int | None = None) -> int:
        """Compile every packed matmul's kernels for the rows it will run, as the node's warm-up does, so that no frame
        or tick pays for one (packed_weights.RowBuckets; a no-op without packed weights): each row bucket up to the
        most rows its module runs, and, unpadded, the row counts every frame or tick repeats: a camera's tokens in the
        tower, a frame's in the projector, one state in its embedding; in the decoder a tick's block (the new state,
        the 0..S-1 other stored states when they are recomputed in it, the H*D queries), a frame's tokens alone and
        with that block, the stored states alone (1..S) and the queries alone (the action head). `workers` threads
        compile them (default: one per CPU this process may run on, at most 4; warm_row_buckets). Returns the kernels
        compiled."""
        c, m = self.config, self.model
        workers = warm_workers() if workers is None else workers
        frame, states = c.tokens_per_frame, c.state_slots
        block = range(1 + c.action_tokens, states + c.action_tokens + 1)  # a tick's rows
        decoder = {*range(1, states + 1), c.action_tokens, *block, frame, *(frame + n for n in block)}
        return (warm_row_buckets(m.vision, c.tokens_per_camera, {c.tokens_per_camera}, workers)
                + warm_row_buckets(m.projector, frame, {frame}, workers) + warm_row_buckets(m.state_proj, 1, {1})
                + warm_row_buckets(m.decoder, frame + states + c.action_tokens, decoder, workers))

    # --- accounting -----------------------------------------------------------------------------------
    def kv_bytes(self) -> dict[str, int]:
        return {"text": self.text.nbytes()["kv_bytes"], "vision": self.vision.stats()["kv_bytes"],
                "action": self.action.nbytes()["kv_bytes"]}

    def storage_tensors(self) -> list[torch.Tensor]:
        """Every preallocated tensor of the cache (for the no-allocation-in-steady-state checks)."""
        return [*self.text.storage_tensors(), *self.vision.storage_tensors(), *self.action.storage_tensors(),
                self._stage_k, self._stage_v, self._query_k, self._query_v,
                *([] if self._prefix is None else [self._prefix.k, self._prefix.v, self._prefix.bias])]
