"""`past_key_values` in and out, as plain `generate` has them: the returned cache holds every fed position's keys
and values (rows that stopped early included), and generation continues from a filled cache."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.naming import CACHE_KWARG
from tests.conftest import make_draft, make_model, padded_batch

KWARGS = dict(do_sample=False, eos_token_id=None, return_dict_in_generate=True)


def _configs(target):
    return {
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        "draft_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=2, tree_width=2),
        "same_draft": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3),
    }


def _unmasked_max_diff(ours, theirs, mask: torch.Tensor) -> float:
    """Largest |difference| over the slots a later query attends to (padding is masked, so its values are free)."""
    worst = 0.0
    for mine, plain in zip(ours.layers, theirs.layers):
        assert mine.keys.shape == plain.keys.shape
        seen = mask[:, None, -plain.keys.shape[2]:, None].bool()
        for a, b in ((mine.keys, plain.keys), (mine.values, plain.values)):
            worst = max(worst, float(((a - b) * seen).abs().max()))
    return worst


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_returned_cache_is_plain_generates(arch):
    """Rows that stop at an EOS early leave the engine's cache; their entries are computed again."""
    target = make_model(arch)
    ids, mask = padded_batch([9, 6, 8], seed=1, repeat_period=3)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=8, **KWARGS).sequences
    for eos in (None, int(free[1, ids.shape[1] + 2])):
        kwargs = dict(attention_mask=mask, max_new_tokens=8, **{**KWARGS, "eos_token_id": eos})
        expected = target.generate(ids, **kwargs)
        fed = torch.cat([mask, mask.new_ones(3, expected.sequences.shape[1] - ids.shape[1] - 1)], dim=1)
        for name, config in _configs(target).items():
            out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
            assert torch.equal(out.sequences, expected.sequences), name
            assert type(out.past_key_values) is type(expected.past_key_values)
            assert out.past_key_values.get_seq_length() == expected.past_key_values.get_seq_length()
            assert _unmasked_max_diff(out.past_key_values, expected.past_key_values, fed) < 1e-5, (name, eos)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_continue_from_returned_cache(arch):
    target = make_model(arch)
    ids, mask = padded_batch([9, 6, 8], seed=2, repeat_period=3)
    first = target.generate(ids, attention_mask=mask, max_new_tokens=4, **KWARGS)
    longer = torch.cat([mask, mask.new_ones(3, 4)], dim=1)
    kwargs = dict(attention_mask=longer, max_new_tokens=9, **KWARGS)
    expected = target.generate(first.sequences, past_key_values=copy.deepcopy(first.past_key_values), **kwargs)
    for name, config in _configs(target).items():
        out = hf_specdec.generate(target, first.sequences, past_key_values=copy.deepcopy(first.past_key_values),
                                  speculative=config, **kwargs)
        assert torch.equal(out.sequences, expected.sequences), name
        assert out.spec_stats.num_draft_tokens > 0


def test_no_cache_returned_without_use_cache():
    target = make_model("llama")
    ids, mask = padded_batch([5, 7], seed=3)
    out = hf_specdec.generate(target, ids, attention_mask=mask, spec_method="ngram", max_new_tokens=4, use_cache=False,
                              **KWARGS)
    assert out.past_key_values is None


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_eagle_continues_from_a_filled_cache(version):
    """The target's features exist for the positions after the filled cache only: the head reads those (a shorter
    context than the target's), and the output is plain generate's, alone and under method="auto". A two-layer
    target gives EAGLE-3 the layers (1, 1, 0): auto reads them as the head does, repeats and order kept."""
    from tests.proposers.test_eagle import trained_head

    target = make_model("llama")
    ids, mask = padded_batch([9, 6, 8], seed=2, repeat_period=3)
    first = target.generate(ids, attention_mask=mask, max_new_tokens=4, **KWARGS)
    longer = torch.cat([mask, mask.new_ones(3, 4)], dim=1)
    kwargs = dict(attention_mask=longer, max_new_tokens=12, **KWARGS)
    expected = target.generate(first.sequences, past_key_values=copy.deepcopy(first.past_key_values), **kwargs)
    head = trained_head(target, version, expected.sequences)
    for method in ("eagle", "auto"):
        config = SpeculativeConfig(method=method, heads=head, num_speculative_tokens=3)
        out = hf_specdec.generate(target, first.sequences, past_key_values=copy.deepcopy(first.past_key_values),
                                  speculative=config, **kwargs)
        assert torch.equal(out.sequences, expected.sequences), method
        assert out.spec_stats.num_accepted_tokens > 0, method


def test_filled_cache_of_another_type_refused():
    from transformers import StaticCache

    target = make_model("llama")
    ids, mask = padded_batch([6, 6], seed=4)
    first = target.generate(ids, attention_mask=mask, max_new_tokens=2, **KWARGS)
    longer = torch.cat([mask, mask.new_ones(2, 2)], dim=1)
    static = StaticCache(config=target.config, max_cache_len=32)
    target.generate(ids, attention_mask=mask, past_key_values=static, max_new_tokens=2)  # now filled
    with pytest.raises(ValueError, match=f"{CACHE_KWARG}: a filled StaticCache"):
        hf_specdec.generate(target, first.sequences, attention_mask=longer, past_key_values=static,
                            spec_method="ngram", max_new_tokens=2)


@pytest.mark.parametrize("case", ["new tokens only", "cache holds the prompt", "cache longer than the prompt"])
def test_a_prompt_that_does_not_extend_the_cache_is_refused_before_any_forward(case, forward_counter):
    """Plain generate takes only the new tokens with a mask over the whole conversation, and a cache holding the
    whole prompt or more (feeding prompt tokens again); speculation needs every position's token id and a prompt
    that extends the cache, and says so before any forward."""
    from transformers import DynamicCache

    target = make_model("llama")
    ids, mask = padded_batch([12, 9], seed=4)
    cached, prompt = {"new tokens only": (8, slice(8, None)), "cache holds the prompt": (12, slice(None)),
                      "cache longer than the prompt": (12, slice(None, 10))}[case]
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :cached], attention_mask=mask[:, :cached], **{CACHE_KWARG: cache})
    inputs = dict(attention_mask=mask if case == "new tokens only" else mask[:, prompt], max_new_tokens=4,
                  do_sample=False, **{CACHE_KWARG: cache})
    target.generate(ids[:, prompt], **copy.deepcopy(inputs))  # plain generate runs, whatever it makes of it
    message = ("attention_mask covers 12 positions but the prompt has 4 and cache holds 8" if case == "new tokens only"
               else f"{CACHE_KWARG} already holds 12 positions and the prompt has {ids[:, prompt].shape[1]}")
    forwards = forward_counter(target)
    with pytest.raises(ValueError, match=message):
        hf_specdec.generate(target, ids[:, prompt], spec_method="ngram", **inputs)
    assert forwards() == 0
