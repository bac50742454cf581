"""Tree verification: walk each row's token tree from the root, keeping the path the target would have produced.

Greedy: at each node, descend into the child whose token is the target's argmax there; stop when none is.

Sampling, lossless, one rule for both kinds of children. At the current node let r = the target distribution
there (after the user's processors). Its children are tried in node order; child i, token x_i drawn from q_i,
is accepted with probability min(1, r(x_i) / q_i(x_i)); if rejected, r <- norm(max(r - q_i, 0)) and the next child
is tried. If one is accepted the walk descends into it; if all are rejected the recovered token is drawn from r;
after an accepted leaf the bonus token is drawn from the target at the leaf.
- Deterministic children (top-k candidates, lookups: `draft_probs` None) are point masses q_i = onehot(x_i):
  x_i is accepted with probability r(x_i) and removed from r when rejected (EAGLE's and SGLang's rule).
- Children drawn independently from the draft (`draft_probs` given) follow SpecInfer's multi-step speculative
  sampling (Miao et al. 2023, arXiv 2305.09781).
Either way the emitted tokens are distributed exactly as tokens drawn one by one from the target.

The result names the accepted path's nodes, so the cache keeps their KV (computed in the same forward) and drops
every other node; nothing is recomputed.
"""

from __future__ import annotations

import torch

from hf_specdec.sampling import sample
from hf_specdec.step.result import PLACEHOLDER_TOKEN_ID, VerificationResult
from hf_specdec.tree.tree import TokenTree


def _row_gather(
    # [B, N, ...]
    values: torch.Tensor,
    # [B]
    nodes: torch.Tensor,
) -> torch.Tensor:
    return values[torch.arange(values.shape[0], device=values.device), nodes]


def _result(
    tree: TokenTree,
    # per step of the walk [B]
    path: list[torch.Tensor],
    # [B]
    num_accepted: torch.Tensor,
    # [B]
    final: torch.Tensor,
) -> VerificationResult:
    nodes = torch.stack(path, dim=1)  # [B, D + 1]: node at each step of the walk (repeats once it stops)
    steps = torch.arange(nodes.shape[1], device=nodes.device)[None, :]
    accepted_tokens = tree.token_ids.gather(1, nodes[:, 1:])  # [B, D]
    out = torch.where(steps[:, :-1] < num_accepted[:, None], accepted_tokens, PLACEHOLDER_TOKEN_ID)
    out = torch.cat([out, out.new_full((out.shape[0], 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    out = torch.where(steps == num_accepted[:, None], final[:, None], out)
    return VerificationResult(output_token_ids=out, num_accepted=num_accepted, path_nodes=nodes,
                              num_nodes=tree.num_nodes)


def follow_acceptable(
    tree: TokenTree,
    # [B, N] bool: whether each node would be accepted once the walk stands on its parent
    acceptable: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Walk from the root into the first acceptable child, as deep as it goes: (path [B] per step, num_accepted
    [B], the node each row stopped on [B])."""
    children = tree.children  # [B, N, M]
    batch = acceptable.shape[0]
    current = torch.zeros(batch, dtype=torch.long, device=acceptable.device)
    active = torch.ones(batch, dtype=torch.bool, device=current.device)
    num_accepted = torch.zeros_like(current)
    path = [current]
    for _ in range(tree.max_depth):
        kids = _row_gather(children, current)  # [B, M]
        match = (kids >= 0) & acceptable.gather(1, kids.clamp(min=0)) & active[:, None]
        found = match.any(dim=1)
        chosen = kids.gather(1, match.long().argmax(dim=1, keepdim=True)).squeeze(1)
        current = torch.where(found, chosen, current)
        num_accepted += found.long()
        active &= found
        path.append(current)
    return path, num_accepted, current


def greedy_tree_verify(
    tree: TokenTree,
    # [B, N]: argmax of the processed target scores at every node
    target_token_ids: torch.Tensor,
) -> VerificationResult:
    parent_argmax = target_token_ids.gather(1, tree.parents.clamp(min=0))  # [B, N]: the target's pick before each node
    acceptable = (tree.token_ids == parent_argmax) & tree.valid
    path, num_accepted, current = follow_acceptable(tree, acceptable)
    return _result(tree, path, num_accepted, _row_gather(target_token_ids, current))


def tree_rejection_sample(
    tree: TokenTree,
    # [B, N, V]: target distributions at every node, after the user's logits processors
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> VerificationResult:
    children = tree.children  # [B, N, M]
    batch, _, vocab = target_probs.shape
    device = target_probs.device
    current = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros_like(current)
    final_probs = torch.zeros(batch, vocab, dtype=torch.float64, device=device)
    path = [current]
    for _ in range(tree.max_depth):
        residual = _row_gather(target_probs, current).double()  # [B, V]
        kids = _row_gather(children, current)  # [B, M]
        chosen = torch.full_like(current, -1)
        for rank in range(kids.shape[1]):
            kid = kids[:, rank]
            trying = (kid >= 0) & active & (chosen < 0)
            token = tree.token_ids.gather(1, kid.clamp(min=0)[:, None])  # [B, 1]
            if tree.draft_probs is None:
                draft = torch.zeros_like(residual).scatter_(1, token, 1.0)
            else:
                draft = _row_gather(tree.draft_probs, (kid - 1).clamp(min=0)).double()
            uniform = torch.rand(batch, dtype=torch.float64, device=device, generator=generator)
            accept = trying & (uniform * draft.gather(1, token).squeeze(1) < residual.gather(1, token).squeeze(1))
            chosen = torch.where(accept, kid, chosen)
            leftover = (residual - draft).clamp_(min=0)
            total = leftover.sum(dim=1, keepdim=True)
            leftover = torch.where(total > 0, leftover / total.clamp(min=1e-300), residual)
            residual = torch.where((trying & ~accept)[:, None], leftover, residual)
        stopped = active & (chosen < 0)
        final_probs = torch.where(stopped[:, None], residual, final_probs)
        active &= chosen >= 0
        current = torch.where(active, chosen, current)
        num_accepted += active.long()
        path.append(current)
    final_probs = torch.where(active[:, None], _row_gather(target_probs, current).double(), final_probs)
    final = sample(final_probs, generator)
    return _result(tree, path, num_accepted, final)
