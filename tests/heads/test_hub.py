"""The Hub boundary: the exact upload calls and files, the model card's metadata, and offline resolution."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.errors import LocalEntryNotFoundError

from hf_specdec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, hub
from tests.heads.test_files import _assert_same, _random_heads


def fake_hf_api(monkeypatch, uploaded: Path) -> list[tuple]:
    """Replaces HfApi in hub.py: records its calls (returned) and copies the uploaded folder to `uploaded`."""
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, **kwargs):
            uploaded.mkdir()
            for file in Path(kwargs["folder_path"]).iterdir():
                (uploaded / file.name).write_bytes(file.read_bytes())
            calls.append(("upload_folder", {k: v for k, v in kwargs.items() if k != "folder_path"}))
            return "commit-info"

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    return calls


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
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    card = ModelCard.load(uploaded / "README.md")
    assert card.data.library_name == "hf-specdec"
    assert card.data.base_model == "local/target"
    assert card.data.pipeline_tag == "text-generation"
    assert {"speculative-decoding", "medusa"} <= set(card.data.tags)
    assert "| mean_acceptance_length | 2.31 |" in card.text
    assert "each projected by its own lm_head over" in card.text
    _assert_same(heads, MedusaHeads.from_pretrained(uploaded))


def test_card_of_shared_lm_head_heads_says_so():
    from hf_specdec.heads.hub import medusa_card

    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=None, num_heads=2, shared_lm_head=True))
    text = medusa_card(heads, "user/heads").text
    assert "each projected by the target's own lm_head" in text and "None" not in text


def test_hub_id_resolves_through_snapshot_download(monkeypatch, tmp_path):
    heads = _random_heads()
    heads.save_pretrained(tmp_path / "snapshot")
    asked = []

    def fake_download(repo_id, revision=None):
        asked.append((repo_id, revision))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(hub, "snapshot_download", fake_download)
    _assert_same(heads, MedusaHeads.from_pretrained("user/heads", revision="v1"))
    assert asked == [("user/heads", "v1")]


def test_offline_miss_is_a_clear_error(monkeypatch):
    def offline(repo_id, revision=None):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="no such local folder, and the Hub repo is not in the local cache"):
        MedusaHeads.from_pretrained("user/absent")


@pytest.mark.parametrize("name", ["/no/such/folder", "./heads/medusa", "examples/heads/medusaa", "~/absent", "a/b/c"])
def test_a_local_looking_path_that_does_not_exist_says_no_such_folder(monkeypatch, name):
    def hub_called(*args, **kwargs):
        raise AssertionError("a local-looking path must not reach the Hub")

    monkeypatch.setattr(hub, "snapshot_download", hub_called)
    for loader in (MedusaHeads.from_pretrained, EagleHead.from_pretrained):
        with pytest.raises(ValueError, match=f"no such folder: '{re.escape(name)}'"):
            loader(name)


def test_a_file_instead_of_its_folder_is_named(tmp_path):
    _random_heads().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is a file; pass the folder that holds it"):
        MedusaHeads.from_pretrained(tmp_path / "adapter_config.json")


def test_damaged_files_are_named(tmp_path):
    heads = _random_heads()
    heads.save_pretrained(tmp_path / "json")
    (tmp_path / "json" / "adapter_config.json").write_text('{"method": "medusa", "num_heads": ')
    with pytest.raises(ValueError, match=r"json/adapter_config.json: not valid JSON .* damaged"):
        MedusaHeads.from_pretrained(tmp_path / "json")
    heads.save_pretrained(tmp_path / "weights")
    weights = tmp_path / "weights" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"weights/adapter_model.safetensors: cannot be read as safetensors"):
        MedusaHeads.from_pretrained(tmp_path / "weights")
    weights.unlink()
    with pytest.raises(ValueError, match=r"weights/adapter_model.safetensors: no such file"):
        MedusaHeads.from_pretrained(tmp_path / "weights")
    EagleHead(EagleConfig(version="eagle", hidden_size=16, intermediate_size=32, num_attention_heads=2,
                          num_key_value_heads=2, vocab_size=40)).save_pretrained(tmp_path / "eagle")
    (tmp_path / "eagle" / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"eagle/adapter_config.json: expected a JSON object, got list"):
        EagleHead.from_pretrained(tmp_path / "eagle")
