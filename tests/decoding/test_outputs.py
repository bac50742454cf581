"""`output_hidden_states` / `output_attentions`: one entry per generated token, each a tuple over layers, with plain
`generate`'s shapes and values (the verified position each token was chosen at; attention weights at their order)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StaticCache

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.naming import CACHE_KWARG
from tests.conftest import make_draft, make_model, padded_batch


def _configs():
    return {
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        "draft_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=2,
                                        tree_width=2),
        "draft_dynamic_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=2,
                                                tree_width=2, tree_total_tokens=3),
    }


def _max_diff(ours: tuple, theirs: tuple, real: torch.Tensor | None = None) -> float:
    """The largest difference over every step and layer; with `real` ([B, P] prompt mask) only at real positions:
    without a cache plain generate recomputes the pad positions (which attend to nothing) to other values at every
    step."""
    assert len(ours) == len(theirs)
    worst = 0.0
    for step_ours, step_theirs in zip(ours, theirs):
        assert len(step_ours) == len(step_theirs)
        for a, b in zip(step_ours, step_theirs):
            assert a.shape == b.shape
            diff = (a - b).abs()
            if real is not None:  # [B, T, H] hidden states or [B, heads, T, T] attentions: query positions
                seen = torch.cat([real, real.new_ones(real.shape[0], b.shape[-2] - real.shape[1])], dim=1).bool()
                diff = diff * (seen[:, :, None] if diff.dim() == 3 else seen[:, None, :, None])
            worst = max(worst, float(diff.max()))
    return worst


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_hidden_states_and_attentions_match_plain_generate(arch, use_cache):
    """gemma2: sliding-window layers keep only their window of keys, as in plain generate. use_cache=False: each
    entry covers the whole sequence so far, as plain generate recomputes it."""
    target = make_model(arch)
    target.config._attn_implementation = "eager"
    ids, mask = padded_batch([9, 6, 8], seed=1, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, eos_token_id=None, use_cache=use_cache,
                  return_dict_in_generate=True, output_attentions=True, output_hidden_states=True)
    expected = target.generate(ids, **kwargs)
    for name, config in _configs().items():
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        assert torch.equal(out.sequences, expected.sequences), name
        assert out.spec_stats.num_draft_tokens > 0
        real = None if use_cache else mask
        assert _max_diff(out.hidden_states, expected.hidden_states, real) < 1e-4, name
        assert _max_diff(out.attentions, expected.attentions, real) < 1e-5, name


def test_sdpa_attentions_are_empty_as_in_plain_generate():
    target = make_model("llama")
    ids, mask = padded_batch([5, 4], seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, output_attentions=True)
    expected = target.generate(ids, **kwargs)
    out = hf_specdec.generate(target, ids, spec_method="ngram", **kwargs)
    assert [len(step) for step in out.attentions] == [len(step) for step in expected.attentions]


@pytest.mark.parametrize("lengths", [[3, 2], [9, 6]])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_attentions_span_a_static_cache_as_in_plain_generate(arch, lengths):
    """Plain generate's weights over a static cache span each layer's whole capacity (a sliding layer's window of 6
    here: prompts shorter and longer than it), zeros on the slots not written yet; a StaticCache passed in too.
    Before, they spanned the keys written so far, as over a dynamic cache."""
    target = make_model(arch)
    target.config._attn_implementation = "eager"
    ids, mask = padded_batch(lengths, seed=1, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, output_attentions=True)
    for static in ({"cache_implementation": "static"},
                   {CACHE_KWARG: lambda: StaticCache(config=target.config, max_cache_len=40)}):
        made = {name: value() if callable(value) else value for name, value in static.items()}
        expected = target.generate(ids, **kwargs, **made)
        made = {name: value() if callable(value) else value for name, value in static.items()}
        out = hf_specdec.generate(target, ids, speculative=_configs()["ngram"], **kwargs, **made)
        assert torch.equal(out.sequences, expected.sequences)
        assert out.spec_stats.num_draft_tokens > 0
        assert [[a.shape for a in step] for step in out.attentions] == \
            [[a.shape for a in step] for step in expected.attentions]
        # the prompt's queries at real positions (a left pad's query attends to nothing: uniform weights over the
        # keys either cache holds), then the generated tokens'
        real = mask.bool()[:, None, :, None]
        assert _max_diff((tuple(a * real for a in out.attentions[0]),) + out.attentions[1:],
                         (tuple(a * real for a in expected.attentions[0]),) + expected.attentions[1:]) < 1e-5


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_attentions_continuing_a_cache_span_the_keys_its_sliding_layers_hold(arch):
    """Continued from a filled cache, plain generate's first entry spans, in a sliding-window layer, only the keys
    the cache's layer holds (transformers keeps the last window - 1) and the new positions'; full layers span the
    whole conversation. Before, every layer's first entry spanned the whole conversation."""
    target = make_model(arch)
    target.config._attn_implementation = "eager"
    ids, mask = padded_batch([9, 6], seed=1, repeat_period=3)
    first = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                            return_dict_in_generate=True)
    prompt = torch.cat([first.sequences, first.sequences[:, -3:]], dim=1)
    kwargs = dict(attention_mask=torch.cat([mask, mask.new_ones(2, prompt.shape[1] - mask.shape[1])], dim=1),
                  max_new_tokens=5, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                  output_attentions=True)
    cache = getattr(first, CACHE_KWARG)
    expected = target.generate(prompt, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs)
    out = hf_specdec.generate(target, prompt, speculative=_configs()["ngram"], **{CACHE_KWARG: copy.deepcopy(cache)},
                              **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.spec_stats.num_draft_tokens > 0
    # the sliding layers' first entry is narrower than the conversation (gemma2's full layers span all of it)
    assert min(a.shape[-1] for a in expected.attentions[0]) < prompt.shape[1]
    assert [[a.shape for a in step] for step in out.attentions] == \
        [[a.shape for a in step] for step in expected.attentions]
    assert _max_diff(out.attentions, expected.attentions) < 1e-5
