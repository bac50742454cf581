"""`SpeculativeConfig(method="recycling")`: its default tree, its table of recycled candidates (what it keeps, what it
drafts, across calls), and its errors. Greedy equality on every architecture, the sampling law, host syncs and
static shapes are in tests/decoding/."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.config import DEFAULT_RECYCLING_NODES, RECYCLED_CANDIDATES
from hf_specdec.proposers import recycling
from hf_specdec.proposers.recycling import (
    RANK_PRIOR,
    RecycledTokens,
    RecyclingProposer,
    forget_recycled_tokens,
    recycling_tree,
)
from hf_specdec.schedule.lookahead import LookaheadTree
from hf_specdec.step import DecodeState
from tests.conftest import VOCAB, make_model, padded_batch

GREEDY = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)


def _prior(path: tuple[int, ...]) -> float:
    return math.prod(RANK_PRIOR[rank] for rank in path)


def test_the_default_tree_keeps_the_likeliest_rank_paths_within_k():
    for nodes, depth in ((6, 5), (12, 3), (30, 4)):
        tree = recycling_tree(nodes, max_depth=depth)
        kept = {tuple(_path(tree, node)) for node in range(1, tree.num_nodes)}
        assert len(kept) == nodes and max(map(len, kept)) <= depth
        # no path left out (of depth <= 3 here) is likelier than a path kept
        others = {path for length in range(1, min(depth, 3) + 1)
                  for path in itertools.product(range(RECYCLED_CANDIDATES), repeat=length)} - kept
        assert min(map(_prior, kept)) >= max(map(_prior, others))
    assert recycling_tree(40, max_depth=2).max_depth == 2
    assert recycling_tree(3, max_depth=1).num_nodes == 4  # the root and the ranks 0, 1, 2
    assert max(recycling_tree(100, max_depth=5).ranks) < RECYCLED_CANDIDATES
    config = SpeculativeConfig(method="recycling")
    proposer = RecyclingProposer(config, make_model("llama"))
    assert proposer.num_nodes(config) == 1 + DEFAULT_RECYCLING_NODES
    assert proposer.draft_depth(config) <= config.num_speculative_tokens


def _path(tree, node: int) -> list[int]:
    path = []
    while node > 0:
        path.insert(0, tree.ranks[node])
        node = tree.parents[node]
    return path


def test_the_table_takes_each_counted_nodes_top_candidates():
    table = RecycledTokens(vocab_size=10, device=torch.device("cpu"))
    scores = torch.arange(10.0).repeat(1, 3, 1)  # [1, 3, 10]: token 9 best, then 8, ...
    scores[0, 1] = scores[0, 1].flip(0)  # node 1: token 0 best
    table.update(torch.tensor([[4, 5, 6]]), torch.tensor([[True, True, False]]), scores)
    assert table.successors[4].tolist() == list(range(9, 9 - RECYCLED_CANDIDATES, -1))
    assert table.successors[5].tolist() == list(range(RECYCLED_CANDIDATES))
    assert (table.successors[6] == -1).all()  # not counted: its update went to the spare row
    assert table.successors[10].tolist() == list(range(9, 9 - RECYCLED_CANDIDATES, -1))
    table.update(torch.tensor([[4]]), torch.tensor([[True]]), scores[:, 1:2])  # a later sight replaces the row
    assert table.successors[4].tolist() == list(range(RECYCLED_CANDIDATES))


def test_a_prompt_seeds_each_tokens_followers_before_its_candidates():
    table = RecycledTokens(vocab_size=10, device=torch.device("cpu"))
    table.successors[1] = torch.tensor([7, 2, 6, 5, 4, 3, 9, 0])
    table.seed([np.array([1, 2, 1, 3, 4, 12]), np.array([4, 5])])  # 12: past the vocabulary, left out
    assert table.successors[1].tolist() == [3, 2, 7, 6, 5, 4, 9, 0]  # the later follower first; 2 once
    assert table.successors[4].tolist() == [5] + [-1] * 7  # from the second prompt, not 12 from the first
    assert table.successors[2].tolist() == [1] + [-1] * 7


def test_a_proposal_follows_the_table_by_rank_within_each_rows_budget():
    target = make_model("llama")
    config = SpeculativeConfig(method="recycling", num_speculative_tokens=3,
                               tree_paths=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    proposer = RecyclingProposer(config, target)
    proposer.table = RecycledTokens(VOCAB, torch.device("cpu"))
    successors = proposer.table.successors
    successors[3, :2] = torch.tensor([5, 6])
    successors[5, :2] = torch.tensor([7, 3])  # 7 was never seen: the path through it stops there
    state = DecodeState.start(torch.tensor([[1, 2, 3], [4, 4, 3]]), None, max_length=20, extra_capacity=8,
                              pad_token_id=0)
    state.set_draft_limits([3, 1], width=3)
    tree = proposer.propose(state).tree
    # nodes: root, (0,), (1,), (0, 0), (0, 1), (0, 0, 0)
    assert tree.token_ids[0].tolist() == [3, 5, 6, 7, 3, 0]
    assert tree.valid[0].tolist() == [True, True, True, True, True, False]
    assert tree.valid[1].tolist() == [True, True, True, False, False, False]  # a budget of one token


def test_lookahead_is_the_whole_tree_a_proposal_would_draft():
    """For rows that decode plainly, the tree the table gives now at full depth, whatever width the step allowed;
    nodes not seen yet (all of them before the table exists) are -1, which no emitted token matches: a proposal
    verifies them too."""
    target = make_model("llama")
    config = SpeculativeConfig(method="recycling", num_speculative_tokens=3,
                               tree_paths=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    proposer = RecyclingProposer(config, target)
    state = DecodeState.start(torch.tensor([[1, 2, 3], [4, 4, 8]]), None, max_length=20, extra_capacity=8,
                              pad_token_id=0)

    def looked_ahead(rows):  # the shipped trees, read with a step's report
        shipped = proposer.lookahead(state, rows)
        state.report(torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
        return [LookaheadTree(tokens, shipped.parents) for tokens in shipped.tokens(state.host, rows)]

    assert [draft.tokens.tolist() for draft in looked_ahead([0, 1])] == [[-1] * 5] * 2
    proposer.table = RecycledTokens(VOCAB, torch.device("cpu"))
    successors = proposer.table.successors
    successors[3, :2] = torch.tensor([5, 6])
    successors[5, :2] = torch.tensor([7, 3])  # 7 was never seen: the path through it stops there
    state.set_draft_limits([0, 0], width=0)
    drafts = looked_ahead([1, 0])
    assert drafts[0].tokens.tolist() == [-1] * 5  # 8 was never seen
    # nodes (0,), (1,), (0, 0), (0, 1), (0, 0, 0); the last, below the unseen 7, unseen too
    assert (drafts[1].tokens.tolist(), drafts[1].parents.tolist()) == ([5, 6, 7, 3, -1], [-1, -1, 0, 0, 2])


def test_a_later_call_starts_from_what_earlier_calls_recycled():
    target = make_model("llama")
    ids, mask = padded_batch([9, 6], seed=4, repeat_period=4)
    config = SpeculativeConfig(method="recycling", schedule="fixed")
    expected = target.generate(ids, attention_mask=mask, **GREEDY)
    first = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, return_dict_in_generate=True,
                                **GREEDY)
    table = recycling.recycled_tokens(target, VOCAB, torch.device("cpu"))
    assert (table.successors[:VOCAB] >= 0).any(dim=1).sum() > 1
    second = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, return_dict_in_generate=True,
                                 **GREEDY)
    assert torch.equal(first.sequences, expected) and torch.equal(second.sequences, expected)
    # the first call drafted nothing in its first step (nothing seen yet), the second drafted from the first's
    assert second.spec_stats.num_accepted_tokens > first.spec_stats.num_accepted_tokens
    forget_recycled_tokens(target)
    assert recycling.recycled_tokens(target, VOCAB, torch.device("cpu")) is not table
    other = make_model("llama")
    assert recycling.recycled_tokens(other, VOCAB, torch.device("cpu")) is not recycling.recycled_tokens(
        target, VOCAB, torch.device("cpu"))


def test_plain_steps_feed_the_table_too():
    """Steps a schedule runs plain (here every step: speculation off by batch size) still recycle the root's
    candidates."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6], seed=4, repeat_period=4)
    config = SpeculativeConfig(method="recycling", disable_by_batch_size=1)
    out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, return_dict_in_generate=True,
                              **GREEDY)
    assert out.spec_stats.num_draft_tokens == 0
    seen = (recycling.recycled_tokens(target, VOCAB, torch.device("cpu")).successors[:VOCAB] >= 0).any(dim=1)
    emitted = set(out.sequences[:, ids.shape[1] - 1: -1].flatten().tolist())
    assert emitted <= set(torch.nonzero(seen).flatten().tolist())


@pytest.mark.parametrize("schedule", ["adaptive", "fixed"])
def test_the_host_knows_which_rows_the_table_holds(schedule):
    """The table's host view (`RecycledTokens.filled`, from the prompt's seed and the verified nodes each step
    ships back) is exactly the set of rows written, after every call; `draft_depths` reads it for each row's last
    emitted token."""
    target = make_model("llama")
    forget_recycled_tokens(target)
    ids, mask = padded_batch([9, 6, 7], seed=4, repeat_period=4)
    config = SpeculativeConfig(method="recycling", num_speculative_tokens=3, schedule=schedule)
    expected = target.generate(ids, attention_mask=mask, **GREEDY)
    for _ in range(2):
        out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, **GREEDY)
        assert torch.equal(out, expected)
        table = recycling.recycled_tokens(target, VOCAB, torch.device("cpu"))
        written = (table.successors[:VOCAB] >= 0).any(dim=1).numpy()
        assert written.any() and np.array_equal(table.filled[:VOCAB], written)
    proposer = RecyclingProposer(config, target)
    proposer.table = table
    state = DecodeState.start(ids, mask, max_length=40, extra_capacity=8, pad_token_id=0)
    unseen = int(np.flatnonzero(~table.filled[:VOCAB])[0])
    seen = int(np.flatnonzero(table.filled[:VOCAB])[0])
    emitted = torch.tensor([[seen, unseen], [unseen, seen], [unseen, 0]])
    state.report(torch.tensor([2, 2, 1]), torch.tensor([1, 1, 0]), emitted)
    assert proposer.draft_depths(state).tolist() == [0, proposer.template.max_depth, 0]


@pytest.mark.parametrize(("options", "message"), [
    (dict(tree_width=2), r"tree_width=2: method='recycling' drafts a tree of rank paths"),
    (dict(tree_paths=[(0,)], tree_total_tokens=4), r"tree_total_tokens: method='recycling' takes its tree from"),
    (dict(tree_paths=[(0,), (8,)]), r"tree_paths: rank 8 in a path; method='recycling' keeps the 8 best"),
    (dict(tree_paths="default"), r"tree_paths='default' names Medusa heads' own tree"),
    (dict(tree_total_tokens=0), r"tree_total_tokens: expected an int in \[1, "),
    (dict(tree_total_tokens=12, num_speculative_tokens=1),
     r"tree_total_tokens: expected an int in \[1, 8\], got 12: with k = 1 and tree_width = 1, method='recycling' has "
     r"8 draft nodes to keep \(rank paths of up to k tokens over its 8 candidates per token\); lower "
     r"tree_total_tokens or raise num_speculative_tokens$"),
    (dict(tree_paths=[(0, 0)]), r"tree_paths: .*\(0, 0\) needs its prefix \(0,\)"),
])
def test_bad_settings_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(method="recycling", **options)


def test_spec_method_recycling_takes_no_assistant():
    target = make_model("llama")
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    expected = target.generate(ids, **GREEDY)
    assert torch.equal(hf_specdec.generate(target, ids, spec_method="recycling", **GREEDY), expected)
    with pytest.raises(ValueError, match="spec_method='recycling' drafts from the text and takes no assistant"):
        hf_specdec.generate(target, ids, spec_method="recycling", assistant=make_model("llama"), **GREEDY)
