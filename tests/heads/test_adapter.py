"""The adapter module every head shares: resolving folders and Hub ids (offline included), damaged files named,
and the registry of adapter types."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from hf_specdec.heads import EagleConfig, EagleHead, MedusaHeads, MlpSpeculator, adapter
from tests.heads.medusa.test_convert import _assert_same, _random_heads


def fake_hf_api(monkeypatch, uploaded: Path) -> list[tuple]:
    """Replaces HfApi in adapter.py: records its calls (returned) and copies the uploaded folder to `uploaded`."""
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

    monkeypatch.setattr(adapter, "HfApi", FakeApi)
    return calls


def test_hub_id_resolves_through_snapshot_download(monkeypatch, tmp_path):
    heads = _random_heads()
    heads.save_pretrained(tmp_path / "snapshot")
    asked = []

    def fake_download(repo_id, revision=None):
        asked.append((repo_id, revision))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(adapter, "snapshot_download", fake_download)
    _assert_same(heads, MedusaHeads.from_pretrained("user/heads", revision="v1"))
    assert asked == [("user/heads", "v1")]


def test_offline_miss_is_a_clear_error(monkeypatch):
    def offline(repo_id, revision=None):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(adapter, "snapshot_download", offline)
    with pytest.raises(ValueError, match="no such local folder, and the Hub repo is not in the local cache"):
        MedusaHeads.from_pretrained("user/absent")


@pytest.mark.parametrize("name", ["/no/such/folder", "./heads/medusa", "examples/heads/medusaa", "~/absent", "a/b/c"])
def test_a_local_looking_path_that_does_not_exist_says_no_such_folder(monkeypatch, name):
    def hub_called(*args, **kwargs):
        raise AssertionError("a local-looking path must not reach the Hub")

    monkeypatch.setattr(adapter, "snapshot_download", hub_called)
    for loader in (MedusaHeads.from_pretrained, EagleHead.from_pretrained, MlpSpeculator.from_pretrained):
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


def test_registry_maps_adapter_types_to_their_heads_and_refuses_a_second_owner():
    assert adapter.registered_head("medusa") is MedusaHeads
    assert adapter.registered_head("eagle") is adapter.registered_head("eagle3") is EagleHead
    assert adapter.registered_head("mlp_speculator") is MlpSpeculator
    assert adapter.registered_head("other") is None

    class Other:
        adapter_types = ("other", "medusa")

    with pytest.raises(ValueError, match="register_head: adapter type 'medusa' is already registered by MedusaHeads"):
        adapter.register_head(Other)
    assert adapter.registered_head("medusa") is MedusaHeads and adapter.registered_head("other") is None
    assert adapter.register_head(MedusaHeads) is MedusaHeads  # the same class again is no second owner


def test_a_folder_of_another_head_names_the_class_that_loads_it(tmp_path):
    EagleHead(EagleConfig(version="eagle", hidden_size=16, intermediate_size=32, num_attention_heads=2,
                          num_key_value_heads=2, vocab_size=40)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="method 'eagle' is not 'medusa'; it holds EagleHead: load it with "
                                         r"EagleHead.from_pretrained"):
        MedusaHeads.from_pretrained(tmp_path)


def test_adapter_weights_that_do_not_fit_the_config_are_named(tmp_path):
    heads = _random_heads()
    heads.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"num_heads": 4}))
    with pytest.raises(ValueError, match=r"adapter weights: missing \['heads.3.0.linear.bias', .*not recognised \[\]"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"vocab_size": 12}))
    with pytest.raises(ValueError, match="adapter weights do not match its adapter_config.json: ") as error:
        MedusaHeads.from_pretrained(tmp_path)
    assert "size mismatch for heads.0.2.weight" in str(error.value)
