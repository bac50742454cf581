"""LOSSY typical acceptance (Medusa's `posterior_threshold` / `posterior_alpha` rule): opt-in only.

A draft token x at a position where the target's distribution is p is accepted when
p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))), H(p) = -sum p log(p + 1e-5); the walk stops at the
first token (chain) or node (tree: the first acceptable child, in node order) that fails, and the next token is
drawn from the target's p there. Accepting plausible-but-not-sampled tokens raises acceptance, and it CHANGES THE
OUTPUT DISTRIBUTION: the emitted tokens no longer follow the target's law (tests measure the bias). It exists
because the Medusa paper offers it; hf_specdec never turns it on by itself.
"""

from __future__ import annotations

import torch

from hf_specdec.sampling import sample
from hf_specdec.step.result import VerificationResult
from hf_specdec.tree.tree import TokenTree
from hf_specdec.verify.chain import _assemble, _first_rejection, _valid_drafts
from hf_specdec.verify.tree import _result, _row_gather, follow_acceptable


def typical_thresholds(
    # [..., V]
    target_probs: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
) -> torch.Tensor:
    """[...]: the probability a token must exceed to be accepted at each position."""
    entropy = -(target_probs * torch.log(target_probs + 1e-5)).sum(dim=-1)
    return torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)


def typical_chain_verify_lossy(
    # [B, k]
    draft_token_ids: torch.Tensor,
    # [B]
    num_draft_tokens: torch.Tensor,
    # [B, k + 1, V]
    target_probs: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
    generator: torch.Generator | None,
) -> VerificationResult:
    k = draft_token_ids.shape[1]
    valid = _valid_drafts(draft_token_ids, num_draft_tokens)
    token_probs = target_probs[:, :k].gather(2, torch.where(valid, draft_token_ids, 0)[..., None]).squeeze(2)
    thresholds = typical_thresholds(target_probs[:, :k], posterior_threshold, posterior_alpha)
    num_accepted = _first_rejection((token_probs > thresholds) & valid)
    final_probs = target_probs.gather(1, num_accepted[:, None, None].expand(-1, 1, target_probs.shape[2])).squeeze(1)
    final = sample(final_probs, generator)
    return _assemble(draft_token_ids, num_accepted, final)


def typical_tree_verify_lossy(
    tree: TokenTree,
    # [B, N, V]
    target_probs: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
    generator: torch.Generator | None,
) -> VerificationResult:
    parent_probs = _rows_of(target_probs, tree.parents.clamp(min=0))  # [B, N, V]: p where each node is judged
    token_probs = parent_probs.gather(2, tree.token_ids[..., None]).squeeze(2)
    acceptable = (token_probs > typical_thresholds(parent_probs, posterior_threshold, posterior_alpha)) & tree.valid
    path, num_accepted, current = follow_acceptable(tree, acceptable)
    final = sample(_row_gather(target_probs, current), generator)
    return _result(tree, path, num_accepted, final)


def _rows_of(
    # [B, N, V]
    values: torch.Tensor,
    # [B, N]
    index: torch.Tensor,
) -> torch.Tensor:
    return values.gather(1, index[..., None].expand(-1, -1, values.shape[2]))
