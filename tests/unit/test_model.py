import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from helpers.model_checks import weights_digest
from vla_node.model.action_head import ActionBins
from vla_node.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from vla_node.model.config import ModelConfig, preset
from vla_node.model.tokenizer import TokenizerError, decode, encode
from vla_node.model.vla import build_vla
from vla_node.validate import ConfigError


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = build_vla(preset("tiny"), seed=7)
    loaded = load_checkpoint(save_checkpoint(model, tmp_path / "ckpt"))
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


@pytest.mark.parametrize("damage, message", [
    ("missing", "missing tensor 'model.layers.0.mlp.up_proj.weight'"),
    ("extra", "unexpected tensor 'model.layers.9.extra.weight'"),
    ("shape", "tensor 'model.layers.0.mlp.up_proj.weight' has shape (3, 3)"),
    ("dtype", "tensor 'model.layers.0.mlp.up_proj.weight' has dtype torch.float16"),
])
def test_damaged_checkpoint_names_the_tensor(tmp_path, damage, message):
    path = save_checkpoint(build_vla(preset("tiny"), seed=0), tmp_path / "ckpt")
    file = path / "decoder" / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.up_proj.weight"
    if damage == "missing":
        del tensors[name]
    elif damage == "extra":
        tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    elif damage == "shape":
        tensors[name] = torch.zeros(3, 3)
    else:
        tensors[name] = tensors[name].half()
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="missing vla.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "vla.json").write_text('{"format_version": 1}')
    with pytest.raises(CheckpointError, match="vla.json: no 'model' table"):
        load_checkpoint(tmp_path)


def test_same_seed_same_weights_in_two_processes():
    code = (
        "import sys; sys.path.insert(0, 'tests'); from helpers.model_checks import weights_digest; "
        "from vla_node.model.config import preset; from vla_node.model.vla import build_vla; print(weights_digest(build_vla(preset('tiny'), seed=11)))"
    )
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    assert len(digests) == 1
    assert digests.pop().strip() == weights_digest(build_vla(preset("tiny"), seed=11))
    assert weights_digest(build_vla(preset("tiny"), seed=12)) != weights_digest(build_vla(preset("tiny"), seed=11))


@pytest.mark.parametrize("head", ["bins", "flow"])
def test_built_without_torchs_default_draws_the_weights_are_those_drawn_after_them(head, monkeypatch):
    """build_vla skips the default init that init_weights overwrites (empty_vla): the same parameters and buffers,
    bit for bit, as init_weights over a VLA built with it; torch's init functions are back afterwards, also when the
    build fails."""
    from torch import nn

    from vla_node.model import vla

    config = preset("tiny", head)
    built, reference = build_vla(config, seed=7), vla.init_weights(vla.VLA(config), 7).eval()
    ours, theirs = dict(built.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(torch.equal(a, b) for a, b in zip(built.buffers(), reference.buffers(), strict=True))
    draws = {name: getattr(nn.init, name) for name in vla._DRAWS}
    monkeypatch.setattr(vla, "VLA", lambda c: (_ for _ in ()).throw(RuntimeError("no memory")))
    with pytest.raises(RuntimeError, match="no memory"):
        vla.empty_vla(config)
    assert {name: getattr(nn.init, name) for name in vla._DRAWS} == draws
    torch.manual_seed(3)
    drawn = nn.Linear(4, 4).weight  # the default init draws again
    torch.manual_seed(3)
    assert torch.equal(drawn, nn.init.kaiming_uniform_(torch.empty(4, 4), a=5 ** 0.5))


@given(st.text(max_size=40))
def test_tokenizer_round_trip(text):
    ids = encode(text, max_tokens=4 * 40 + 1)
    assert ids[0] == 256 and all(0 <= i < 256 for i in ids[1:])
    assert decode(ids) == text


def test_tokenizer_non_ascii_and_limit():
    assert decode(encode("überhole den LKW → links 🚗", 64)) == "überhole den LKW → links 🚗"
    with pytest.raises(TokenizerError, match="does not fit"):
        encode("x" * 30, max_tokens=24)


@settings(max_examples=200)
@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=2, max_size=2))
def test_action_bins_round_trip_within_half_a_bin(values):
    bins = ActionBins(preset("tiny"))
    back = bins.to_values(bins.to_bins(np.array(values)))
    assert np.all(np.abs(back - np.array(values)) <= bins.width / 2 + 1e-6)


def test_preset_errors_are_clear():
    with pytest.raises(ConfigError, match="did you mean 'small'"):
        preset("smal")
    with pytest.raises(ConfigError, match=r"model.num_kv_heads = 3: expected a divisor of num_heads 8"):
        ModelConfig(num_kv_heads=3)
    with pytest.raises(ConfigError, match="model.action_low"):
        ModelConfig(action_dims=3)
    # values that load but would make every logit NaN (and the action bin 0, published as if valid)
    for key, value in (("rms_eps", -1.0), ("vision_eps", 0.0), ("rope_theta", 0.0), ("rms_eps", float("nan"))):
        with pytest.raises(ConfigError, match=rf"model.{key} = .*: expected a finite number > 0"):
            ModelConfig(**{key: value})
    with pytest.raises(ConfigError, match=r"model.action_low\[0\] = -inf: expected a finite number"):
        ModelConfig(action_low=(float("-inf"), -1.0))


def test_rms_norm_is_hf_llamas():
    """fp32: bit for bit; bf16: one rounding instead of HF's two (at most a bf16 step apart); a weight in another
    dtype than the input: HF's form exactly."""
    from vla_node.model.decoder import RMSNorm

    def hf(norm, x):
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)

    norm = RMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    x = torch.randn(17, 64) * 3
    # exact on every CPU: on the CPU torch's rms_norm runs as the same pow, mean, rsqrt and mul kernels as HF's form
    # on the same shapes (ATen's own code, no BLAS; checked under ATEN_CPU_CAPABILITY avx512, avx2 and default)
    assert torch.equal(norm(x), hf(norm, x))
    mixed = norm(x.bfloat16())  # fp32 weight, bf16 input
    assert mixed.dtype == torch.float32 and torch.equal(mixed, hf(norm, x.bfloat16()))
    norm = norm.to(torch.bfloat16)
    ours, theirs = norm(x.bfloat16()).float(), hf(norm, x.bfloat16()).float()
    assert ((ours - theirs).abs() <= theirs.abs() * 2.0**-7 + 1e-6).all()
