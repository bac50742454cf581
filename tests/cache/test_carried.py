"""A drafter's context travels with the cache a call returns: a call continuing from that cache (a conversation's
next turn) drafts after an EAGLE head's keys and values over the earlier text, not from the new positions alone,
and a draft model encodes only the new text; output stays plain generate's."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CompileConfig

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.carried import carried_by
from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.proposers.draft_model import DrafterContext
from tests.conftest import make_model, padded_batch

KWARGS = dict(do_sample=False, eos_token_id=None, return_dict_in_generate=True)
K = 3


@pytest.fixture(scope="module")
def turns():
    """A target, a head fitted to its text, a padded batch's first turn by hf_specdec, and the second turn's mask."""
    from tests.proposers.test_eagle import trained_head

    target = make_model("llama")
    ids, mask = padded_batch([9, 6, 8], seed=2, repeat_period=3)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, **KWARGS)
    head = trained_head(target, "eagle", plain.sequences)
    config = SpeculativeConfig(method="eagle", heads=head, num_speculative_tokens=K, schedule="fixed")
    first = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=8, **KWARGS)
    longer = torch.cat([mask, mask.new_ones(3, 8)], dim=1)
    return target, head, config, first, longer


def _context(cache) -> DrafterContext:
    (context,) = [kept for kept in carried_by(cache) if isinstance(kept, DrafterContext)]
    return context


def test_the_carried_context_is_the_heads_over_the_whole_text(turns):
    """The head's keys and values carried from the first call are those it computes over the same text in one call
    (each fed token's with the target's feature before it, at the same position), for every token (those
    that waited for a feed when the call ended are fed before it returns, but a row's that finished earlier)."""
    target, _, config, first, longer = turns
    carried = _context(first.past_key_values)
    whole = hf_specdec.generate(target, first.sequences, attention_mask=longer, speculative=config, max_new_tokens=4,
                                **KWARGS)
    reference = _context(whole.past_key_values)
    real = longer.sum(dim=1).tolist()
    # every pair (each real token but the first, with the feature before it) of the rows that generated in the last
    # step; a row that finished before lacks its last step's tokens
    assert any(length == count - 1 for length, count in zip(carried.lengths_on_host, real, strict=True))
    for row, length in enumerate(carried.lengths_on_host):
        assert real[row] - 1 - (K + 1) <= length <= real[row] - 1
        for (keys, values), (whole_keys, whole_values) in zip(carried.layers, reference.layers, strict=True):
            torch.testing.assert_close(keys[row, :, :length], whole_keys[row, :, :length], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(values[row, :, :length], whole_values[row, :, :length], atol=1e-5, rtol=1e-4)
    assert carried.next_position.tolist() == carried.lengths_on_host


@pytest.mark.parametrize("method", ["eagle", "auto"])
@pytest.mark.parametrize("static", [False, True])
def test_the_next_turn_starts_from_the_carried_context(turns, method, static, monkeypatch):
    """From the returned cache or a deep copy of it, twice, with dynamic or static shapes: the head starts from the
    carried context (which the call leaves as it was), and the output is plain generate's."""
    target, head, _, first, longer = turns
    config = SpeculativeConfig(method=method, heads=head, num_speculative_tokens=K)
    kwargs = dict(attention_mask=longer, max_new_tokens=12, **KWARGS)
    shapes = dict(compile_config=CompileConfig(), disable_compile=True) if static else {}
    expected = target.generate(first.sequences, past_key_values=copy.deepcopy(first.past_key_values), **kwargs)
    carried = _context(first.past_key_values)
    before = [tensor.clone() for pair in carried.layers for tensor in pair]
    restored = []
    prefill_from = RaggedKVCache.prefill_from

    def spy(cache, *args):  # the head's cache after the restore: the carried slots, every row's length
        prefill_from(cache, *args)
        restored.append(([t for pair in cache.layers_by_order(max(carried.lengths_on_host)) for t in pair],
                         cache.lengths.tolist()))

    monkeypatch.setattr(RaggedKVCache, "prefill_from", spy)
    for cache in (first.past_key_values, copy.deepcopy(first.past_key_values), first.past_key_values):
        out = hf_specdec.generate(target, first.sequences, past_key_values=cache, speculative=config, **shapes,
                                  **kwargs)
        assert torch.equal(out.sequences, expected.sequences)
        assert out.spec_stats.num_accepted_tokens > 0
    assert len(restored) == 3
    for tensors, lengths in restored:
        assert lengths == carried.lengths_on_host
        assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))
    after = [tensor for pair in carried.layers for tensor in pair]  # the calls left the carried context as it was
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_cache_changed_since_carries_nothing(turns):
    """Extended by plain generate, cropped, or returned by a call without a head: no context, and the output is
    still plain generate's."""
    target, _, config, first, longer = turns
    assert carried_by(first.past_key_values)
    cropped = copy.deepcopy(first.past_key_values)
    cropped.crop(-2)
    assert carried_by(cropped) == ()
    extended = copy.deepcopy(first.past_key_values)
    target.generate(first.sequences, attention_mask=longer, past_key_values=extended,
                    max_new_tokens=2, do_sample=False, eos_token_id=None)
    assert carried_by(extended) == ()
    ngram = hf_specdec.generate(target, first.sequences[:, :-8], attention_mask=longer[:, :-8], spec_method="ngram",
                                max_new_tokens=8, **KWARGS)
    assert carried_by(ngram.past_key_values) == ()
    assert carried_by(hf_specdec.generate(target, first.sequences[:, :-8], attention_mask=longer[:, :-8],
                                          speculative=config, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                          return_dict_in_generate=True, use_cache=False).past_key_values) == ()


def test_mtp_layers_carry_their_context(monkeypatch):
    """MTP layers draft like an EAGLE head (from the target's features): they carry their context too."""
    from tests.proposers.test_mtp import mtp_layers, mtp_target

    target = mtp_target("deepseek_v3", num_layers=2)
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=5)
    config = SpeculativeConfig(method="mtp", heads=mtp_layers(target), num_speculative_tokens=3)
    first = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=6, **KWARGS)
    carried = _context(first.past_key_values)
    # every row's context lacks at most its final token; the rows that took part in the last step (the call's last
    # rows to finish, at least one) hold all of it (a row that finished a step earlier lacks that step's tokens:
    # which rows those are depends on the drafts accepted, which near-ties in the draft can move)
    full = [int(real) + 6 - 1 for real in mask.sum(dim=1)]
    assert all(length <= whole for length, whole in zip(carried.lengths_on_host, full, strict=True))
    assert any(length == whole for length, whole in zip(carried.lengths_on_host, full, strict=True))
    restored = []
    prefill_from = RaggedKVCache.prefill_from
    monkeypatch.setattr(RaggedKVCache, "prefill_from",
                        lambda cache, *args: (restored.append(list(args[2])), prefill_from(cache, *args))[1])
    longer = torch.cat([mask, mask.new_ones(3, 6)], dim=1)
    kwargs = dict(attention_mask=longer, max_new_tokens=10, **KWARGS)
    expected = target.generate(first.sequences, past_key_values=copy.deepcopy(first.past_key_values), **kwargs)
    out = hf_specdec.generate(target, first.sequences, past_key_values=first.past_key_values, speculative=config,
                              **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert restored == [carried.lengths_on_host]


def test_a_draft_model_carries_its_cache_and_encodes_only_the_new_text(monkeypatch):
    """A draft model's context carried with the cache holds its keys and values over the first turn (as its own
    forward over that text computes them, left padding masked); the next turn restores it and encodes only the
    columns after it, with the same output as plain generate."""
    from hf_specdec.proposers.draft_model import DraftModelProposer
    from tests.conftest import noisy_copy

    target = make_model("llama")
    draft = noisy_copy(target, seed=1)
    ids, mask = padded_batch([9, 6, 8], seed=2, repeat_period=3)
    config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=K)
    first = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=8, **KWARGS)
    carried = _context(first.past_key_values)
    longer = torch.cat([mask, mask.new_ones(3, 8)], dim=1)
    positions = (longer.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        own = draft(first.sequences, attention_mask=longer, position_ids=positions, use_cache=True).past_key_values
    for row, seen in enumerate(carried.seen):
        assert first.sequences.shape[1] - 1 - (K + 1) <= seen  # all but the last step's tokens
        real = longer[row, :seen].bool()
        assert torch.equal(carried.valid[row, :seen], real)
        for (keys, values), layer in zip(carried.layers, own.layers, strict=True):
            torch.testing.assert_close(keys[row, :, :seen][:, real], layer.keys[row, :, :seen][:, real], atol=1e-5,
                                       rtol=1e-4)
            torch.testing.assert_close(values[row, :, :seen][:, real], layer.values[row, :, :seen][:, real],
                                       atol=1e-5, rtol=1e-4)
    prefilled, chains = [], []
    monkeypatch.setattr(DraftModelProposer, "_prefill", lambda *args: prefilled.append(None))
    prefill_chain = RaggedKVCache.prefill_chain

    def spy(cache, ids, *args, **kwargs):  # the draft's chains (the target's cache encodes the new tokens too)
        if cache.model is draft:
            chains.append(ids.shape[1])
        return prefill_chain(cache, ids, *args, **kwargs)

    monkeypatch.setattr(RaggedKVCache, "prefill_chain", spy)
    restored = []
    prefill_from = RaggedKVCache.prefill_from

    def restore(cache, *args):  # the restored cache masks the carried padding
        prefill_from(cache, *args)
        restored.append(torch.equal(cache.valid[:, : carried.valid.shape[1]], carried.valid) and cache.padded)

    monkeypatch.setattr(RaggedKVCache, "prefill_from", restore)
    new = torch.randint(3, 128, (3, 4), generator=torch.Generator().manual_seed(5))
    prompt = torch.cat([first.sequences, new], dim=1)
    kwargs = dict(attention_mask=torch.cat([longer, longer.new_ones(3, 4)], dim=1), max_new_tokens=10, **KWARGS)
    expected = target.generate(prompt, past_key_values=copy.deepcopy(first.past_key_values), **kwargs)
    out = hf_specdec.generate(target, prompt, past_key_values=first.past_key_values, speculative=config, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.spec_stats.num_accepted_tokens > 0
    assert prefilled == [] and chains == [prompt.shape[1] - 1 - min(carried.seen)] and restored == [True]
