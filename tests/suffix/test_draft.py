"""Suffix drafts: worked examples, and every field against the brute-force reference on random texts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hf_specdec.suffix import EMPTY_DRAFT, SuffixCache, SuffixConfig, propose_suffix_draft
from tests.suffix import reference


def _propose(outputs, prompt, k, **config):
    cache = SuffixCache(SuffixConfig(**config))
    for output in outputs:
        cache.add(output)
    return propose_suffix_draft(cache, cache.start_request(prompt), prompt, k)


def test_follows_the_most_frequent_continuation_of_the_best_match():
    # [1, 2, 3] occurred before, followed by 4: half of its occurrences (the other is the context's own end)
    draft = _propose([], [1, 2, 3, 4, 1, 2, 3], k=3)
    assert (draft.tokens, draft.parents, draft.depths) == ((4, 1, 2), (-1, 0, 1), (1, 2, 3))
    assert draft.probs == (0.5, 0.5, 0.5) and draft.score == 1.5
    assert (draft.match_length, draft.source) == (3, "local")
    assert draft.paths() == [(4,), (4, 1), (4, 1, 2)]


def test_frequent_alternatives_become_branches_of_one_tree():
    draft = _propose([[5, 6, 7], [5, 6, 8], [5, 6, 7]], [9, 5, 6], k=4)
    # [5, 6] matched (budget 2): 7 in 2 of 3 outputs, 8 in 1, both children of the context's last token
    assert (draft.tokens, draft.parents, draft.source, draft.match_length) == ((7, 8), (-1, -1), "global", 2)
    assert draft.probs == pytest.approx((2 / 3, 1 / 3)) and draft.score == pytest.approx(1.0)
    # a continuation under min_token_prob is not proposed
    assert _propose([[5, 6, 7], [5, 6, 8], [5, 6, 7]], [9, 5, 6], k=4, min_token_prob=0.5).tokens == (7,)


def test_a_chain_follows_the_most_frequent_continuation_only():
    cache = SuffixCache(SuffixConfig())
    for output in ([3, 4, 5, 6, 7, 1], [3, 4, 5, 6, 8, 2], [3, 4, 5, 6, 7, 1]):
        cache.add(output)
    request = cache.start_request([9, 3, 4, 5, 6])  # a match of 4 tokens: a budget of 4
    tree = propose_suffix_draft(cache, request, [9, 3, 4, 5, 6], 4)
    assert (tree.tokens, tree.parents) == ((7, 1, 8, 2), (-1, 0, -1, 2))
    chain = propose_suffix_draft(cache, request, [9, 3, 4, 5, 6], 4, chain=True)
    assert (chain.tokens, chain.parents) == ((7, 1), (-1, 0))
    assert chain.probs == pytest.approx((2 / 3, 2 / 3))


def test_budget_is_the_match_length_times_the_factor_plus_the_offset_capped_by_k():
    config = SuffixConfig(max_spec_factor=0.5, max_spec_offset=1.0)
    assert [config.draft_budget(m, 3) for m in (1, 2, 3, 4, 5, 9)] == [1, 2, 2, 3, 3, 3]
    assert SuffixConfig(max_spec_offset=-2.0).draft_budget(1, 5) == 0
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    assert _propose([text], [1, 2], k=8).tokens == (3, 4)  # a 2-token match drafts 2 tokens
    assert _propose([text], [1, 2], k=8, max_spec_factor=2.0).tokens == (3, 4, 5, 6)
    assert _propose([text], [1, 2], k=3, max_spec_factor=2.0).tokens == (3, 4, 5)


def test_ties_go_to_the_longer_match_and_to_the_local_tree():
    # [2] and [1, 2] both occur twice, followed by 9 once: equal scores, the longer match wins
    draft = _propose([], [1, 2, 9, 1, 2], k=2, max_spec_factor=10.0)
    assert (draft.tokens, draft.match_length) == ((9, 1), 2)
    # local: [7] -> 8 with probability 1/2; global: [7] -> 8 or 9, 1/2 each: a tie, local wins
    assert _propose([[7, 8, 3, 7, 9]], [7, 8, 7], k=1).source == "local"
    # global: [7] -> 8 always: better, global wins
    draft = _propose([[7, 8]], [7, 8, 7], k=1)
    assert (draft.tokens, draft.probs, draft.source) == ((8,), (1.0,), "global")


def test_nothing_to_propose():
    assert _propose([[1, 2, 3]], [4, 5], k=4) == EMPTY_DRAFT
    assert _propose([[1, 2, 3]], [1, 2], k=0) == EMPTY_DRAFT
    assert _propose([[1, 2, 3]], [], k=4) == EMPTY_DRAFT
    assert EMPTY_DRAFT.num_tokens == 0 and EMPTY_DRAFT.source is None and EMPTY_DRAFT.max_depth == 0


def test_contexts_as_arrays_and_bad_budgets():
    cache = SuffixCache()
    cache.add([1, 2, 3])
    request = cache.start_request(np.array([1, 2]))
    assert propose_suffix_draft(cache, request, np.array([1, 2]), 4).tokens == (3,)
    assert propose_suffix_draft(cache, None, [1, 2], 4).tokens == (3,)  # global tree only
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0, got -1"):
        propose_suffix_draft(cache, request, [1, 2], -1)
    with pytest.raises(ValueError, match="started by another SuffixCache"):
        propose_suffix_draft(SuffixCache(), request, [1, 2], 4)
    request.finish()
    with pytest.raises(ValueError, match="request is finished"):
        propose_suffix_draft(cache, request, [1, 2], 4)


@pytest.mark.parametrize("chain", [False, True])
def test_drafts_match_the_brute_force_reference(chain):
    """Trees, and chains (each node's most frequent continuation, for targets that verify chains only)."""
    rng = random.Random(0)
    drafted = 0
    for _ in range(300):
        config = SuffixConfig(
            max_depth=rng.randint(2, 8),
            max_cached_requests=rng.choice([0, 1, 3, 100]),
            max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
            max_spec_offset=rng.choice([-1.0, 0.0, 1.5]),
            min_token_prob=rng.choice([0.05, 0.1, 0.3, 1.0]),
        )
        vocab = rng.randint(1, 5)
        cache = SuffixCache(config)
        outputs = []
        for _ in range(rng.randint(0, 6)):
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            cache.add(output)
            outputs.append(output)
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        request = cache.start_request(context)
        outputs.append([])  # the request's own output, growing in the global tree
        outputs = outputs[-config.max_cached_requests:] if config.max_cached_requests else []
        for _ in range(4):
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            request.extend(new)
            context += new
            if outputs:
                outputs[-1] = outputs[-1] + new
            k = rng.randint(0, 8)
            draft = propose_suffix_draft(cache, request, context, k, chain=chain)
            got = (draft.tokens, draft.parents, draft.depths, draft.probs, draft.score, draft.match_length,
                   draft.source)
            assert got == reference.propose([context], outputs, context, k, config, chain=chain)
            assert all(p < i for i, p in enumerate(draft.parents)) and draft.num_tokens <= k
            if chain:
                assert draft.parents == tuple(range(-1, draft.num_tokens - 1))
            drafted += draft.num_tokens > 0
    assert drafted > 300  # most proposals drafted something: the comparison is not between empty drafts
