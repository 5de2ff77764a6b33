"""Partial recompute of the vision tower (Eventful Transformers style, with a dense residual stream).

Per camera the cache keeps, for every layer and token: the layer's input when the token was last recomputed there
(`x_ref`; only with the drift gates below, but layer 0's always), its query, key and value, and the two residual
updates the layer added (attention after out_proj, `attn_out`; MLP, `mlp_out`); and the final outputs. A frame in
which only some patches changed runs the residual stream of every token through every layer, but recomputes the
expensive parts only for some:

  - recomputed tokens (the gate's changed patches, plus at each layer those whose input drifted by more than
    `drift_threshold` (relative L2) since they were last recomputed there, or with a `layer_budget` the most drifted
    up to that many times the gate's count): layer norm, Q/K/V, attention, out_proj
    and MLP; with a drift threshold the MLP has its own gate on its input (x + attention), since reused tokens'
    attention moves their MLP input even when the layer input did not move;
  - reused tokens: keep their cached Q/K/V and MLP update; with `attend_all` their attention (cached query over
    every token's current K/V) and out_proj are recomputed, so they see their changed neighbours (cheap next to
    Q/K/V and the MLP); their residual stream carries every change of their input forward.
  - shared drift (`shared_drift_samples` > 0, the node's default): what a reused token misses is mostly shared by
    all of them (its neighbours changed, not itself: on the freeway clip 77% of the error energy of the reused
    tokens' tower outputs lies in the mean direction). Per layer, a few evenly spaced reused tokens are recomputed
    too, and every reused token's cached Q/K/V, attention update and MLP update move by the sample's mean change;
    reused tokens then skip their attention as well. On the freeway clip at 10 fps (threshold 8) this took the
    logit error from 11% to 4%, at a lower cost than `attend_all`.

With `fresh_embeddings` every token's patch embedding comes from the current pixels (a single [T, 3*P*P] x
[3*P*P, W] product), so sub-threshold drift of reused patches reaches the stream too. With every token changed
this is the full forward pass; with none changed, nothing is computed and the outputs stay bit for bit.

A refresh is staged: `refresh` computes the new state of a camera into staging buffers and returns all T outputs;
`commit` applies every staged camera at once and `discard` drops them, so the owner commits the tower together with
the decoder's KV cache (a budget stop leaves both as they were).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from vla_node.backends import cpu_kernels
from vla_node.backends.refresh_rows import shared_sample
from vla_node.model.vision import VisionTower, softmax_attention

if TYPE_CHECKING:
    from vla_node.backends.native_frame import NativeFrame
    from vla_node.backends.native_tower import NativeTower
    from vla_node.kv.attention import Segment
    from vla_node.kv.prefix import PrefixBuffer

Check = Callable[[float], bool]  # called with the fraction done; False = stop now


class VisionStageAborted(Exception):
    pass


@dataclass
class ExtraRows:
    """Rows decoded in the same pass as a frame's tokens (the action tick's block), so that each layer's matmuls
    read the weights once for both. They attend as `attend(layer, q, k, v, frame_k, frame_v)` says (q [H, n, hd],
    their own k and v [KV, n, hd], the frame's staged k and v [KV, T, hd] -> [H, n, hd]); every layer's K/V goes to
    out_k / out_v [L, KV, n, hd] and their final hidden states to `hidden` [n, hidden]."""

    x: torch.Tensor  # [n, hidden] input embeddings
    positions: torch.Tensor  # int64 [n]
    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    out_k: torch.Tensor
    out_v: torch.Tensor
    hidden: torch.Tensor | None = None
    # where `attend` is this: the frame's staged K/V copied into the prefix buffer's slots from `frame_at`, then
    # PrefixBuffer.attend (its block set): (buffer, frame_at), which a NativeFrame may run in C; None: only `attend`
    prefix: "tuple[PrefixBuffer, int] | None" = None


def drifted_rows(x: torch.Tensor, x_ref: torch.Tensor, base: torch.Tensor | None, threshold: float | None,
                 mask: torch.Tensor, budget: float | None = None) -> torch.Tensor:
    """Rows to recompute: `base` (int64 [n]), plus those whose relative L2 drift ||x - x_ref|| / ||x_ref|| exceeds
    `threshold` (None = off), plus, up to round(budget * n) rows in all (None = off), the most drifted of the rest
    (Eventful Transformers' top-k; a row that has not moved is never added). x, x_ref [T, W]; mask bool [T] is
    scratch. Returns sorted int64 [n']."""
    if base is None:
        return torch.arange(x.shape[0], device=x.device)
    if threshold is None and budget is None:
        return base
    drift = torch.linalg.vector_norm((x - x_ref).float(), dim=-1) / torch.linalg.vector_norm(x_ref.float(), dim=-1)
    drift.nan_to_num_(nan=0.0)  # [T]; 0/0: a zero row that stayed zero has not moved (x/0 = inf: it has)
    if threshold is None:
        mask.zero_()
    else:
        torch.gt(drift, threshold, out=mask)
    mask[base] = True
    if budget is not None:
        extra = min(round(budget * base.numel()), x.shape[0]) - int(mask.sum())
        if extra > 0:
            top = drift.masked_fill(mask, 0.0).topk(extra)  # the most drifted rows not selected yet
            mask[top.indices[top.values > 0]] = True
    return mask.nonzero().flatten()


def shift_reused(out: torch.Tensor, old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, sample: torch.Tensor,
                 dim: int, at: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> None:
    """out <- old for every token, moved by the mean change (new - old) over `sample`, then new at `rows` (sorted,
    a superset of sample). Tokens run along `dim` of out and old (all T) and of new (the n recomputed rows). `at`:
    the sample's places among the rows (searchsorted(rows, sample)), where the caller has them already; `scratch`:
    fp32, at least old's size, for the move of a non-fp32 `old` (without it, a temporary is allocated); `residual`
    (out's shape): a residual stream that then takes out, residual += out (in the same pass where the kernel runs)."""
    if sample.numel():
        if at is None:
            at = torch.searchsorted(rows, sample)  # the sample's places among the recomputed rows
        if cpu_kernels.shift(out, old, new, rows, sample, at, dim, residual):  # the same bits in one pass
            return
        change = new.index_select(dim, at).float() - old.index_select(dim, sample).float()
        move = change.mean(dim, keepdim=True)
        if old.dtype == torch.float32:
            torch.add(old, move, out=out)
        else:  # the move in fp32, rounded once: as out.copy_(old).add_(move) computes it, without its temporaries
            wide = old.float() if scratch is None else scratch.view(-1)[: old.numel()].view(old.shape).copy_(old)
            out.copy_(wide.add_(move))
    else:
        out.copy_(old)
    out.index_copy_(dim, rows, new)
    if residual is not None:
        residual.add_(out)


class Rows(NamedTuple):
    """The tokens a layer recomputes: rows sorted int64 [n] (the gate's, the drifted and the shared-drift sample),
    the sample int64 [s] and its places among the rows, `at` int64 [s]."""

    rows: torch.Tensor
    sample: torch.Tensor
    at: torch.Tensor


def pick_rows(x: torch.Tensor, x_ref: torch.Tensor, base: torch.Tensor | None, threshold: float | None,
              mask: torch.Tensor, budget: float | None, samples: int) -> Rows:
    """drifted_rows, then (while some token is reused) the shared-drift sample of `samples` tokens (shared_sample)."""
    rows = drifted_rows(x, x_ref, base, threshold, mask, budget)  # [n]
    sample = rows[:0]
    if samples and rows.numel() < x.shape[0]:
        rows, sample = shared_sample(rows, samples, mask)
    return Rows(rows, sample, torch.searchsorted(rows, sample))


def _stage_rows(out: torch.Tensor, old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor | None) -> None:
    """out [T, W] <- old with `rows` replaced by new [n, W]; rows None: new holds every row."""
    if rows is None:
        out.copy_(new)
    else:
        out.copy_(old)
        out.index_copy_(0, rows, new)


class VisionTokenCache:
    def __init__(self, tower: VisionTower, num_cameras: int, dtype: torch.dtype = torch.float32, *,
                 attend_all: bool = True, fresh_embeddings: bool = False, drift_threshold: float | None = None,
                 layer_budget: float | None = None, shared_drift_samples: int = 0,
                 attention: Callable = softmax_attention) -> None:
        """attend_all: reused tokens recompute their attention over every token's current K/V (and out_proj);
        fresh_embeddings: reused tokens' patch embeddings follow the current pixels;
        drift_threshold: per layer, also recompute tokens whose input (and, for the MLP, whose MLP input) moved more
        than this (relative L2) since they were last recomputed there (None = only the gate's tokens);
        layer_budget: per layer, recompute this many times the gate's tokens: the most drifted others too;
        shared_drift_samples: per layer, recompute this many evenly spaced reused tokens too and move every reused
        token's cached Q/K/V, attention and MLP updates by their mean change (then reused tokens skip attention);
        attention: q [H, n, hd] over k, v [H, T, hd] -> [H, n, hd] (softmax_attention, or vision.fused_attention
        where it pays)."""
        self.tower, self.attention = tower, attention
        self.shared_drift_samples = shared_drift_samples
        self.attend_all, self.fresh_embeddings, self.drift_threshold = attend_all, fresh_embeddings, drift_threshold
        self.layer_budget = layer_budget
        # x_ref is read by the per-layer drift gates only (and layer 0's as the reused tokens' embeddings), mid_ref
        # by the MLP's gate only: without those gates the stage skips writing them
        self._track_inputs = drift_threshold is not None or layer_budget is not None
        emb = tower.embeddings
        layers = tower.encoder.layers
        attn = layers[0].self_attn
        T, W = emb.position_embedding.num_embeddings, emb.patch_embedding.out_channels
        L, H, hd = len(layers), attn.heads, attn.head_dim
        C = num_cameras
        self.tokens, self.width, self.heads, self.head_dim, self.num_layers = T, W, H, hd, L
        self.x_ref = torch.zeros(C, L, T, W, dtype=dtype)  # each layer's input when the token was last recomputed
        self.qkv = torch.zeros(C, L, 3, H, T, hd, dtype=dtype)  # query, key, value (the views q, k, v)
        self.attn_out = torch.zeros(C, L, T, W, dtype=dtype)  # the attention's residual update (after out_proj)
        self.mlp_out = torch.zeros(C, L, T, W, dtype=dtype)  # the MLP's residual update
        self.mid_ref = torch.zeros(C, L, T, W, dtype=dtype)  # each MLP's input (x + attention) when last recomputed
        self.out = torch.zeros(C, T, W, dtype=dtype)  # post-layernorm outputs
        self.valid = [False] * C
        # staging: every tensor above, whole (a refresh rewrites a camera's state; commit swaps it in)
        self._stage = {name: torch.zeros_like(getattr(self, name)) for name in self._STATE}
        self._staged: list[bool] = [False] * C
        self._staged_rows: list[list[int]] = [[0] * L for _ in range(C)]  # tokens recomputed per layer (accounting)
        self._mask = torch.zeros(T, dtype=torch.bool)
        self._x = torch.zeros(T, W, dtype=dtype)  # the residual stream of the camera being refreshed
        self._wide = None if dtype == torch.float32 else torch.zeros(3 * T * W)  # shift_reused's fp32 scratch
        self.native: NativeTower | None = None  # use_native

    _STATE = ("x_ref", "qkv", "attn_out", "mlp_out", "mid_ref", "out")

    def use_native(self, native: "NativeTower | None") -> None:
        """Run a refresh's layers but their norms as `native` (backends/native_tower.py: the same bits in two C
        calls a layer) where it applies: the `attention` given is the CPU kernel's, no per-layer drift gate runs, and
        the refresh is full or draws a shared-drift sample."""
        self.native = native

    @property
    def q(self) -> torch.Tensor:
        return self.qkv[:, :, 0]  # [C, L, H, T, hd]

    @property
    def k(self) -> torch.Tensor:
        return self.qkv[:, :, 1]

    @property
    def v(self) -> torch.Tensor:
        return self.qkv[:, :, 2]

    def recomputed_tokens(self, camera: int) -> float:
        """Mean over layers of the tokens the staged refresh of `camera` recomputed (Q/K/V and MLP)."""
        rows = self._staged_rows[camera]
        return sum(rows) / len(rows)

    @torch.inference_mode()
    def refresh(self, camera: int, pixels: torch.Tensor, tokens: torch.Tensor | None,
                check: Check | None = None) -> torch.Tensor:
        """pixels [3, S, S]; tokens int64 [n] to recompute (None = all; a camera's first frame is always full).
        Stages the camera's new state and returns its outputs [T, W] (every token's: reused tokens move too when
        their context does)."""
        if not self.valid[camera]:
            tokens = None
        if tokens is not None:
            tokens = tokens.sort().values
        st = {name: buf[camera] for name, buf in self._stage.items()}
        live = {name: getattr(self, name)[camera] for name in self._STATE}
        if tokens is not None and tokens.numel() == 0:  # nothing changed: the state stays as it is, bit for bit
            for name in self._STATE:
                st[name].copy_(live[name])
            self._staged[camera] = True
            self._staged_rows[camera] = [0] * self.num_layers
            return st["out"]
        emb = self.tower.embeddings
        patches = emb.patchify(pixels[None])[0]  # [T, 3*P*P]
        x = self._x
        if tokens is None or self.fresh_embeddings:
            x.copy_(emb.embed_patches(patches[None])[0])  # [T, W]
        else:
            x.copy_(live["x_ref"][0])
            x[tokens] = emb.embed_patches(patches[tokens][None], tokens)[0]
        # without the per-layer drift gates every layer recomputes the same rows: picked once
        fixed = None if self._track_inputs else self._pick_rows(x, live["x_ref"][0], tokens)
        for i, layer in enumerate(self.tower.encoder.layers):
            if check is not None and not check(i / self.num_layers):
                raise VisionStageAborted(f"stopped before vision layer {i}")
            self._layer(i, layer, x, tokens, live, st, camera, fixed)
        st["out"].copy_(self.tower.post_layernorm(x))
        self._staged[camera] = True
        return st["out"]

    def _pick_rows(self, x: torch.Tensor, x_ref: torch.Tensor, tokens: torch.Tensor | None) -> Rows:
        return pick_rows(x, x_ref, tokens, self.drift_threshold, self._mask, self.layer_budget,
                         self.shared_drift_samples)

    def _layer(self, i: int, layer, x: torch.Tensor, tokens: torch.Tensor | None, live: dict, st: dict,
               camera: int, fixed: Rows | None) -> None:
        """One encoder layer over the residual stream x [T, W] (updated in place), writing the staged state; `fixed`:
        the rows every layer recomputes (None: this layer's drift gate picks them)."""
        a = layer.self_attn
        T, W, H, hd = self.tokens, self.width, self.heads, self.head_dim
        rows, sample, at = fixed if fixed is not None else self._pick_rows(x, live["x_ref"][i], tokens)
        n = rows.numel()
        self._staged_rows[camera][i] = n
        full = n == T
        xr = x if full else x.index_select(0, rows)  # [n, W]
        sqkv, sx = st["qkv"][i], st["x_ref"][i]  # [3, H, T, hd], [T, W]
        if self._track_inputs or i == 0:
            _stage_rows(sx, live["x_ref"][i], xr, None if full else rows)
        if self.native is not None and not self._track_inputs and (full or sample.numel()):
            self.native.half(i, 0, x, layer.layer_norm1(xr), fixed, st, live)
            self.native.half(i, 1, x, layer.layer_norm2(x if full else x.index_select(0, rows)), fixed, st, live)
            return
        sq, sk, sv = sqkv
        h = layer.layer_norm1(xr)
        qkv = a.__dict__.get("qkv")  # packed weights' one q|k|v matmul (packed_weights.PackedQKV)
        if qkv is not None:
            heads = qkv(h).reshape(n, 3, H, hd).permute(1, 2, 0, 3)  # [n, 3W] -> [3, H, n, hd]
            if full:
                sqkv.copy_(heads)
        else:  # each [n, W] -> [H, n, hd], stacked straight into the staged q|k|v when every row is new
            heads = torch.stack([p(h).reshape(n, H, hd).transpose(0, 1) for p in (a.q_proj, a.k_proj, a.v_proj)],
                                out=sqkv if full else None)
        q = heads[0]
        if not full:  # one shift for the three: [3, H, n, hd] into [3, H, T, hd]
            shift_reused(sqkv, live["qkv"][i], heads, rows, sample, 2, at, self._wide)
        sa, sm = st["attn_out"][i], st["mlp_out"][i]
        if full or (self.attend_all and not self.shared_drift_samples):
            attn = self.attention(sq, sk, sv)  # [H, T, hd]
            sa.copy_(a.out_proj(attn.transpose(0, 1).reshape(T, W)))  # [H, T, hd] -> [T, W]
            x.add_(sa)
        else:
            attn = self.attention(q, sk, sv)  # [H, n, hd]
            new = a.out_proj(attn.transpose(0, 1).reshape(n, W))  # [H, n, hd] -> [n, W]
            shift_reused(sa, live["attn_out"][i], new, rows, sample, 0, at, self._wide, residual=x)
        if not full and self.drift_threshold is not None:  # the MLP's own gate: its input moved with the attention
            rows = drifted_rows(x, live["mid_ref"][i], rows, self.drift_threshold, self._mask)
            at = None  # the sample's places among the new rows: shift_reused finds them
            n = rows.numel()
            full = n == T
            self._staged_rows[camera][i] = n
        mid = x if full else x.index_select(0, rows)  # [n, W]
        if self.drift_threshold is not None:
            _stage_rows(st["mid_ref"][i], live["mid_ref"][i], mid, None if full else rows)
        if full:
            sm.copy_(layer.mlp(layer.layer_norm2(x)))
            x.add_(sm)
        else:
            shift_reused(sm, live["mlp_out"][i], layer.mlp(layer.layer_norm2(mid)), rows, sample, 0, at,
                         self._wide, residual=x)

    def commit(self) -> None:
        """Apply every staged refresh: a staged camera's state is whole in the staging buffers, so with every
        camera staged the two sets of buffers swap (nothing copied); else the staged cameras are copied."""
        if all(self._staged):
            for name in self._STATE:
                live = getattr(self, name)
                setattr(self, name, self._stage[name])
                self._stage[name] = live
        else:
            for camera, staged in enumerate(self._staged):
                if staged:
                    for name in self._STATE:
                        getattr(self, name)[camera].copy_(self._stage[name][camera])
        self.valid = [valid or staged for valid, staged in zip(self.valid, self._staged)]
        self.discard()

    def discard(self) -> None:
        self._staged = [False] * len(self._staged)

    def reset(self) -> None:
        self.valid = [False] * len(self.valid)
        self.discard()


class _Picked(NamedTuple):
    """A decoder layer's rows to recompute (FrameTokenCache._pick): `index` int64 [n + n_extra], those rows and the
    extra rows behind them as rows of the residual stream (None: every row), and their RoPE tables [n + n_extra, hd]."""

    rows: Rows
    index: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor


class FrameTokenCache:
    """The decoder side of reuse: the current frame's vision tokens through the decoder, one frame (vision_frames = 1).

    Kept per layer and token: the layer's input when the token was last recomputed there (`x_ref`), its query
    (after RoPE), its key and value (fp32, every token's; the vision partition stores them in its own dtype), and
    the two residual updates (attention after o_proj, MLP). A partial run keeps the residual stream of every token
    and, at every layer, re-projects every token's K/V from its current input (cheap next to the rest: grouped-query
    K/V), so that the action queries see every token's change; it recomputes Q, attention, o_proj and the MLP only
    for the recomputed tokens (the gate's, plus those whose input drifted by more than `drift_threshold` or, up to
    `layer_budget` times the gate's count, drifted most); reused
    tokens recompute their attention with their cached query when `attend_all`, or with `shared_drift_samples`
    skip it and move their attention and MLP updates by the sample's mean change (as in the tower; their queries
    are not read then). Staged like the tower cache.

    The last layer computes only K/V: the vision tokens' final hidden states feed nothing (the action queries read
    their K/V), so x_ref, q, attn_out, mlp_out and mid_ref hold the first L - 1 layers.
    """

    _STATE = ("x_ref", "q", "k", "v", "attn_out", "mlp_out", "mid_ref")

    def __init__(self, layers, rope, tokens: int, dtype: torch.dtype = torch.float32, *, attend_all: bool = True,
                 drift_threshold: float | None = None, layer_budget: float | None = None,
                 shared_drift_samples: int = 0, extra_rows: int = 0) -> None:
        self.layers, self.rope = layers, rope
        self.shared_drift_samples = shared_drift_samples
        self.attend_all, self.drift_threshold, self.layer_budget = attend_all, drift_threshold, layer_budget
        self._track_inputs = drift_threshold is not None or layer_budget is not None  # as VisionTokenCache's
        a = layers[0].self_attn
        L, H, KV, hd = len(layers), a.heads, a.kv_heads, a.head_dim
        hidden = a.q_proj.in_features
        self.tokens, self.hidden, self.heads, self.kv_heads, self.head_dim = tokens, hidden, H, KV, hd
        self.x_ref = torch.zeros(L - 1, tokens, hidden, dtype=dtype)
        self.q = torch.zeros(L - 1, H, tokens, hd, dtype=dtype)
        self.k = torch.zeros(L, KV, tokens, hd, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.attn_out = torch.zeros(L - 1, tokens, hidden, dtype=dtype)
        self.mlp_out = torch.zeros_like(self.attn_out)
        self.mid_ref = torch.zeros_like(self.attn_out)  # each MLP's input when last recomputed
        self._stage = {name: torch.zeros_like(getattr(self, name)) for name in self._STATE}
        self._mask = torch.zeros(tokens, dtype=torch.bool)
        self._x = torch.zeros(tokens + extra_rows, hidden, dtype=dtype)  # residual streams: the frame, extra rows
        self._wide = None if dtype == torch.float32 else torch.zeros(tokens * hidden)  # shift_reused's fp32 scratch
        self._every_row = torch.arange(tokens + extra_rows)  # every row of _x: a full run's index
        self._extra_index = self._every_row[tokens:]  # the extra rows' places in _x
        self.native: NativeFrame | None = None  # use_native
        self.context: object = None  # what the cached state was computed against (the instruction); None = empty
        self._staged_context: object = None
        self._staged = False
        self.staged_rows = [0] * (L - 1)  # tokens recomputed per layer but the last by the staged run (accounting)

    def use_native(self, native: "NativeFrame | None") -> None:
        """Run a run's layers with extra rows attending over a prefix buffer (ExtraRows.prefix) as `native`
        (backends/native_frame.py: the same bits in one C call a layer) where it applies: the caller's `attend` is
        gather_attention on the CPU kernel, no per-layer drift gate runs, and the run is full or draws a shared-drift
        sample."""
        self.native = native

    @property
    def staged_k(self) -> torch.Tensor:
        return self._stage["k"]  # [L, KV, T, hd]

    @property
    def staged_v(self) -> torch.Tensor:
        return self._stage["v"]

    def run(self, x: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor | None,
            text: Callable[[int], Segment], context: object, check: Check | None = None,
            attend: Callable | None = None, extra: ExtraRows | None = None) -> None:
        """x [T, hidden] every token's input embedding; positions int64 [T]; tokens int64 [n] to recompute (None =
        all, which is required when the cache holds nothing for `context`); text(layer) the text partition's
        Segment. Stages every layer's K/V (staged_k, staged_v) and the cache's new state. `check` as in the
        policy's blocks (raises VisionStageAborted). `extra`: rows decoded in the same matmuls (at most the
        extra_rows given at construction); they stage nothing, and the frame's results are those of a run without
        them up to float rounding (a matmul over a few rows plus theirs may round differently)."""
        from vla_node.kv.attention import Segment, segmented_attention

        apply_rope = cpu_kernels.apply_rope  # decoder.apply_rope, in one pass where the kernels run
        attend = attend or segmented_attention
        if tokens is not None and context != self.context:
            raise ValueError(f"partial decoder run against context {context!r}: the cache holds {self.context!r}")
        T = self.tokens
        n_extra = 0 if extra is None else extra.x.shape[0]
        if n_extra > self._x.shape[0] - T:
            raise ValueError(f"{n_extra} extra rows: this cache was built for at most {self._x.shape[0] - T}")
        if extra is not None:
            positions = torch.cat([positions, extra.positions])  # [T + n_extra]
        cos, sin = self.rope(positions, x.dtype)  # [T + n_extra, hd]
        xa = self._x[: T + n_extra]  # the frame's residual stream, then the extra rows'
        xs, xe = xa[:T], xa[T:]
        xs.copy_(x)
        if extra is not None:
            xe.copy_(extra.x)
        extra_index = self._extra_index[:n_extra]
        fixed = None  # the rows every layer recomputes, once picked (without the per-layer drift gates)
        if self._runs_native(extra):
            fixed = self._pick(0, xs, tokens, cos, sin, extra_index)
            if fixed.index is None or fixed.rows.sample.numel():  # every row, or a partial run with its sample
                self._run_native(xa, cos, sin, fixed, text, extra, check)
                self._staged, self._staged_context = True, context
                return
        n_layers = len(self.layers)
        for i, layer in enumerate(self.layers):
            if check is not None and not check(i / n_layers):
                raise VisionStageAborted(f"stopped before decoder layer {i}")
            a = layer.self_attn
            h = layer.input_layernorm(xa)  # [T + n_extra, hidden]
            last = i == n_layers - 1
            q_all = self._stage_kv(i, a, h, cos, sin, tokens is None and not last, extra, apply_rope)
            if last:  # the frame's tokens need only their K/V here; extra rows finish the layer
                if extra is not None:
                    self._finish_extra_rows(i, layer, a, h, cos, sin, xe, extra, apply_rope)
                break
            picked = fixed if fixed is not None else self._pick(i, xs, tokens, cos, sin, extra_index)
            if not self._track_inputs:
                fixed = picked
            self._recompute_layer(i, layer, a, h, q_all, picked, xa, xs, xe, text, attend, extra, extra_index,
                                  Segment, apply_rope)
        self._staged, self._staged_context = True, context

    def _runs_native(self, extra: ExtraRows | None) -> bool:
        return (self.native is not None and extra is not None and extra.prefix is not None
                and not self._track_inputs)

    def _run_native(self, xa: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, picked: _Picked,
                    text: Callable[[int], Segment], extra: ExtraRows, check: Check | None) -> None:
        """run's layers by self.native (use_native), the budget checked before each as run does: a partial run's
        picked rows with their sample, or every row (picked.index None)."""
        n_layers = len(self.layers)
        live = {name: getattr(self, name) for name in ("q", "attn_out", "mlp_out")}
        index = self._every_row[: xa.shape[0]] if picked.index is None else picked.index
        self.native.begin(xa, cos, sin, picked.rows, index, picked.cos, picked.sin, self._stage, live,
                          extra.out_k, extra.out_v, extra.prefix)
        for i in range(n_layers):
            if check is not None and not check(i / n_layers):
                raise VisionStageAborted(f"stopped before decoder layer {i}")
            segment = text(i)
            self.native.layer(i, segment.k, segment.v)
            if i < n_layers - 1:
                self.staged_rows[i] = picked.rows.rows.numel()
        extra.hidden = xa[self.tokens :]

    def _stage_kv(self, i: int, a, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, every_query: bool,
                  extra: ExtraRows | None, apply_rope: Callable) -> torch.Tensor | None:
        """Layer i's K/V of every row (the frame's, then the extra rows') from its normed input h [T + n_extra,
        hidden], staged (the extra rows' to extra.out_k / out_v). With every_query and packed q|k|v weights, returns
        every row's query [H, T + n_extra, hd] too (from the same matmul); else None."""
        T, H, KV, hd = self.tokens, self.heads, self.kv_heads, self.head_dim
        s = self._stage
        # a full run below the last layer computes every row's query too: with packed weights' one q|k|v
        # matmul (packed_weights.PackedQKV), q and k take one RoPE call
        qkv = a.__dict__.get("qkv") if every_query else None
        q_all = None
        if qkv is not None:
            heads = qkv(h).reshape(-1, H + 2 * KV, hd).transpose(0, 1)  # -> [H + 2 KV, T + n_extra, hd]
            qk = apply_rope(heads[: H + KV], cos, sin)
            q_all, k, v = qk[:H], qk[H:], heads[H + KV :]
        else:
            k = apply_rope(a.k_proj(h).reshape(-1, KV, hd).transpose(0, 1), cos, sin)  # -> [KV, T + n_extra, hd]
            v = a.v_proj(h).reshape(-1, KV, hd).transpose(0, 1)
        s["k"][i].copy_(k[:, :T])
        s["v"][i].copy_(v[:, :T])
        if extra is not None:
            extra.out_k[i].copy_(k[:, T:])
            extra.out_v[i].copy_(v[:, T:])
        return q_all

    def _finish_extra_rows(self, i: int, layer, a, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           xe: torch.Tensor, extra: ExtraRows, apply_rope: Callable) -> None:
        """The last layer for the extra rows alone (its K/V staged): their queries, attention over their own and
        the frame's staged K/V, and the rest of the layer over their residual stream xe; sets extra.hidden."""
        T, H, hd = self.tokens, self.heads, self.head_dim
        s = self._stage
        q = a.q_proj(h[T:]).reshape(extra.x.shape[0], H, hd).transpose(0, 1)  # [n, H*hd] -> [H, n, hd]
        q = apply_rope(q, cos[T:], sin[T:])
        attn = extra.attend(i, q, extra.out_k[i], extra.out_v[i], s["k"][i], s["v"][i])
        extra.hidden = layer.finish(xe, attn)

    def _pick(self, i: int, xs: torch.Tensor, tokens: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              extra_index: torch.Tensor) -> _Picked:
        """Layer i's rows to recompute (pick_rows over the frame's stream xs [T, hidden]) as rows of the whole
        stream with the extra rows behind them, and their RoPE tables."""
        rows, sample, at = pick_rows(xs, self.x_ref[i], tokens, self.drift_threshold, self._mask, self.layer_budget,
                                     self.shared_drift_samples)
        if rows.numel() == self.tokens:
            return _Picked(Rows(rows, sample, at), None, cos, sin)
        index = torch.cat([rows, extra_index])  # [n + n_extra] rows of the stream
        return _Picked(Rows(rows, sample, at), index, cos.index_select(0, index), sin.index_select(0, index))

    def _recompute_layer(self, i: int, layer, a, h: torch.Tensor, q_all: torch.Tensor | None, picked: _Picked,
                         xa: torch.Tensor, xs: torch.Tensor, xe: torch.Tensor, text: Callable[[int], Segment],
                         attend: Callable, extra: ExtraRows | None, extra_index: torch.Tensor, segment_type: type,
                         apply_rope: Callable) -> None:
        """Layer i below the last, its K/V staged, over the residual streams xa (xs the frame's [T, hidden], xe the
        extra rows'; updated in place): for the `picked` rows and the extra rows, their queries, attention and
        o_proj (reused tokens' updates kept or moved), then the MLP (_update_mlp). Stages q, x_ref, attn_out."""
        T, H, hd = self.tokens, self.heads, self.head_dim
        s = self._stage
        rows, sample, at = picked.rows
        n = rows.numel()
        self.staged_rows[i] = n
        full = n == T
        sq = s["q"][i]
        # queries of the recomputed rows and the extra rows, one matmul: [H, n + n_extra, hd]
        if q_all is not None:  # (a full run: every row)
            q = q_all
        else:
            index = picked.index
            q = a.q_proj(h if index is None else h.index_select(0, index)).reshape(-1, H, hd).transpose(0, 1)
            q = apply_rope(q, picked.cos, picked.sin)
        q_extra = q[:, n:]
        if full:
            sq.copy_(q[:, :T])
        else:
            sq.copy_(self.q[i])
            sq.index_copy_(1, rows, q[:, :n])
        if self._track_inputs:
            _stage_rows(s["x_ref"][i], self.x_ref[i], xs if full else xs.index_select(0, rows),
                        None if full else rows)
        own = segment_type(s["k"][i], s["v"][i], None)
        sa = s["attn_out"][i]
        every = full or (self.attend_all and not self.shared_drift_samples)  # every token's attention anew
        attn, _ = attend(sq if every else q[:, :n], [text(i), own])  # [H, T or n, hd]
        parts = [attn]  # one o_proj for both: [H, T or n, hd] | [H, n_extra, hd]
        if extra is not None:
            parts.append(extra.attend(i, q_extra, extra.out_k[i], extra.out_v[i], s["k"][i], s["v"][i]))
        rows_in = torch.cat([part.transpose(0, 1) for part in parts])  # -> [rows, H, hd], one copy
        out = a.o_proj(rows_in.reshape(-1, H * hd))  # [rows, H, hd] -> [rows, H*hd]
        if every:
            sa.copy_(out[:T])
            xs.add_(sa)
        else:
            shift_reused(sa, self.attn_out[i], out[:n], rows, sample, 0, at, self._wide, residual=xs)
        xe.add_(out[out.shape[0] - xe.shape[0] :])
        self._update_mlp(i, layer, xa, xs, xe, picked, full, extra_index)

    def _update_mlp(self, i: int, layer, xa: torch.Tensor, xs: torch.Tensor, xe: torch.Tensor, picked: _Picked,
                    full: bool, extra_index: torch.Tensor) -> None:
        """Layer i's MLP over the residual streams (in place) for the recomputed rows, after the MLP's own drift
        gate, and the extra rows; reused tokens' updates kept or moved by the sample's. Stages mid_ref, mlp_out."""
        T = self.tokens
        s = self._stage
        sm = s["mlp_out"][i]
        (rows, sample, at), index = picked.rows, picked.index
        if not full and self.drift_threshold is not None:  # the MLP's own gate
            rows = drifted_rows(xs, self.mid_ref[i], rows, self.drift_threshold, self._mask)
            full = rows.numel() == T
            self.staged_rows[i] = rows.numel()
            at, index = None, None if full else torch.cat([rows, extra_index])  # [rows + n_extra]
        if self.drift_threshold is not None:
            _stage_rows(s["mid_ref"][i], self.mid_ref[i], xs if full else xs.index_select(0, rows),
                        None if full else rows)
        mid = xa if full else xa.index_select(0, index)  # [rows + n_extra, hidden]
        out = layer.mlp(layer.post_attention_layernorm(mid))
        if full:
            sm.copy_(out[:T])
            xs.add_(sm)
        else:
            shift_reused(sm, self.mlp_out[i], out[: rows.numel()], rows, sample, 0, at, self._wide, residual=xs)
        xe.add_(out[out.shape[0] - xe.shape[0] :])

    def commit(self) -> None:
        """Apply the staged run: the staging buffers hold the whole new state, so the two sets swap."""
        if not self._staged:
            return
        for name in self._STATE:
            live = getattr(self, name)
            setattr(self, name, self._stage[name])
            self._stage[name] = live
        self.context = self._staged_context
        self.discard()

    def discard(self) -> None:
        self._staged = False

    def reset(self) -> None:
        self.context = None
        self.discard()
