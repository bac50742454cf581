"""Two chains drafted by different proposers for the same rows, verified as one tree.

Under `method="auto"`, a step that drafts with a model drafter (an EAGLE head, Medusa heads, an MLP speculator)
also carries each row's n-gram lookup continuation, where the lookup found one: on hardware where verifying a few
more tokens costs about what one costs (a GPU; a CPU in bfloat16), the step keeps whichever guess the target
follows further. The second chain shares the first's longest common prefix and branches off where they differ, so
no token is verified twice.

Lossless either way (`hf_specdec.verify.tree`): greedy verification follows the target's argmax down whichever
branch holds it; sampled verification tries a node's children in turn against the residual, each with the law it
was drawn from (the first chain's own, where it was sampled; a point mass for a lookup's token). Where the first
chain's sampled token equals the lookup's, the node keeps the sampled law: it was drawn from it, and the lookup's
continuation hangs under it as deterministic children.
"""

from __future__ import annotations

import torch

from hf_specdec.tree.tree import TokenTree


def unite_chains(first: TokenTree, second: TokenTree) -> TokenTree:
    """`first`'s nodes, then `second`'s draft nodes past the prefix the two share (the others are padding), as one
    tree of 1 + k1 + k2 nodes; both are chains ([B, 1 + k1] and [B, 1 + k2] tokens) from the same roots, `second`'s
    drafts deterministic."""
    if not (first.is_chain and second.is_chain):
        raise ValueError("unite_chains: both proposals must be chains")
    if second.draft_probs is not None:
        raise ValueError("unite_chains: the second chain must be deterministic (a lookup's)")
    k1, k2 = first.num_nodes - 1, second.num_nodes - 1
    ours, theirs = first.token_ids[:, 1:], second.token_ids[:, 1:]  # [B, k1], [B, k2]
    real, their_real = first.valid[:, 1:], second.valid[:, 1:]
    both = min(k1, k2)
    same = (ours[:, :both] == theirs[:, :both]) & real[:, :both] & their_real[:, :both]
    shared = same.long().cumprod(dim=1).sum(dim=1, keepdim=True)  # [B, 1]: the common prefix's length
    depth = torch.arange(1, k2 + 1, device=theirs.device)[None, :]  # [1, k2]: depth of `second`'s node j
    keep = their_real & (depth > shared)
    # a kept node's parent: the node one level up, `first`'s while still on the shared prefix (node 0 = the root)
    parents = torch.where(depth - 1 <= shared, depth - 1, k1 + depth - 1)
    parents = torch.where(keep, parents, 0)  # padding hangs off the root
    draft_probs = None
    if first.draft_probs is not None:  # lookups' tokens as one-hot laws beside the sampled ones
        onehot = torch.zeros(*theirs.shape, first.draft_probs.shape[2], dtype=first.draft_probs.dtype,
                             device=theirs.device).scatter_(2, theirs[..., None], 1.0)
        draft_probs = torch.cat([first.draft_probs, onehot], dim=1)
    return TokenTree(
        token_ids=torch.cat([first.token_ids, theirs.to(first.token_ids.device)], dim=1),
        parents=torch.cat([first.parents, parents.to(first.parents.device)], dim=1),
        valid=torch.cat([first.valid, keep.to(first.valid.device)], dim=1),
        draft_probs=draft_probs,
        max_depth=max(k1, k2),
        max_children=2,
    )
