"""`TokenTree`: one draft tree per batch row, with the same node budget for every row.

Node 0 of each row is its root: the row's last committed token, whose KV is not yet cached. Nodes are in an order
where every parent precedes its children; padding nodes (`valid` False) hang off the root and are never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from hf_specdec.tree.template import TreeTemplate


@dataclass(frozen=True)
class TokenTree:
    # [B, N]: token of each node; node 0 is the root
    token_ids: torch.Tensor
    # [B, N]: parent node index, -1 at the root; parents[b, i] < i
    parents: torch.Tensor
    # [B, N] bool: real nodes (the root is always real)
    valid: torch.Tensor
    # [B, N, V] or None: the distribution each node's token was drawn from; None for deterministic nodes
    # (top-k candidates, lookups), which verification treats as point masses
    draft_probs: torch.Tensor | None = None

    @classmethod
    def from_template(
        cls,
        template: TreeTemplate,
        # [B, N]: tokens laid out in the template's node order (node 0 = root)
        token_ids: torch.Tensor,
        # [B, N] bool or None (all real)
        valid: torch.Tensor | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> TokenTree:
        parents = torch.tensor(template.parents, device=token_ids.device).expand_as(token_ids)
        if valid is None:
            valid = torch.ones_like(token_ids, dtype=torch.bool)
        return cls(token_ids=token_ids, parents=parents, valid=valid, draft_probs=draft_probs)

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: entry (q, j) is True iff node j is node q or one of its ancestors. Computed once per tree,
        by iterating over depth: each pass adds every node's parent's ancestors."""
        batch, n = self.parents.shape
        ancestors = torch.eye(n, dtype=torch.bool, device=self.parents.device).expand(batch, n, n).clone()
        has_parent = (self.parents >= 0)[..., None]
        parent_rows = self.parents.clamp(min=0)[..., None].expand(batch, n, n)
        while True:
            grown = ancestors | (ancestors.gather(1, parent_rows) & has_parent)
            if torch.equal(grown, ancestors):
                return ancestors
            ancestors = grown

    @cached_property
    def depths(self) -> torch.Tensor:
        """[B, N]: distance of each node from the root."""
        return self.ancestors.sum(dim=2) - 1

    @cached_property
    def children(self) -> torch.Tensor:
        """[B, N, M]: the valid children of every node in node order, padded with -1 (M = most children)."""
        batch, n = self.parents.shape
        is_child = (self.parents[:, None, :] == torch.arange(n, device=self.parents.device)[None, :, None])
        is_child &= self.valid[:, None, :]  # [B, node, candidate child]
        width = max(int(is_child.sum(dim=2).max()), 1)
        index = torch.arange(n, device=self.parents.device).expand(batch, n, n)
        order = torch.where(is_child, index, n + index).sort(dim=2).values[:, :, :width]
        return torch.where(order < n, order, -1)
