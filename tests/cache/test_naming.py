"""The KV cache's name at the boundary with transformers: `past_key_values` up to 5.23, `cache` from 5.24."""

from __future__ import annotations

import copy
import warnings

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.naming import CACHE_KWARG, cache_keyword, given_cache
from tests.conftest import make_model, padded_batch


def test_cache_kwarg_follows_the_installed_transformers():
    renamed = Version(transformers.__version__) >= Version("5.24.0.dev0")
    assert CACHE_KWARG == ("cache" if renamed else "past_key_values")
    assert CACHE_KWARG in GenerateDecoderOnlyOutput.__dataclass_fields__


def test_cache_keyword_reads_the_forward_signature():
    class New(nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    class Old(nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class Wrapper(nn.Module):
        def forward(self, *args, **kwargs):
            return args

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(Wrapper()) == CACHE_KWARG
    assert cache_keyword(make_model("llama")) == CACHE_KWARG


def test_given_cache_takes_either_spelling():
    marker = object()
    assert given_cache({"cache": marker}) is marker
    assert given_cache({"past_key_values": marker, "cache": None}) is marker
    assert given_cache({"attention_mask": marker}) is None


def test_engine_speaks_the_installed_name():
    """A call that returns the cache and continues from it raises no deprecation warning of transformers' own:
    every model call and the output use the installed version's name."""
    target = make_model("llama")
    ids, mask = padded_batch([7, 4], seed=3)
    kwargs = {"do_sample": False, "eos_token_id": None, "return_dict_in_generate": True, "max_new_tokens": 6}
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3)
    expected = target.generate(ids, attention_mask=mask, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **kwargs)
        cache = getattr(out, CACHE_KWARG)
        longer = torch.cat([mask, mask.new_ones(2, 6)], dim=1)
        more = hf_specdec.generate(target, out.sequences, attention_mask=longer, speculative=config,
                                   **{CACHE_KWARG: cache}, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    assert more.sequences.shape[1] == out.sequences.shape[1] + 6
