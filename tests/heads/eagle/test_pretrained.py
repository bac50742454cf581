"""EAGLE heads saved, loaded and pushed: our adapter folder round trip, the exact upload calls and files, the model
card's metadata, and resolution by repo id."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from hf_specdec.heads import EagleHead, adapter
from tests.heads.eagle.test_convert import (
    DRAFT_V,
    TARGET_LAYERS,
    assert_same,
    eagle3_safeailab_weights,
    llama_dict,
    random_head,
    write,
)
from tests.heads.test_adapter import fake_hf_api


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_push_to_hub_uploads_adapter_and_card(monkeypatch, tmp_path, version):
    calls = fake_hf_api(monkeypatch, tmp_path / "uploaded")
    head = random_head(version)
    measured = {"mean_acceptance_length": 3.52, "speedup": 2.14}
    assert head.push_to_hub("user/eagle", private=False, token="t0k", measured=measured) == "commit-info"
    assert calls == [
        ("init", "t0k"),
        ("create_repo", "user/eagle", {"private": False, "exist_ok": True, "repo_type": "model"}),
        ("upload_folder", {"repo_id": "user/eagle", "repo_type": "model",
                           "commit_message": "Upload EAGLE head (hf_specdec)"}),
    ]
    uploaded = tmp_path / "uploaded"
    files = ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in uploaded.iterdir()) == files
    card = ModelCard.load(uploaded / "README.md")
    assert card.data.library_name == "hf-specdec"
    assert card.data.base_model == "local/target"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.tags == ["speculative-decoding", version, "hf-specdec"]
    assert "| mean_acceptance_length | 3.52 |" in card.text and "| speedup | 2.14 |" in card.text
    assert 'EagleHead.from_pretrained("user/eagle")' in card.text
    assert_same(head, EagleHead.from_pretrained(uploaded))


def test_card_says_what_the_head_reads():
    card = random_head("eagle3", base_model_name_or_path=None).model_card("user/eagle")
    assert card.data.base_model is None
    assert "# EAGLE-3 draft head for an unnamed base model" in card.text
    assert "entering layers [2, 4, 5] (fused)" in card.text and "draft vocabulary of 48 tokens" in card.text
    assert "Not measured yet." in card.text
    card = random_head("eagle").model_card("user/eagle")
    assert "# EAGLE-1/2 draft head for local/target" in card.text and "the target's final hidden state" in card.text


def test_commit_message_is_passed_through(monkeypatch, tmp_path):
    calls = fake_hf_api(monkeypatch, tmp_path / "uploaded")
    random_head().push_to_hub("user/eagle", commit_message="step 2000")
    assert calls[-1][1]["commit_message"] == "step 2000"


def test_hub_id_of_a_published_checkpoint_resolves_through_snapshot_download(monkeypatch, tmp_path):
    head = random_head("eagle3", base_model_name_or_path=None)
    (tmp_path / "snapshot").mkdir()
    write(tmp_path / "snapshot", llama_dict(draft_vocab_size=DRAFT_V), eagle3_safeailab_weights(head))
    asked = []

    def fake_download(repo_id, revision=None):
        asked.append((repo_id, revision))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(adapter, "snapshot_download", fake_download)
    loaded = EagleHead.from_pretrained("yuhuili/EAGLE3-tiny", revision="main", num_target_layers=TARGET_LAYERS)
    assert asked == [("yuhuili/EAGLE3-tiny", "main")]
    assert_same(head, loaded)


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_adapter_round_trip(tmp_path, version):
    head = random_head(version, revision="abc")
    head.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert list(config) == sorted(config)
    assert config["method"] == version and "version" not in config
    assert config["task_type"] == "CAUSAL_LM" and config["revision"] == "abc"
    assert config["base_model_name_or_path"] == "local/target" and "library_version" in config
    # the target's embeddings (and EAGLE-1's lm_head) are never stored
    assert not any("embed" in k for k in load_file(str(tmp_path / "adapter_model.safetensors")))
    assert_same(head, EagleHead.from_pretrained(tmp_path))


def test_adapter_unknown_keys_are_warned_and_ignored(tmp_path):
    head = random_head()
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"future_option": 3}))
    with pytest.warns(UserWarning, match="ignoring unknown keys \\['future_option'\\]"):
        assert_same(head, EagleHead.from_pretrained(tmp_path))


def test_adapter_of_another_method_is_refused(tmp_path):
    random_head().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"method": "medusa"}))
    with pytest.raises(ValueError, match="method 'medusa' is not 'eagle' or 'eagle3'"):
        EagleHead.from_pretrained(tmp_path)


def test_adapter_feature_layers_must_agree(tmp_path):
    random_head().save_pretrained(tmp_path)
    assert EagleHead.from_pretrained(tmp_path, feature_layers=(2, 4, 5)).config.feature_layers == (2, 4, 5)
    message = r"feature_layers: the checkpoint fuses target layers \(2, 4, 5\), not \(2, 6, 9"
    with pytest.raises(ValueError, match=message):
        EagleHead.from_pretrained(tmp_path, num_target_layers=12)
