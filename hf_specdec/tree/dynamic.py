"""The EAGLE-2 selection of a dynamic draft tree (Li et al. 2024): of every candidate node a drafter expanded, keep
the best `total` by cumulative log-probability. The kept set is closed under ancestry (a child never scores above
its parent; ties go to the shallower node, which comes first), so it is a tree; its nodes are re-indexed so parents
precede children. Candidates are deterministic, so the tree carries no draft distribution (point masses)."""

from __future__ import annotations

import torch

from hf_specdec.tree.tree import TokenTree


def select_best_nodes(
    # [B]: each row's last committed token (the root)
    root_token_ids: torch.Tensor,
    # [B, C]: every candidate's token; candidate 0 is the root (its entry is not read)
    token_ids: torch.Tensor,
    # [B, C]: each candidate's parent candidate, -1 at the root; ids grow with depth
    parents: torch.Tensor,
    # [B, C]: cumulative log-probability of each candidate's path
    cum_log_probs: torch.Tensor,
    # each candidate's depth (host ints, the same for every row)
    depths: list[int],
    total: int,
    # [B]: draft tokens each row may still take (deeper nodes are padding)
    budget: torch.Tensor,
    # the most children any candidate has (a host bound)
    max_children: int,
    device: torch.device,
) -> tuple[TokenTree, torch.Tensor]:
    """The tree of the best `total` candidates (fewer when there are fewer) on `device`, and [B, total] the candidate
    id of each of its draft nodes."""
    batch, count = token_ids.shape
    total = min(total, count - 1)
    by_depth = torch.tensor(depths, device=token_ids.device)
    order = cum_log_probs[:, 1:].sort(dim=1, descending=True, stable=True).indices[:, :total] + 1  # candidate ids
    chosen = order.sort(dim=1).values  # ids grow with depth: parents before children
    new_index = torch.full((batch, count), -1, dtype=torch.long, device=token_ids.device)
    new_index[:, 0] = 0
    new_index.scatter_(1, chosen, torch.arange(1, total + 1, device=token_ids.device).expand(batch, -1))
    tree_parents = torch.cat([parents[:, :1], new_index.gather(1, parents.gather(1, chosen))], dim=1)
    tree_tokens = torch.cat([root_token_ids[:, None].to(token_ids.device), token_ids.gather(1, chosen)], dim=1)
    tree_depths = torch.cat([by_depth[:1].expand(batch, 1), by_depth[chosen]], dim=1)
    tree = TokenTree(
        token_ids=tree_tokens.to(device),
        parents=tree_parents.to(device),
        valid=tree_depths.to(device) <= budget.to(device)[:, None],
        max_depth=max(depths),
        max_children=max_children,
    )
    return tree, chosen
