"""MultiRatePolicy with every piece of arithmetic in engines: the host keeps the books, the engines compute.

The host side is MultiRatePolicy's: the partitions (text, vision, action ring), their storage dtypes and KIVI
quantization, commits and transactions, the reuse plans. What changes is who computes: each verb fills the
input buffers of pure static-shape steps (backends/engine_set.py), runs them (`Engine.run(inputs, outputs)`
into buffers this policy owns) and commits their outputs:

    update_text    text            | decoder-T-a | decoder-T-b over the held frame (it attends to the text; the
                                     decoder's reuse state is then the new instruction's, so the next frame may
                                     refresh partially, where the eager policy refreshes the decoder in full)
    update_vision  tower-K (every camera) | decoder-K-a | decoder-K-b, or decoder-tick-K-a | -b with the action
                                            tick in the frame's pass (bins head; a flow tick never joins it)
    action_tick    tick (the fused form: the new state, the other stored states recomputed, the queries); the
                   flow head: flow-tick-N (N Euler steps of the expert, after the same state rows: FlowTickStep),
                   N = `steps` (default the model's flow_steps) among the counts built. A tick guided toward the
                   previous chunk (real-time chunking: a vector-Jacobian product per step, not exported) runs the
                   eager flow tick (runtime/flow_tick.py) over the same partitions

`|` is a budget check: a stage stopped there has written only staging buffers, so the cache, the prefix buffers
and the reuse state stay as they were. The same code runs every backend: torch (the step modules eagerly),
onnxruntime, tensorrt, cudagraph. The state a partial refresh needs (the tower's and the decoder's per-token
queries, keys, values and residual updates) lives in two sets of buffers, live and staged, swapped on commit.

What it covers: one frame in the vision memory (vision_frames = 1, fifo), parallel action decoding, reuse without
drift gates (the node's defaults); either action head (the flow head at the step counts its engines were built for).
The host's buffers are fp32 whatever `model.dtype` says: an engine's precision is its recipe's (the ONNX graph's own
types, int8 Q/DQ). Other configurations stay on MultiRatePolicy (backend "torch" with the eager policy): constructing
this policy for one is a ValueError naming the setting.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vla_node.backends.engine_set import EngineSet, capacities, decoder_cut, other_slots, tick_positions
from vla_node.backends.flow_step import flow_bias, state_bias, state_positions
from vla_node.backends.steps import text_bias, tick_bias
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.action_head import ActionChunk, check_state
from vla_node.model.config import ModelConfig
from vla_node.model.flow import ChunkGuide, tick_noise
from vla_node.model.tokenizer import encode
from vla_node.model.vla import VLA, to_pixels
from vla_node.runtime.policy import Check, MultiRatePolicy, VisionUpdate, on_device, require_commit
from vla_node.runtime.reuse import ReuseConfig
from vla_node.runtime.stages import stop


def unsupported(c: ModelConfig, cache: CacheConfig, reuse: ReuseConfig) -> str | None:
    """Why an engine policy cannot run this configuration of model `c` (None: it can)."""
    checks = [(c.vision_frames == 1, f"model.vision_frames = {c.vision_frames} (engines hold one frame)"),
              (cache.vision.policy == "fifo", f"cache.vision.policy = {cache.vision.policy!r} (engines: fifo)"),
              (c.action_decode == "parallel", f"action_decode = {c.action_decode!r} (engines: parallel)"),
              (reuse.tower_drift_threshold is None and reuse.decoder_drift_threshold is None
               and reuse.layer_budget is None, "reuse drift gates (tower/decoder_drift_threshold, layer_budget)")]
    failed = [why for ok, why in checks if not ok]
    return None if not failed else "; ".join(failed)


class EnginePolicy(MultiRatePolicy):
    def __init__(self, model: VLA, engines: EngineSet, cache: CacheConfig = CacheConfig(),
                 device: str | torch.device = "cpu", reuse: ReuseConfig = ReuseConfig()) -> None:
        why = unsupported(model.config, cache, reuse)
        if why is not None:
            raise ValueError(f"backend {engines.backend!r} runs engines, which do not cover {why}: use backend "
                             "'torch' (the eager policy) or change the setting")
        # the eager policy's tick prefix and reuse caches are not used: the engines' buffers replace them
        super().__init__(model, dataclasses.replace(cache, tick_prefix=False), torch.float32, device,
                         dataclasses.replace(reuse, shared_drift_samples=0))
        self.tower_cache = self._frame_tokens = None
        self.reuse_config = reuse
        self.engines = engines
        self.samples = reuse.shared_drift_samples
        with self.device:
            self._allocate_engine_buffers()

    # --- buffers ----------------------------------------------------------------------------------------
    def _allocate_engine_buffers(self) -> None:
        c = self.config
        L, KV, hd, H, hidden = c.num_layers, c.num_kv_heads, c.head_dim, c.num_heads, c.hidden_size
        C, Tc, T, Tt, S, Q = c.num_cameras, c.tokens_per_camera, c.tokens_per_frame, c.max_text_tokens, \
            c.state_slots, c.action_tokens
        Lv, W, Hv = c.vision_layers, c.vision_width, c.vision_heads
        P = Tt + T
        zeros = torch.zeros

        def kv(tokens: int) -> torch.Tensor:
            return zeros(L, KV, tokens, hd)

        # text step
        self._ids, self._text_positions = zeros(Tt, dtype=torch.long), torch.arange(Tt)
        self._text_block_bias = zeros(Tt, Tt)
        self._new_text = {"text_k": kv(Tt), "text_v": kv(Tt)}
        # the committed text and the tick's prefix (text | vision), as the partitions store them, in fp32
        self._text_k, self._text_v, self._text_bias = kv(Tt), kv(Tt), zeros(Tt)
        self._new_text_bias = zeros(Tt)  # the new instruction's validity, while its stage runs
        self._prefix_k, self._prefix_v, self._prefix_bias = kv(P), kv(P), zeros(P)
        # the tower's per-camera state and the decoder's (FrameTokenCache's layout), live and staged
        self._tower = [{"x0": zeros(C, Tc, W), "q": zeros(C, Lv, Hv, Tc, W // Hv), "k": zeros(C, Lv, Hv, Tc, W // Hv),
                        "v": zeros(C, Lv, Hv, Tc, W // Hv), "attn_out": zeros(C, Lv, Tc, W),
                        "mlp_out": zeros(C, Lv, Tc, W), "out": zeros(C, Tc, W)} for _ in range(2)]
        self._decoder = [{"q": zeros(L - 1, H, T, hd), "attn_out": zeros(L - 1, T, hidden),
                          "mlp_out": zeros(L - 1, T, hidden)} for _ in range(2)]
        self._tower_valid = [False] * C
        self._decoder_context: str | None = None  # the instruction the decoder state was computed against
        self._pixels = zeros(C, 3, c.image_size, c.image_size)
        self._frame = {"frame_embeds": zeros(T, hidden), "frame_k": kv(T), "frame_v": kv(T)}
        self._streams = {False: zeros(T + 1, hidden), True: zeros(T + 1 + S + Q, hidden)}  # between decoder pieces
        self._positions = torch.tensor(list(c.vision_positions(0)))
        # per capacity, the index inputs (rows, the shared-drift sample's places and weights)
        s = max(self.samples, 1)
        self._tower_rows = {k: {"rows": zeros(C, k, dtype=torch.long), "sample_at": zeros(C, s, dtype=torch.long),
                                "sample_weight": zeros(C, s)} for k in capacities(Tc, self.samples)}
        self._decoder_rows = {k: {"rows": zeros(k, dtype=torch.long), "sample_at": zeros(s, dtype=torch.long),
                                  "sample_weight": zeros(s)} for k in capacities(T, self.samples)}
        # the tick's rows (new state | the other stored states | queries) and its outputs
        self._state_x, self._tick_positions_buf = zeros(S, hidden), zeros(S + Q, dtype=torch.long)
        self._tick_block_bias = zeros(S + Q, P + S + Q)
        self._tick_out = {"logits": zeros(Q, c.vocab_size), "state_k": kv(S), "state_v": kv(S)}
        self._other_slots = [other_slots(S, slot) for slot in range(S)]
        self._ring_stale = False  # a commit since the last tick: the ring's stored states are not recomputed yet
        self._noise_host = zeros(c.action_horizon, c.action_dims, device="cpu")  # tick_noise draws on the CPU
        self._noise_generator = torch.Generator()
        self._flow_buffers = self._allocate_flow_buffers() if c.action_head == "flow" else {}

    def _allocate_flow_buffers(self) -> dict[str, torch.Tensor]:
        """The flow tick step's inputs and outputs (flow_step.py), by binding name: the prefix K/V are the bins tick's
        and so are, for 'prefix', the state rows' (state_x, state_k / state_v: _commit_tick commits them)."""
        c = self.config
        S, P, n = c.state_slots, c.max_text_tokens + c.tokens_per_frame, c.flow_tokens
        buffers = {"prefix_k": self._prefix_k, "prefix_v": self._prefix_v,  # the tick's prefix, loaded per commit
                   "noise": torch.zeros(c.action_horizon, c.action_dims),
                   "chunk": torch.zeros(c.action_horizon, c.action_dims)}
        if c.flow_state == "suffix":
            return {**buffers, "state": torch.zeros(c.state_dim), "expert_bias": torch.zeros(n, P + n)}
        return {**buffers, "state_x": self._state_x, "positions": torch.zeros(S, dtype=torch.long),
                "bias": torch.zeros(S, P + S), "expert_bias": torch.zeros(n, P + S + n),
                "state_k": self._tick_out["state_k"], "state_v": self._tick_out["state_v"]}

    def storage_tensors(self) -> list[torch.Tensor]:
        buffers = [self._ids, self._text_block_bias, *self._new_text.values(), self._new_text_bias, self._text_k,
                   self._text_v, self._text_bias, self._prefix_k, self._prefix_v, self._prefix_bias, self._pixels,
                   *self._frame.values(), *self._streams.values(), self._state_x, self._tick_positions_buf,
                   self._tick_block_bias,
                   *self._tick_out.values(), *self._flow_buffers.values(), self._noise_host]
        for group in (*self._tower, *self._decoder, *self._tower_rows.values(), *self._decoder_rows.values()):
            buffers.extend(group.values())
        return [*self.text.storage_tensors(), *self.vision.storage_tensors(), *self.action.storage_tensors(),
                *buffers]

    def _load_text(self) -> None:
        """The committed text as the partition stores it, into the frame steps' text inputs."""
        for layer in range(self.config.num_layers):
            seg = self._segment(self.text, layer)
            self._text_k[layer].copy_(seg.k)
            self._text_v[layer].copy_(seg.v)
        self._text_bias.zero_().masked_fill_(~self.text.valid, float("-inf"))

    def _load_prefix(self) -> None:
        """The tick's prefix (text | vision) as the partitions store them, after every commit."""
        Tt = self.config.max_text_tokens
        for layer in range(self.config.num_layers):
            (vision,) = self.vision.segments(layer)  # one partition (fifo, one frame)
            self._prefix_k[layer, :, :Tt].copy_(self._text_k[layer])
            self._prefix_v[layer, :, :Tt].copy_(self._text_v[layer])
            self._prefix_k[layer, :, Tt:].copy_(vision.k)
            self._prefix_v[layer, :, Tt:].copy_(vision.v)
        self._prefix_bias[:Tt].copy_(self._text_bias)
        self._prefix_bias[Tt:].zero_().masked_fill_(~self.vision.partitions[0].valid, float("-inf"))

    def _after_commit(self, prefix_loaded: bool = False) -> None:
        self._load_prefix()
        self._ring_stale = True  # the next tick recomputes the stored states (the engines' fused form)

    # --- text -------------------------------------------------------------------------------------------
    @on_device
    def update_text(self, instruction: str, check: Check | None = None) -> None:
        """The instruction through the text step, then the held frame through the decoder over it (from the
        tower's outputs, a full decoder refresh); committed together."""
        c = self.config
        ids = encode(instruction, c.max_text_tokens)
        n = len(ids)
        stop(check, 0.0, "stopped before the text step")
        self._ids.zero_()[:n].copy_(torch.tensor(ids))
        self._text_block_bias.copy_(text_bias(n, c.max_text_tokens))
        self.engines["text"].run({"ids": self._ids, "positions": self._text_positions, "bias": self._text_block_bias},
                                 self._new_text)
        held = bool(self._frame_ids)
        if held:
            total = n + c.tokens_per_frame
            stop(check, n / total, "stopped before the frame's decoder step")
            self._new_text_bias.zero_()[n:] = float("-inf")
            self._run_decoder(self._tower[0]["out"], None, self._new_text["text_k"], self._new_text["text_v"],
                              self._new_text_bias, None, check, (n + total) / (2 * total))
        # commit: nothing above touched the cache
        positions = torch.arange(n)
        self.text.clear()
        self.text.write(positions, self._new_text["text_k"][:, :, :n], self._new_text["text_v"][:, :, :n], positions, 0)
        self.vision.clear()
        if held:
            frame_id = self._frame_ids[-1]
            self.vision.admit_frame(frame_id, self._frame["frame_k"], self._frame["frame_v"], self._positions)
            self._swap_decoder(instruction)
        self.text_ids, self.instruction = ids, instruction
        self._load_text()
        self._after_commit()

    # --- vision -----------------------------------------------------------------------------------------
    @on_device
    def update_vision(self, images: np.ndarray, tokens: list[torch.Tensor | None] | None = None,
                      scene_cut: bool = False, check: Check | None = None, state=None) -> VisionUpdate:
        """MultiRatePolicy.update_vision on engines: the tower step recomputes each camera's `tokens` (None = all;
        a camera's first frame is full), then the decoder step the frame's changed tokens (all when the decoder
        holds no frame for this instruction), with the action tick's rows in its pass when `state` is given."""
        if not self.text_ids:
            raise RuntimeError("update_vision before update_text: the instruction must be set first")
        c = self.config
        Tc = c.tokens_per_camera
        if scene_cut or tokens is None:
            tokens = [None] * c.num_cameras
        tokens = [None if t is None or not self._tower_valid[cam] else t.to(self.device).sort().values
                  for cam, t in enumerate(tokens)]
        partial = bool(self._frame_ids) and all(t is not None for t in tokens) \
            and self._decoder_context == self.instruction
        tick = state is not None and c.action_head == "bins"  # a flow tick never joins the frame's pass
        if tick:
            s = check_state(state, c.state_dim).to(self.device, torch.float32)
        if partial and all(t.numel() == 0 for t in tokens):  # nothing changed: the cache stays as it is
            self.frame_count += 1
            return VisionUpdate(self.frame_count - 1, 0, c.tokens_per_frame, False, None)
        self._pixels.copy_(to_pixels(images, torch.float32))
        stop(check, 0.0, "stopped before the vision tower")
        refreshed = self._run_tower(tokens)
        stop(check, 0.5, "stopped after the vision tower")
        flat = torch.cat([cam * Tc + t for cam, t in enumerate(tokens)]) if partial else None  # [n] frame tokens
        slot = self.state_count % c.state_slots
        if tick:
            self._fill_tick_rows(s, slot, torch.cat([self._text_bias, torch.zeros(c.tokens_per_frame)]))
        self._run_decoder(self._tower[1]["out"], flat, self._text_k, self._text_v, self._text_bias, tick, check)
        chunk = self._chunk() if tick else None  # checks the tick's writes: nothing that can fail is left below
        # commit
        if partial:
            self.vision.partitions[0].write(self._token_slots, self._frame["frame_k"], self._frame["frame_v"],
                                            self._positions, self._frame_ids[-1])
        else:
            frame_id = self.frame_count
            admission = self.vision.admit_frame(frame_id, self._frame["frame_k"], self._frame["frame_v"],
                                                self._positions, scene_cut=scene_cut)
            self._token_slots.copy_(admission.slots)
            self._frame_ids = [frame_id]
        self._tower.reverse()  # the staged tower state becomes the live one
        self._tower_valid = [True] * c.num_cameras
        self._swap_decoder(self.instruction)
        self._after_commit()
        if tick:
            self._commit_tick(slot)
        self.frame_count += 1
        return VisionUpdate(self.frame_count - 1, refreshed, c.tokens_per_frame, not partial, chunk)

    def _run_tower(self, tokens: list[torch.Tensor | None]) -> int:
        """Every camera through the tower step at the smallest capacity that holds its rows, into the staged tower
        state. Returns the tokens recomputed (the gate's and the shared-drift sample's)."""
        from vla_node.backends.tower_partial_step import tower_rows

        Tc = self.config.tokens_per_camera
        need = max(Tc if t is None else min(Tc, t.numel() + self.samples) for t in tokens)
        k = _capacity(self._tower_rows, need)
        rows = self._tower_rows[k]
        for name, value in zip(("rows", "sample_at", "sample_weight"), tower_rows(tokens, Tc, k, self.samples)):
            rows[name].copy_(value)
        live, staged = self._tower
        names = ("x0", "q", "k", "v", "attn_out", "mlp_out")
        inputs = {"pixels": self._pixels, **rows, **{n: live[n] for n in names}}
        outputs = {"out": staged["out"], **{f"{n}_new": staged[n] for n in names}}
        self.engines[f"tower-{k}"].run(inputs, outputs)
        return int((rows["rows"] < Tc).sum())

    def _run_decoder(self, tower_out: torch.Tensor, flat: torch.Tensor | None, text_k: torch.Tensor,
                     text_v: torch.Tensor, text_valid: torch.Tensor, tick: bool | None, check: Check | None = None,
                     halfway: float = 0.75) -> None:
        """The frame through the decoder's two pieces (flat: its changed tokens; None = all), into the staged frame
        K/V and decoder state; with `tick`, the tick rows (_fill_tick_rows) in the same pass, into the tick's
        outputs. `check(halfway)` between the pieces: a stop there has written staging buffers only."""
        from vla_node.backends.decoder_partial_step import decoder_rows

        c = self.config
        T, L, cut = c.tokens_per_frame, c.num_layers, decoder_cut(c)
        k = _capacity(self._decoder_rows, T if flat is None else min(T, flat.numel() + self.samples))
        rows = self._decoder_rows[k]
        for name, value in zip(("rows", "sample_at", "sample_weight"), decoder_rows(flat, T, k, self.samples)):
            rows[name].copy_(value)
        live, staged = self._decoder
        stream = self._streams[bool(tick)]
        shared = {"positions": self._positions, "text_k": text_k, "text_v": text_v, "text_bias": text_valid,
                  **rows, **live}
        if tick:
            shared.update(tick_positions=self._tick_positions_buf, tick_bias=self._tick_block_bias)
        frame, out = self._frame, self._tick_out
        base = f"decoder-tick-{k}" if tick else f"decoder-{k}"
        # the first piece: layers [0, cut), its state and the residual stream
        outputs = {"frame_embeds": frame["frame_embeds"], "frame_k": frame["frame_k"][:cut],
                   "frame_v": frame["frame_v"][:cut], **{f"{n}_new": staged[n][:cut] for n in staged},
                   "x_out": stream}
        if tick:
            outputs.update(state_k=out["state_k"][:cut], state_v=out["state_v"][:cut])
        extra = {"state_x": self._state_x} if tick else {}
        self.engines[f"{base}-a"].run({"tower_out": tower_out, **shared, **extra}, outputs)
        stop(check, halfway, f"stopped after decoder layer {cut - 1}")
        # the second: layers [cut, L)
        outputs = {"frame_k": frame["frame_k"][cut:], "frame_v": frame["frame_v"][cut:]}
        if cut < L - 1:
            outputs.update({f"{n}_new": staged[n][cut:] for n in staged})
        if tick:
            outputs.update(logits=out["logits"], state_k=out["state_k"][cut:], state_v=out["state_v"][cut:])
        self.engines[f"{base}-b"].run({"x_in": stream, **shared}, outputs)

    def _swap_decoder(self, context: str | None) -> None:
        self._decoder.reverse()
        self._decoder_context = context

    # --- action -----------------------------------------------------------------------------------------
    @on_device
    def action_tick(self, state, check: Check | None = None, steps: int | None = None,
                    guide: ChunkGuide | None = None, commit: bool = True) -> ActionChunk:
        """The tick step over the prefix: the new state in its ring slot, the other stored states recomputed, the
        action queries decoded; committed at the end (commit=False: nothing committed, a timing run; bins only). The
        flow head: _flow_tick (`steps` Euler steps, guided toward `guide` where given)."""
        if not self.text_ids:
            raise RuntimeError("action_tick before update_text: the instruction must be set first")
        c = self.config
        if c.action_head == "flow":
            require_commit(commit)
            return self._flow_tick(state, check, steps, guide)
        if steps is not None or guide is not None:
            raise ValueError(f"denoising steps {steps!r} / guide: the flow head's; this model's head is bins")
        s = check_state(state, c.state_dim).to(self.device, torch.float32)
        slot = self.state_count % c.state_slots
        self._fill_tick_rows(s, slot, self._prefix_bias)
        stop(check, 0.0, "stopped before the tick step")
        self.engines["tick"].run({"state_x": self._state_x, "positions": self._tick_positions_buf,
                                  "prefix_k": self._prefix_k, "prefix_v": self._prefix_v,
                                  "bias": self._tick_block_bias}, self._tick_out)
        chunk = self._chunk()
        if commit:
            self._commit_tick(slot)
        return chunk

    # --- the flow head's tick ----------------------------------------------------------------------------
    def flow_step_counts(self) -> tuple[int, ...]:
        """The Euler step counts this policy's engines were built for (flow-tick-N), descending."""
        counts = [name.removeprefix("flow-tick-") for name in self.engines.engines if name.startswith("flow-tick-")]
        return tuple(sorted((int(n) for n in counts if n.isdigit()), reverse=True))

    def _flow_tick(self, state, check: Check | None, steps: int | None, guide: ChunkGuide | None) -> ActionChunk:
        """flow-tick-`steps` over the prefix (the state rows recomputed, as the bins tick's), from the noise the
        eager tick draws; committed at the end. A count without an engine is a ValueError naming those built.

        With `guide`, the eager flow tick (MultiRatePolicy.action_tick) over the same partitions and ring: it reads
        the ring's stored K/V, which the engines leave stale after a commit (their tick recomputes them in its
        rows), so they are recomputed first (_refresh_states, what the eager policy does after every commit). A
        guided tick stopped part way thus leaves the ring refreshed (the K/V the next tick would compute; the
        counts, validity and embeddings as they were), nothing else changed."""
        c = self.config
        steps = c.flow_steps if steps is None else steps
        built = self.flow_step_counts()
        if isinstance(steps, bool) or steps not in built:
            raise ValueError(f"denoising steps {steps!r}: no flow-tick engine for that count; built: "
                             f"{', '.join(map(str, built))} (model.flow_steps and scheduler.denoising_steps)")
        if guide is not None:
            if self._ring_stale and c.flow_state == "prefix":
                self._refresh_states()  # what the eager policy does after every commit (idempotent)
                self._ring_stale = False
            return MultiRatePolicy.action_tick(self, state, check, steps, guide)
        s = check_state(state, c.state_dim).to(self.device, torch.float32)
        slot = self.state_count % c.state_slots
        self._fill_flow_inputs(s, slot)
        stop(check, 0.0, "stopped before the flow tick step")
        engine = self.engines[f"flow-tick-{steps}"]
        buffers = self._flow_buffers
        engine.run({n: buffers[n] for n in engine.input_names}, {n: buffers[n] for n in engine.output_names})
        actions = buffers["chunk"].to("cpu", torch.float32, copy=True).numpy()  # the buffer is reused by the next tick
        if c.flow_state == "prefix":
            self.action.check_tokens(buffers["state_k"], buffers["state_v"],
                                     torch.zeros(c.state_slots, dtype=torch.long), 0)  # before anything is committed
            self._commit_tick(slot)
            self._ring_stale = False  # every valid stored state was recomputed and committed with it
        else:
            self.state_count += 1
        return ActionChunk(actions, None, None, steps)

    def _fill_flow_inputs(self, state: torch.Tensor, slot: int) -> None:
        """The flow tick step's inputs: the tick's noise; 'prefix': the state rows (_fill_tick_rows' new state | the
        other ring slots), their positions and bias, the expert's bias over the prefix and those states; 'suffix':
        the state vector and the expert's bias over the prefix."""
        c, buffers = self.config, self._flow_buffers
        tick_noise(c.action_horizon, c.action_dims, self.noise_seed, self.state_count, self._noise_generator,
                   self._noise_host, c.flow_noise_scale)
        buffers["noise"].copy_(self._noise_host)
        if c.flow_state == "suffix":
            buffers["state"].copy_(state)
            buffers["expert_bias"].copy_(flow_bias(c, self._prefix_bias, None))
            return
        others = self._other_slots[slot]
        stored_valid = self.action.valid.index_select(0, others)  # [S - 1]
        self._state_x[0].copy_(self.model.embed_state(state)[0])
        self._state_x[1:].copy_(self._state_embeds.index_select(0, others))
        buffers["positions"].copy_(state_positions(c, slot))
        buffers["bias"].copy_(state_bias(self._prefix_bias, stored_valid))
        buffers["expert_bias"].copy_(flow_bias(c, self._prefix_bias, stored_valid))

    def _fill_tick_rows(self, state: torch.Tensor, slot: int, prefix_bias: torch.Tensor) -> None:
        """The tick block's inputs: the new state's embedding, then the other ring slots' stored embeddings (in
        ring order after `slot`; invalid ones masked), their positions and the block's bias over `prefix_bias`."""
        c = self.config
        others = self._other_slots[slot]
        self._state_x[0].copy_(self.model.embed_state(state)[0])
        self._state_x[1:].copy_(self._state_embeds.index_select(0, others))
        self._tick_positions_buf.copy_(tick_positions(c, slot))
        self._tick_block_bias.copy_(tick_bias(prefix_bias, self.action.valid.index_select(0, others),
                                              c.action_tokens))

    def _chunk(self) -> ActionChunk:
        """The tick's chunk, and its writes checked (a non-finite K/V raises here, before any commit)."""
        out = self._tick_out
        self.action.check_tokens(out["state_k"], out["state_v"], torch.zeros(self.config.state_slots,
                                                                               dtype=torch.long), 0)
        logits = out["logits"].to("cpu", torch.float32, copy=True)  # the buffer is reused by the next tick
        bins = self.bins.bins_from_logits(logits).numpy()
        return ActionChunk(self.bins.to_values(bins), bins, logits)

    def _commit_tick(self, slot: int) -> None:
        """The new state into its ring slot; the other valid stored states' recomputed K/V over theirs."""
        c = self.config
        out = self._tick_out
        others = self._other_slots[slot]
        valid = self.action.valid.index_select(0, others)
        if bool(valid.any()):
            kept = others[valid]
            at = torch.arange(1, c.state_slots)[valid]  # their rows in the tick block
            self.action.write(kept, out["state_k"][:, :, at], out["state_v"][:, :, at], c.state_base + kept, 0)
        position = torch.tensor([c.state_base + slot])
        self.action.write(torch.tensor([slot]), out["state_k"][:, :, :1], out["state_v"][:, :, :1], position, 0)
        self._state_embeds[slot].copy_(self._state_x[0])
        self.state_count += 1


def _capacity(by_capacity: dict, need: int) -> int:
    """The smallest capacity that holds `need` rows."""
    return min(k for k in by_capacity if k >= need)

