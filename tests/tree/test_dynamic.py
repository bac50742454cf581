"""EAGLE-2 candidates: when an expansion may stop early (`Candidates.settled`), and that stopping keeps the tree a full
expansion would have chosen."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.tree.dynamic import Candidates
from tests.conftest import make_draft, make_model, padded_batch
from tests.proposers.test_mlp_speculator import random_speculator


def _log_probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows).log()


def test_settled_once_no_frontier_node_can_beat_the_kept_ones():
    # depth 1: tokens 0 and 1 at 0.6 and 0.3, both on the frontier
    candidates = Candidates(_log_probs([[0.6, 0.3, 0.05, 0.05]]), width=2)
    assert not candidates.settled(3)  # fewer candidates than kept nodes
    assert not candidates.settled(2)  # a child of 0.6 may beat 0.3
    assert candidates.settled(1)  # a child of the best scores at most the best itself: a tie, the older wins
    # children: of 0.6 -> 0.7 / 0.2 of it (0.42, 0.12), of 0.3 -> 0.9 / 0.1 of it (0.27, 0.03); frontier 0.42, 0.27
    candidates.expand(_log_probs([[[0.7, 0.2, 0.05, 0.05], [0.9, 0.1, 1e-9, 1e-9]]]))
    assert not candidates.settled(3)  # the third best is 0.3: a child of 0.42 may beat it
    assert candidates.settled(2)  # the second best is the frontier's 0.42 itself


def test_settled_needs_every_row():
    candidates = Candidates(_log_probs([[0.9, 0.05, 0.03, 0.02], [0.5, 0.4, 0.05, 0.05]]), width=2)
    # row 0: children of 0.9 -> 0.45 / 0.45, of 0.05 -> tiny: the frontier (0.45) is under its second best (0.45:
    # its own node) and every later one; row 1: children of 0.5 -> 0.45 / 0.05, of 0.4 -> 0.36 / 0.04
    candidates.expand(_log_probs([[[0.5, 0.5, 1e-9, 1e-9], [0.5, 0.5, 1e-9, 1e-9]],
                                  [[0.9, 0.1, 1e-9, 1e-9], [0.9, 0.1, 1e-9, 1e-9]]]))
    assert candidates.settled(1)
    assert not candidates.settled(3)  # row 1's third best is 0.4 < its frontier's 0.45


@pytest.mark.parametrize("drafter", ["draft", "mlp_speculator"])
def test_a_settled_expansion_proposes_the_full_expansion_s_tree(drafter, monkeypatch):
    """Every proposal of a dynamic tree (a draft model's, an MLP speculator's), with levels stopped once settled and
    with every level drafted, on a batch with padding: the same trees, and some steps stopped early."""
    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    draft = make_draft() if drafter == "draft" else random_speculator(target)
    trees, stops = [], []
    select, settled = Candidates.select, Candidates.settled

    def recording_select(self, *args):
        tree, chosen = select(self, *args)
        trees.append((tree.token_ids.clone(), tree.parents.clone(), tree.valid.clone()))
        return tree, chosen

    def recording_settled(self, total):
        stops.append(settled(self, total))
        return stops[-1]

    monkeypatch.setattr(Candidates, "select", recording_select)
    runs = {}
    for name, check in (("settling", recording_settled), ("full", lambda self, total: False)):
        monkeypatch.setattr(Candidates, "settled", check)
        trees.clear()
        drafts = {"draft_model": copy.deepcopy(draft)} if drafter == "draft" else {"heads": draft}
        config = SpeculativeConfig(method=drafter, num_speculative_tokens=4 if drafter == "draft" else 3,
                                   tree_width=2, tree_total_tokens=3, schedule="fixed", **drafts)
        out = hf_specdec.generate(target, ids, speculative=config, **kwargs)
        runs[name] = (out, list(trees))
    assert any(stops), "no expansion settled early"
    assert torch.equal(runs["settling"][0], runs["full"][0])
    assert torch.equal(runs["full"][0], target.generate(ids, **kwargs))
    assert len(runs["settling"][1]) == len(runs["full"][1])
    for settled_tree, full_tree in zip(runs["settling"][1], runs["full"][1]):
        assert all(torch.equal(a, b) for a, b in zip(settled_tree, full_tree))
