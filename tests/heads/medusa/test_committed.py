"""The committed test-bed Medusa heads (examples/heads/medusa): small bf16 files that load, fit the test-bed target,
and keep greedy output identical to plain generate, as a chain and with their fitted tree."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import MedusaHeads
from hf_specdec.testbed.loading import heads_dir, load_testbed
from hf_specdec.testbed.workloads import load_workload

MAX_BYTES = 13 * 1024 * 1024


def test_committed_heads_files():
    folder = heads_dir("medusa")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert sum(p.stat().st_size for p in folder.iterdir()) <= MAX_BYTES
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert list(config) == sorted(config) and config["method"] == "medusa" and config["tree_paths"]


@pytest.fixture(scope="module")
def testbed():
    tokenizer, target, _ = load_testbed()
    tokenizer.padding_side = "left"
    return tokenizer, target, MedusaHeads.from_pretrained(heads_dir("medusa"))


@pytest.mark.parametrize("tree", [False, True])
def test_committed_heads_are_lossless_on_the_test_bed(testbed, tree):
    tokenizer, target, heads = testbed
    batch = tokenizer(load_workload("completion")[:2], return_tensors="pt", padding=True)
    kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=16, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    config = SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=heads.config.num_heads,
                               tree_paths=heads.tree() if tree else None)
    out = hf_specdec.generate(target, batch["input_ids"], speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(batch["input_ids"], **kwargs))
    assert out.spec_stats.num_accepted_tokens > 0


def test_default_tree_is_the_heads_own(testbed):
    """tree_paths="default" takes the tree fitted to the heads (3 heads: the built-in 4-deep tree would not fit)."""
    _, _, heads = testbed
    config = SpeculativeConfig(method="medusa", heads=heads, tree_paths="default")
    assert config.tree_paths == heads.tree() == heads.config.tree_paths
