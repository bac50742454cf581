"""The committed test bed loads offline and its models are trained."""

import math
from pathlib import Path

import pytest
import torch

from hf_specdec.testbed.loading import TESTBED_ENV_VAR, load_testbed
from hf_specdec.testbed.loading import testbed_dir as find_testbed
from hf_specdec.testbed.workloads import load_workload


@pytest.fixture(scope="module")
def testbed():
    return load_testbed()


def test_missing_testbed_names_path_and_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(TESTBED_ENV_VAR, str(missing))
    with pytest.raises(FileNotFoundError, match=TESTBED_ENV_VAR) as info:
        find_testbed()
    assert str(missing) in str(info.value)


def test_weights_are_safetensors_and_small() -> None:
    root = find_testbed()
    files = [p for p in root.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert {"target", "draft"} <= {p.parent.name for p in files if p.suffix == ".safetensors"}
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20


def test_tokenizer_round_trips(testbed) -> None:
    tokenizer, _, _ = testbed
    text = "def f(x, *args):\n\treturn {'é': x ** 2}  # ünïcode ☃\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_target_and_draft_share_vocabulary_and_special_ids(testbed) -> None:
    tokenizer, target, draft = testbed
    for model in (target, draft):
        assert model.config.vocab_size == len(tokenizer)
        for config in (model.config, model.generation_config):
            assert config.bos_token_id == tokenizer.bos_token_id
            assert config.eos_token_id == tokenizer.eos_token_id
            assert config.pad_token_id == tokenizer.pad_token_id
    assert draft.num_parameters() * 5 < target.num_parameters()


@torch.no_grad()
def test_models_are_trained(testbed) -> None:
    tokenizer, target, draft = testbed
    prompt = load_workload("completion")[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    logits = target(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    held_out = tokenizer(load_workload("long")[0], return_tensors="pt").input_ids[:, :512]
    for model in (target, draft):
        loss = model(held_out, labels=held_out).loss.item()
        assert loss < 0.5 * math.log(len(tokenizer))
