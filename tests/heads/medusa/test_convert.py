"""Published Medusa layouts (FasterDecoding v0.1/1.0 and "version 2", vLLM) built with their exact key names."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import MedusaConfig, MedusaHeads
from tests.conftest import make_model, padded_batch

H, V = 8, 11


def _random_heads(num_heads=3, num_layers=2) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=num_heads, num_layers=num_layers,
                                     base_model_name_or_path="local/target", revision="abc"))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    return heads


def _assert_same(a: MedusaHeads, b: MedusaHeads) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    hidden = torch.randn(2, H)
    assert torch.equal(a(hidden), b(hidden))


def _faster_decoding_weights(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    layers = heads.config.num_layers
    out = {}
    for h, head in enumerate(heads.heads):
        for layer in range(layers):
            out[f"{h}.{layer}.linear.weight"] = head[layer].linear.weight.detach().clone()
            out[f"{h}.{layer}.linear.bias"] = head[layer].linear.bias.detach().clone()
        out[f"{h}.{layers}.weight"] = head[layers].weight.detach().clone()
    return out


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_faster_decoding_layout(tmp_path, suffix):
    heads = _random_heads()
    weights = _faster_decoding_weights(heads)
    if suffix == "safetensors":
        save_file(weights, str(tmp_path / "medusa_lm_head.safetensors"))
    else:
        torch.save(weights, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2,
                                                      "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    loaded = MedusaHeads.from_pretrained(tmp_path)
    assert loaded.config.base_model_name_or_path == "lmsys/vicuna-7b-v1.3"
    _assert_same(heads, loaded)


def test_version_2_layout_shares_the_target_lm_head_and_stays_lossless(tmp_path):
    """Legacy Medusa PR #97 / TGI MedusaHeadV2: `medusa_lm_head.safetensors` with `{i}.0.linear.weight|bias` only."""
    target = make_model("llama")
    torch.manual_seed(1)
    weights = {}
    for i in range(3):
        weights[f"{i}.0.linear.weight"] = torch.randn(32, 32) * 0.05
        weights[f"{i}.0.linear.bias"] = torch.randn(32) * 0.05
    save_file(weights, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "version": "2",
                                                      "base_model_name_or_path": "local/target"}))
    heads = MedusaHeads.from_pretrained(tmp_path)
    assert heads.config.shared_lm_head and heads.config.vocab_size is None and heads.config.num_heads == 3
    assert sorted(heads.state_dict()) == sorted(f"heads.{k}" for k in weights)
    hidden = torch.randn(2, 32)
    lm_head = target.get_output_embeddings()
    block = hidden @ weights["1.0.linear.weight"].T + weights["1.0.linear.bias"]
    expected = lm_head(hidden + torch.nn.functional.silu(block))
    torch.testing.assert_close(heads(hidden, lm_head)[:, 1], expected)

    ids, mask = padded_batch([9, 12], seed=5, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    reference = target.generate(ids, **kwargs)
    for tree in (None, [(0,), (1,), (0, 0), (0, 0, 0)]):
        config = SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=3, tree_paths=tree)
        assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **kwargs), reference)

    heads.save_pretrained(tmp_path / "ours")  # and our own folder keeps the mode
    assert MedusaHeads.from_pretrained(tmp_path / "ours").config.shared_lm_head


def test_version_2_needs_one_layer_and_unknown_weights_are_refused(tmp_path):
    weights = {k: v for k, v in _faster_decoding_weights(_random_heads(num_layers=2)).items() if "linear" in k}
    save_file(weights, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    with pytest.raises(ValueError, match="'version 2' layout: expected medusa_num_layers 1, got 2"):
        MedusaHeads.from_pretrained(tmp_path)
    save_file({"0.0.weight": torch.zeros(H, H)}, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="unrecognised Medusa weights"):
        MedusaHeads.from_pretrained(tmp_path)


def test_vllm_layout(tmp_path):
    heads = _random_heads(num_layers=1)
    weights = {}
    for h, head in enumerate(heads.heads):
        weights[f"medusa_heads.blocks.{h}.layers.0.weight"] = head[0].linear.weight.detach().clone()
        weights[f"medusa_heads.blocks.{h}.layers.0.bias"] = head[0].linear.bias.detach().clone()
        weights[f"medusa_heads.lm_heads.{h}.weight"] = head[1].weight.detach().clone()
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1,
                                                      "medusa_fc_bias": True}))
    _assert_same(heads, MedusaHeads.from_pretrained(tmp_path))


def test_unrecognised_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a Medusa head folder"):
        MedusaHeads.from_pretrained(tmp_path)
