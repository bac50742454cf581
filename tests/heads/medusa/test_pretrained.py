"""Medusa heads saved, loaded and pushed: our adapter folder round trip, and the upload with its model card."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from hf_specdec.heads import MedusaConfig, MedusaHeads
from tests.heads.medusa.test_convert import _assert_same, _random_heads
from tests.heads.test_adapter import fake_hf_api


def test_adapter_round_trip(tmp_path):
    heads = _random_heads()
    heads.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert list(config) == sorted(config)
    assert config["method"] == "medusa" and config["task_type"] == "CAUSAL_LM" and config["revision"] == "abc"
    _assert_same(heads, MedusaHeads.from_pretrained(tmp_path))


def test_unknown_config_keys_are_warned_and_ignored(tmp_path):
    heads = _random_heads()
    heads.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"future_option": 3}))
    with pytest.warns(UserWarning, match="ignoring unknown keys \\['future_option'\\]"):
        _assert_same(heads, MedusaHeads.from_pretrained(tmp_path))


def test_push_to_hub_uploads_adapter_and_card(monkeypatch, tmp_path):
    calls = fake_hf_api(monkeypatch, tmp_path / "uploaded")
    heads = _random_heads()
    result = heads.push_to_hub("user/heads", private=True, token="t0k", measured={"mean_acceptance_length": 2.31})
    assert result == "commit-info"
    assert calls == [
        ("init", "t0k"),
        ("create_repo", "user/heads", {"private": True, "exist_ok": True, "repo_type": "model"}),
        ("upload_folder", {"repo_id": "user/heads", "repo_type": "model",
                           "commit_message": "Upload Medusa heads (hf_specdec)"}),
    ]
    uploaded = tmp_path / "uploaded"
    files = ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in uploaded.iterdir()) == files
    card = ModelCard.load(uploaded / "README.md")
    assert card.data.library_name == "hf-specdec"
    assert card.data.base_model == "local/target"
    assert card.data.pipeline_tag == "text-generation"
    assert {"speculative-decoding", "medusa"} <= set(card.data.tags)
    assert "| mean_acceptance_length | 2.31 |" in card.text
    assert "each projected by its own lm_head over" in card.text
    _assert_same(heads, MedusaHeads.from_pretrained(uploaded))


def test_card_of_shared_lm_head_heads_says_so():
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=None, num_heads=2, shared_lm_head=True))
    text = heads.model_card("user/heads").text
    assert "each projected by the target's own lm_head" in text and "None" not in text
