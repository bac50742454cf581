"""Chain verification: which draft tokens the target keeps, and the one token it adds.

Vocabulary (vLLM's): a step's output is the *accepted* draft tokens, then one more token: a *recovered* token
sampled from the residual distribution where a draft token was rejected, or a *bonus* token sampled from the
target when every draft token was accepted. Rows are independent; each has its own number of draft tokens.

Both functions are pure: tensors in, a `VerificationResult` out, randomness only from the `torch.Generator`.

Sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): draft token x drawn from `draft_probs` is kept
with probability min(1, target_probs(x) / draft_probs(x)); at the first rejection the recovered token is drawn
from norm(max(target_probs - draft_probs, 0)). The emitted tokens are then distributed exactly as tokens drawn
one by one from `target_probs`. Draft-free proposers (n-gram) pass `draft_probs=None`: their draft is a point mass,
so x is kept with probability target_probs(x) and the residual is `target_probs` with x removed.
Uniforms are float64: float32 `rand` can return exactly 0 (PyTorch #16706), and the test is strict (u < ratio)
so a token with target probability 0 is never kept.
"""

from __future__ import annotations

import torch

from hf_specdec.sampling import sample
from hf_specdec.step.result import PLACEHOLDER_TOKEN_ID, VerificationResult


def _first_rejection(
    # [B, k] bool
    accepted: torch.Tensor,
) -> torch.Tensor:
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _assemble(
    # [B, k]
    draft_token_ids: torch.Tensor,
    # [B]
    num_accepted: torch.Tensor,
    # [B]
    final_token_ids: torch.Tensor,
) -> VerificationResult:
    batch, k = draft_token_ids.shape
    column = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_zeros(batch, 1)], dim=1)
    out = torch.where(column < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    out = torch.where(column == num_accepted[:, None], final_token_ids[:, None], out)
    return VerificationResult.chain(out, num_accepted)


def _valid_drafts(
    # [B, k]
    draft_token_ids: torch.Tensor,
    # [B]
    num_draft_tokens: torch.Tensor,
) -> torch.Tensor:
    column = torch.arange(draft_token_ids.shape[1], device=draft_token_ids.device)[None, :]
    return column < num_draft_tokens[:, None]


def greedy_verify(
    # [B, k]: entries at or after num_draft_tokens[b] are ignored
    draft_token_ids: torch.Tensor,
    # [B]
    num_draft_tokens: torch.Tensor,
    # [B, k + 1]: argmax of the processed target scores at each position
    target_token_ids: torch.Tensor,
) -> VerificationResult:
    """Keep drafts while they equal the target's argmax; then emit the target's argmax."""
    k = draft_token_ids.shape[1]
    if k == 0:  # a plain step (a host fact): each row emits the target's argmax, no chain arithmetic
        return VerificationResult.chain(target_token_ids, target_token_ids.new_zeros(target_token_ids.shape[0]))
    column = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    accepted = (draft_token_ids == target_token_ids[:, :k]) & (column[:, :k] < num_draft_tokens[:, None])
    num_accepted = _first_rejection(accepted)
    # the accepted drafts are the target's own argmax, and so is the token after them
    out = torch.where(column <= num_accepted[:, None], target_token_ids, PLACEHOLDER_TOKEN_ID)
    return VerificationResult.chain(out, num_accepted)


def rejection_sample(
    # [B, k]: entries at or after num_draft_tokens[b] are ignored
    draft_token_ids: torch.Tensor,
    # [B]
    num_draft_tokens: torch.Tensor,
    # [B, k, V] the distributions the drafts were drawn from, or None for point-mass (draft-free) proposers
    draft_probs: torch.Tensor | None,
    # [B, k + 1, V] target distributions after the user's logits processors
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> VerificationResult:
    """Lossless speculative sampling over a chain; see the module docstring."""
    batch, k = draft_token_ids.shape
    device = target_probs.device
    valid = _valid_drafts(draft_token_ids, num_draft_tokens)
    safe_drafts = torch.where(valid, draft_token_ids, 0)
    target_at_draft = target_probs[:, :k].gather(2, safe_drafts[..., None]).squeeze(2).double()
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(2, safe_drafts[..., None]).squeeze(2).double()
    uniform = torch.rand((batch, k), dtype=torch.float64, device=device, generator=generator)
    accepted = (uniform * draft_at_draft < target_at_draft) & valid
    num_accepted = _first_rejection(accepted)

    # The distribution of the final token: residual where a draft was rejected, the target itself otherwise.
    final_target = target_probs.gather(1, num_accepted[:, None, None].expand(-1, 1, target_probs.shape[2])).squeeze(1)
    rejected = num_accepted < num_draft_tokens
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k > 0:
        rejected_token = safe_drafts.gather(1, at[:, None])  # [B, 1]
        if draft_probs is None:
            draft_at = torch.zeros_like(final_target).scatter_(1, rejected_token, 1.0)
        else:
            draft_at = draft_probs.gather(1, at[:, None, None].expand(-1, 1, draft_probs.shape[2])).squeeze(1)
        residual = (final_target - draft_at).clamp_(min=0)
        # p == q up to rounding: the rejection had probability ~0; fall back to the target itself.
        degenerate = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(degenerate, final_target, residual)
        final_target = torch.where(rejected[:, None], residual, final_target)
    final = sample(final_target, generator)
    return _assemble(draft_token_ids, num_accepted, final)
