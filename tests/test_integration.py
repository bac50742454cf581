"""The public entry points: both spellings, enable/disable, streamers, and every bad input (before any work)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import SynthIDTextWatermarkingConfig
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from hf_specdec.integration import check_transformers_version
from tests.conftest import make_draft, make_model, padded_batch

GREEDY = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
EAGLE = EagleHead(EagleConfig.for_target(make_model("llama")))
MEDUSA = MedusaHeads(MedusaConfig(hidden_size=EAGLE.config.hidden_size, vocab_size=EAGLE.config.vocab_size, num_heads=3))


@pytest.fixture
def enabled():
    hf_specdec.enable()
    yield
    hf_specdec.disable()


def test_enable_is_idempotent_and_disable_restores(enabled):
    from transformers.generation.utils import GenerationMixin

    patched = GenerationMixin.generate
    hf_specdec.enable()
    assert GenerationMixin.generate is patched and hf_specdec.is_enabled()
    hf_specdec.disable()
    assert not hf_specdec.is_enabled()
    with pytest.raises(ValueError, match="speculative"):
        make_model("llama").generate(torch.tensor([[5, 6]]), speculative=SpeculativeConfig(method="ngram"))
    hf_specdec.enable()


@pytest.mark.parametrize("option", [{"assistant_model": "draft"}, {"prompt_lookup_num_tokens": 3}])
def test_transformers_assisted_generation_on_a_batch_says_how_to_batch_it(enabled, option, forward_counter):
    """transformers' own assisted generation stays its own (one row), and on a batch the error names hf_specdec's
    spelling before any forward."""
    target, draft = make_model("llama"), make_draft()
    option = {name: draft if value == "draft" else value for name, value in option.items()}
    (name, _), = option.items()
    ids, mask = padded_batch([9, 6], seed=3, repeat_period=4)
    count = forward_counter(target)
    with pytest.raises(ValueError, match=rf"{name}=: transformers' own assisted generation runs one row at a time, "
                                         r"and this batch has 2; hf_specdec drafts for the whole batch: pass "):
        target.generate(ids, attention_mask=mask, **option, **GREEDY)
    assert count() == 0
    one = padded_batch([9], seed=3, repeat_period=4)[0]
    assert torch.equal(target.generate(one, **option, **GREEDY), target.generate(one, **GREEDY))


def test_all_spellings_agree(enabled):
    target = make_model("llama")
    draft = make_draft()
    ids, mask = padded_batch([6, 9], seed=1, repeat_period=3)
    expected = target.generate(ids, attention_mask=mask, **GREEDY)
    config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=5)
    outputs = [
        target.generate(ids, attention_mask=mask, speculative=config, **GREEDY),
        target.generate(ids, attention_mask=mask, assistant=draft, spec_method="draft", **GREEDY),
        target.generate(ids, attention_mask=mask, assistant=draft, **GREEDY),
        target.generate(ids, attention_mask=mask, spec_method="ngram", **GREEDY),
        hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY),
    ]
    for out in outputs:
        assert torch.equal(out, expected)


def test_spec_stats_fields():
    target = make_model("llama")
    ids, mask = padded_batch([6, 9, 4], seed=1, repeat_period=2)
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=3)
    out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, return_dict_in_generate=True, **GREEDY)
    stats = out.spec_stats
    assert len(stats.per_row) == 3
    assert stats.num_accepted_tokens == sum(r.num_accepted_tokens for r in stats.per_row)
    assert stats.accepted_per_position[0] == stats.num_drafts
    # 12 new tokens per row: the first from the prefill, then drafts of 3, 3 and 2 (the budget), all accepted
    assert [r.accepted_per_position for r in stats.per_row] == [[3, 3, 2]] * 3
    assert stats.mean_acceptance_length == 1 + 24 / 9
    assert stats.target_forward_passes == 4
    assert stats.to_dict()["acceptance_rate"] == 1.0


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_streamer_receives_every_token_in_order(enabled, method):
    target = make_model("llama")
    ids = torch.tensor([[7, 8, 9, 7, 8, 9, 7]])
    plain, ours = Recorder(), Recorder()
    target.generate(ids, streamer=plain, **GREEDY)
    spec = dict(speculative=SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target))) if method == "draft" \
        else dict(spec_method="ngram")
    target.generate(ids, streamer=ours, **spec, **GREEDY)
    assert ours.chunks == plain.chunks  # the prompt, then one token at a time
    assert ours.ended and plain.ended


@pytest.mark.parametrize("eos", [False, True])
def test_streamer_receives_every_rows_tokens_column_by_column(enabled, eos):
    """A batch of 2, left padded: the streamer gets each step's [B] tokens as plain generate puts them (a finished
    row's as padding), not the first row's alone, nor stopping when the first row stops."""
    target = make_model("llama")
    ids, mask = padded_batch([5, 7], seed=1, repeat_period=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    if eos:  # a token the first row emits early
        free = target.generate(ids, **kwargs)
        kwargs["eos_token_id"] = int(free[0, ids.shape[1] + 1])
    plain, ours = Recorder(), Recorder()
    expected = target.generate(ids, streamer=plain, **kwargs)
    assert torch.equal(target.generate(ids, streamer=ours, spec_method="ngram", **kwargs), expected)
    assert ours.chunks == plain.chunks and ours.ended
    assert len(plain.chunks) == 1 + 8 and all(len(chunk) == 2 for chunk in plain.chunks[1:])


def test_one_token_prompt_with_draft():
    target = make_model("gpt_neox")
    ids = torch.tensor([[5], [9]])
    expected = target.generate(ids, **GREEDY)
    config = SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=3)
    assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **GREEDY), expected)


def test_draft_with_padded_vocabulary_works_on_the_shared_part():
    target = make_model("llama")
    ids, mask = padded_batch([8, 5], seed=2)
    expected = target.generate(ids, attention_mask=mask, **GREEDY)
    for vocab in (130, 192):  # 128 padded up, both ways round
        config = SpeculativeConfig(method="draft", draft_model=make_draft(vocab=vocab), num_speculative_tokens=4)
        for sample in (False, True):
            out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config,
                                      **{**GREEDY, "do_sample": sample})
            assert out.shape == expected.shape and (out < 128).all()
            if not sample:
                assert torch.equal(out, expected)


def test_transformers_version_range():
    check_transformers_version("5.23.0")
    check_transformers_version("5.24.0")
    with pytest.raises(RuntimeError, match="transformers >=5.23.0,<5.25.0"):
        check_transformers_version("4.57.1")
    with pytest.raises(RuntimeError, match="found 5.25.0"):
        check_transformers_version("5.25.0")
    with pytest.raises(RuntimeError, match="found 6.1.0"):
        check_transformers_version("6.1.0")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(method="lookahead"), "SpeculativeConfig.method: unknown method 'lookahead'"),
        (dict(method="draft"), "SpeculativeConfig.draft_model: method='draft' needs a draft model"),
        (dict(method="draft", draft_model="gpt2"), "SpeculativeConfig.draft_model: expected a transformers"),
        (dict(method="ngram", draft_model=make_draft()), "does not use a draft model"),
        (dict(method="ngram", num_speculative_tokens=0), r"num_speculative_tokens: expected an int in \[1, 64\]"),
        (dict(method="ngram", num_speculative_tokens=1000), r"num_speculative_tokens: expected an int in \[1, 64\]"),
        (dict(method="ngram", num_speculative_tokens=2.5), "num_speculative_tokens: expected an int"),
        (dict(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min .4. must be <="),
        (dict(method="ngram", prompt_lookup_min=0), "prompt_lookup_min: expected an int >= 1"),
        (dict(method="ngram", seed=-1), "seed: expected an int >= 0"),
        (dict(method="ngram", tree_width=0), r"tree_width: expected an int in \[1, 512\]"),
        (dict(method="ngram", tree_width=200, num_speculative_tokens=5), "over the budget of 512"),
        (dict(method="medusa", heads=MEDUSA, tree_total_tokens=4),
         r"trees of a chosen size need a method of \['draft', 'eagle', 'mtp', 'mlp_speculator', 'early_exit', 'auto', "
         r"'ngram', 'recycling'\], got 'medusa'"),
        (dict(method="ngram", tree_total_tokens=4),
         "n-gram lookup drafts a trie of tree_width continuations and tree_width is 1, a chain of k tokens; set "
         "tree_width"),
        (dict(method="ngram", tree_width=2, num_speculative_tokens=3, tree_total_tokens=7),
         r"tree_total_tokens: expected an int in \[1, 6\]"),
        (dict(method="draft", draft_model=make_draft(), tree_width=2, num_speculative_tokens=2, tree_total_tokens=7),
         r"tree_total_tokens: expected an int in \[1, 6\], got 7: with k = 2 and tree_width = 2, method='draft' has 6 "
         r"draft nodes to keep \(the tree_width best nodes of each of k depths, each offering tree_width children\); "
         r"lower tree_total_tokens or raise num_speculative_tokens / tree_width"),
        (dict(method="draft", draft_model=make_draft(), tree_total_tokens="auto"),
         r"tree_total_tokens='auto' sizes a dynamic tree of tree_width >= 2 branches per node, and tree_width is 1"),
        (dict(method="draft", draft_model=make_draft(), tree_width=2, tree_total_tokens="big"),
         r"tree_total_tokens: expected an int or 'auto', got 'big'"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(method="medusa", heads=EAGLE),
         "heads: method='medusa' needs hf_specdec.heads.MedusaHeads, got an EagleHead; an EagleHead is for method='eagle'"),
        (dict(method="eagle", heads=MEDUSA),
         "heads: method='eagle' needs hf_specdec.heads.EagleHead, got a MedusaHeads; a MedusaHeads is for method='medusa'"),
        (dict(method="eagle", heads=make_draft()), "got a LlamaForCausalLM; a causal LM is a draft model, for method='draft'"),
        (dict(method="draft", draft_model=EAGLE), "draft_model: expected a transformers causal LM .*, got an EagleHead; "),
        (dict(method="medusa", heads=MEDUSA, tree_paths=[[0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]),
         "SpeculativeConfig.tree_paths: "),
        (dict(method="medusa", heads=MEDUSA, tree_paths=[[0, 1]]), "SpeculativeConfig.tree_paths: "),
        (dict(method="medusa", heads=MEDUSA, tree_paths="wide"), "SpeculativeConfig.tree_paths: "),
    ],
)
def test_each_method_checks_the_type_of_its_drafter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


NGRAM = SpeculativeConfig(method="ngram")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (dict(speculative=NGRAM, num_beams=2), "num_beams=2: beam search cannot be combined"),
        (dict(speculative=NGRAM, penalty_alpha=0.6, top_k=4), "generation mode 'contrastive_search'"),
        (dict(speculative=NGRAM, cache_implementation="offloaded"), "cache_implementation='offloaded'"),
        (dict(speculative=NGRAM, guidance_scale=1.5), "guidance_scale: classifier-free guidance runs the model"),
        (dict(speculative=NGRAM, watermarking_config=SynthIDTextWatermarkingConfig(keys=[5, 9, 13], ngram_len=3)),
         r"watermarking_config: a SynthIDTextWatermarkingConfig's processor keeps state"),
        (dict(speculative=NGRAM, assistant=make_draft()), "assistant=: conflicts with speculative's draft_model"),
        (dict(spec_method="ngram", assistant=make_draft()),
         "assistant=: spec_method='ngram' drafts from the text and takes no assistant, got a LlamaForCausalLM"),
        (dict(spec_method="medusa", assistant=EAGLE),
         "assistant=: spec_method='medusa' needs hf_specdec.heads.MedusaHeads, got an EagleHead; an EagleHead is for "
         "method='eagle'"),
        (dict(spec_method="draft", assistant=MEDUSA), "assistant=: spec_method='draft' needs a transformers causal LM"),
        (dict(spec_method="medusa"), "spec_method='medusa' needs assistant=<hf_specdec.heads.MedusaHeads>"),
        (dict(speculative=NGRAM, spec_method="draft"), "spec_method='draft' conflicts with speculative.method='ngram'"),
        (dict(speculative=NGRAM, assistant_model=make_draft()), "assistant_model: transformers' own option"),
        (dict(speculative=NGRAM, prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens: transformers' own option"),
        (dict(speculative="ngram"), "speculative: expected a hf_specdec.SpeculativeConfig"),
        (dict(spec_method="draft"), "spec_method='draft' needs assistant="),
        (dict(spec_method="eagle"), "spec_method='eagle' needs assistant="),
        (dict(spec_method="lookahead"), "spec_method='lookahead': unknown method"),
        (dict(assistant=make_draft(vocab=1000)), "vocabulary size 1000 does not match the target's 128"),
    ],
)
def test_bad_generate_call_fails_before_any_forward(call, match, forward_counter):
    target = make_model("llama")
    count = forward_counter(target)
    ids, mask = padded_batch([5, 3], seed=0)
    with pytest.raises(ValueError, match=match):
        hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=4, **call)
    assert count() == 0, "an invalid call must not run the model"


def test_assistant_without_spec_method_takes_the_method_its_type_names():
    from hf_specdec.integration import resolve_config

    assert resolve_config(None, EAGLE, None).method == "eagle"
    assert resolve_config(None, MEDUSA, None).method == "medusa"
    assert resolve_config(None, make_draft(), None).method == "draft"


def test_medusa_drafts_as_many_tokens_as_it_has_heads_and_says_so():
    target = make_model("llama")
    ids, mask = padded_batch([6, 4], seed=2)
    config = SpeculativeConfig(method="medusa", heads=MEDUSA, num_speculative_tokens=5, schedule="fixed")
    with pytest.warns(UserWarning, match=r"num_speculative_tokens=5: these Medusa heads guess 3 tokens ahead"):
        out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, return_dict_in_generate=True,
                                  **GREEDY)
    assert out.spec_stats.num_speculative_tokens == 3
    assert len(out.spec_stats.accepted_per_position) == 3
    stats = out.spec_stats
    assert 2 * stats.num_drafts < stats.num_draft_tokens <= 3 * stats.num_drafts  # 3 per step (fewer near the end)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=ngram, return_dict_in_generate=True,
                              **GREEDY)
    assert out.spec_stats.num_speculative_tokens == 4


def test_draft_with_other_special_tokens_is_refused():
    target = make_model("llama")
    draft = make_draft()
    draft.generation_config.eos_token_id = 7
    with pytest.raises(ValueError, match="eos_token_id \\[7\\] does not match the target's \\[1\\]"):
        hf_specdec.generate(target, torch.tensor([[4, 5]]), assistant=draft, max_new_tokens=3)


def test_text_iterator_streamer_yields_the_same_text(enabled):
    from threading import Thread

    from transformers import AutoTokenizer, TextIteratorStreamer

    from hf_specdec.testbed.loading import testbed_dir

    tokenizer = AutoTokenizer.from_pretrained(testbed_dir() / "tokenizer")
    target = make_model("llama")
    ids = torch.tensor([[70, 71, 72, 70, 71, 72, 70]])
    texts = []
    for spec in ({}, {"spec_method": "ngram"}):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        thread = Thread(target=target.generate, args=(ids,), kwargs=dict(streamer=streamer, **spec, **GREEDY))
        thread.start()
        texts.append("".join(streamer))
        thread.join()
    assert texts[0] == texts[1] and texts[0]


def test_text_generation_pipeline_takes_the_keywords(enabled):
    """A transformers `pipeline` hands its generate keywords to `model.generate`: batched, left-padded prompts
    give the texts plain `generate` gives."""
    from transformers import pipeline

    from hf_specdec.testbed import load_testbed

    tokenizer, model, small_model = load_testbed()
    tokenizer.padding_side = "left"
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = ["def parse_args(argv):\n", "import os\nimport sys\n\n", "class Point:\n    def __init__(self"]
    options = dict(max_new_tokens=16, do_sample=False, batch_size=3)
    plain = generator(prompts, **options)
    assert all(text[0]["generated_text"].startswith(prompt) and text[0]["generated_text"] != prompt
               for text, prompt in zip(plain, prompts, strict=True))
    calls = {"target": 0, "draft": 0}
    model.register_forward_hook(lambda *_: calls.__setitem__("target", calls["target"] + 1))
    small_model.register_forward_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))
    config = SpeculativeConfig(method="draft", draft_model=small_model, num_speculative_tokens=4)
    assert generator(prompts, speculative=config, **options) == plain
    assert calls["draft"] > 0 and calls["target"] < options["max_new_tokens"]  # drafts were verified
    assert generator(prompts, spec_method="ngram", **options) == plain
