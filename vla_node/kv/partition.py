"""One KV partition: preallocated K/V storage for a fixed number of token slots, all layers, plus per-slot
metadata. Float storage (fp32/bf16/fp16) or INT8 KIVI (keys per channel over groups of `key_group` slots,
values per token, scales stored beside the data).

Verbs: write (all layers of n tokens at once, all-or-nothing), read (one layer, dequantized into the
caller's buffers), gather (all layers of some slots, fp32), evict, clear, free_slots. Nothing is allocated
for storage after construction; a write validates everything before it touches storage.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from vla_node.kv import dtypes, quant
from vla_node.kv.dtypes import torch_dtypes
from vla_node.validate import choose, is_int, require

STORAGE_DTYPES = torch_dtypes(dtypes.STORAGE_DTYPES)
SCALE_DTYPES = torch_dtypes(dtypes.SCALE_DTYPES)


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """Shape and storage of one partition. `key_group` and `scale_dtype` matter for int8 only."""

    name: str
    capacity: int
    dtype: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    key_group: int = 64
    scale_dtype: str = "fp16"

    def __post_init__(self) -> None:
        p = f"kv.{self.name}" if self.name else "kv"
        require(isinstance(self.name, str) and self.name.isidentifier(), f"{p}.name", self.name,
                "an identifier such as 'vision'")
        choose(f"{p}.dtype", self.dtype, STORAGE_DTYPES)
        choose(f"{p}.scale_dtype", self.scale_dtype, SCALE_DTYPES)
        for key in ("capacity", "n_layers", "n_kv_heads", "head_dim", "key_group"):
            value = getattr(self, key)
            require(is_int(value) and value > 0, f"{p}.{key}", value,
                    "a positive integer")

    @property
    def torch_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.dtype]

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    @property
    def quantized(self) -> bool:
        return self.dtype == "int8"

    @property
    def n_key_groups(self) -> int:
        return math.ceil(self.capacity / self.key_group)


class KVPartition:
    """Preallocated KV storage `[n_layers, n_kv_heads, capacity, head_dim]` with per-slot metadata.

    Public metadata tensors (read them, change them only through the verbs):
      valid bool[C], position int64[C] (RoPE position the key was rotated at), frame_id int64[C],
      importance fp32[C] (accumulated attention mass or a caller's score), count int32[C] (members merged
      into the slot, 1 for a plain token), tier int8[C] (a tier id the owner assigns).
    """

    def __init__(self, spec: PartitionSpec, device: str | torch.device = "cpu") -> None:
        self.spec = spec
        self.device = resolve_device(device)
        L, H, C, D = spec.n_layers, spec.n_kv_heads, spec.capacity, spec.head_dim
        dev = self.device
        self.k = torch.zeros(L, H, C, D, dtype=spec.torch_dtype, device=dev)
        self.v = torch.zeros(L, H, C, D, dtype=spec.torch_dtype, device=dev)
        if spec.quantized:
            sd, G = spec.torch_scale_dtype, spec.n_key_groups
            self.k_scale = torch.ones(L, H, G, D, dtype=sd, device=dev)  # per channel per key group
            self.k_zero = torch.zeros(L, H, G, D, dtype=sd, device=dev)
            self.v_scale = torch.ones(L, H, C, 1, dtype=sd, device=dev)  # per token
            self.v_zero = torch.zeros(L, H, C, 1, dtype=sd, device=dev)
            # fp32 staging for non-fp32 reads: one layer for read(), up to 1 MiB of layers at a time for read_all()
            staged_layers = max(1, min(L, (1 << 20) // (H * C * D * 4)))
            self._deq = torch.zeros(staged_layers, H, C, D, dtype=torch.float32, device=dev)
        self.valid = torch.zeros(C, dtype=torch.bool, device=dev)
        self.position = torch.zeros(C, dtype=torch.int64, device=dev)
        self.frame_id = torch.zeros(C, dtype=torch.int64, device=dev)
        self.importance = torch.zeros(C, dtype=torch.float32, device=dev)
        self.count = torch.zeros(C, dtype=torch.int32, device=dev)
        self.tier = torch.zeros(C, dtype=torch.int8, device=dev)
        self._slot_ids = torch.arange(C, device=dev)
        self._n_writes = 0
        self._tokens_written = 0
        self._tokens_evicted = 0
        self._limit = (torch.finfo(spec.torch_scale_dtype).max if spec.quantized
                       else torch.finfo(spec.torch_dtype).max)
        self.kivi: quant.WholeKivi | None = None  # int8: whole writes and read_all through it where it applies

    # ------------------------------------------------------------------ sizes

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    @property
    def tokens_used(self) -> int:
        return int(self.valid.sum())

    @property
    def tokens_free(self) -> int:
        return self.capacity - self.tokens_used

    def _data_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def _scale_tensors(self) -> list[torch.Tensor]:
        return [self.k_scale, self.k_zero, self.v_scale, self.v_zero] if self.spec.quantized else []

    def _metadata_tensors(self) -> list[torch.Tensor]:
        return [self.valid, self.position, self.frame_id, self.importance, self.count, self.tier]

    def storage_tensors(self) -> list[torch.Tensor]:
        """Every preallocated tensor (for memory accounting and no-reallocation checks)."""
        return self._data_tensors() + self._scale_tensors() + self._metadata_tensors()

    def nbytes(self) -> dict[str, int]:
        """Bytes by kind: data (K/V codes or values), scales (scales + zero points), metadata;
        kv_bytes = data + scales; total = kv_bytes + metadata (read staging excluded)."""

        def size(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        data, scales, meta = size(self._data_tensors()), size(self._scale_tensors()), size(self._metadata_tensors())
        return {"data": data, "scales": scales, "metadata": meta, "kv_bytes": data + scales,
                "total": data + scales + meta}

    def stats(self) -> dict[str, Any]:
        b = self.nbytes()
        return {
            "name": self.name,
            "dtype": self.spec.dtype,
            "capacity": self.capacity,
            "tokens_used": self.tokens_used,
            "kv_bytes": b["kv_bytes"],
            "metadata_bytes": b["metadata"],
            "writes": self._n_writes,
            "tokens_written": self._tokens_written,
            "tokens_evicted": self._tokens_evicted,
        }

    # ------------------------------------------------------------------ slots

    def free_slots(self, n: int) -> torch.Tensor:
        """The n lowest free slots (LongTensor[n]); ValueError when fewer are free."""
        free = self._slot_ids[~self.valid]
        if free.numel() < n:
            raise ValueError(f"partition {self.name!r}: asked for {n} free slots, {free.numel()} free "
                             f"of capacity {self.capacity}")
        return free[:n]

    def _as_slots(self, slots_or_mask: torch.Tensor, what: str) -> torch.Tensor:
        if slots_or_mask.dtype == torch.bool:
            if slots_or_mask.shape != (self.capacity,):
                raise ValueError(f"{self.name}.{what}: mask shape {tuple(slots_or_mask.shape)}: expected "
                                 f"({self.capacity},)")
            return self._slot_ids[slots_or_mask.to(self.device)]
        self._check_slots(slots_or_mask, what)
        return slots_or_mask.to(self.device)

    def _check_slots(self, slots: torch.Tensor, what: str) -> None:
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise ValueError(f"{self.name}.{what}: slots {_describe(slots)}: expected an int64 tensor [n]")
        if slots.numel() == 0:
            return
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= self.capacity:
            raise ValueError(f"{self.name}.{what}: slot {lo if lo < 0 else hi} out of range: expected "
                             f"0 <= slot < {self.capacity}")
        if slots.numel() > 1 and torch.unique(slots).numel() != slots.numel():
            raise ValueError(f"{self.name}.{what}: duplicate slots in {slots.tolist()}: expected distinct slots")

    def evict(self, slots_or_mask: torch.Tensor) -> int:
        """Invalidate slots (LongTensor[n] or bool[C]); returns how many valid tokens were evicted."""
        slots = self._as_slots(slots_or_mask, "evict")
        n = int(self.valid[slots].sum())
        self.valid[slots] = False
        self.importance[slots] = 0.0
        self.count[slots] = 0
        self._tokens_evicted += n
        return n

    def clear(self) -> None:
        """Invalidate every slot (storage is kept, not freed)."""
        self._tokens_evicted += self.tokens_used
        self.valid.zero_()
        self.importance.zero_()
        self.count.zero_()

    def add_importance(self, slots_or_mask: torch.Tensor | None, scores: torch.Tensor, decay: float = 1.0) -> None:
        """importance = importance * decay + scores, on valid slots only. Call it once per tick (sum the
        scores over layers first): the decay applies per call.

        slots_or_mask None: scores is [C]; bool mask [C]: scores is [C] (used where the mask is True);
        LongTensor[n]: scores is [n]."""
        if decay != 1.0:
            self.importance.mul_(decay)
        if slots_or_mask is None or slots_or_mask.dtype == torch.bool:
            if scores.shape != (self.capacity,):
                raise ValueError(f"{self.name}.add_importance: scores shape {tuple(scores.shape)}: expected "
                                 f"({self.capacity},) with a mask or None")
            take = self.valid if slots_or_mask is None else self.valid & slots_or_mask.to(self.device)
            self.importance.add_(torch.where(take, scores.to(self.device, torch.float32), 0.0))
            return
        slots = self._as_slots(slots_or_mask, "add_importance")
        if scores.shape != slots.shape:
            raise ValueError(f"{self.name}.add_importance: scores shape {tuple(scores.shape)}: expected "
                             f"{tuple(slots.shape)} (one per slot)")
        s = scores.to(self.device, torch.float32) * self.valid[slots]
        self.importance.index_add_(0, slots, s)

    # ------------------------------------------------------------------ write

    def write(
        self,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        frame_id: int | torch.Tensor,
        *,
        importance: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
        tier: int = 0,
    ) -> None:
        """Write all layers of n tokens: k, v [n_layers, n_kv_heads, n, head_dim] into `slots` (int64[n],
        distinct), with positions int64[n], frame_id (int or int64[n]), optional importance fp32[n]
        (default 0) and count int32[n] (default 1). Overwriting valid slots is allowed.

        All-or-nothing: every argument is checked before storage is touched; on error nothing changes."""
        self._validate_write(slots, k, v, positions, frame_id, importance, count, tier)
        n = slots.numel()
        if n == 0:
            return
        slots = slots.to(self.device)
        whole = n == self.capacity and torch.equal(slots, self._slot_ids)  # every slot in order (a frame's FIFO)
        if self.spec.quantized:
            self._write_int8(slots, k, v, whole)
        else:
            self.k.index_copy_(2, slots, k.to(self.device, self.k.dtype))
            self.v.index_copy_(2, slots, v.to(self.device, self.v.dtype))
        at = slice(None) if whole else slots  # a whole write copies instead of scattering
        self.position[at] = positions.to(self.device)
        self.frame_id[at] = frame_id.to(self.device) if isinstance(frame_id, torch.Tensor) else frame_id
        if importance is None:
            self.importance[at] = 0.0
        else:
            self.importance[at] = importance.to(self.device, torch.float32)
        if count is None:
            self.count[at] = 1
        else:
            self.count[at] = count.to(self.device, torch.int32)
        self.tier[at] = tier
        self.valid[at] = True
        self._n_writes += 1
        self._tokens_written += n

    def _validate_write(self, slots, k, v, positions, frame_id, importance, count, tier) -> None:
        self._check_slots(slots, "write")
        self.check_tokens(k, v, positions, frame_id, importance, count, n=slots.numel())
        if not isinstance(tier, int) or isinstance(tier, bool) or not -128 <= tier <= 127:
            raise ValueError(f"{self.name}.write: tier {tier!r}: expected an int in [-128, 127]")

    def check_tokens(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        frame_id: int | torch.Tensor,
        importance: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
        n: int | None = None,
    ) -> None:
        """Everything write() checks except the slots: shapes, dtypes, device, finite values within the
        storage's range. Owners call it before they evict, so that a bad stage changes nothing."""
        s = self.spec
        if n is None:
            n = k.shape[2] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
        want = (s.n_layers, s.n_kv_heads, n, s.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != want:
                raise ValueError(f"{self.name}.write: {name} {_describe(t)}: expected a float tensor {list(want)} "
                                 "[n_layers, n_kv_heads, n, head_dim]")
            if t.device != self.device:
                raise ValueError(f"{self.name}.write: {name} on {t.device}: expected {self.device}")
        _check_vector(self.name, "positions", positions, n, (torch.int64,))
        if isinstance(frame_id, torch.Tensor):
            _check_vector(self.name, "frame_id", frame_id, n, (torch.int64,))
        elif not isinstance(frame_id, int) or isinstance(frame_id, bool) or not -2**63 <= frame_id < 2**63:
            raise ValueError(f"{self.name}.write: frame_id {frame_id!r}: expected an int64 value or tensor [n]")
        if importance is not None:
            _check_vector(self.name, "importance", importance, n, (torch.float32, torch.float64, torch.float16,
                                                                    torch.bfloat16))
        if count is not None:
            _check_vector(self.name, "count", count, n, (torch.int32, torch.int64))
            if n and (int(count.min()) < 1 or int(count.max()) > 2**31 - 1):
                raise ValueError(f"{self.name}.write: count {count.tolist()}: expected every count in 1..2**31-1 "
                                 "(stored as int32)")
        if n == 0:
            return
        for name, t in (("k", k), ("v", v)):
            lo, hi = torch.aminmax(t)  # one pass; NaN propagates
            biggest = max(-float(lo), float(hi))
            if not biggest <= self._limit:  # NaN compares False
                raise ValueError(f"{self.name}.write: {name} has |value| up to {biggest}: expected finite values "
                                 f"within +-{self._limit} for {s.dtype} storage")

    def _write_int8(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, whole: bool) -> None:
        sd = self.spec.torch_scale_dtype
        if whole and self.kivi is not None and self.kivi.quantize_kv(
                k, v, self.spec.key_group, self.k, self.k_scale, self.k_zero, self.v, self.v_scale, self.v_zero):
            return
        # values: per token over head_dim
        qv = quant.quantize_values(v, sd)  # data [L, H, n, D], scale/zero [L, H, n, 1]
        if whole:
            self._write_int8_whole(k, qv)
            return
        # keys: per channel over the groups of slots this write touches; the whole group is re-quantized
        G = self.spec.key_group
        groups = torch.unique(torch.div(slots, G, rounding_mode="floor"))  # [m], sorted
        m = groups.numel()
        members = groups[:, None] * G + torch.arange(G, device=self.device)  # [m, G] slot ids
        exists = members < self.capacity  # the last group may be partial
        members = members.clamp_max(self.capacity - 1)
        L, H, _, D = self.k.shape
        flat = members.reshape(-1)  # [m*G]
        row = torch.searchsorted(groups, torch.div(slots, G, rounding_mode="floor"))  # [n] group index
        col = slots % G  # [n] member index
        old_live = exists & self.valid[members]  # [m, G]
        old_live[row, col] = False  # overwritten members are not old
        has_old = old_live.any(dim=1)  # [m]
        new_live = torch.zeros_like(old_live)
        new_live[row, col] = True
        live = (old_live | new_live)[None, None, :, :, None]  # [1, 1, m, G, 1]
        any_old = bool(has_old.any())
        if any_old:
            old_scale, old_zero = self.k_scale[:, :, groups], self.k_zero[:, :, groups]  # [L, H, m, D]
            codes = self.k[:, :, flat].reshape(L, H, m, G, D)  # [L, H, m, G, D]
            work = quant.dequantize(codes, old_scale[:, :, :, None], old_zero[:, :, :, None])
        else:  # every touched group is rewritten whole (a frame over its own slots): nothing old to keep
            work = torch.zeros(L, H, m, G, D, device=self.device)
        work[:, :, row, col] = k.float()  # overlay new tokens; [L, H, n, D] into [L, H, m, G, D]
        scale, zero = quant.quant_params(work, dim=3, scale_dtype=sd, live=live)
        scale, zero = scale.squeeze(3), zero.squeeze(3)  # [L, H, m, D]
        if any_old:
            # keep the old parameters of a channel when its group has old members and the new tokens fit its
            # range: old members then re-quantize to exactly the same codes (no drift from repeated writes)
            is_new = new_live[None, None, :, :, None]  # [1, 1, m, G, 1]
            lo = torch.where(is_new, work, float("inf")).amin(dim=3)  # [L, H, m, D]
            hi = torch.where(is_new, work, float("-inf")).amax(dim=3)
            top = old_zero.float() + quant.Q_LEVELS * old_scale.float()
            keep = has_old[None, None, :, None] & (lo >= old_zero.float()) & (hi <= top)
            scale = torch.where(keep, old_scale, scale)
            zero = torch.where(keep, old_zero, zero)
        new_codes = quant.quantize_with(work, scale[:, :, :, None], zero[:, :, :, None])  # [L, H, m, G, D]
        # commit (nothing below can fail)
        keep_cols = exists.reshape(-1)  # [m*G]
        self.k.index_copy_(2, flat[keep_cols], new_codes.reshape(L, H, m * G, D)[:, :, keep_cols])
        self.k_scale.index_copy_(2, groups, scale)
        self.k_zero.index_copy_(2, groups, zero)
        self.v.index_copy_(2, slots, qv.data)
        self.v_scale.index_copy_(2, slots, qv.scale)
        self.v_zero.index_copy_(2, slots, qv.zero)

    def _write_int8_whole(self, k: torch.Tensor, qv: quant.Quantized) -> None:
        """Every slot rewritten, in slot order (a frame that fills its partition, as FIFO over one frame does each
        frame): no key group keeps an old member, so each is quantized from its new tokens alone. The codes and
        scales equal the general path's (same ranges, same rounding) without its gather and scatter."""
        sd, G, C = self.spec.torch_scale_dtype, self.spec.key_group, self.capacity
        full = C // G * G  # slots in whole groups; the last group may hold fewer (C % G)
        for start, end, group in ((0, full, G), (full, C, C - full)):
            if end > start:
                qk = quant.quantize_keys(k[:, :, start:end], group, sd)  # data [L, H, end-start, D]
                first = start // G
                self.k[:, :, start:end].copy_(qk.data)
                self.k_scale[:, :, first : first + qk.scale.shape[2]].copy_(qk.scale)  # [L, H, groups, D]
                self.k_zero[:, :, first : first + qk.zero.shape[2]].copy_(qk.zero)
        self.v.copy_(qv.data)
        self.v_scale.copy_(qv.scale)
        self.v_zero.copy_(qv.zero)

    # ------------------------------------------------------------------ read

    def read(
        self,
        layer: int,
        out_k: torch.Tensor | None = None,
        out_v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V of one layer as [n_kv_heads, capacity, head_dim] and the valid mask bool[capacity].

        With out_k/out_v (any float dtype, that shape) the values are dequantized / converted into them;
        without, float storage returns views of the storage (int8 storage requires the buffers)."""
        if not 0 <= layer < self.spec.n_layers:
            raise ValueError(f"{self.name}.read: layer {layer}: expected 0 <= layer < {self.spec.n_layers}")
        if (out_k is None) != (out_v is None):
            raise ValueError(f"{self.name}.read: pass both out_k and out_v or neither")
        if out_k is None:
            if self.spec.quantized:
                raise ValueError(f"{self.name}.read: int8 storage needs out_k/out_v buffers "
                                 f"[{self.spec.n_kv_heads}, {self.capacity}, {self.spec.head_dim}]")
            return self.k[layer], self.v[layer], self.valid
        want = (self.spec.n_kv_heads, self.capacity, self.spec.head_dim)
        for name, t in (("out_k", out_k), ("out_v", out_v)):
            if tuple(t.shape) != want or not t.is_floating_point():
                raise ValueError(f"{self.name}.read: {name} {_describe(t)}: expected a float tensor {list(want)}")
        if not self.spec.quantized:
            out_k.copy_(self.k[layer])
            out_v.copy_(self.v[layer])
            return out_k, out_v, self.valid
        self._dequant_layers(layer, out_k, out_v, self._deq[0])
        return out_k, out_v, self.valid

    def read_all(self, out_k: torch.Tensor, out_v: torch.Tensor) -> torch.Tensor:
        """K, V of every layer dequantized / converted into out_k, out_v [n_layers, n_kv_heads, capacity, head_dim]
        (any float dtype; views into a larger buffer work): what read() returns for each layer, in a few passes over
        all layers instead of one per layer. Returns the valid mask bool[capacity]."""
        want = (self.spec.n_layers, self.spec.n_kv_heads, self.capacity, self.spec.head_dim)
        for name, t in (("out_k", out_k), ("out_v", out_v)):
            if tuple(t.shape) != want or not t.is_floating_point():
                raise ValueError(f"{self.name}.read_all: {name} {_describe(t)}: expected a float tensor {list(want)}")
        if not self.spec.quantized:
            out_k.copy_(self.k)
            out_v.copy_(self.v)
        elif self.kivi is not None and self.kivi.dequantize_kv(self.k, self.k_scale, self.k_zero, self.v, self.v_scale,
                                                               self.v_zero, self.spec.key_group, out_k, out_v):
            pass
        elif out_k.dtype == torch.float32 and out_v.dtype == torch.float32:
            self._dequant_layers(slice(None), out_k, out_v, None)  # straight into the outputs
        else:
            n_layers, step = want[0], self._deq.shape[0]  # layers per pass through the fp32 staging
            for start in range(0, n_layers, step):
                end = min(start + step, n_layers)
                self._dequant_layers(slice(start, end), out_k[start:end], out_v[start:end], self._deq[: end - start])
        return self.valid

    def round_trip(self, k: torch.Tensor, v: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """out_k, out_v <- what read() of a layer returns after a write of every slot in order with k, v [n_kv_heads,
        capacity, head_dim] as that layer's K/V (stored in this partition's dtype: quantized and dequantized, or
        converted), without touching the storage: for a block that attends to a frame before it is committed."""
        want = (self.spec.n_kv_heads, self.capacity, self.spec.head_dim)
        for name, t in (("k", k), ("v", v), ("out_k", out_k), ("out_v", out_v)):
            if tuple(t.shape) != want or not t.is_floating_point():
                raise ValueError(f"{self.name}.round_trip: {name} {_describe(t)}: expected a float tensor {list(want)}")
        if not self.spec.quantized:
            out_k.copy_(k.to(self.k.dtype))
            out_v.copy_(v.to(self.v.dtype))
            return
        sd, G, C = self.spec.torch_scale_dtype, self.spec.key_group, self.capacity
        full = C // G * G  # as _write_int8_whole: whole key groups, then the last, partial one
        for start, end, group in ((0, full, G), (full, C, C - full)):
            if end > start:
                out_k[:, start:end].copy_(quant.dequantize_keys(quant.quantize_keys(k[:, start:end], group, sd), group))
        out_v.copy_(quant.dequantize_values(quant.quantize_values(v, sd)))

    def read_keys(self, layer: int, out_k: torch.Tensor) -> torch.Tensor:
        """K of one layer dequantized / converted into out_k [n_kv_heads, capacity, head_dim]."""
        want = (self.spec.n_kv_heads, self.capacity, self.spec.head_dim)
        if not 0 <= layer < self.spec.n_layers or tuple(out_k.shape) != want or not out_k.is_floating_point():
            raise ValueError(f"{self.name}.read_keys: layer {layer}, out_k {_describe(out_k)}: expected "
                             f"0 <= layer < {self.spec.n_layers} and a float tensor {list(want)}")
        if self.spec.quantized:
            self._dequant_keys(layer, out_k, self._deq[0])
        else:
            out_k.copy_(self.k[layer])
        return out_k

    def _dequant_layers(self, layers: int | slice, out_k: torch.Tensor, out_v: torch.Tensor,
                        staging: torch.Tensor | None) -> None:
        """K and V of `layers` (one index: [H, C, D]; a slice: [l, H, C, D]) dequantized into out_k, out_v, through the
        fp32 `staging` (their shape) where they are not fp32."""
        self._dequant_keys(layers, out_k, staging)
        if out_v.dtype == torch.float32:
            quant.dequantize(self.v[layers], self.v_scale[layers], self.v_zero[layers], out=out_v)
        else:
            out_v.copy_(quant.dequantize(self.v[layers], self.v_scale[layers], self.v_zero[layers], out=staging))

    def _dequant_keys(self, layers: int | slice, out_k: torch.Tensor, staging: torch.Tensor | None) -> None:
        dk = out_k if out_k.dtype == torch.float32 else staging  # [.., H, C, D]
        G, C = self.spec.key_group, self.capacity
        full = C // G
        codes, scale, zero = self.k[layers], self.k_scale[layers], self.k_zero[layers]  # [.., H, C | groups, D]
        if full:
            by_group = (full, G)  # [.., H, full * G, D] -> [.., H, groups, G, D]
            quant.dequantize(codes[..., : full * G, :].unflatten(-2, by_group), scale[..., :full, None, :],
                             zero[..., :full, None, :], out=dk[..., : full * G, :].unflatten(-2, by_group))
        if full * G < C:
            quant.dequantize(codes[..., full * G :, :], scale[..., full : full + 1, :], zero[..., full : full + 1, :],
                             out=dk[..., full * G :, :])
        if dk is not out_k:
            out_k.copy_(dk)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers of the given slots, fp32: k, v [n_layers, n_kv_heads, n, head_dim] (new tensors; for
        moves between partitions and merges, not for the per-tick path)."""
        self._check_slots(slots, "gather")
        slots = slots.to(self.device)
        if not self.spec.quantized:
            return self.k[:, :, slots].float(), self.v[:, :, slots].float()
        g = torch.div(slots, self.spec.key_group, rounding_mode="floor")
        k = quant.dequantize(self.k[:, :, slots], self.k_scale[:, :, g], self.k_zero[:, :, g])
        v = quant.dequantize(self.v[:, :, slots], self.v_scale[:, :, slots], self.v_zero[:, :, slots])
        return k, v

    def key_step(self, slots: torch.Tensor) -> torch.Tensor:
        """Quantization step of the keys at `slots` [n_layers, n_kv_heads, n, head_dim] (int8 only)."""
        if not self.spec.quantized:
            raise ValueError(f"{self.name}.key_step: storage is {self.spec.dtype}: expected int8")
        g = torch.div(slots.to(self.device), self.spec.key_group, rounding_mode="floor")
        return self.k_scale[:, :, g].float()

    def value_step(self, slots: torch.Tensor) -> torch.Tensor:
        """Quantization step of the values at `slots` [n_layers, n_kv_heads, n, 1] (int8 only)."""
        if not self.spec.quantized:
            raise ValueError(f"{self.name}.value_step: storage is {self.spec.dtype}: expected int8")
        return self.v_scale[:, :, slots.to(self.device)].float()


def resolve_device(device: str | torch.device) -> torch.device:
    """The device with its index: tensors report 'cuda:0', and torch.device('cuda') != torch.device('cuda:0')."""
    d = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)}"
    return repr(t)


def _check_vector(part: str, name: str, t: Any, n: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != (n,):
        allowed = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{part}.write: {name} {_describe(t)}: expected a {allowed} tensor [{n}]")


__all__ = ["PartitionSpec", "KVPartition", "resolve_device", "STORAGE_DTYPES", "SCALE_DTYPES"]
