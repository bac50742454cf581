"""The committed test-bed EAGLE heads (examples/heads/eagle, examples/heads/eagle3): small bf16 files that load, fit
the test-bed target, keep greedy output identical to plain generate, and draft like trained heads (mean acceptance
length above 2 where an untrained head gets about 1; measured 2.8 / 3.4 for EAGLE-1/2 chain / tree and 2.4 / 2.7 for
EAGLE-3 on these prompts)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import EagleHead
from hf_specdec.testbed.loading import heads_dir, load_testbed
from hf_specdec.testbed.workloads import load_workload

MAX_BYTES = 8 * 1024 * 1024
KINDS = ("eagle", "eagle3")


@pytest.mark.parametrize("kind", KINDS)
def test_committed_head_files(kind):
    folder = heads_dir(kind)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert sum(p.stat().st_size for p in folder.iterdir()) <= MAX_BYTES
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as weights:
        float_dtypes = {weights.get_slice(n).get_dtype() for n in weights.keys() if n not in ("d2t", "t2d")}
    assert float_dtypes == {"BF16"}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert list(config) == sorted(config) and config["method"] == kind


@pytest.fixture(scope="module")
def testbed():
    tokenizer, target, _ = load_testbed()
    tokenizer.padding_side = "left"
    return tokenizer, target, {kind: EagleHead.from_pretrained(heads_dir(kind)).eval() for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", [False, True])
def test_committed_heads_are_lossless_and_trained(testbed, kind, tree):
    tokenizer, target, heads = testbed
    batch = tokenizer(load_workload("completion")[:2], return_tensors="pt", padding=True)
    kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=24, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    shape = dict(top_k=3, depth=4, total_tokens=12) if tree else dict(num_speculative_tokens=4)
    config = SpeculativeConfig(method="eagle", heads=heads[kind], **shape)
    out = hf_specdec.generate(target, batch["input_ids"], speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(batch["input_ids"], **kwargs))
    assert out.spec_stats.mean_acceptance_length > 2.0
