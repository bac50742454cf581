"""The n-gram matcher on literal arrays, and the batched proposer."""

from __future__ import annotations

import numpy as np
import torch

from hf_specdec import SpeculativeConfig
from hf_specdec.proposers.ngram import (
    NgramProposer,
    build_trie,
    find_ngram_continuation,
    find_ngram_continuations,
    matched_ngram_length,
)
from hf_specdec.step import DecodeState


def _find(tokens, min_n=1, max_n=3, k=4):
    return find_ngram_continuation(np.array(tokens), min_n, max_n, k).tolist()


def test_longest_match_wins_over_shorter_later_match():
    # suffix [7, 8, 9]: matched in full at index 0 (continues with 1, 2); [8, 9] alone also matches later
    assert _find([7, 8, 9, 1, 2, 5, 8, 9, 3, 7, 8, 9]) == [1, 2, 5, 8]


def test_most_recent_occurrence_among_equal_lengths():
    # [4, 5] ends at 1 and at 4: the later one wins; its continuation [2, 4, 5] then repeats
    assert _find([4, 5, 1, 4, 5, 2, 4, 5], max_n=2) == [2, 4, 5, 2]


def test_copy_runs_past_the_end_of_the_text():
    assert _find([3, 7, 7], k=4) == [7, 7, 7, 7]  # a run goes on
    assert _find([9, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]  # so does an alternation


def test_no_match_and_too_short():
    assert _find([1, 2, 3, 4]) == []
    assert _find([5]) == []
    assert _find([5, 5], k=0) == []


def test_min_n_is_respected():
    assert _find([1, 2, 9, 3, 2], min_n=2) == []
    assert _find([1, 2, 9, 3, 2], min_n=1) == [9, 3, 2, 9]


def test_continuation_is_capped_at_k():
    assert _find([1, 2, 3, 4, 5, 6, 1, 2], k=3) == [3, 4, 5]


def test_batched_proposer_ragged_rows_and_budget():
    pad = 0
    ids = torch.tensor([[0, 0, 6, 7, 8, 6, 7], [1, 2, 3, 4, 1, 2, 3], [0, 9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    state = DecodeState.start(ids, mask, max_length=9, extra_capacity=5, pad_token_id=pad)
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    proposer.start(state, mask)
    proposal = proposer.propose(state)
    # budget: max_length 9 - length 7 - 1 = 1 draft token per row
    assert proposal.num_draft_tokens.tolist() == [1, 1, 0]
    assert proposal.draft_token_ids[:, :1].tolist()[:2] == [[8], [4]]
    assert proposal.draft_probs is None


def test_lookahead_is_the_chain_a_proposal_would_draft():
    ids = torch.tensor([[0, 0, 6, 7, 8, 6, 7], [1, 2, 3, 4, 1, 2, 3], [0, 9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    state = DecodeState.start(ids, mask, max_length=40, extra_capacity=5, pad_token_id=0)
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    proposer.start(state, mask)
    proposer.skip(state)
    assert [(draft.tokens.tolist(), draft.parents.tolist()) for draft in proposer.lookahead(state, [2, 0])] == [
        ([], []), ([8, 6, 7], [-1, 0, 1])]
    proposal = proposer.propose(state)
    assert proposal.draft_token_ids[0].tolist() == [8, 6, 7] and proposal.num_draft_tokens[2] == 0


def test_draft_classes_are_the_matched_ngram_lengths():
    """Row 0 ends with `6 7`, matched earlier (2); row 1 with `1 2 3`, matched in full (3, the longest looked for);
    row 2 with nothing seen before (0: no draft). With prompt_lookup_min=3, row 0's 2-gram is no match."""
    ids = torch.tensor([[0, 0, 6, 7, 8, 6, 7], [1, 2, 3, 4, 1, 2, 3], [0, 9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    state = DecodeState.start(ids, mask, max_length=40, extra_capacity=5, pad_token_id=0)
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    proposer.start(state, mask)
    assert proposer.num_draft_classes == 3 and proposer.draft_classes(state).tolist() == [2, 3, 0]
    strict = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=3))
    strict.start(state, mask)
    assert strict.draft_classes(state).tolist() == [0, 3, 0]
    assert matched_ngram_length(np.array([5, 6, 7, 8, 6, 7]), 1, 3) == 2


def test_left_padding_is_never_matched():
    ids = torch.tensor([[0, 0, 0, 5, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1]])
    state = DecodeState.start(ids, mask, max_length=20, extra_capacity=5, pad_token_id=0)
    proposer = NgramProposer(SpeculativeConfig(method="ngram"))
    proposer.start(state, mask)
    proposal = proposer.propose(state)
    assert proposal.num_draft_tokens.tolist() == [0]


def _brute_force(tokens, min_n, max_n, k):
    """The latest earlier occurrence of the longest suffix n-gram, then LZ77-style copying one token at a time."""
    return next(iter(_brute_force_branches(tokens, min_n, max_n, k, 1)), [])


def test_matcher_equals_brute_force_on_random_texts():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        min_n, max_n = sorted(rng.integers(1, 5, size=2).tolist())
        k = int(rng.integers(1, 6))
        assert _find(tokens, min_n, max_n, k) == _brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def _branches(tokens, min_n=1, max_n=3, k=3, w=4):
    return [c.tolist() for c in find_ngram_continuations(np.array(tokens), min_n, max_n, k, w)]


def _brute_force_branches(tokens, min_n, max_n, k, w):
    """The longest suffix n-gram's earlier occurrences, latest first, each copied one token at a time; distinct."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        found = []
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[length - n :]:
                text = list(tokens)
                for source in range(start + n, start + n + k):
                    text.append(text[source])
                if text[length:] not in found:
                    found.append(text[length:])
        if found:
            return found[:w]
    return []


def test_branches_equal_brute_force_on_random_texts():
    rng = np.random.default_rng(1)
    for _ in range(300):
        tokens = rng.integers(0, 5, size=int(rng.integers(1, 30))).tolist()
        min_n, max_n = sorted(rng.integers(1, 4, size=2).tolist())
        k, w = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        assert _branches(tokens, min_n, max_n, k, w) == _brute_force_branches(tokens, min_n, max_n, k, w), (
            tokens, min_n, max_n, k, w)


def _paths(tokens, parents, valid):
    """Every valid node's path of tokens from the root (exclusive)."""
    paths = []
    for node in np.flatnonzero(valid)[1:]:
        path = []
        while node > 0:
            path.append(int(tokens[node]))
            node = parents[node]
        paths.append(path[::-1])
    return paths


def test_trie_keeps_first_tokens_before_long_tails():
    """Nodes go by depth + rank (the index of the first continuation through them): with 5 of 11 draft nodes the
    trie keeps the first continuation's first three tokens and the first token each of the others adds."""
    continuations = [np.array([1, 2, 3, 4]), np.array([1, 5, 6, 7]), np.array([8, 9, 9, 9])]
    assert sorted(_paths(*build_trie(0, continuations, 1 + 11))) == [
        [1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 5], [1, 5, 6], [1, 5, 6, 7], [8], [8, 9], [8, 9, 9], [8, 9, 9, 9]]
    tokens, parents, valid = build_trie(0, continuations, 1 + 5)
    assert sorted(_paths(tokens, parents, valid)) == [[1], [1, 2], [1, 2, 3], [1, 5], [8]]
    assert all(parents[node] < node for node in range(1, 6)) and parents[0] == -1 and valid.all()
    tokens, parents, valid = build_trie(0, continuations[:1], 1 + 6)  # padding past the one continuation
    assert valid.tolist() == [True] * 5 + [False] * 2 and parents[5:].tolist() == [0, 0]


def test_sized_trie_proposal_has_the_configured_nodes():
    ids = torch.tensor([[6, 3, 9, 6, 4, 9, 5, 6, 1, 2, 6, 7, 5, 6], [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]])
    mask = torch.ones_like(ids)
    state = DecodeState.start(ids, mask, max_length=40, extra_capacity=20, pad_token_id=0)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=4, tree_total_tokens=5,
                               prompt_lookup_max=2)
    proposer = NgramProposer(config)
    proposer.start(state, mask)
    tree = proposer.propose(state).tree
    assert tree.num_nodes == 6 and tree.valid[1].all()
    # row 1: [1, 2] continues 6, 5, 4 and 3, each followed by 1, 2 (most recent first); by depth + rank: the first
    # continuation's three tokens (keys 1, 2, 3), the second's first two (2, 3); the third's first (3) ties last
    row = _paths(tree.token_ids[1].numpy(), tree.parents[1].numpy(), tree.valid[1].numpy())
    assert sorted(row) == [[5], [5, 1], [6], [6, 1], [6, 1, 2]]
    # row 0: [5, 6] occurred once, continued by 1, 2, 6: three nodes, then padding
    assert tree.valid[0].tolist() == [True] * 4 + [False] * 2
    assert _paths(tree.token_ids[0].numpy(), tree.parents[0].numpy(), tree.valid[0].numpy()) == [[1], [1, 2], [1, 2, 6]]
