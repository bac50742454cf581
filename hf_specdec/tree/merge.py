"""One token tree per row taken from several proposals' trees: a step in which rows draft with different proposers
(`method="auto"` per row, a hybrid's suffix and fallback rows) verifies them all in one forward.

Each row keeps its chosen tree's nodes in that tree's own order, so a node index means the same in the merged tree
as in the tree it came from (a proposer reads its own rows' verification result unchanged). Trees are padded to the
widest one (padding: invalid children of the root). Chains give a chain. Where some tree carries draft
distributions, the rows of the others get a point mass at each of their tokens, which verification treats exactly
as a deterministic draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_specdec.tree.template import TreeTemplate
from hf_specdec.tree.tree import TokenTree


def merge_trees(
    trees: Sequence[TokenTree],
    # [B] long: the index into `trees` of the tree each row takes
    choice: torch.Tensor,
) -> TokenTree:
    """Each row's tree from `trees[choice[b]]`, all padded to the widest."""
    width = max(tree.num_nodes for tree in trees)
    batch = trees[0].token_ids.shape[0]
    picks = [(choice == index)[:, None] for index in range(len(trees))]  # [B, 1] bool each

    def padded(tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        extra = width - tree.num_nodes
        tokens = torch.nn.functional.pad(tree.token_ids, (0, extra))
        parents = torch.nn.functional.pad(tree.parents.expand(batch, -1), (0, extra))
        valid = torch.nn.functional.pad(tree.valid, (0, extra))
        return tokens, parents, valid

    tokens, parents, valid = padded(trees[0])
    for tree, pick in zip(trees[1:], picks[1:]):
        tree_tokens, tree_parents, tree_valid = padded(tree)
        tokens = torch.where(pick, tree_tokens, tokens)
        parents = torch.where(pick, tree_parents, parents)
        valid = torch.where(pick, tree_valid, valid)
    draft_probs = None
    if any(tree.draft_probs is not None for tree in trees):
        draft_probs = _merged_probs(list(zip(trees, picks)), tokens)
    if all(tree.is_chain for tree in trees):
        dense = all(tree.dense and tree.num_nodes == width for tree in trees)
        return TokenTree.from_template(TreeTemplate.chain(width - 1), tokens, valid, draft_probs, dense=dense)
    return TokenTree(token_ids=tokens, parents=parents, valid=valid, draft_probs=draft_probs,
                     max_depth=max(tree.max_depth for tree in trees),
                     max_children=max(max(tree.max_children for tree in trees), 1))


def _merged_probs(
    # each tree with [B, 1] bool: the rows that take it
    trees: list[tuple[TokenTree, torch.Tensor]],
    # [B, N]: the merged tree's tokens
    tokens: torch.Tensor,
) -> torch.Tensor:
    """[B, N - 1, V]: each row's draft distributions from the tree it takes, and a point mass at its token where
    that tree carries none (a deterministic tree, or the nodes past its own)."""
    carrying = [(tree.draft_probs, rows) for tree, rows in trees if tree.draft_probs is not None]
    probs = torch.zeros(*tokens[:, 1:].shape, carrying[0][0].shape[2], device=tokens.device)
    carried = torch.zeros(tokens[:, 1:].shape, dtype=torch.bool, device=tokens.device)
    for tree_probs, rows in carrying:
        known = tree_probs.shape[1]
        probs[:, :known] = torch.where(rows[:, :, None], tree_probs.to(probs.dtype), probs[:, :known])
        carried[:, :known] |= rows
    return probs.scatter_add_(2, tokens[:, 1:, None], (~carried).to(probs.dtype)[:, :, None])
