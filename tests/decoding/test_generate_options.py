"""transformers' `generate` options beyond plain token prompts: each gives exactly plain `generate`'s output."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from tests.conftest import make_draft, make_model, padded_batch
from tests.heads.medusa.test_model import heads_for
from tests.proposers.test_eagle import eagle_head
from tests.proposers.test_mlp_speculator import random_speculator

GREEDY = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)


def _configs(target) -> dict[str, SpeculativeConfig]:
    return {
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        "ngram_tree": SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=2),
        "same_draft": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3),
        "random_draft_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=2,
                                               tree_width=2),
    }


@pytest.mark.parametrize("side", ["left", "right"])
def test_token_type_ids_match_plain_generate(side):
    """GPT-2 style segment ids: new tokens take each row's last segment id, as in plain generate."""
    target = make_model("gpt2")
    ids, mask = padded_batch([9, 6, 8], seed=1, repeat_period=3, side=side)
    segments = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=mask, token_type_ids=segments, **GREEDY)
    expected = target.generate(ids, **kwargs)
    assert not torch.equal(expected, target.generate(ids, attention_mask=mask, **GREEDY)), "segments must matter"
    for name, config in _configs(target).items():
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), name
        assert out.spec_stats.num_draft_tokens > 0, name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_inputs_embeds_match_plain_generate(arch):
    """A prompt given as embeddings: the output holds the new tokens only, as plain generate's does."""
    target = make_model(arch)
    ids, mask = padded_batch([9, 6, 8], seed=2, repeat_period=3)
    embeds = target.get_input_embeddings()(ids).detach() + 0.01  # not the embeddings of any token id
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, **GREEDY)
    expected = target.generate(**kwargs)
    assert expected.shape == (3, GREEDY["max_new_tokens"])
    for config in (SpeculativeConfig(method="ngram", num_speculative_tokens=3),
                   SpeculativeConfig(method="ngram", tree_width=2, num_speculative_tokens=3),
                   SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=2),
                   SpeculativeConfig(method="mlp_speculator", heads=random_speculator(target),
                                     num_speculative_tokens=2)):
        out = hf_specdec.generate(target, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), config.method
        assert out.spec_stats.num_draft_tokens > 0


def test_inputs_embeds_refused_for_proposers_that_read_prompt_ids():
    target = make_model("llama")
    ids, mask = padded_batch([5, 4], seed=3)
    embeds = target.get_input_embeddings()(ids).detach()
    for config in (SpeculativeConfig(method="draft", draft_model=make_draft()),
                   SpeculativeConfig(method="early_exit", early_exit_layer=1)):
        with pytest.raises(ValueError, match=f"inputs_embeds: method={config.method!r} drafts from the prompt's token "
                                             "ids"):
            hf_specdec.generate(target, inputs_embeds=embeds, attention_mask=mask, speculative=config, **GREEDY)
    # method="auto" with a draft model or an EAGLE head, and hybrid drafting with one, are refused alike (they
    # crashed mid-call before)
    for config, drafter in ((SpeculativeConfig(method="auto", draft_model=make_draft()), "draft"),
                            (SpeculativeConfig(method="auto", heads=eagle_head(target)), "eagle"),
                            (SpeculativeConfig(method="suffix", fallback=SpeculativeConfig(
                                method="draft", draft_model=make_draft())), "draft")):
        with pytest.raises(ValueError, match=f"inputs_embeds: method={config.method!r} \\(drafting with "
                                             f"{drafter!r}\\) drafts from the prompt's token ids"):
            hf_specdec.generate(target, inputs_embeds=embeds, attention_mask=mask, speculative=config, **GREEDY)
    # auto with heads that read no ids drafts from embeddings as they do
    medusa = SpeculativeConfig(method="auto", heads=heads_for(target))
    expected = target.generate(inputs_embeds=embeds, attention_mask=mask, **GREEDY)
    out = hf_specdec.generate(target, inputs_embeds=embeds, attention_mask=mask, speculative=medusa, **GREEDY)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_proposers_that_read_ids_draft_from_the_ids_given_with_embeddings(arch):
    """Token ids for every embedded position: the draft model, early exit, an EAGLE head, MTP-style features and
    `method="auto"` draft from the ids' text while the target encodes the embeddings (noisy here, so the two
    differ): the output is plain generate's on the embeddings."""
    from tests.proposers.test_eagle import trained_head

    target = make_model(arch)
    ids, mask = padded_batch([9, 6, 8], seed=2, repeat_period=3)
    noise = torch.randn(*ids.shape, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    embeds = target.get_input_embeddings()(ids).detach() + noise
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    expected = target.generate(ids, **kwargs)
    assert not torch.equal(expected.sequences, target.generate(ids, attention_mask=mask, **GREEDY))
    for config in (SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3),
                   SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3,
                                     tree_width=2),
                   SpeculativeConfig(method="early_exit", early_exit_layer=1, num_speculative_tokens=3),
                   SpeculativeConfig(method="eagle", heads=trained_head(target, "eagle", expected.sequences),
                                     num_speculative_tokens=3),
                   SpeculativeConfig(method="auto", draft_model=copy.deepcopy(target), num_speculative_tokens=3)):
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        assert torch.equal(out.sequences, expected.sequences), config.method
        assert out.spec_stats.num_draft_tokens > 0, config.method
    # ids for some embedded positions only: refused, naming both counts
    with pytest.raises(ValueError, match=r"inputs_embeds: method='draft' drafts from the prompt's token ids, .*\(9 "
                                         r"embedded positions, 5 token ids\)"):
        hf_specdec.generate(target, ids[:, -5:], inputs_embeds=embeds, attention_mask=mask,
                            speculative=SpeculativeConfig(method="draft", draft_model=make_draft()), **GREEDY)


def test_use_cache_false_gives_the_same_output():
    """Speculation keeps its own cache whatever `use_cache` says; the tokens are plain generate's."""
    target = make_model("qwen2")
    ids, mask = padded_batch([7, 10], seed=4, repeat_period=4)
    kwargs = dict(attention_mask=mask, use_cache=False, **GREEDY)
    expected = target.generate(ids, **kwargs)
    for name, config in _configs(target).items():
        assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **kwargs), expected), name


def test_num_return_sequences_samples_each_prompt_n_times():
    """generate repeats each prompt n times before the loop; every copy is sampled independently."""
    target = make_model("llama")
    ids, mask = padded_batch([6, 8], seed=5, repeat_period=3)
    out = hf_specdec.generate(target, ids, attention_mask=mask, spec_method="ngram", num_return_sequences=3,
                              do_sample=True, max_new_tokens=16, eos_token_id=None, return_dict_in_generate=True)
    assert out.sequences.shape == (6, ids.shape[1] + 16)
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids.repeat_interleave(3, dim=0))
    assert len({tuple(row.tolist()) for row in out.sequences[:3]}) > 1, "copies of a prompt are sampled apart"
    assert out.spec_stats.num_draft_tokens > 0


def test_model_without_logits_to_keep():
    """GPT2DoubleHeadsModel returns logits for every prompt position; the first new token comes from the last."""
    from transformers import GPT2Config, GPT2DoubleHeadsModel

    torch.manual_seed(0)
    target = GPT2DoubleHeadsModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    assert not target._supports_logits_to_keep()
    ids, mask = padded_batch([9, 6], seed=6, repeat_period=3)
    kwargs = dict(attention_mask=mask, pad_token_id=0, **GREEDY)
    expected = target.generate(ids, **kwargs)
    assert torch.equal(hf_specdec.generate(target, ids, spec_method="ngram", **kwargs), expected)


def test_input_ids_with_inputs_embeds_and_continuing_from_embeds():
    """Both ids and embeddings (the ids appear in the output, the embeddings are encoded), then a continuation
    from embeddings plus the returned cache, as transformers' own tests do it."""
    target = make_model("llama")
    ids, mask = padded_batch([7, 7], seed=7, repeat_period=3)
    embeds = target.get_input_embeddings()(ids).detach() * 1.5
    kwargs = dict(return_dict_in_generate=True, **GREEDY)
    expected = target.generate(ids, inputs_embeds=embeds, attention_mask=mask, **kwargs)
    out = hf_specdec.generate(target, ids, inputs_embeds=embeds, attention_mask=mask, spec_method="ngram", **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    first = target.generate(inputs_embeds=embeds, attention_mask=mask, **{**kwargs, "max_new_tokens": 3})
    longer = torch.cat([embeds, target.get_input_embeddings()(first.sequences)], dim=1)
    longer_mask = torch.cat([mask, mask.new_ones(2, 3)], dim=1)
    expected = target.generate(inputs_embeds=longer, attention_mask=longer_mask,
                               past_key_values=copy.deepcopy(first.past_key_values), **kwargs)
    out = hf_specdec.generate(target, inputs_embeds=longer, attention_mask=longer_mask, spec_method="ngram",
                              past_key_values=copy.deepcopy(first.past_key_values), **kwargs)
    assert torch.equal(out.sequences, expected.sequences)


def test_batch_without_pad_token_when_nothing_stops_early():
    """Without an EOS nothing is padded, so plain generate needs no pad token; neither does speculation."""
    target = make_model("llama")
    target.generation_config.pad_token_id = None
    ids, _ = padded_batch([6, 6], seed=8, repeat_period=3)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=None)
    assert torch.equal(hf_specdec.generate(target, ids, spec_method="ngram", **kwargs), target.generate(ids, **kwargs))


def test_int32_prompt_ids():
    """Plain generate takes int32 prompt ids and returns int64 sequences; so does speculation."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6], seed=3, repeat_period=4)
    expected = target.generate(ids.int(), attention_mask=mask, **GREEDY)
    assert expected.dtype == torch.int64
    configs = _configs(target) | {"eagle": SpeculativeConfig(method="eagle", heads=eagle_head(target),
                                                             num_speculative_tokens=3)}
    for name, config in configs.items():
        out = hf_specdec.generate(target, ids.int(), attention_mask=mask, speculative=config, **GREEDY)
        assert out.dtype == torch.int64 and torch.equal(out, expected), name


def test_sampling_with_every_token_banned_fails_as_plain_generate():
    """`no_repeat_ngram_size=1` over more new tokens than the vocabulary holds bans every token in the end: plain
    generate's sampling raises there (torch.multinomial), and so does speculation, with an error that says why,
    rather than emitting a token drawn from no distribution. Greedy decoding takes the first token then, in both."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6], seed=3, repeat_period=4)
    banned = dict(attention_mask=mask, max_new_tokens=140, no_repeat_ngram_size=1, pad_token_id=0, eos_token_id=None)
    sampling = banned | dict(do_sample=True, top_k=4)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        target.generate(ids, **sampling)
    greedy = target.generate(ids, **banned, do_sample=False)
    configs = {"ngram_tree": _configs(target)["ngram_tree"], "random_draft_tree": _configs(target)["random_draft_tree"],
               "eagle": SpeculativeConfig(method="eagle", heads=eagle_head(target), num_speculative_tokens=3)}
    for config in configs.values():
        with pytest.raises(RuntimeError, match=r"sampling: row \d has no token with a finite score to sample at new "
                                               r"token 1[23]\d \(the logits processors left every token at -inf"):
            hf_specdec.generate(target, ids, speculative=config, **sampling)
        assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **banned, do_sample=False), greedy)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_with_a_pinned_schedule_is_reproducible_from_a_seed(method):
    """With `schedule="fixed"` a seed, the config's or torch's global one, gives the same text every call, and
    another seed other text. (The adaptive schedule's widths follow measured step times, so there the same seed can
    draw other text, with the same law.)"""
    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=True, temperature=1.5, eos_token_id=None)
    drafter = dict(draft_model=make_draft()) if method == "draft" else {}

    def sample(seed=None, global_seed=None):
        if global_seed is not None:
            torch.manual_seed(global_seed)
        config = SpeculativeConfig(method=method, schedule="fixed", seed=seed, num_speculative_tokens=3, **drafter)
        return hf_specdec.generate(target, ids, speculative=config, **kwargs)

    assert torch.equal(sample(seed=5), sample(seed=5))
    assert not torch.equal(sample(seed=5), sample(seed=6))
    assert torch.equal(sample(global_seed=5), sample(global_seed=5))
    assert not torch.equal(sample(global_seed=5), sample(global_seed=6))


@pytest.mark.parametrize("copies", [1, 2])
def test_encoder_repetition_penalty_matches_plain_generate(copies):
    """The encoder repetition penalty holds one prompt per row of the prompts (not of the batch when each prompt
    is generated `num_return_sequences` times): each row is scored with its own prompt's tokens."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6, 8], seed=1, repeat_period=3)
    # copies of a prompt need sampling; with top-k 1 it draws the best token, as greedy decoding does
    decoding = GREEDY if copies == 1 else {**GREEDY, "do_sample": True, "top_k": 1}
    kwargs = dict(attention_mask=mask, num_return_sequences=copies, **decoding)
    expected = target.generate(ids, encoder_repetition_penalty=1.6, **kwargs)
    assert not torch.equal(expected, target.generate(ids, **kwargs)), "the penalty must matter"
    kwargs["encoder_repetition_penalty"] = 1.6
    for name, config in _configs(target).items():
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), name
        assert out.spec_stats.num_draft_tokens > 0, name
