"""`TokenTree`: one draft tree per batch row, with the same node budget for every row.

Node 0 of each row is its root: the row's last committed token, whose KV is not yet cached. Nodes are in an order
where every parent precedes its children; padding nodes (`valid` False) hang off the root and are never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def depths(self) -> torch.Tensor:
        """[B, N]: distance of each node from the root."""
        depths = torch.zeros_like(self.parents)
        for node in range(1, self.num_nodes):
            depths[:, node] = depths.gather(1, self.parents[:, node : node + 1].clamp(min=0)).squeeze(1) + 1
        return depths

    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: entry (q, j) is True iff node j is node q or one of its ancestors."""
        batch, n = self.parents.shape
        eye = torch.eye(n, dtype=torch.bool, device=self.parents.device).expand(batch, n, n)
        rows = [eye[:, 0]]
        for node in range(1, n):
            parent_rows = torch.stack(rows, dim=1).gather(
                1, self.parents[:, node, None, None].clamp(min=0).expand(batch, 1, n)
            )
            rows.append(parent_rows.squeeze(1) | eye[:, node])
        return torch.stack(rows, dim=1)

    def children(self) -> torch.Tensor:
        """[B, N, M]: the valid children of every node in node order, padded with -1 (M = most children)."""
        batch, n = self.parents.shape
        is_child = (self.parents[:, None, :] == torch.arange(n, device=self.parents.device)[None, :, None])
        is_child &= self.valid[:, None, :]  # [B, node, candidate child]
        width = max(int(is_child.sum(dim=2).max()), 1)
        index = torch.arange(n, device=self.parents.device).expand(batch, n, n)
        order = torch.where(is_child, index, n + index).sort(dim=2).values[:, :, :width]
        return torch.where(order < n, order, -1)
