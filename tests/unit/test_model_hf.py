"""The model against outside oracles: transformers' LlamaForCausalLM and SiglipVisionModel."""

import pytest
import torch

from helpers.model_checks import HF_CONFIGS as CONFIGS
from helpers.model_checks import hf_llama
from vla_node.model.checkpoint import save_checkpoint
from vla_node.model.vla import block_causal_mask, build_vla

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is the oracle")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    model = build_vla(CONFIGS[request.param], seed=3)
    return model, save_checkpoint(model, tmp_path_factory.mktemp(request.param))


@torch.inference_mode()
def test_decoder_logits_equal_llama_causal(checkpoint):
    model, path = checkpoint
    hf = hf_llama(path)
    ids = torch.randint(0, 516, (37,), generator=torch.Generator().manual_seed(0))
    ours = model.decoder(model.embed_text(ids), torch.arange(37), None)
    theirs = hf(input_ids=ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4


@torch.inference_mode()
def test_decoder_logits_equal_llama_block_causal_fixed_positions(checkpoint):
    """The node's real sequence: embeddings, fixed-slot positions and the block-causal mask."""
    model, path = checkpoint
    hf = hf_llama(path)
    c = model.config
    g = torch.Generator().manual_seed(1)
    n_text, frame, n_state, n_query = 9, c.tokens_per_frame, 2, c.action_tokens
    embeds = torch.randn(n_text + frame + n_state + n_query, c.hidden_size, generator=g) * 0.5
    positions = torch.cat([
        torch.arange(n_text), torch.tensor(list(c.vision_positions(0))),
        torch.arange(c.state_base, c.state_base + n_state), torch.arange(c.query_base, c.query_base + n_query),
    ])
    mask = block_causal_mask(n_text, [frame], n_state, n_query)
    ours = model.decoder(embeds, positions, mask)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    theirs = hf(inputs_embeds=embeds[None], position_ids=positions[None], attention_mask=additive).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4


@torch.inference_mode()
def test_vision_tower_equals_siglip(checkpoint):
    model, path = checkpoint
    hf, info = transformers.SiglipVisionModel.from_pretrained(
        str(path / "vision"), output_loading_info=True, dtype=torch.float32, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    c = model.config
    pixels = torch.rand(2, 3, c.image_size, c.image_size, generator=torch.Generator().manual_seed(2)) * 2 - 1
    ours = model.vision(pixels)
    theirs = hf.eval()(pixel_values=pixels).last_hidden_state
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4
