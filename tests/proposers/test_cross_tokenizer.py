"""A draft with another tokenizer: greedy output exactly plain `generate`'s (batched, padded), sampling exactly the
target's law (drafts on the shared vocabulary), and the errors."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.proposers.cross_tokenizer import CrossTokenizerProposer, VocabularyMap, continuation_ids
from hf_specdec.testbed import load_testbed
from hf_specdec.testbed.other_tokenizer import permuted
from tests.decoding import test_sampling_lossless as law_test
from tests.proposers.other_tokenizers import byte_level

PROMPTS = ["def parse_args(argv):\n", "import os\nimport sys\n\n", "class Foo:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def testbed():
    tokenizer, target, draft = load_testbed()
    return tokenizer, target, draft


@pytest.fixture(scope="module")
def other_drafts(testbed):
    tokenizer, _, draft = testbed
    return {"permuted": permuted(tokenizer, draft), "bytes": byte_level()}


@pytest.mark.parametrize("side", ["left", "right"])
def test_greedy_matches_plain_generate(testbed, other_drafts, side):
    """Batch 3 of different lengths; the permuted draft is the test bed's draft under other ids (its drafts are
    accepted as often as with the shared tokenizer), the byte-level one segments text unlike the target."""
    tokenizer, target, draft = testbed
    tokenizer.padding_side = side
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(**batch, **kwargs)
    own = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=4)
    shared = hf_specdec.generate(target, **batch, **kwargs, return_dict_in_generate=True, speculative=own)
    for name, (draft_tokenizer, other) in other_drafts.items():
        config = SpeculativeConfig(method="draft", draft_model=other, draft_tokenizer=draft_tokenizer,
                                   tokenizer=tokenizer, num_speculative_tokens=4)
        out = hf_specdec.generate(target, **batch, **kwargs, speculative=config, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected), f"{name}/{side}"
        assert out.spec_stats.num_draft_tokens > 0, name
        if name == "permuted" and side == "left":
            assert out.spec_stats.num_accepted_tokens >= 0.8 * shared.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_draft_whose_learned_positions_end_before_its_text_is_exact_and_warned(testbed, do_sample):
    """A GPT-2 draft whose table holds 64 positions, drafting byte by byte: its text passes the table within the
    call; every later position is read as its last one, the output is plain generate's, and one warning says why
    the drafts there are rarely kept."""
    tokenizer, target, _ = testbed
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPTS[0] * 2, PROMPTS[1]], return_tensors="pt", padding=True)
    draft_tokenizer, draft = byte_level(learned_positions=64)
    config = SpeculativeConfig(method="draft", draft_model=draft, draft_tokenizer=draft_tokenizer,
                               tokenizer=tokenizer, num_speculative_tokens=4)
    kwargs = dict(max_new_tokens=12, do_sample=do_sample, eos_token_id=None)
    torch.manual_seed(0)
    expected = target.generate(**batch, **kwargs)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="holds 64 positions and this call reaches .* tokens of the draft's") as seen:
        out = hf_specdec.generate(target, **batch, **kwargs, speculative=config, return_dict_in_generate=True)
    assert sum("learned positions" in str(w.message) for w in seen) == 1
    assert out.spec_stats.num_draft_tokens > 0
    if not do_sample:
        assert torch.equal(out.sequences, expected)


def test_greedy_drafts_report_their_retokenised_depths(testbed, other_drafts, monkeypatch):
    """Greedy drafts are re-tokenised on the host, so the proposal tells the schedule each row's real draft depth
    (the bytes draft's k draft tokens make fewer target tokens): no position past it counts as rejected."""
    from hf_specdec.schedule.controller import Schedule

    tokenizer, target, _ = testbed
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    seen, observe = [], Schedule.observe

    def recording(self, state, proposal):
        seen.append((proposal.host_depths, list(self.allowed), proposal.num_draft_tokens.tolist()))
        observe(self, state, proposal)

    monkeypatch.setattr(Schedule, "observe", recording)
    draft_tokenizer, other = other_drafts["bytes"]
    config = SpeculativeConfig(method="draft", draft_model=other, draft_tokenizer=draft_tokenizer,
                               tokenizer=tokenizer, num_speculative_tokens=4)
    hf_specdec.generate(target, **batch, max_new_tokens=16, do_sample=False, eos_token_id=None, speculative=config)
    drafted = [entry for entry in seen if any(entry[1])]
    assert drafted
    for depths, allowed, counts in drafted:
        assert depths is not None and list(depths) == counts and all(d <= a for d, a in zip(depths, allowed))
    assert any(d < a for depths, allowed, _ in drafted for d, a in zip(depths, allowed)), drafted


def test_the_draft_reads_the_target_text(testbed, other_drafts, monkeypatch):
    """After every step each row's draft tokens spell exactly the text of the target tokens it has read, including
    characters of several bytes that the target's tokens split (the draft waits for the rest of a character)."""
    tokenizer, target, _ = testbed
    tokenizer.padding_side = "left"
    prompts = ["s = 'naïve café ✓ — 日本語'\n", "# → ü\nx = 1\n"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in batch.input_ids[0].tolist()), "a split character"
    checked = []
    commit = CrossTokenizerProposer.commit

    def checking(self, state, result):
        commit(self, state, result)
        for b, row in enumerate(self.rows):
            text = tokenizer.decode(self.text.row(b)[: row.read].tolist(), skip_special_tokens=True)
            assert self.draft_tokenizer.decode(row.draft, skip_special_tokens=True) == text
            assert len(row.draft) - row.cached >= 1
            checked.append(row.read)

    monkeypatch.setattr(CrossTokenizerProposer, "commit", checking)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = target.generate(**batch, **kwargs)
    for draft_tokenizer, draft in other_drafts.values():
        config = SpeculativeConfig(method="draft", draft_model=draft, draft_tokenizer=draft_tokenizer,
                                   tokenizer=tokenizer, num_speculative_tokens=3)
        assert torch.equal(hf_specdec.generate(target, **batch, **kwargs, speculative=config), expected)
    assert len(checked) > 8


def test_transformers_spelling(testbed, other_drafts):
    """`model.generate(assistant=draft, assistant_tokenizer=..., tokenizer=...)`, as transformers spells it."""
    tokenizer, target, _ = testbed
    tokenizer.padding_side = "left"
    draft_tokenizer, draft = other_drafts["permuted"]
    batch = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = target.generate(**batch, **kwargs)
    hf_specdec.enable()
    try:
        out = target.generate(**batch, **kwargs, assistant=draft, assistant_tokenizer=draft_tokenizer,
                              tokenizer=tokenizer)
        assert torch.equal(out, expected)
        with pytest.raises(ValueError, match="pass tokenizer=... to generate"):
            target.generate(**batch, **kwargs, assistant=draft, assistant_tokenizer=draft_tokenizer)
    finally:
        hf_specdec.disable()


def test_same_vocabulary_takes_the_shared_tokenizer_path(testbed):
    """Tokenizers with one vocabulary: drafts are the draft model's own, as without tokenizers."""
    tokenizer, target, draft = testbed
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    plain = hf_specdec.generate(target, **batch, **kwargs,
                                speculative=SpeculativeConfig(method="draft", draft_model=draft))
    given = hf_specdec.generate(target, **batch, **kwargs, speculative=SpeculativeConfig(
        method="draft", draft_model=draft, draft_tokenizer=tokenizer, tokenizer=tokenizer))
    assert given.spec_stats == plain.spec_stats


def test_continuation_ids_tokenise_running_text(other_drafts, testbed):
    tokenizer = testbed[0]
    text = "    return self.value\n"
    for tail_end in range(1, len(text)):
        ids = tokenizer.encode(text[:tail_end], add_special_tokens=False) + continuation_ids(
            tokenizer, text[:tail_end], text[tail_end:])
        assert tokenizer.decode(ids) == text
    byte_tokenizer = other_drafts["bytes"][0]
    assert continuation_ids(byte_tokenizer, "x = ", "42") == byte_tokenizer.encode("42")


# ---- sampling: tiny tokenizers over the law test's 8 tokens ----


def _char_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], upper: str = "") -> PreTrainedTokenizerFast:
    """Byte-level BPE over `vocab`; the letters in `upper` are read as capitals."""
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    if upper:
        backend.normalizer = normalizers.Sequence([normalizers.Replace(c, c.upper()) for c in upper])
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _law_tokenizers():
    """The target's: one token per letter a-h (ids 0-7, the law test's vocabulary); the draft's reads d, e, f as
    D, E, F, has x and the merges ab, bc, DE, in another order. Shared: a, b, c, which the target mostly emits."""
    target = _char_tokenizer({c: i for i, c in enumerate("abcdefgh")}, [])
    draft_vocab = {"x": 0, "F": 1, "E": 2, "D": 3, "c": 4, "b": 5, "a": 6, "ab": 7, "DE": 8, "bc": 9}
    draft = _char_tokenizer(draft_vocab, [("a", "b"), ("D", "E"), ("b", "c")], upper="def")
    return target, draft


def _law_draft(vocab: int) -> LlamaForCausalLM:
    """A random one-layer Llama with damped logits: its drafts spread over the shared tokens."""
    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=None,
                                         bos_token_id=None, eos_token_id=None)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.1)
    return model


@pytest.fixture(scope="module")
def law_setup():
    target_tokenizer, draft_tokenizer = _law_tokenizers()
    return law_test.make_target(), target_tokenizer, draft_tokenizer, _law_draft(len(draft_tokenizer))


def test_sampling_matches_exact_target_law(law_setup):
    """The law test's target (its power is checked there) with a draft of another vocabulary; drafts accepted and
    rejected at depths 1 and 2."""
    target, target_tokenizer, draft_tokenizer, draft = law_setup
    assert target_tokenizer.decode(law_test.PROMPT[0]) == "defdefde"
    vocab = VocabularyMap.build(draft_tokenizer, target_tokenizer, law_test.VOCAB, len(draft_tokenizer))
    assert sorted(vocab.target_ids.tolist()) == [0, 1, 2]
    assert draft_tokenizer.encode("defdefde") == [8, 1, 8, 1, 8]
    config = SpeculativeConfig(method="draft", draft_model=draft, draft_tokenizer=draft_tokenizer,
                               tokenizer=target_tokenizer, num_speculative_tokens=3, seed=31)
    law_test.assert_exact_law_with_drafts(target, config)


def test_sampling_test_catches_a_misreported_draft_distribution(law_setup, monkeypatch):
    """Were the shared-vocabulary distribution not carried to the target's ids as drawn (here: reported uniform),
    the law test above would fail."""
    target, target_tokenizer, draft_tokenizer, draft = law_setup
    draw = CrossTokenizerProposer._draw

    def misreported(self, logits):
        token, feed, probs = draw(self, logits)
        return token, feed, torch.full_like(probs, 1.0 / probs.shape[-1])

    monkeypatch.setattr(CrossTokenizerProposer, "_draw", misreported)
    config = SpeculativeConfig(method="draft", draft_model=draft, draft_tokenizer=draft_tokenizer,
                               tokenizer=target_tokenizer, num_speculative_tokens=3, seed=31)
    law = law_test.exact_law(target, law_test.TEMPERATURE)
    assert not law_test.accepted(law_test.chi_square_pvalues(law_test.draws(target, law_test.TEMPERATURE, config), law))


# ---- errors ----


def test_errors(testbed, other_drafts):
    tokenizer, target, _ = testbed
    draft_tokenizer, draft = other_drafts["bytes"]
    batch = tokenizer(PROMPTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match=r"vocabulary size 258 does not match the target's 4096.*draft_tokenizer"):
        hf_specdec.generate(target, **batch, max_new_tokens=4,
                            speculative=SpeculativeConfig(method="draft", draft_model=draft))
    with pytest.raises(ValueError, match="SpeculativeConfig.tokenizer: .*draft_tokenizer was given, tokenizer is"):
        SpeculativeConfig(method="draft", draft_model=draft, draft_tokenizer=draft_tokenizer)
    with pytest.raises(ValueError, match="SpeculativeConfig.draft_tokenizer: expected a transformers tokenizer"):
        SpeculativeConfig(method="draft", draft_model=draft, draft_tokenizer="gpt2", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="only method='draft' takes tokenizers"):
        SpeculativeConfig(method="ngram", draft_tokenizer=draft_tokenizer, tokenizer=tokenizer)
    config = dict(method="draft", draft_model=draft, draft_tokenizer=draft_tokenizer, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="chains only"):
        hf_specdec.generate(target, **batch, max_new_tokens=4, speculative=SpeculativeConfig(**config, tree_width=2))
    with pytest.raises(ValueError, match="static caches and compiled forwards are not supported with draft_tokenizer"):
        hf_specdec.generate(target, **batch, max_new_tokens=4, cache_implementation="static",
                            speculative=SpeculativeConfig(**config))
    digits = _char_tokenizer({c: i for i, c in enumerate("0123456789")}, [])
    with pytest.raises(ValueError, match="no token string is in both vocabularies"):
        VocabularyMap.build(digits, _law_tokenizers()[0], 8, 10)
