"""The committed drafters: where they are, which exist, and loading them in the target's dtype."""

from __future__ import annotations

import re

import pytest
import torch

from hf_specdec.heads import EagleHead, MedusaHeads
from hf_specdec.testbed import drafters, loading
from hf_specdec.testbed.loading import heads_dir, load_testbed


def test_the_test_beds_drafters_load_in_the_targets_dtype():
    _, target, _ = load_testbed(dtype=torch.bfloat16)
    for kind, expected in (("draft", torch.nn.Module), ("medusa", MedusaHeads), ("eagle", EagleHead),
                           ("eagle3", EagleHead)):
        assert drafters.has_drafter("testbed", kind)
        drafter = drafters.load_drafter("testbed", kind, target)
        assert isinstance(drafter, expected) and not drafter.training
        assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}


def test_unknown_names_and_missing_drafters_are_clear_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="model: expected one of"):
        drafters.drafter_dir("gpt5", "draft")
    with pytest.raises(ValueError, match="kind: expected one of"):
        drafters.drafter_dir("smollm2", "lookahead")
    monkeypatch.setattr(drafters, "drafter_dir", lambda model, kind: tmp_path / kind)
    assert not drafters.has_drafter("smollm2", "eagle")
    with pytest.raises(FileNotFoundError, match="no committed eagle drafter for 'smollm2'"):
        drafters.load_drafter("smollm2", "eagle", torch.nn.Linear(1, 1))


def test_every_head_kind_is_found_beside_the_test_bed(monkeypatch, tmp_path):
    """`heads_dir` serves each kind of heads, committed or not: a kind without heads (the MLP speculator) is a
    clear error naming the folder and the training command, and no drafter."""
    assert heads_dir("eagle3") == loading.testbed_dir().parent / "heads" / "eagle3"
    with pytest.raises(ValueError, match="kind: expected one of .*'mlp_speculator'.*got 'lookahead'"):
        heads_dir("lookahead")
    monkeypatch.setenv("HF_SPECDEC_TESTBED", str(tmp_path / "testbed"))
    (tmp_path / "testbed").mkdir()
    folder = tmp_path / "heads" / "mlp_speculator"
    with pytest.raises(FileNotFoundError, match=f"no mlp_speculator heads at {re.escape(str(folder))}.*train mlp_spec"):
        heads_dir("mlp_speculator")
    assert not drafters.has_drafter("testbed", "mlp_speculator")
    with pytest.raises(FileNotFoundError, match="hf-specdec train mlp_speculator"):
        drafters.load_drafter("testbed", "mlp_speculator", torch.nn.Linear(1, 1))
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    assert drafters.drafter_dir("testbed", "mlp_speculator") == folder
    assert drafters.has_drafter("testbed", "mlp_speculator")


def test_a_drafter_loads_from_a_folder_given(monkeypatch, tmp_path):
    """`folder=` loads a drafter of the committed layout from elsewhere (a training run's output), the same weights
    as the folder's, whether or not one of its kind is committed; a folder without one is a clear error naming it."""
    _, target, _ = load_testbed(dtype=torch.float32)
    committed = drafters.load_drafter("testbed", "eagle3", target)
    committed.save_pretrained(tmp_path / "mine")
    mine = drafters.load_drafter("testbed", "eagle3", target, folder=tmp_path / "mine")
    assert isinstance(mine, EagleHead) and not mine.training
    for (name, a), (_, b) in zip(committed.state_dict().items(), mine.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match=f"folder '{re.escape(str(tmp_path))}': no adapter_config.json"):
        drafters.load_drafter("testbed", "medusa", target, folder=tmp_path)
    with pytest.raises(ValueError, match="kind: expected one of"):
        drafters.load_drafter("testbed", "lookahead", target, folder=tmp_path / "mine")
    # no committed heads at all (an empty test bed folder): the folder given still loads
    monkeypatch.setenv("HF_SPECDEC_TESTBED", str(tmp_path / "testbed"))
    (tmp_path / "testbed").mkdir()
    assert not drafters.has_drafter("testbed", "eagle3")
    assert isinstance(drafters.load_drafter("testbed", "eagle3", target, folder=tmp_path / "mine"), EagleHead)
