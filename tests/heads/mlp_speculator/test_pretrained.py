"""MLP speculators saved, loaded and pushed: our adapter folder round trip, the exact upload calls and files, and the
model card."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from hf_specdec.heads import MlpSpeculator
from tests.heads.mlp_speculator.test_convert import assert_same
from tests.heads.mlp_speculator.test_model import random_speculator
from tests.heads.test_adapter import fake_hf_api


@pytest.mark.parametrize("tie_weights", [False, True])
def test_adapter_round_trip(tmp_path, tie_weights):
    head = random_speculator(tie_weights=tie_weights, scale_input=True, revision="abc")
    head.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert list(config) == sorted(config)
    assert config["method"] == "mlp_speculator" and config["task_type"] == "CAUSAL_LM" and "library_version" in config
    assert config["tie_weights"] is tie_weights and config["revision"] == "abc"
    loaded = MlpSpeculator.from_pretrained(tmp_path)
    assert loaded.config == head.config
    assert_same(head, loaded)


def test_push_to_hub_uploads_adapter_and_card(monkeypatch, tmp_path):
    calls = fake_hf_api(monkeypatch, tmp_path / "uploaded")
    head = random_speculator(tie_weights=True)
    assert head.push_to_hub("user/mlp", token="t0k", measured={"mean_acceptance_length": 2.61}) == "commit-info"
    assert calls == [
        ("init", "t0k"),
        ("create_repo", "user/mlp", {"private": None, "exist_ok": True, "repo_type": "model"}),
        ("upload_folder", {"repo_id": "user/mlp", "repo_type": "model",
                           "commit_message": "Upload MLP speculator (hf_specdec)"}),
    ]
    uploaded = tmp_path / "uploaded"
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", "adapter_config.json",
                                                         "adapter_model.safetensors"]
    card = ModelCard.load(uploaded / "README.md")
    assert card.data.library_name == "hf-specdec" and card.data.base_model == "local/target"
    assert card.data.tags == ["speculative-decoding", "mlp_speculator", "hf-specdec"]
    text = " ".join(card.text.split())
    assert "# MLP speculator for local/target" in text
    assert "of 3 stages that reads the target model's final hidden state (width 12)" in text
    assert ("State width 8; its own embeddings and lm_heads over 23 tokens; tied: one embedding, norm and lm_head for "
            "every stage") in text
    assert f"input scaling: False; {head.num_parameters() / 1e6:.1f} M parameters" in text
    assert 'MlpSpeculator.from_pretrained("user/mlp")' in card.text
    assert "| mean_acceptance_length | 2.61 |" in card.text
    assert_same(head, MlpSpeculator.from_pretrained(uploaded))

