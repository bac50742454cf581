"""Medusa's static trees: the fit to measured rank accuracies, and the heads' own tree (fitted, else the default)."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.heads import MedusaConfig, MedusaHeads
from hf_specdec.heads.medusa import fit_tree


def test_fit_tree_keeps_the_likeliest_paths_as_a_tree():
    accuracy = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.3, 0.0], [0.4, 0.0, 0.0]])  # [K = 3 heads, R = 3 ranks]
    # path chances: (0,) .6, (0,0) .3, (1,) .2, (0,1) .18, (0,0,0) .12, (1,0) .1, (2,) .1, ...
    assert fit_tree(accuracy, 5) == [[0], [0, 0], [1], [0, 1], [0, 0, 0]]
    assert fit_tree(accuracy, 7) == [[0], [0, 0], [1], [0, 1], [0, 0, 0], [2], [1, 0]]  # ties: shorter first
    ones = torch.ones(2, 2)  # every chance 1: ties everywhere, still prefix-closed
    assert fit_tree(ones, 4) == [[0], [1], [0, 0], [0, 1]]
    with pytest.raises(ValueError, match="fit_tree: num_nodes: expected an int >= 1"):
        fit_tree(accuracy, 0)


def test_heads_tree_is_the_fitted_one_else_the_default():
    from hf_specdec.tree.template import DEFAULT_MEDUSA_TREE

    four = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=8, num_heads=4))
    assert four.tree() == [list(p) for p in DEFAULT_MEDUSA_TREE]
    assert max(map(len, MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=8, num_heads=2)).tree())) == 2
    fitted = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=8, num_heads=2, tree_paths=[[0], [1], [0, 0]]))
    assert fitted.tree() == [[0], [1], [0, 0]]
