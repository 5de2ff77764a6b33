"""backends/native_tick: the tick with fresh states, whole in one C call, gives the bits of the policy's tick on
NativeRows (every output: bins, values, logits, the ring's K/V, the state embedding, the prefix buffer), with ties
and NaN among the bin logits too; it stops at the budget as the layers do, lets any other error out, and applies
only where every piece of it runs on the CPU kernels."""

import copy

import numpy as np
import pytest
import torch

from helpers.native_layers import WEIGHTS, Counted, needs_native_layers
from vla_node.backends import cpu_kernels
from vla_node.backends.loading import convert_weights, load_model
from vla_node.backends.native_tick import NativeHead, NativeTick
from vla_node.backends.tick_engine import intra_op_threads
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.tokenizer import BIN_BASE
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.stages import StageAborted

pytestmark = [needs_native_layers, pytest.mark.usefixtures("attention_on_the_kernel")]

CONFIG = preset("tiny").replace(image_size=64)  # 16 tokens a frame


def _policies(plain=None, weights: str = "packed") -> tuple[MultiRatePolicy, MultiRatePolicy]:
    """Two policies of the same weights (of `plain`, default seed 3's; packed bf16 or int8): the first's fresh-state
    ticks on NativeTick and its other ticks' head on NativeHead (both counted), the second's on NativeRows and the
    Python head."""
    plain = load_model(CONFIG, "plain", seed=3) if plain is None else plain
    whole, rows = (MultiRatePolicy(convert_weights(copy.deepcopy(plain), weights), CacheConfig(), torch.bfloat16)
                   for _ in range(2))
    assert whole._native_tick is not None, f"NativeTick did not build for the {weights} policy"
    whole._native_tick = Counted(whole._native_tick, "run")
    whole._native_head = Counted(whole._native_head, "run")
    rows._native_tick = rows._native_head = None
    return whole, rows


def _frame(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)


def _drive(policy: MultiRatePolicy) -> list:
    """Frames (their tick in the pass) with ticks after them, an instruction change (the next tick recomputes the
    stale states in its block: not NativeTick's), a tick not committed: every chunk, then the ring, the stored
    state embeddings and the prefix buffer."""
    out = []
    policy.update_text("keep the lane")
    for i in range(3):
        state = np.full(CONFIG.state_dim, 0.1 * i, np.float32)
        out.append(policy.update_vision(policy.prepare_frames([_frame(i)]), state=state).chunk)
        out.extend(policy.action_tick(state + 0.01 * j) for j in range(CONFIG.state_slots + 1))  # round the ring
        if i == 1:
            policy.update_text("turn left at the light")
            out.extend(policy.action_tick(state) for _ in range(2))
    out.append(policy.action_tick(np.ones(CONFIG.state_dim, np.float32), commit=False))
    for layer in range(CONFIG.num_layers):
        out.append(policy.action.read(layer))
    out.append((policy._state_embeds, policy._prefix.k, policy._prefix.v, torch.tensor(policy.state_count)))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal with NaN equal to NaN (where both have one)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(a, tuple):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"item {i} differs"
        else:
            assert _same_bits(a.logits, b.logits), f"chunk {i}: logits differ by {(a.logits - b.logits).abs().max()}"
            assert np.array_equal(a.bins, b.bins), f"chunk {i}: bins differ"
            assert a.actions.dtype == b.actions.dtype and np.array_equal(a.actions, b.actions), f"chunk {i}: values"


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_whole_tick_in_one_call_gives_the_bits_of_the_tick_on_native_rows(threads, weights):
    with intra_op_threads(threads):
        whole, rows = _policies(weights=weights)
        got, want = _drive(whole), _drive(rows)
    _assert_same(got, want)
    # NativeTick: every tick after a frame, the uncommitted one and the one after the second text's fused tick;
    # NativeHead alone: the frames' ticks and the fused one
    assert whole._native_tick.calls == 3 * (CONFIG.state_slots + 1) + 1 + 1
    assert whole._native_head.calls == 3 + 1


def test_tied_and_nan_bin_logits_pick_the_bin_torch_argmax_picks():
    plain = load_model(CONFIG, "plain", seed=3)
    with torch.no_grad():
        plain.decoder.model.norm.weight.zero_()  # every logit 0: all bins tie, the first (0) is the argmax
    whole, rows = _policies(plain)
    got, want = _drive(whole), _drive(rows)
    _assert_same(got, want)
    assert (got[1].bins == 0).all() and whole._native_tick.calls > 0
    with torch.no_grad():
        plain.decoder.lm_head.weight[[BIN_BASE + 11, BIN_BASE + 13]] = float("nan")  # NaN the maximum: the first
    whole, rows = _policies(plain)
    got, want = _drive(whole), _drive(rows)
    _assert_same(got, want)
    assert (got[1].bins == 11).all() and whole._native_tick.calls > 0


def test_a_budget_stop_before_a_layer_commits_nothing_and_other_errors_pass_through():
    whole, rows = _policies()
    state = np.zeros(CONFIG.state_dim, np.float32)
    asked = []
    for policy in (whole, rows):
        policy.update_text("go")
        policy.update_vision(policy.prepare_frames([_frame(0)]), state=state)
        count, ring = policy.state_count, policy.action.read(0)
        fractions = []
        with pytest.raises(StageAborted, match="stopped before decoder layer 1"):
            policy.action_tick(state, check=lambda f: fractions.append(f) or f < 0.5)
        asked.append(fractions)
        assert policy.state_count == count and all(torch.equal(a, b) for a, b in zip(ring, policy.action.read(0)))

        def broken(fraction: float) -> bool:
            raise KeyError("the budget's clock is gone")

        with pytest.raises(KeyError, match="the budget's clock is gone"):
            policy.action_tick(state, check=broken)
        assert policy.state_count == count
    assert asked[0] == asked[1] == [0.0, 0.5]
    assert whole._native_tick.calls == 2
    _assert_same([whole.action_tick(state + 1, check=lambda f: True)], [rows.action_tick(state + 1)])


def test_a_tick_over_another_block_or_of_another_state_and_a_head_of_other_rows_are_refused():
    whole, _ = _policies()
    tick, head = whole._native_tick.native, whole._native_head.native
    rows = torch.zeros(CONFIG.action_tokens, CONFIG.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"query rows \(8, 64\) torch.float32: expected contiguous bf16 \[8, 64\]"):
        head.run(rows.float())
    with pytest.raises(ValueError, match=r"query rows \(64, 8\) torch.bfloat16: expected"):
        head.run(rows.reshape(8, 64).t())
    head.run(rows)
    state = torch.zeros(CONFIG.state_dim, dtype=torch.bfloat16)
    whole._prefix.set_block(None, None, 3)
    n = 1 + CONFIG.action_tokens
    with pytest.raises(ValueError, match=rf"over a block of 3 rows: expected a bf16 state \[4\] and the {n} rows"):
        tick.run(state, 0)
    whole._prefix.set_block(None, None, n)
    with pytest.raises(ValueError, match=r"a tick of state \(4,\) torch.float32 .* expected a bf16 state \[4\]"):
        tick.run(state.float(), 0)


def test_it_applies_only_to_the_parallel_bins_head_with_every_piece_on_the_kernels():
    fp32 = MultiRatePolicy(load_model(CONFIG, "plain", seed=3), CacheConfig(), torch.float32)
    assert fp32._native_tick is None
    for other in (CONFIG.replace(action_decode="autoregressive"), CONFIG.replace(action_head="flow")):
        policy = MultiRatePolicy(load_model(other, "packed", seed=3), CacheConfig(), torch.bfloat16)
        assert policy._native_tick is None
    if cpu_kernels.int8_linear_kernel():  # the int8 linear for int8 weights
        int8 = MultiRatePolicy(load_model(CONFIG, "int8", seed=3), CacheConfig(), torch.bfloat16)
        assert int8._native_tick is not None
    packed = MultiRatePolicy(load_model(CONFIG, "packed", seed=3), CacheConfig(), torch.bfloat16)
    n = 1 + CONFIG.action_tokens
    head = (packed.model, packed.config, packed._logits, packed.bins)
    out = (packed.model, packed.config, packed._stage_k[:, :, :n], packed._stage_v[:, :, :n])
    assert NativeHead.build(*head) is not None and NativeTick.build(packed._native_rows, packed._native_head, *out)
    assert NativeTick.build(None, packed._native_head, *out) is None and NativeTick.build(packed._native_rows, None,
                                                                                           *out) is None
    with pytest.raises(ValueError, match=rf"logits \({n - 1}, 300\) torch.float32: expected .* logits \[{n - 1}, "):
        NativeHead.build(*head[:2], torch.zeros(n - 1, 300), packed.bins)
    with pytest.raises(ValueError, match=r"tick K/V out \(2, 2, 9, 16\) torch.float32: expected \[2, 2, 9, 16\] bf16"):
        NativeTick.build(packed._native_rows, packed._native_head, *out[:2], out[2].float(), out[3].float())
    packed.model.decoder.model.norm.__class__ = type(packed.model.decoder.model.norm).__mro__[1]  # torch's RMSNorm
    assert NativeHead.build(*head) is None
