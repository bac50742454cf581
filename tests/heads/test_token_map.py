"""Token maps: heads that project with the target's lm_head draft over its rows at the map only, losslessly (greedy
equality on several architectures with padding; the sampling law test has token-map cases), and the map is built,
checked, sliced, saved and refused as documented."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from hf_specdec.heads.eagle import export_speculators
from hf_specdec.heads.token_map import TokenMapLMHead, check_token_map, most_frequent_tokens, token_map_lm_head
from hf_specdec.proposers.medusa import MedusaProposer
from tests.conftest import VOCAB, make_model, padded_batch, record_eagle_guesses, record_proposed_tokens
from tests.proposers.test_eagle import trained_head

# half the vocabulary, scattered, so the target often wants a token the heads cannot draft
HALF = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[: VOCAB // 2].sort().values


def shared_medusa(target: torch.nn.Module, num_heads: int = 3) -> MedusaHeads:
    """Heads on the target's lm_head whose blocks start at zero: head i guesses the target's next token again."""
    text = target.config.get_text_config()
    return MedusaHeads(MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size, num_heads=num_heads,
                                    shared_lm_head=True)).eval()


def test_most_frequent_tokens_by_count_then_id():
    ids = torch.tensor([[7, 7, 3, 3, 9], [3, 1, 1, 7, 0]])  # counts: 3 -> 3, 7 -> 3, 1 -> 2, 9 -> 1, 0 -> 1
    assert most_frequent_tokens(ids, 10, 3).tolist() == [1, 3, 7]
    assert most_frequent_tokens(ids, 10, 4).tolist() == [0, 1, 3, 7]  # 0 and 9 tie: the smaller id
    assert most_frequent_tokens(ids, 10, 10).tolist() == list(range(10))  # unseen ids fill the map last
    for size in (0, 11):
        with pytest.raises(ValueError, match="size"):
            most_frequent_tokens(ids, 10, size)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[1, 2]]), "1-D"), (torch.tensor([], dtype=torch.long), "non-empty"), ([1, 2], "1-D"),
    (torch.tensor([1.0, 2.0]), "integer"), (torch.tensor([3, 128]), r"\[0, 128\)"), (torch.tensor([-1, 3]), "lie in"),
    (torch.tensor([4, 2, 4]), "distinct"),
])
def test_bad_token_maps_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message) as error:
        check_token_map(bad, VOCAB, "EagleHead.set_token_map")
    assert "EagleHead.set_token_map" in str(error.value)


@pytest.mark.parametrize("shape", [(1, 32), (3, 5, 32), (2, 1, 7, 32)])
def test_sliced_logits_equal_the_lm_heads_at_the_map_and_minus_inf_elsewhere(shape):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    ids = torch.tensor([0, 3, 17, 64, 127])
    hidden = torch.randn(shape)
    logits = TokenMapLMHead(lm_head, ids, VOCAB)(hidden)
    assert logits.shape == (*shape[:-1], VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[..., ids], lm_head(hidden)[..., ids])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(logits[..., outside]).all())


def test_the_slice_is_reused_and_rebuilt_when_the_weight_or_map_changes():
    lm_head = torch.nn.Linear(32, VOCAB, bias=False)
    ids = HALF.clone()
    first = token_map_lm_head(lm_head, ids)
    assert token_map_lm_head(lm_head, ids) is first
    with torch.no_grad():
        lm_head.weight.mul_(2.0)
    second = token_map_lm_head(lm_head, ids)
    assert second is not first and torch.equal(second.weight, lm_head.weight[ids])
    other = ids[:10].clone()  # two maps on one lm_head (two heads of one target) are kept side by side
    third = token_map_lm_head(lm_head, other)
    assert third is not second and token_map_lm_head(lm_head, ids) is second
    assert token_map_lm_head(lm_head, other) is third
    with torch.no_grad():
        ids[0] = 1 if int(ids[0]) != 1 else 0  # a map changed in place is sliced again
    assert token_map_lm_head(lm_head, ids) is not second


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("shape", [dict(num_speculative_tokens=3), dict(top_k=3, depth=3, total_tokens=6)])
def test_eagle_with_a_token_map_matches_plain_generate_and_drafts_only_mapped_ids(arch, shape):
    target = make_model(arch)
    ids, mask = padded_batch([11, 5, 9], seed=4, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    head = trained_head(target, "eagle", expected)
    for token_map in (most_frequent_tokens(expected, VOCAB, 48), HALF):
        head.set_token_map(token_map)
        with pytest.MonkeyPatch.context() as patch:
            drafted = record_eagle_guesses(patch)
            out = hf_specdec.generate(target, ids, speculative=SpeculativeConfig(method="eagle", heads=head, **shape),
                                      return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected)
        assert out.spec_stats.num_draft_tokens > 0
        assert bool(torch.isin(torch.cat(drafted), token_map).all())
    assert out.spec_stats.num_accepted_tokens > 0


def test_a_greedy_dynamic_tree_over_a_map_is_the_one_the_whole_vocabulary_gives(monkeypatch):
    """A greedy EAGLE-2 tree of a head with a token map ranks the map's ids alone (its logits elsewhere are -inf):
    step by step, the trees it proposes are the ones scoring the whole vocabulary gives, and hold only mapped ids."""
    from hf_specdec.proposers import draft_model
    from hf_specdec.proposers.eagle import EagleProposer

    target = make_model("llama")
    ids, mask = padded_batch([11, 5, 9], seed=4, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    head = trained_head(target, "eagle", expected)
    head.set_token_map(HALF)
    config = SpeculativeConfig(method="eagle", heads=head, top_k=3, depth=3, total_tokens=6, schedule="fixed")
    trees, columns = [], []

    class Recorded(draft_model.Candidates):
        def __init__(self, log_probs, width, token_ids=None):
            columns.append(log_probs.shape[-1])
            super().__init__(log_probs, width, token_ids)

    for whole_vocabulary in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            if whole_vocabulary:  # the proposer no longer sees the map: it ranks every id, -inf outside the map
                patch.setattr(draft_model, "TokenMapLMHead", type("NotAMap", (), {}))
            patch.setattr(draft_model, "Candidates", Recorded)
            proposals = record_proposed_tokens(patch, EagleProposer)
            out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        assert torch.equal(out, expected)
        assert set(columns) == {VOCAB if whole_vocabulary else len(HALF)}
        trees.append(proposals)
        columns.clear()
    assert len(trees[0]) == len(trees[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*trees))
    assert bool(torch.isin(torch.cat(trees[0]), HALF).all())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]])
def test_medusa_with_a_token_map_matches_plain_generate_and_drafts_only_mapped_ids(arch, tree, monkeypatch):
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    heads = shared_medusa(target)
    heads.set_token_map(HALF)
    proposals = record_proposed_tokens(monkeypatch, MedusaProposer)
    config = SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=3, tree_paths=tree,
                               schedule="fixed")
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_draft_tokens > 0 and out.spec_stats.num_accepted_tokens > 0
    assert bool(torch.isin(torch.cat(proposals), HALF).all())


def test_token_maps_round_trip_through_adapter_folders(tmp_path):
    target = make_model("llama")
    eagle = EagleHead(EagleConfig.for_target(target, "eagle"))
    medusa = shared_medusa(target)
    for name, head in (("eagle", eagle), ("medusa", medusa)):
        head.set_token_map(HALF)
        head.save_pretrained(tmp_path / name)
        loaded = type(head).from_pretrained(tmp_path / name)
        assert loaded.config.token_map_size == len(HALF) and torch.equal(loaded.token_map, HALF)
        head.set_token_map(None)
        head.save_pretrained(tmp_path / f"{name}-full")
        loaded = type(head).from_pretrained(tmp_path / f"{name}-full")
        assert loaded.token_map is None and loaded.config.token_map_size is None


def test_model_cards_name_the_token_map():
    target = make_model("llama")
    eagle, medusa = EagleHead(EagleConfig.for_target(target, "eagle")), shared_medusa(target)
    for head in (eagle, medusa):
        assert "token map" not in str(head.model_card("org/heads"))
        head.set_token_map(HALF)
        assert f"{len(HALF)} token ids: a token map" in str(head.model_card("org/heads"))


def test_speculators_export_drafts_over_the_whole_vocabulary(tmp_path):
    target = make_model("llama")
    head = EagleHead(EagleConfig.for_target(target, "eagle", base_model_name_or_path="org/target"))
    head.set_token_map(HALF)
    export_speculators(head, tmp_path)
    loaded = EagleHead.from_pretrained(tmp_path)
    assert loaded.token_map is None


def test_heads_that_cannot_take_a_token_map_say_why():
    target = make_model("llama")
    with pytest.raises(ValueError, match="its own draft vocabulary"):
        EagleHead(EagleConfig.for_target(target, "eagle3")).set_token_map(HALF)
    own = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=VOCAB, num_heads=2))
    with pytest.raises(ValueError, match="shared_lm_head=True"):
        own.set_token_map(HALF)
    with pytest.raises(ValueError, match="MedusaConfig.token_map_size"):
        MedusaConfig(hidden_size=32, vocab_size=VOCAB, token_map_size=8)
    with pytest.raises(ValueError, match="MedusaConfig.token_map_size: expected at most"):
        MedusaConfig(hidden_size=32, vocab_size=VOCAB, shared_lm_head=True, token_map_size=VOCAB + 1)
    with pytest.raises(ValueError, match="EagleConfig.token_map_size: only for version 'eagle'"):
        EagleConfig.for_target(target, "eagle3", token_map_size=8)
    with pytest.raises(ValueError, match="vocab_size: these heads do not record"):
        MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=None, shared_lm_head=True)).set_token_map(HALF)


def test_a_token_map_made_for_a_larger_vocabulary_is_refused_before_generating():
    target = make_model("llama")
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=None, shared_lm_head=True))
    heads.set_token_map(torch.tensor([3, 500]), vocab_size=1000)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="past the target's vocabulary"):
        hf_specdec.generate(target, ids, speculative=SpeculativeConfig(method="medusa", heads=heads),
                            max_new_tokens=4)
