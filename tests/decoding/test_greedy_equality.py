"""Greedy speculative output is token-for-token plain `generate`'s, on every architecture, batched and padded."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList, WatermarkingConfig

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.suffix import SuffixCache
from tests.conftest import ARCHITECTURES, DECODER, EOS, SPECIAL, VOCAB, make_draft, make_model, padded_batch

LENGTHS = [12, 7, 10]  # batch 3, left padded; longer than every sliding window in conftest
NEW_TOKENS = 24


def _proposers(target: torch.nn.Module) -> dict[str, SpeculativeConfig]:
    return {
        "random_draft": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=4),
        "same_draft": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4),
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3),
        "random_draft_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3,
                                               tree_width=3),
        "same_draft_tree": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3,
                                             tree_width=2),
        "ngram_tree": SpeculativeConfig(method="ngram", num_speculative_tokens=4, tree_width=3),
        # the trie cut to its likeliest-looking 6 of up to 12 draft nodes
        "ngram_sized_tree": SpeculativeConfig(method="ngram", num_speculative_tokens=4, tree_width=3,
                                              tree_total_tokens=6),
        "random_draft_dynamic_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3,
                                                       tree_width=2, tree_total_tokens=5),
        # the tree's size from this model's measured verify costs (hf_specdec.schedule.tree_size)
        "random_draft_auto_tree": SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3,
                                                    tree_width=2, tree_total_tokens="auto"),
        "suffix": SpeculativeConfig(method="suffix", suffix_cache=SuffixCache()),
        # token recycling's default tree, and a tree of its own rank paths (the table carries over from the first)
        "recycling": SpeculativeConfig(method="recycling"),
        "recycling_paths": SpeculativeConfig(method="recycling", num_speculative_tokens=3,
                                             tree_paths=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
        # k drafts from one forward over the unseen tokens and k - 1 mask tokens (PARD)
        "parallel_draft": SpeculativeConfig(method="draft", draft_model=make_draft(), parallel_drafting=True,
                                            pard_token=VOCAB - 1, num_speculative_tokens=4),
        # suffix rows and draft-model rows in the same steps (the score threshold sits between the two)
        "suffix_hybrid": SpeculativeConfig(
            method="suffix", suffix_cache=SuffixCache(), fallback_min_score=1.5,
            fallback=SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3)),
    }


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_matches_plain_generate(arch, side):
    """Right padding too: plain generate then continues each row at its last prompt position + 1 (trailing pads
    carry position 0) after the whole padded prompt; the output must be the same, padding and all."""
    target = make_model(arch)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5, side=side)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    for name, config in _proposers(target).items():
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        stats = out.spec_stats
        if side == "right":  # the draft reads the trailing pads as text: output exact, acceptance not full
            assert stats.num_draft_tokens > 0
            continue
        if name == "same_draft":
            assert stats.acceptance_rate == 1.0, f"{arch}: a copy of the target must always be accepted"
            # 1 prefill + ceil((NEW_TOKENS - 1) / 5) verify steps
            assert stats.target_forward_passes == 1 + -(-(NEW_TOKENS - 1) // 5)
        if name == "same_draft_tree":
            # the top branch is always accepted whole: 1 prefill + ceil((NEW_TOKENS - 1) / 4) verify steps
            assert stats.target_forward_passes == 1 + -(-(NEW_TOKENS - 1) // 4), arch
        assert stats.num_draft_tokens > 0


# Newer decoder families users bring (per name: the config and model class, and what their tiny config needs beyond
# conftest's DECODER): QK norms, mixtures of experts, NoPE layers, attention sinks with alternating sliding windows,
# scaled residuals, parallel blocks. Checked with fewer proposers than the architectures above: every proposer
# reaches the model through the same cache and masks
NEWER_ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "num_hidden_layers": 4, "sliding_window": 6}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_hidden_layers": 4}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                 "layer_types": ["sliding_attention", "full_attention"]}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
}


@pytest.mark.parametrize("arch", sorted(NEWER_ARCHITECTURES))
def test_newer_architectures_match_plain_generate(arch):
    config_name, model_name, extra = NEWER_ARCHITECTURES[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **{**DECODER, **extra}, **SPECIAL)
    target = getattr(transformers, model_name)(config).eval()
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, **kwargs)
    configs = {name: config for name, config in _proposers(target).items()
               if name in ("random_draft", "same_draft_tree", "ngram", "random_draft_dynamic_tree", "suffix",
                           "recycling")}
    configs["early_exit"] = SpeculativeConfig(method="early_exit", early_exit_layer=1, num_speculative_tokens=3)
    for name, config in configs.items():
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        assert out.spec_stats.num_draft_tokens > 0, f"{arch}/{name}"
        if name in ("same_draft_tree", "ngram"):  # drafts kept (and, for n-gram, some rolled back)
            assert out.spec_stats.num_accepted_tokens > 0, f"{arch}/{name}"


def test_eos_and_processors_match_plain_generate():
    """EOS inside accepted blocks, rows finishing at different steps, prefix-dependent processors."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6, 11, 4], seed=5, repeat_period=3)
    base = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    free = target.generate(ids, **base)[:, ids.shape[1] :]
    eos = int(free[1, 6])  # a token plain decoding emits mid-sequence, so some rows stop early
    kwargs = {**base, "eos_token_id": eos, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "min_new_tokens": 2}
    expected = target.generate(ids, **kwargs)
    assert expected.shape[1] < ids.shape[1] + 30 or (expected == 0).any(), "the EOS should end some row early"
    for config in _proposers(target).values():
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        assert torch.equal(out, expected)


def allowed_by_prompt(period: int):
    """A `prefix_allowed_tokens_fn` that bans one token in `period`, chosen by the prompt's index in the batch and
    the last token."""
    return lambda batch_id, prefix: [t for t in range(VOCAB) if (t + batch_id + int(prefix[-1])) % period]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefix_allowed_tokens_fn_gets_each_rows_batch_index(arch, side):
    """The callback is asked, as in plain generate, with the index of the row's prompt and the row's prefix, at
    every verified position (a chain, a trie, a dynamic tree, suffix and draft-model rows in one step; drafts it
    bans are rejected); in sampling, the copies `num_return_sequences` makes
    share their prompt's index (top-k 1 makes sampling deterministic, so the output compares exactly)."""
    target = make_model(arch)
    ids, mask = padded_batch([9, 6, 11, 4], seed=5, repeat_period=3, side=side)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                  prefix_allowed_tokens_fn=allowed_by_prompt(3))
    expected = target.generate(ids, **kwargs)
    assert not torch.equal(expected, target.generate(ids, **(kwargs | dict(prefix_allowed_tokens_fn=None))))
    accepted = {}
    proposers = _proposers(target)
    for name in ("same_draft", "ngram_tree", "random_draft_dynamic_tree", "suffix_hybrid"):
        config = proposers[name]
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), name
        accepted[name] = out.spec_stats.num_accepted_tokens
    assert accepted["same_draft"] > 0 and accepted["ngram_tree"] > 0, accepted
    sampling = kwargs | dict(do_sample=True, top_k=1, num_return_sequences=2)
    expected = target.generate(ids, **sampling)
    out = hf_specdec.generate(target, ids, speculative=proposers["ngram_tree"], **sampling)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("batch", [2, 3])
def test_token_lists_as_long_as_the_batch_apply_to_every_row(batch):
    """Processors hold their token lists as tensors (suppressed tokens, the EOS ids of min_length and the length
    penalty); a list exactly as long as the batch is still one list for every row, not one token per row."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6, 11][:batch], seed=5, repeat_period=3)
    base = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    free = target.generate(ids, **base)[:, ids.shape[1] :]
    tokens = list(dict.fromkeys(free[:, :3].flatten().tolist()))[:batch]  # tokens every row's text starts with
    assert len(tokens) == batch
    options = {
        "suppress_tokens": dict(suppress_tokens=tokens),
        "min_length": dict(eos_token_id=tokens, min_length=ids.shape[1] + 8),
        "decay": dict(eos_token_id=tokens, exponential_decay_length_penalty=(2, 1.5)),
    }
    for name, option in options.items():
        kwargs = {**base, **option, "return_dict_in_generate": True, "output_scores": True}
        expected = target.generate(ids, **kwargs)
        for proposer in ("same_draft", "ngram_tree"):
            out = hf_specdec.generate(target, ids, speculative=_proposers(target)[proposer], **kwargs)
            assert torch.equal(out.sequences, expected.sequences), (name, proposer)
            eos = torch.tensor(option.get("eos_token_id") or [-1])
            for step, (ours, theirs) in enumerate(zip(out.scores, expected.scores)):
                # rows not ended yet (an ended row's scores are zeros; plain generate computes them on padding)
                live = ~torch.isin(out.sequences[:, ids.shape[1] : ids.shape[1] + step], eos).any(dim=1)
                torch.testing.assert_close(ours[live], theirs[live], msg=f"{name}/{proposer}, step {step}")


def test_prefix_seeded_watermark_matches_plain_generate():
    """WatermarkingConfig's green lists are a function of the prefix: each verified position gets its own."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6, 11], seed=5, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                  watermarking_config=WatermarkingConfig(bias=4.0, seeding_scheme="selfhash"))
    expected = target.generate(ids, **kwargs)
    assert not torch.equal(expected, target.generate(ids, **{**kwargs, "watermarking_config": None}))
    for name in ("ngram", "same_draft", "ngram_tree"):
        out = hf_specdec.generate(target, ids, speculative=_proposers(target)[name], return_dict_in_generate=True,
                                  **kwargs)
        assert torch.equal(out.sequences, expected), name
        assert out.spec_stats.num_accepted_tokens > 0, name


class StopAfter(StoppingCriteria):
    def __init__(self, prompt_length: int, new_tokens: int) -> None:
        self.limit = prompt_length + new_tokens

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.limit, dtype=torch.bool)


def test_custom_stopping_criterion_is_exact():
    """transformers' assisted loop overshoots a custom stop (9 -> 12); here it stops at exactly 9 new tokens."""
    target = make_model("llama")
    ids, mask = padded_batch([8, 5], seed=2)
    criteria = StoppingCriteriaList([StopAfter(ids.shape[1], 9)])
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, stopping_criteria=criteria, **kwargs)
    same = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=5)
    out = hf_specdec.generate(target, ids, speculative=same, stopping_criteria=criteria, **kwargs)
    assert expected.shape[1] == ids.shape[1] + 9
    assert torch.equal(out, expected)


def test_max_new_tokens_is_exact_with_full_acceptance():
    target = make_model("qwen2")
    ids, mask = padded_batch([6, 6], seed=4)
    same = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=7)
    for new_tokens in (1, 2, 8, 9, 17):
        kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
        out = hf_specdec.generate(target, ids, speculative=same, **kwargs)
        assert torch.equal(out, target.generate(ids, **kwargs)), new_tokens


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_generating_to_the_last_learned_position_matches_plain_generate(arch):
    """Models with a table of learned positions (GPT-2, OPT) generate up to its end: the final steps' blocks are as
    wide as the widest row's draft (static shapes: always the full width), and their dummy nodes once took positions
    past the table (an IndexError)."""
    target = make_model(arch)
    limit = getattr(target.config, "n_positions", None) or target.config.max_position_embeddings
    ids, mask = padded_batch([limit - 20, limit - 26, limit - 23], seed=1, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=limit + 1 - ids.shape[1], do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    expected = target.generate(ids, **kwargs)  # it feeds positions up to the table's last
    for config, extra in [(SpeculativeConfig(method="ngram", num_speculative_tokens=5), {}),
                          (SpeculativeConfig(method="suffix"), {}),
                          (SpeculativeConfig(method="ngram", num_speculative_tokens=5), {"cache_implementation": "static"}),
                          (SpeculativeConfig(method="draft", draft_model=make_model(arch), num_speculative_tokens=4,
                                             tree_width=2, tree_total_tokens=5), {"cache_implementation": "static"})]:
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs, **extra)
        assert torch.equal(out, expected), (config.method, extra)


def test_output_scores_and_logits_match_plain_generate():
    target = make_model("llama")
    ids, mask = padded_batch([7, 7], seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, output_scores=True, output_logits=True, repetition_penalty=1.2)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3)
    out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 10
    for ours, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(out.logits, expected.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_eos_token_of_generation_config_default():
    """The model's own generation_config EOS (not passed to generate) is honoured."""
    target = make_model("gpt2")
    ids, mask = padded_batch([5, 8, 3], seed=8)
    target.generation_config.eos_token_id = int(target.generate(ids, attention_mask=mask, max_new_tokens=8,
                                                                do_sample=False, eos_token_id=None)[0, -4])
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    expected = target.generate(ids, **kwargs)
    out = hf_specdec.generate(target, ids, spec_method="ngram", **kwargs)
    assert torch.equal(out, expected)
    assert target.generation_config.eos_token_id != EOS


def test_stop_strings_stop_exactly_where_plain_generate_stops():
    """With an EOS criterion, a row that hits the stop string ends there and is padded; without one, plain
    generate keeps generating it until every row has stopped; both behaviours are reproduced."""
    from transformers import AutoTokenizer

    from hf_specdec.testbed.loading import testbed_dir

    tokenizer = AutoTokenizer.from_pretrained(testbed_dir() / "tokenizer")
    target = make_model("llama")
    ids, mask = padded_batch([8, 5, 6], seed=12, repeat_period=3)
    same = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=5)
    for eos in (None, 127):  # 127: an EOS this model never emits here, so only the stop string ends rows
        kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                      stop_strings=["X"], tokenizer=tokenizer)  # row 0 emits "X" early, row 1 never
        expected = target.generate(ids, **kwargs)
        assert (expected[0, -1] == 0) == (eos is not None), "row 0 is padded exactly when an EOS criterion exists"
        for config in (same, SpeculativeConfig(method="ngram", num_speculative_tokens=5)):
            out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
            assert torch.equal(out, expected), (eos, config.method)
    with pytest.raises(ValueError, match="stop_strings: stopping on strings needs the tokenizer"):
        hf_specdec.generate(target, ids, speculative=same, stop_strings=["X"], max_new_tokens=3)



def test_dynamic_tree_keeps_the_draft_cache_on_the_accepted_path():
    """A peaked model drafting for itself: the greedy path always has the best cumulative log-probability, so
    every step accepts the whole depth, but only if the draft kept exactly the accepted path's KV each time."""
    target = make_model("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(80.0)
    ids, mask = padded_batch([9, 6, 11], seed=4, repeat_period=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=25, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4,
                               tree_width=3, tree_total_tokens=8)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.target_forward_passes == 1 + -(-(25 - 1) // 5)


def test_finished_rows_leave_the_target_cache(monkeypatch):
    """Rows that end early (EOS) are dropped from the target's cache; the others go on, exactly as plain generate,
    for chains, trees and the heads that read the target's features."""
    from hf_specdec.cache.ragged import RaggedKVCache
    from tests.heads.medusa.test_model import heads_for
    from tests.proposers.test_eagle import eagle_head, trained_head

    held_rows = []
    select_rows = RaggedKVCache.select_rows

    def spy(cache, rows, *args):
        held_rows.append(rows.shape[0])
        select_rows(cache, rows, *args)

    monkeypatch.setattr(RaggedKVCache, "select_rows", spy)
    target = make_model("llama")
    ids, mask = padded_batch([9, 6, 11, 4, 8, 7], seed=5, repeat_period=3)
    ids, mask = ids.flip(0), mask.flip(0)  # with this EOS the last rows finish first: now the first ones do
    base = dict(attention_mask=mask, max_new_tokens=30, do_sample=False)
    free = target.generate(ids, eos_token_id=None, **base)[:, ids.shape[1] :]
    # the token that plain decoding emits mid-sequence in the most rows: they stop at different steps
    early = free[:, 2:20]
    eos = max(early.unique().tolist(), key=lambda token: int((early == token).any(dim=1).sum()))
    expected = target.generate(ids, eos_token_id=eos, **base)
    assert (expected[:, -1] == 0).sum() >= 3, "rows should end early"
    configs = {
        **_proposers(target),
        "medusa": SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=3),
        "eagle_tree": SpeculativeConfig(method="eagle", heads=trained_head(target, "eagle", free), top_k=2, depth=3,
                                        total_tokens=5),
        "eagle3": SpeculativeConfig(method="eagle", heads=eagle_head(target, "eagle3"), num_speculative_tokens=3),
    }
    for name, config in configs.items():
        held_rows.clear()
        out = hf_specdec.generate(target, ids, speculative=config, eos_token_id=eos, **base)
        assert torch.equal(out, expected), name
        assert held_rows and held_rows[-1] < ids.shape[0], f"{name}: no finished row left the cache"
    assert (expected[0, -1] == 0) and (expected[-1, -1] != 0), "a row before a held row should leave the cache"
