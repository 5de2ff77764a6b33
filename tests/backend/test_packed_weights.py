"""Packed bf16 weights (oneDNN) with fused MLP activations: the same products as F.linear, the same model outputs
within bf16 rounding, the cache still exact against the reference on the same packed model."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import assert_within, bf16_ulp
from vla_node.backends import cpu_features
from vla_node.backends.packed_weights import PackedLinear, packed_weights_available, use_packed_weights
from vla_node.config import ModelSection
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy
from vla_node.runtime.reference import ReferencePolicy
from vla_node.validate import ConfigError

needs_packed = pytest.mark.skipif(not packed_weights_available(),
                                  reason="packed bf16 weights need oneDNN running bf16 in hardware (AVX512-BF16 or "
                                         f"AMX, as ONEDNN_MAX_CPU_ISA allows); here: {cpu_features.describe()}")


@pytest.fixture
def onednn(monkeypatch):
    """Weights packed from here on for oneDNN's primitive, as where cpu_kernels' linear does not run (AMX, more than
    one thread, no AVX512-BF16): the row buckets and their warm-up are oneDNN's."""
    from vla_node.backends import packed_weights

    monkeypatch.setattr(packed_weights, "kernel_matmuls", lambda: False)


@pytest.fixture(params=["oneDNN", "kernel"])
def engine(request, monkeypatch):
    """Each packed-weight test on oneDNN's primitive and, where it runs, on cpu_kernels' linear."""
    from vla_node.backends import cpu_kernels, packed_weights

    if request.param == "kernel" and not cpu_kernels.linear_kernel():
        pytest.skip(f"cpu_kernels' linear does not run here ({cpu_kernels.status()}; {cpu_features.describe()})")
    monkeypatch.setattr(packed_weights, "kernel_matmuls", lambda: request.param == "kernel")
    return request.param


def _linear(bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(48, 40, bias=bias).to(torch.bfloat16).requires_grad_(False)


def _bf16_ulps(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| in units of bf16 spacing at |expected| (one rounding to nearest: at most 0.5)."""
    spacing = expected.float().abs().clamp_min(1e-3) * 2.0**-7
    return float(((got.float() - expected.float()).abs() / spacing).max())


@needs_packed
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(48,), (1, 48), (17, 48), (2, 3, 48)])
def test_packed_linear_equals_f_linear_to_one_bf16_rounding(bias, shape, engine):
    """oneDNN's inner product on the prepacked weight against F.linear's matmul primitive: the same sums in fp32,
    each rounded once to bf16. Two kernels (weight layouts, blockings) may add in another order, so a sum on the
    edge between two bf16 values may take the neighbouring one: one bf16 step of the largest magnitude."""
    linear = _linear(bias)
    x = torch.randn(shape).to(torch.bfloat16)
    got = PackedLinear(linear)(x)
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.bfloat16
    expected = F.linear(x, linear.weight, linear.bias)
    assert_within(got.float(), expected.float(), bf16_ulp(expected), "packed against F.linear")


@needs_packed
@pytest.mark.parametrize("activation, reference", [
    ("gelu_tanh", lambda y: F.gelu(y, approximate="tanh")),
    ("silu", F.silu),
])
def test_fused_activation_is_applied_before_the_bf16_rounding(activation, reference, engine):
    linear = _linear(True)
    x = torch.randn(64, 48).to(torch.bfloat16)
    expected = reference(F.linear(x.float(), linear.weight.float(), linear.bias.float()))  # fp32 all the way
    got = PackedLinear(linear, activation)(x)
    unfused = reference(F.linear(x, linear.weight, linear.bias))  # rounds to bf16 twice
    assert _bf16_ulps(got, expected) <= 0.51  # rounded to bf16 once, to nearest: half a step
    assert _bf16_ulps(unfused, expected) > 0.51  # (rounding twice is measurably worse on these inputs)


@needs_packed
def test_times_fuses_the_product(engine):
    linear, other = _linear(False), torch.randn(17, 40).to(torch.bfloat16)
    x = torch.randn(17, 48).to(torch.bfloat16)
    expected = F.linear(x.float(), linear.weight.float()) * other.float()
    assert _bf16_ulps(PackedLinear(linear).times(x, other), expected) <= 0.51  # one rounding, as above
    assert _bf16_ulps(F.linear(x, linear.weight) * other, expected) > 0.51  # a matmul, then a multiply: two


@needs_packed
def test_every_linear_is_packed_and_the_model_keeps_its_outputs_state_dict_and_copies(engine):
    config = preset("tiny")
    plain = build_vla(config, seed=4).to(torch.bfloat16)
    packed = use_packed_weights(copy.deepcopy(plain))
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert packed.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(packed.state_dict()[key], value, rtol=0, atol=0)
    rng = np.random.default_rng(0)
    frame, state = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), np.zeros(config.state_dim, np.float32)
    ours = ReferencePolicy(packed, torch.bfloat16).step([frame], "follow the lane", state).logits.float()
    theirs = ReferencePolicy(plain, torch.bfloat16).step([frame], "follow the lane", state).logits.float()
    rel = torch.linalg.vector_norm(ours - theirs) / torch.linalg.vector_norm(theirs)
    assert rel.item() < 2e-2  # bf16 compute: fused activations round once instead of twice
    clone = copy.deepcopy(packed)  # re-packs from the kept weights
    again = ReferencePolicy(clone, torch.bfloat16).step([frame], "follow the lane", state).logits.float()
    torch.testing.assert_close(again, ours, rtol=0, atol=0)


@needs_packed
def test_the_cache_stays_exact_against_the_reference_on_the_packed_model(engine):
    """Incremental decoding on the packed model equals full recompute on the same packed model: the weights
    change the model, not the cache's exactness (all-fp32 partitions, bf16 compute on both sides)."""
    config = preset("tiny").replace(vision_frames=2)
    model = use_packed_weights(build_vla(config, seed=3).to(torch.bfloat16))
    reference = ReferencePolicy(model, torch.bfloat16)
    policy = MultiRatePolicy(model, CacheConfig.exact(), torch.bfloat16)
    rng = np.random.default_rng(1)
    policy.update_text("follow the lane")
    for _ in range(3):
        frame = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
        state = rng.normal(size=config.state_dim).astype(np.float32)
        policy.update_vision(policy.prepare_frames([frame]))
        ours, theirs = policy.action_tick(state).logits.float(), reference.step([frame], "follow the lane", state)
        rel = torch.linalg.vector_norm(ours - theirs.logits.float()) / torch.linalg.vector_norm(theirs.logits.float())
        assert rel.item() < 2e-2  # bf16 compute, different block shapes: rounding only


@needs_packed
def test_bad_dtypes_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="bf16 CPU nn.Linear, got torch.float32"):
        PackedLinear(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="activation 'relu'"):
        PackedLinear(_linear(True), "relu")
    linear = PackedLinear(_linear(True))
    with pytest.raises(RuntimeError, match=r"takes a bf16 CPU input \[..., 48\], got torch.float32 \(3, 48\)"):
        linear(torch.randn(3, 48))
    model = use_packed_weights(build_vla(preset("tiny")).to(torch.bfloat16))
    with pytest.raises(ValueError, match="packed weights stay bf16 on the CPU"):
        model.to(torch.float32)
    with pytest.raises(ValueError, match="bf16 CPU nn.Linear"):
        use_packed_weights(build_vla(preset("tiny")))


def test_config_takes_packed_only_with_bf16_compute_on_a_cpu_that_has_it(monkeypatch):
    import vla_node.backends.fp16_weights as precision
    import vla_node.backends.packed_weights as packed

    monkeypatch.setattr(packed, "packed_kernels_run", lambda: True)  # as where oneDNN runs bf16 (not under AVX2)

    with pytest.raises(ConfigError, match=r"model.weights = 'packed': expected 'fp32' with dtype 'fp32' on 'cpu'"):
        ModelSection(weights="packed", dtype="fp32")
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    with pytest.raises(ConfigError, match=r"model.weights = 'packed': expected 'fp32' here: packed bf16 weights"):
        ModelSection(weights="packed", dtype="bf16")
    assert ModelSection(weights="auto", dtype="bf16").resolved_weights == "bf16"
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert ModelSection(weights="packed", dtype="bf16").resolved_weights == "packed"
    assert ModelSection(weights="auto", dtype="auto").resolved_weights == "packed"
    assert ModelSection(weights="auto", dtype="bf16", device="cuda").resolved_weights == "bf16"
    monkeypatch.setattr(packed, "packed_kernels_run", lambda: False)  # the flags say bf16, oneDNN refuses it
    assert ModelSection(weights="auto", dtype="bf16").resolved_weights == "bf16"
    with pytest.raises(ConfigError, match=r"model.weights = 'packed': expected 'fp32' here: packed bf16 weights"):
        ModelSection(weights="packed", dtype="bf16")


def test_packed_weights_are_offered_exactly_where_onednn_runs_them():
    """The probe packs and runs a tiny bf16 matmul; availability also needs bf16 in hardware as oneDNN runs it."""
    from vla_node.backends.fp16_weights import cpu_has_bf16
    from vla_node.backends.packed_weights import packed_kernels_run

    packed_kernels_run()
    assert packed_kernels_run.cache_info().currsize == 1  # probed once, remembered
    assert packed_weights_available() == (cpu_has_bf16() and packed_kernels_run())
    if not packed_weights_available():
        with pytest.raises(RuntimeError, match="need oneDNN running bf16 in hardware .*; here: oneDNN"):
            use_packed_weights(build_vla(preset("tiny")).to(torch.bfloat16))


@needs_packed
@pytest.mark.parametrize("rows", [1, 17, 196])
def test_the_fused_qkv_projection_equals_the_three_projections_to_bf16_rounding(rows, engine):
    """One q|k|v matmul against three: the same sums, but oneDNN blocks the wider output otherwise and may add in
    another order (it does on an AMX Xeon at 196 rows), so a projection may land on the neighbouring bf16 value: v
    within one bf16 step of the largest magnitude; q and k carry that step through RoPE's three bf16 roundings
    (x * cos, roll(x) * sin, their sum), each of which may then take a neighbour too: four steps."""
    model = use_packed_weights(build_vla(preset("small"), seed=2).to(torch.bfloat16))
    layer = model.decoder.model.layers[1]
    x = torch.randn(rows, model.config.hidden_size).to(torch.bfloat16)
    cos, sin = model.decoder.rope(torch.arange(rows) + 40, torch.bfloat16)
    with torch.inference_mode():
        fused = layer.project_qkv(x, cos, sin)
        qkv = layer.self_attn.__dict__.pop("qkv")  # the three projections on their own
        assert "qkv" not in dict(layer.self_attn.named_modules()) and not any("qkv" in k for k in model.state_dict())
        separate = layer.project_qkv(x, cos, sin)
        object.__setattr__(layer.self_attn, "qkv", qkv)  # back as a plain attribute, as use_packed_weights sets it
    for name, a, b, steps in zip("qkv", fused, separate, (4, 4, 1)):
        assert_within(a.float(), b.float(), steps * bf16_ulp(b), name)
    clone = copy.deepcopy(model)  # the copy's fused projection packs the copy's weights
    attention = clone.decoder.model.layers[1].self_attn
    assert attention.__dict__["qkv"]._parts[0] is attention.q_proj


@needs_packed
@pytest.mark.parametrize("rows", [1, 17, 196])
def test_the_towers_fused_qkv_projection_with_biases_equals_the_three_projections_to_bf16_rounding(rows, engine):
    """SigLIP's q|k|v (each with a bias) as one matmul: the same sums with the biases added, within one bf16 step of
    the largest magnitude (see above: another blocking may round a sum to the neighbouring value)."""
    model = use_packed_weights(build_vla(preset("small"), seed=2).to(torch.bfloat16))
    attention = model.vision.encoder.layers[1].self_attn
    assert attention.q_proj.bias is not None
    x = torch.randn(rows, model.config.vision_width).to(torch.bfloat16)
    with torch.inference_mode():
        fused = attention.__dict__["qkv"](x).split(model.config.vision_width, dim=-1)  # [rows, 3W] -> 3 x [rows, W]
        separate = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    for name, a, b in zip("qkv", fused, separate):
        assert_within(a.float(), b.float(), bf16_ulp(b), name)


@needs_packed
def test_the_fused_qkv_takes_three_biases_or_none():
    from vla_node.backends.packed_weights import PackedQKV

    with_bias, without = PackedLinear(_linear(True)), PackedLinear(_linear(False))
    with pytest.raises(ValueError, match="three projections with a bias each or none"):
        PackedQKV(with_bias, without, with_bias)


@needs_packed
def test_the_tower_cache_with_the_fused_qkv_equals_the_three_projections_to_bf16_rounding(engine):
    """VisionTokenCache takes a camera's q|k|v from the one matmul: a full refresh, then a partial one (the shared
    drift moving the reused tokens), against the same packed tower with the three projections; the outputs and
    the cached q|k|v within two bf16 steps of their largest magnitude per layer (one rounding's step carried
    through each bf16 layer, as in the decoder's test above)."""
    from vla_node.model.vision import fused_attention
    from vla_node.runtime.vision_cache import VisionTokenCache

    config = preset("tiny").replace(image_size=64)
    rng = np.random.default_rng(1)
    frames = [torch.from_numpy(rng.random((3, 64, 64), np.float32)).to(torch.bfloat16) for _ in range(2)]
    changed = torch.tensor([0, 3, 5, 9, 12])
    results = []
    for fused in (True, False):
        tower = use_packed_weights(build_vla(config, seed=4).to(torch.bfloat16)).vision
        if not fused:
            for layer in tower.encoder.layers:
                del layer.self_attn.__dict__["qkv"]
        cache = VisionTokenCache(tower, 1, torch.bfloat16, shared_drift_samples=2, attention=fused_attention)
        full = cache.refresh(0, frames[0], None).clone()
        cache.commit()
        partial = cache.refresh(0, frames[1], changed).clone()
        cache.commit()
        results.append((full, partial, cache.qkv.clone()))
    for name, a, b in zip(("full refresh", "partial refresh", "q|k|v"), *results):
        assert_within(a.float(), b.float(), 2 * config.vision_layers * bf16_ulp(b), name)


@needs_packed
def test_a_full_frame_pass_with_the_fused_qkv_equals_the_three_projections_to_bf16_rounding(engine):
    """FrameTokenCache's full run takes every row's query from the one q|k|v matmul. Where that rounds a projection
    to the neighbouring bf16 value (see above), the step is carried through the decoder's bf16 layers: the logits,
    K/V and queries within two bf16 steps of their largest magnitude per layer (measured: a step on every element
    of every fused projection moves them by at most 3.3 steps over the tiny preset's two layers)."""
    config = preset("tiny").replace(image_size=64)
    frame = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    state = np.ones(config.state_dim, np.float32)
    results = []
    for fused in (True, False):
        model = use_packed_weights(build_vla(config, seed=4).to(torch.bfloat16))
        if not fused:
            for layer in model.decoder.model.layers:
                del layer.self_attn.__dict__["qkv"]
        policy = MultiRatePolicy(model, CacheConfig(), torch.bfloat16)
        policy.update_text("go")
        chunk = policy.update_vision(policy.prepare_frames([frame]), state=state).chunk
        results.append((chunk.logits, policy._frame_tokens.k.clone(), policy._frame_tokens.q.clone()))
    for name, a, b in zip(("logits", "k", "q"), *results):
        assert_within(a.float(), b.float(), 2 * config.num_layers * bf16_ulp(b), name)


@needs_packed
@pytest.mark.parametrize("shape", [(48,), (5, 48), (16, 48), (2, 9, 48), (33, 48)])
def test_bucketed_rows_give_the_rows_results_and_reuse_their_scratch(monkeypatch, shape, onednn):
    """Rows padded up to a bucket (as on an AMX CPU; forced here on any CPU that packs): each matmul, the fused
    MLPs and the q|k|v projection return exactly their rows' results, in the input's leading shape, against the same
    modules unbucketed (the same kernel family, so one bf16 step at most where oneDNN blocks the padded rows
    otherwise); the padding goes through one scratch buffer, not a new one a call."""
    from vla_node.backends import packed_weights

    model = use_packed_weights(build_vla(preset("tiny"), seed=5).to(torch.bfloat16))
    layer = model.decoder.model.layers[0]
    width = model.config.hidden_size
    x = torch.randn(*shape[:-1], width).to(torch.bfloat16)
    matmuls = {"q_proj": layer.self_attn.q_proj, "qkv": layer.self_attn.__dict__["qkv"], "swiglu": layer.mlp,
               "projector": model.projector}
    inputs = {"projector": torch.randn(*shape[:-1], model.config.vision_width).to(torch.bfloat16)}
    n = x.numel() // width
    with torch.inference_mode():
        for matmul in matmuls.values():
            monkeypatch.setattr(packed_weights._row_buckets(matmul), "step", 1)
        plain = {name: m(inputs.get(name, x)) for name, m in matmuls.items()}
        for name, matmul in matmuls.items():
            rows = packed_weights._row_buckets(matmul)
            monkeypatch.setattr(rows, "step", 8)
            got = matmul(inputs.get(name, x))
            assert got.shape == plain[name].shape and got.dtype == torch.bfloat16, name
            assert_within(got.float(), plain[name].float(), bf16_ulp(plain[name]), name)
            scratch = rows._scratch
            assert scratch.shape[0] == (0 if n % 8 == 0 else -(-n // 8) * 8), name  # padded to the bucket, or not
            matmul(inputs.get(name, x))
            assert rows._scratch is scratch, name  # kept between calls


@needs_packed
def test_warm_row_buckets_compiles_every_bucket_and_exact_count_once(monkeypatch, onednn):
    """Each bucket up to max_rows, then each exact count between buckets (a count on a bucket needs no kernel of its
    own), declared on every matmul and run on one matmul per kernel key (a layer's matmuls share theirs with the same
    matmuls of the other layers); a second warm-up compiles the buckets again (cache hits) but no exact count
    twice."""
    from vla_node.backends import packed_weights

    model = use_packed_weights(build_vla(preset("tiny"), seed=5).to(torch.bfloat16))
    matmuls = [m for m in model.modules() if isinstance(m, (packed_weights.PackedSwiGLU, packed_weights.PackedGeluMLP))]
    alone = [m for m in model.modules() if isinstance(m, PackedLinear)
             and not any(m is child for mlp in matmuls for child in mlp.children())]
    alone.append(model.vision.embeddings.__dict__["packed_patches"])  # the patch embedding's matmul
    layers = [*model.vision.encoder.layers, *model.decoder.model.layers]
    qkv = [layer.self_attn.__dict__["qkv"] for layer in layers]  # SigLIP's and Llama's
    everything = [packed_weights._row_buckets(m) for m in matmuls + alone + qkv]
    for rows in everything:
        monkeypatch.setattr(rows, "step", 16)
    calls = []
    monkeypatch.setattr(packed_weights.PackedQKV, "forward", lambda self, x: calls.append(x.shape[0]))
    keys = {packed_weights._kernel_key(m) for m in matmuls + alone + qkv}
    qkv_keys = {packed_weights._kernel_key(m) for m in qkv}
    assert len(qkv_keys) == 2 and len(keys) < len(matmuls + alone + qkv)  # SigLIP's and Llama's; layers share
    assert packed_weights.warm_row_buckets(model, 40, {20, 5, 32}) == 5 * len(keys)  # 16, 32, 48, then 5 and 20
    assert calls == [16, 32, 48, 5, 20] * len(qkv_keys)
    assert all(rows.exact == {5, 20} for rows in everything)
    assert packed_weights.warm_row_buckets(model, 40, {5, 20}) == 3 * len(keys)


@needs_packed
def test_warm_row_buckets_in_threads_runs_what_one_thread_runs(monkeypatch, onednn):
    """workers > 1: the same row counts on the same kernel keys as one thread (in any order), every count declared.
    (That the stages then find those kernels, compiled for this thread's OpenMP thread count, is the oneDNN log's
    test below.)"""
    from vla_node.backends import packed_weights

    monkeypatch.setattr(packed_weights, "bucket_step", lambda: 16)
    calls: dict[int, list] = {1: [], 3: []}
    for workers, seen in calls.items():
        model = use_packed_weights(build_vla(preset("tiny"), seed=5).to(torch.bfloat16))

        def record(self, x, seen=seen):
            seen.append((str(packed_weights._kernel_key(self)), x.shape[0]))

        monkeypatch.setattr(packed_weights.PackedQKV, "forward", record)
        monkeypatch.setattr(packed_weights.PackedSwiGLU, "forward", record)
        assert packed_weights.warm_row_buckets(model, 40, {20, 5}, workers) > 0
        qkv = [layer.self_attn.__dict__["qkv"] for layer in model.decoder.model.layers]
        assert all(packed_weights._row_buckets(m).exact == {5, 20} for m in qkv)
    assert sorted(calls[3]) == sorted(calls[1]) and calls[1]


def test_only_the_row_counts_declared_exact_run_unpadded_however_often_others_recur():
    """RowBuckets alone (no oneDNN needed): a count between buckets is padded on every call, however often it comes
    (nothing is compiled after warm-up); a declared count and a full bucket pass through as they are."""
    from vla_node.backends import packed_weights

    rows = packed_weights.RowBuckets(4)
    rows.step = 8
    x = torch.ones(5, 4, dtype=torch.bfloat16)
    assert all(rows.pad(x).shape == (8, 4) for _ in range(20))
    assert rows.exact == set()
    rows.exact.add(5)  # as warm_row_buckets declares it
    assert rows.pad(x) is x
    full = torch.ones(16, 4, dtype=torch.bfloat16)
    assert rows.pad(full) is full  # a full bucket: never padded
    assert rows.pad(torch.ones(41, 4, dtype=torch.bfloat16)).shape == (48, 4)
    assert rows.pad(torch.ones(3, 4)).dtype == torch.float32  # not bf16: left for the primitive to name


@needs_packed
def test_compile_kernels_declares_the_ticks_and_the_frames_row_counts_and_a_run_adds_none(monkeypatch, onednn):
    """With rows padded to 16 (as on AMX; forced here on any CPU that packs), the policy's warm-up declares exact the
    counts its stages repeat, per module; a frame with its tick, a partial frame and a tick then leave every exact set
    as it was, and none of a tick's matmuls pads its rows."""
    from vla_node.backends import packed_weights

    monkeypatch.setattr(packed_weights, "bucket_step", lambda: 16)
    config = preset("tiny").replace(image_size=64)  # 16 tokens a frame, 4 states, 4 x 2 action queries
    model = use_packed_weights(build_vla(config, seed=4).to(torch.bfloat16))
    policy = MultiRatePolicy(model, CacheConfig(), torch.bfloat16)
    assert policy.compile_kernels() > 0
    T, S, Q = config.tokens_per_frame, config.state_slots, config.action_tokens
    block = set(range(1 + Q, S + Q + 1))
    layer = model.decoder.model.layers[0]
    expected = {*range(1, S + 1), Q, *block, T, *(T + n for n in block)}
    decoder = [layer.self_attn.__dict__["qkv"]._rows, layer.self_attn.o_proj._rows, layer.mlp.gate_proj._rows]
    decoder.append(layer.mlp.down_proj._rows)  # the fused MLP's second matmul takes the first's rows as they are
    assert all(rows.exact == {n for n in expected if n % 16} for rows in decoder)
    tower = model.vision.encoder.layers[0]
    assert tower.self_attn.__dict__["qkv"]._rows.exact == {config.tokens_per_camera} - {16}
    every = [m._rows for m in model.modules() if isinstance(m, PackedLinear)]
    every += [m.__dict__["qkv"]._rows for m in model.modules() if "qkv" in m.__dict__]
    exact = [set(rows.exact) for rows in every]
    seen = []  # (row count, padded) of every matmul call

    def pad(self, x, pad=packed_weights.RowBuckets.pad):
        rows = pad(self, x)
        seen.append((x.numel() // self.width, rows is not x))
        return rows

    monkeypatch.setattr(packed_weights.RowBuckets, "pad", pad)
    frame = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    state = np.ones(config.state_dim, np.float32)
    policy.update_text("go")
    policy.update_vision(policy.prepare_frames([frame]), state=state)
    policy.update_vision(policy.prepare_frames([frame[::-1]]), [torch.tensor([1, 5])], state=state)
    seen.clear()
    policy.action_tick(state)  # the states are stale after a frame: recomputed in the tick's block
    assert block & {n for n, _ in seen} and not any(padded for _, padded in seen)
    assert exact == [rows.exact for rows in every]


def test_rows_are_padded_to_a_tile_with_AMX_and_to_8_elsewhere(monkeypatch):
    """bucket_step: 16 rows (an AMX tile's) where oneDNN runs AMX, 8 on the other CPUs that pack (AVX512-BF16)."""
    from vla_node.backends import cpu_features, packed_weights

    for amx, step in ((True, 16), (False, 8)):
        monkeypatch.setattr(cpu_features, "onednn_runs_amx", lambda amx=amx: amx)
        assert packed_weights.bucket_step() == step
        assert packed_weights.RowBuckets(4).step == step


@needs_packed
@pytest.mark.parametrize("step, widths", [(16, (72, 88)), (8, (80, 96))])
def test_after_compile_kernels_oneDNN_creates_no_packed_kernel_in_a_frame_or_a_tick(monkeypatch, capfd, step, widths,
                                                                                    onednn):
    """oneDNN's own log of the primitives it creates (torch.backends.mkldnn.verbose): after the policy's warm-up, with
    rows padded to 16 (as on AMX) or 8 (elsewhere), a frame with its tick, partial frames of several sizes and a tick
    find every packed matmul's kernel in oneDNN's cache, although the warm-up ran each row count on one matmul per
    kernel key (one layer of the decoder's, one of the tower's): none is created anew. Without the warm-up they are.
    oneDNN's cache is the process's, so each run has MLP widths no other test uses (the other kernels may be cached
    already)."""
    from vla_node.backends import packed_weights

    monkeypatch.setattr(packed_weights, "bucket_step", lambda: step)
    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(4)]
    state = np.ones(preset("tiny").state_dim, np.float32)

    def created_in_stages(warm: bool, mlp_width: int) -> list[str]:
        config = preset("tiny").replace(image_size=64, vision_mlp=mlp_width, intermediate_size=2 * mlp_width)
        model = use_packed_weights(build_vla(config, seed=6).to(torch.bfloat16))  # 16 tokens a frame
        policy = MultiRatePolicy(model, CacheConfig(), torch.bfloat16)
        if warm:
            assert policy.compile_kernels(workers=2) > 0  # in two threads: the kernels still serve this one
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            policy.update_text("go")
            policy.update_vision(policy.prepare_frames([frames[0]]), state=state)
            for frame, changed in zip(frames[1:], ([1, 5], [0, 2, 3, 7, 9, 11, 12], list(range(13)))):
                policy.update_vision(policy.prepare_frames([frame]), [torch.tensor(changed)], state=state)
            policy.action_tick(state)
        log = capfd.readouterr().out.splitlines()
        assert any(",inner_product," in line for line in log), log[:20]  # the log is there: packed matmuls ran
        return [line for line in log if "create:cache_miss" in line and ",inner_product," in line]

    assert created_in_stages(warm=True, mlp_width=widths[0]) == []
    assert created_in_stages(warm=False, mlp_width=widths[1])  # the check sees a kernel compiled in a stage
