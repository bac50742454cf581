"""The draft model's dynamic tree: every node it feeds sees exactly its own ancestors."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.proposers.draft_model import DraftModelProposer
from hf_specdec.tree.dynamic import Candidates
from tests.conftest import VOCAB, make_draft, make_model, noisy_copy, padded_batch, record_proposed_tokens


def test_dynamic_tree_nodes_see_exactly_their_ancestors(monkeypatch):
    """With a copy of the target as the draft, the draft's logits at every node fed at depth d are the target's
    logits after some root-to-node path through the nodes fed at depths 1..d-1; a node that missed an ancestor
    (or saw a stranger) would match no path."""
    target = make_model("llama")
    draft = copy.deepcopy(target)
    ids = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9]])
    levels: list[tuple[torch.Tensor, torch.Tensor]] = []  # per draft tree forward: fed tokens [w], logits [w, V]
    original = RaggedKVCache.forward

    def recording(self, input_ids, *args, **kwargs):
        logits = original(self, input_ids, *args, **kwargs)
        # the draft's tree forwards feed top_k = 3 nodes (the forward of the committed tokens before them feeds 2)
        if self.model is draft and input_ids.shape[1] == 3 and len(levels) < 3:
            levels.append((input_ids[0].clone(), logits[0].clone()))
        return logits

    monkeypatch.setattr(RaggedKVCache, "forward", recording)
    # every level drafted (an expansion that settles early stops before depth 3; tests/tree/test_dynamic.py)
    monkeypatch.setattr(Candidates, "settled", lambda self, total: False)
    config = SpeculativeConfig(method="draft", draft_model=draft, top_k=3, depth=4, total_tokens=10)
    hf_specdec.generate(target, ids, speculative=config, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert len(levels) == 3  # the first proposal fed depths 1, 2 and 3
    prefix = torch.cat([ids, ids.new_tensor([[0]])], dim=1)  # placeholder for the first committed token
    with torch.no_grad():
        prefix[0, -1] = target(ids).logits[0, -1].argmax()
    for depth, (tokens, logits) in enumerate(levels, start=1):
        earlier = [level[0].tolist() for level in levels[: depth - 1]]
        for token, node_logits in zip(tokens.tolist(), logits):
            paths = [list(p) + [token] for p in itertools.product(*earlier)]
            with torch.no_grad():
                candidates = target(torch.cat([prefix.expand(len(paths), -1), torch.tensor(paths)], dim=1)).logits[:, -1]
            distance = (candidates - node_logits).abs().amax(dim=-1).min()
            assert distance < 1e-4, f"depth {depth} token {token}: no root-to-node path gives its logits ({distance})"


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "gemma2"])
@pytest.mark.parametrize("shape", [dict(num_speculative_tokens=3), dict(top_k=2, depth=3, total_tokens=5)])
def test_draft_token_map_matches_plain_generate_and_drafts_only_mapped_ids(arch, shape, monkeypatch):
    """A draft model with a token map (half the vocabulary, scattered) drafts those ids only, through a copy of
    it: the user's draft keeps its own lm_head, and output is plain generate's."""
    target = make_model(arch)
    ids, mask = padded_batch([11, 5, 9], seed=4, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    draft = noisy_copy(target)
    lm_head = draft.get_output_embeddings()
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[: VOCAB // 2]
    token_map = torch.unique(torch.cat([token_map, expected.flatten()[::3]]))  # some of the answer's tokens too
    proposals = record_proposed_tokens(monkeypatch, DraftModelProposer)
    config = SpeculativeConfig(method="draft", draft_model=draft, draft_token_map=token_map, schedule="fixed",
                               **shape)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_accepted_tokens > 0
    assert bool(torch.isin(torch.cat(proposals), token_map).all())
    assert draft.get_output_embeddings() is lm_head


def test_auto_passes_the_token_map_to_its_draft_candidate_only():
    target = make_model("llama")
    ids, mask = padded_batch([11, 5, 9], seed=4, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="auto", draft_model=noisy_copy(target), draft_token_map=torch.arange(64))
    assert torch.equal(hf_specdec.generate(target, ids, speculative=config, **kwargs), expected)


def test_bad_draft_token_maps_are_refused_before_any_forward():
    target = make_model("llama")
    draft = make_draft()
    with pytest.raises(ValueError, match="SpeculativeConfig.draft_token_map: the token ids a draft model drafts"):
        SpeculativeConfig(method="ngram", draft_token_map=torch.arange(8))
    with pytest.raises(ValueError, match="SpeculativeConfig.draft_token_map: expected integer token ids"):
        SpeculativeConfig(method="draft", draft_model=draft, draft_token_map=torch.rand(8))
    with pytest.raises(ValueError, match="SpeculativeConfig.draft_token_map: token ids must be distinct"):
        SpeculativeConfig(method="draft", draft_model=draft, draft_token_map=torch.tensor([3, 3]))
    config = SpeculativeConfig(method="draft", draft_model=draft, draft_token_map=torch.tensor([3, VOCAB]))
    with pytest.raises(ValueError, match=rf"ids up to {VOCAB}, but the draft's lm_head has {VOCAB} rows"):
        hf_specdec.generate(target, torch.tensor([[5, 6, 7]]), speculative=config, max_new_tokens=4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("shape", [dict(num_speculative_tokens=3), dict(top_k=2, depth=3, total_tokens=5)])
def test_a_draft_with_fewer_ids_than_the_target_reads_the_ids_it_lacks_as_its_last(arch, shape, monkeypatch):
    """A draft whose vocabulary is shorter than the target's (padded less, as a family's small model against its
    large one, or without tokens added to the target's) is fed the prompt's and output's ids past its own as its
    last id, and drafts only ids it has; the output is plain generate's."""
    target = make_model(arch)
    short = VOCAB - 32
    draft = noisy_copy(target, scale=0.2)
    draft.resize_token_embeddings(short)
    ids, mask = padded_batch([11, 5, 9], seed=4, repeat_period=2)
    assert int(ids.max()) >= short  # the prompts hold ids the draft lacks
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    proposals = record_proposed_tokens(monkeypatch, DraftModelProposer)
    config = SpeculativeConfig(method="draft", draft_model=draft, schedule="fixed", **shape)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_accepted_tokens > 0
    assert int(torch.cat(proposals).max()) < short


@pytest.mark.parametrize(("prompt", "new"), [(20, 30), (40, 10)])
def test_a_context_longer_than_the_drafts_learned_positions_is_exact_and_warned(prompt, new):
    """A draft whose table of learned positions (GPT-2's, 32 here) is shorter than the call, a prompt longer than it
    too: every position past the table is read as its last one; the output is plain generate's, and a warning says
    why the drafts there are rarely kept. A call that feeds no position past the table does not warn."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.conftest import SPECIAL

    target = make_model("llama")
    torch.manual_seed(0)
    draft = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32,
                                       **SPECIAL)).eval()
    ids, mask = padded_batch([prompt, prompt - 5], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None)
    for shape in (dict(num_speculative_tokens=3), dict(top_k=2, depth=3, total_tokens=5)):
        config = SpeculativeConfig(method="draft", draft_model=draft, **shape)
        with pytest.warns(UserWarning, match=f"holds 32 positions and this call reaches {prompt + new}"):
            out = hf_specdec.generate(target, ids, speculative=config, max_new_tokens=new, **kwargs)
        assert torch.equal(out, target.generate(ids, max_new_tokens=new, **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short = padded_batch([20, 15], seed=3, repeat_period=5)[0]
        hf_specdec.generate(target, short, speculative=SpeculativeConfig(method="draft", draft_model=draft),
                            max_new_tokens=33 - 20, do_sample=False, eos_token_id=None)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_a_parallel_draft_proposes_what_one_forward_over_the_context_and_masks_predicts(arch, monkeypatch):
    """Each step's k drafts are the draft's greedy tokens after the row's whole committed text followed by k - 1
    mask tokens, as one fresh forward over them computes: the mask tokens sit at the positions after the text and
    none stays in the draft's cache. Rows of a padded batch accept different counts; the output is plain
    generate's."""
    target = make_model(arch)
    draft = noisy_copy(target, scale=0.3)
    mask_token, k = VOCAB - 1, 3
    draft.config.pard_token = mask_token
    ids, mask = padded_batch([11, 5, 9], seed=4, repeat_period=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    steps = []  # per step: each row's committed text and its drafts
    propose = DraftModelProposer._propose_parallel

    def recording(self, state, *args):
        proposal = propose(self, state, *args)
        steps.append(([state.sequences[b, : int(state.lengths[b])].clone() for b in range(state.batch_size)],
                      proposal.tree.token_ids[:, 1:].clone(), proposal.tree.valid[:, 1:].clone()))
        return proposal

    monkeypatch.setattr(DraftModelProposer, "_propose_parallel", recording)
    config = SpeculativeConfig(method="draft", draft_model=draft, parallel_drafting=True, num_speculative_tokens=k,
                               schedule="fixed")
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert 0 < out.spec_stats.num_accepted_tokens < out.spec_stats.num_draft_tokens
    assert len(steps) > 3
    for texts, drafts, valid in steps:
        for row, text in enumerate(texts):
            if not bool(valid[row].any()):
                continue
            real = torch.cat([text[: mask.shape[1]][mask[row].bool()], text[mask.shape[1]:]])
            fresh = torch.cat([real, real.new_full((k - 1,), mask_token)])[None]
            with torch.no_grad():
                greedy = draft(fresh).logits[0, -k:].argmax(-1)
            assert torch.equal(drafts[row][valid[row]], greedy[: int(valid[row].sum())]), (arch, row)


def test_parallel_drafting_is_refused_where_it_cannot_run():
    target = make_model("llama")
    draft = make_draft()
    with pytest.raises(ValueError, match="parallel_drafting: it runs a draft model, which method='ngram' does not"):
        SpeculativeConfig(method="ngram", parallel_drafting=True)
    with pytest.raises(ValueError, match="parallel_drafting: method='auto' drafts in parallel with a draft model; pass "
                                         "draft_model"):
        SpeculativeConfig(method="auto", parallel_drafting=True)
    with pytest.raises(ValueError, match="parallel_drafting: it drafts one chain"):
        SpeculativeConfig(method="draft", draft_model=draft, parallel_drafting=True, tree_width=2)
    with pytest.raises(ValueError, match="pard_token: the mask id of a parallel draft model, used only with"):
        SpeculativeConfig(method="draft", draft_model=draft, pard_token=5)
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    with pytest.raises(ValueError, match=r"config names no mask token .*pard_token=<the id its training filled>"):
        hf_specdec.generate(target, prompt, max_new_tokens=4,
                            speculative=SpeculativeConfig(method="draft", draft_model=draft, parallel_drafting=True))
    with pytest.raises(ValueError, match=rf"mask token {VOCAB} is not one of the draft model's {VOCAB} token ids"):
        hf_specdec.generate(target, prompt, max_new_tokens=4, speculative=SpeculativeConfig(
            method="draft", draft_model=draft, parallel_drafting=True, pard_token=VOCAB))
    with pytest.raises(ValueError, match="parallel_drafting: a parallel draft's feed .* static shapes"):
        hf_specdec.generate(target, prompt, max_new_tokens=4, cache_implementation="static",
                            speculative=SpeculativeConfig(method="draft", draft_model=draft, parallel_drafting=True,
                                                          pard_token=3))
