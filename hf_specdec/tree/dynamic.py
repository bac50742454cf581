"""The EAGLE-2 dynamic draft tree (Li et al. 2024): the expansion (`Candidates`: at each depth the best `width` new
nodes by cumulative log-probability each offer their top `width` children) and the selection: of every candidate
node a drafter expanded, keep the best `total` by cumulative log-probability. The kept set is closed under ancestry (a child never scores above
its parent; ties go to the shallower node, which comes first), so it is a tree; its nodes are re-indexed so parents
precede children. Candidates are deterministic, so the tree carries no draft distribution (point masses)."""

from __future__ import annotations

import functools

import torch

from hf_specdec.tree.tree import TokenTree


def candidate_count(width: int, depth: int) -> int:
    """The candidates an expansion of `depth` levels offers: the root's top `width`, then `width` children of each of
    the `width` frontier nodes per further level (the most nodes a dynamic tree can keep)."""
    return width + (depth - 1) * width**2


# device types on which an expansion reads, before each level, whether it has settled (`Candidates.settled`: one host
# read per level; on a CPU it waits for nothing, and saved a third of the EAGLE-1/2 head's levels on SmolLM2,
# `benchmarks/tree_settle.py`); on a GPU the read would stall the queue each level (not measured there)
SETTLING_DEVICES = frozenset({"cpu"})


def settles_on(device: torch.device) -> bool:
    """Whether an expansion on `device` checks, before each level, whether it has settled."""
    return device.type in SETTLING_DEVICES


def kept_nodes(total: int, depth: int, max_depth: int) -> int:
    """The nodes a tree of `total` nodes over `max_depth` levels keeps in a step the schedule narrows to `depth`
    levels, ceil(total * depth / max_depth): its verify forward shrinks with the step, as a chain's does."""
    return -(-total * depth // max_depth)


def select_best_nodes(
    # [B]: each row's last committed token (the root)
    root_token_ids: torch.Tensor,
    # [B, C]: every candidate's token; candidate 0 is the root (its entry is not read)
    token_ids: torch.Tensor,
    # [B, C]: each candidate's parent candidate, -1 at the root; ids grow with depth
    parents: torch.Tensor,
    # [B, C]: cumulative log-probability of each candidate's path
    cum_log_probs: torch.Tensor,
    # [C]: each candidate's depth (the same for every row)
    depths: torch.Tensor,
    total: int,
    # [B]: draft tokens each row may still take (deeper nodes are padding)
    budget: torch.Tensor,
    # the deepest candidate's depth and the most children any candidate has (host bounds)
    depth_bound: int,
    max_children: int,
    device: torch.device,
) -> tuple[TokenTree, torch.Tensor]:
    """The tree of the best `total` candidates (fewer when there are fewer) on `device`, and [B, total] the candidate
    id of each of its draft nodes."""
    batch, count = token_ids.shape
    total = min(total, count - 1)
    by_depth = depths.to(token_ids.device)
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
        max_depth=min(depth_bound, total),  # `total` nodes reach no deeper
        max_children=max_children,
    )
    return tree, chosen


class Candidates:
    """The candidates of an EAGLE-2 expansion, grown a depth at a time: at each depth the `width` frontier nodes (the
    best new candidates by cumulative log-probability) each offer their top `width` children. Candidate 0 is the
    root; the depth-1 candidates are the root's top `width` tokens."""

    def __init__(
        self,
        # [B, V]: log-probabilities of the token after the root
        log_probs: torch.Tensor,
        width: int,
        # [V] long: the token id of each column of the log-probabilities (a drafter over a token map scores its
        # ids only); None: column j is token j
        token_ids: torch.Tensor | None = None,
    ) -> None:
        self.token_ids = token_ids
        cum, tokens = log_probs.topk(width, dim=-1)  # [B, w]
        tokens = self._ids(tokens)
        batch = tokens.shape[0]
        self.width = width
        self.tokens = [torch.zeros_like(tokens[:, :1]), tokens]
        self.parents = [torch.full_like(tokens[:, :1], -1), torch.zeros_like(tokens)]
        self.cum = [torch.zeros_like(cum[:, :1]), cum]
        self.levels = 1  # candidate depths below the root
        # [B, w]: the frontier's candidate ids, tokens and cumulative log-probabilities
        self.frontier = torch.arange(1, width + 1, device=tokens.device).expand(batch, -1)
        self.frontier_tokens, self.frontier_cum = tokens, cum

    def expand(
        self,
        # [B, w, V]: log-probabilities of the token after each frontier node
        log_probs: torch.Tensor,
    ) -> torch.Tensor:
        """Add each frontier node's top `width` children; the best `width` of them become the frontier. Returns
        [B, w] which of the w * w children each new frontier node is (child i of frontier node i // w)."""
        batch, width = self.frontier.shape[0], self.width
        child_cum, child_tokens = (log_probs + self.frontier_cum[:, :, None]).topk(width, dim=-1)  # [B, w, w]
        child_tokens = self._ids(child_tokens)
        first_id = 1 + width + (self.levels - 1) * width * width  # candidates so far
        child_tokens, child_cum = child_tokens.reshape(batch, -1), child_cum.reshape(batch, -1)
        self.tokens.append(child_tokens)
        self.cum.append(child_cum)
        self.parents.append(self.frontier[:, :, None].expand(-1, -1, width).reshape(batch, -1))
        self.levels += 1
        best = child_cum.topk(width, dim=-1).indices
        self.frontier = first_id + best
        self.frontier_tokens, self.frontier_cum = child_tokens.gather(1, best), child_cum.gather(1, best)
        return best

    def settled(self, total: int) -> bool:
        """Whether no deeper candidate can enter the best `total` in any row: every row's best frontier node scores at
        most its `total`-th best candidate so far. A child scores at most its parent (log-probabilities are <= 0)
        and only frontier nodes are expanded, so deeper levels could only add candidates that lose to `total` older
        ones (a tie goes to the older: `select_best_nodes` sorts stably, and ids grow with depth): the selection is
        the one a full expansion would make. One read of a [B] bool."""
        scores = torch.cat(self.cum, dim=1)[:, 1:]  # the root is no candidate
        if scores.shape[1] < total:
            return False
        kth_best = scores.topk(total, dim=1).values[:, -1]
        return bool((self.frontier_cum.max(dim=1).values <= kth_best).all())

    def _ids(
        self,
        # [...] long: columns of the log-probabilities
        columns: torch.Tensor,
    ) -> torch.Tensor:
        """[...] their token ids."""
        return columns if self.token_ids is None else self.token_ids[columns]

    def select(
        self,
        # [B]
        root_token_ids: torch.Tensor,
        total: int,
        # [B]
        budget: torch.Tensor,
        device: torch.device,
    ) -> tuple[TokenTree, torch.Tensor]:
        """`select_best_nodes` over the candidates."""
        depths = candidate_depths(self.width, self.levels, self.frontier.device)
        return select_best_nodes(root_token_ids, torch.cat(self.tokens, dim=1), torch.cat(self.parents, dim=1),
                                 torch.cat(self.cum, dim=1), depths, total, budget, self.levels, self.width, device)


@functools.lru_cache(maxsize=32)
def candidate_depths(width: int, levels: int, device: torch.device) -> torch.Tensor:
    """[C]: each candidate's depth after `levels` depths of an expansion of `width` (the root, `width` nodes at depth
    1, then `width * width` per depth), built once per shape and device."""
    depths = [0] + [1] * width + [d for d in range(2, levels + 1) for _ in range(width * width)]
    return torch.tensor(depths, device=device)
