"""A target dispatched by accelerate (`device_map`, hooks, one layer offloaded to disk) generates identically."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

import hf_specdec
from hf_specdec import SpeculativeConfig
from tests.conftest import make_model, padded_batch


def test_device_map_with_disk_offload_matches_plain(tmp_path):
    reference = make_model("llama")
    reference.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    dispatched = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    assert getattr(dispatched, "hf_device_map", None) and hasattr(dispatched.model.layers[1], "_hf_hook")
    ids, mask = padded_batch([10, 6, 8], seed=7, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = reference.generate(ids, **kwargs)
    for config in (
        SpeculativeConfig(method="draft", draft_model=copy.deepcopy(reference), num_speculative_tokens=4),
        SpeculativeConfig(method="ngram", num_speculative_tokens=4),
    ):
        out = hf_specdec.generate(dispatched, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_draft_tokens > 0
