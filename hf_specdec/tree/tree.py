"""`TokenTree`: one draft tree per batch row, with the same node budget for every row.

Node 0 of each row is its root: the row's last committed token, whose KV is not yet cached. Nodes are in an order
where every parent precedes its children; padding nodes (`valid` False) hang off the root and are never accepted.
A chain of k draft tokens is the one-branch tree (`TreeTemplate.chain(k)`).

Structure without host syncs: a tree whose rows all share one shape (a chain, a static tree) carries its
`TreeTemplate`, and its ancestry, depths and children come from tensors built once per template and device. Other
trees (tries, dynamic trees, whose shape differs per row) carry host bounds on their depth and branching, and
their ancestry is closed in exactly `max_depth` passes: the host never reads the tree back to decide when to stop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
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
    # [B, N - 1, V] or None: the distribution node i + 1's token was drawn from; None for deterministic nodes
    # (top-k candidates, lookups), which verification treats as point masses
    draft_probs: torch.Tensor | None = None
    # the shape every row shares, when it does (node layout, depths, ranks), else None
    template: TreeTemplate | None = None
    # host bounds (from the template when there is one): the deepest node's depth, the most children of a node
    max_depth: int = field(default=-1)
    max_children: int = field(default=-1)
    # a host fact: every node of every row is real (`valid` is all True), so the verify forward needs no dummies
    dense: bool = False

    def __post_init__(self) -> None:
        nodes = self.token_ids.shape[1]
        if self.template is not None:
            object.__setattr__(self, "max_depth", self.template.max_depth)
            object.__setattr__(self, "max_children", self.template.max_children)
        if self.max_depth < 0:  # no bound given: the worst case, a chain of every node
            object.__setattr__(self, "max_depth", nodes - 1)
        if self.max_children < 0:
            object.__setattr__(self, "max_children", max(nodes - 1, 1))

    @classmethod
    def from_template(
        cls,
        template: TreeTemplate,
        # [B, N]: tokens laid out in the template's node order (node 0 = root)
        token_ids: torch.Tensor,
        # [B, N] bool or None (all real)
        valid: torch.Tensor | None = None,
        # [B, N - 1, V] or None
        draft_probs: torch.Tensor | None = None,
        # every node of every row is real (a host fact; True when `valid` is None)
        dense: bool = False,
    ) -> TokenTree:
        parents = template_tensors(template, token_ids.device).parents.expand_as(token_ids)
        if valid is None:
            valid, dense = torch.ones_like(token_ids, dtype=torch.bool), True
        return cls(token_ids=token_ids, parents=parents, valid=valid, draft_probs=draft_probs, template=template,
                   dense=dense)

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    @property
    def is_chain(self) -> bool:
        """Every row is one line of nodes (a host fact: from the template)."""
        return self.template is not None and self.template.is_chain

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: entry (q, j) is True iff node j is node q or one of its ancestors."""
        batch, n = self.parents.shape
        if self.template is not None:
            return template_tensors(self.template, self.parents.device).ancestors.expand(batch, n, n)
        ancestors = torch.eye(n, dtype=torch.bool, device=self.parents.device).expand(batch, n, n).clone()
        has_parent = (self.parents >= 0)[..., None]
        parent_rows = self.parents.clamp(min=0)[..., None].expand(batch, n, n)
        for _ in range(self.max_depth):  # pass d adds the ancestors d levels up
            ancestors = ancestors | (ancestors.gather(1, parent_rows) & has_parent)
        return ancestors

    @cached_property
    def depths(self) -> torch.Tensor:
        """[B, N]: distance of each node from the root."""
        if self.template is not None:
            return template_tensors(self.template, self.parents.device).depths.expand_as(self.parents)
        return self.ancestors.sum(dim=2) - 1

    @cached_property
    def children(self) -> torch.Tensor:
        """[B, N, M]: the valid children of every node in node order, -1 where there is none (M = `max_children`)."""
        batch, n = self.parents.shape
        if self.template is not None:
            kids = template_tensors(self.template, self.parents.device).children.expand(batch, -1, -1)
            real = self.valid.gather(1, kids.clamp(min=0).reshape(batch, -1)).view_as(kids)
            return torch.where(real & (kids >= 0), kids, -1)
        is_child = (self.parents[:, None, :] == torch.arange(n, device=self.parents.device)[None, :, None])
        is_child &= self.valid[:, None, :]  # [B, node, candidate child]
        index = torch.arange(n, device=self.parents.device).expand(batch, n, n)
        order = torch.where(is_child, index, n + index).sort(dim=2).values[:, :, : self.max_children]
        return torch.where(order < n, order, -1)


@dataclass(frozen=True)
class TemplateTensors:
    # [N]
    parents: torch.Tensor
    # [N]
    depths: torch.Tensor
    # [N]: each node's rank among its parent's candidates (-1 at the root)
    ranks: torch.Tensor
    # [N, N] bool: node j is node q or one of its ancestors
    ancestors: torch.Tensor
    # [N, M]: each node's children in node order, -1 padded
    children: torch.Tensor


@functools.lru_cache(maxsize=64)
def template_tensors(template: TreeTemplate, device: torch.device) -> TemplateTensors:
    """A template's structure as tensors on `device`, built once."""
    n = template.num_nodes
    ancestors = torch.eye(n, dtype=torch.bool)
    children = torch.full((n, template.max_children), -1, dtype=torch.long)
    used = [0] * n
    for node in range(1, n):
        parent = template.parents[node]
        ancestors[node] |= ancestors[parent]
        children[parent, used[parent]] = node
        used[parent] += 1
    return TemplateTensors(
        parents=torch.tensor(template.parents, device=device),
        depths=torch.tensor(template.depths, device=device),
        ranks=torch.tensor(template.ranks, device=device),
        ancestors=ancestors.to(device),
        children=children.to(device),
    )
