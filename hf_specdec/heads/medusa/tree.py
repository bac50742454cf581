"""Medusa's static trees of rank paths (path (r0, r1, ...): head 0's rank-r0 guess, then head 1's rank-r1 guess, ...):
the default one for K heads, and the one fitted to heads' measured rank accuracies."""

from __future__ import annotations

import torch

from hf_specdec.tree.template import likeliest_rank_paths, rank_budget_paths

MAX_DEFAULT_TREE_DEPTH = 4


def default_tree(num_heads: int) -> list[list[int]]:
    """Every path over the first (up to 4) heads whose ranks sum to at most 2 (for 4 heads: the built-in 34-node
    default tree)."""
    depth = min(num_heads, MAX_DEFAULT_TREE_DEPTH)
    return [list(p) for p in rank_budget_paths(depth=depth, rank_budget=2)]


def fit_tree(
    # [K, R]: P(head i's rank-r candidate is the token that follows), measured on data
    rank_accuracy: torch.Tensor,
    num_nodes: int,
) -> list[list[int]]:
    """Medusa's tree fit: a path's chance of being accepted whole is the product of its heads' rank accuracies
    (heads taken as independent); keep the `num_nodes` likeliest paths (`likeliest_rank_paths`)."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"fit_tree: num_nodes: expected an int >= 1, got {num_nodes!r}")
    return [list(path) for path in likeliest_rank_paths(rank_accuracy.double().tolist(), num_nodes)]
