"""The accept step of the decode loop: which rule judges a proposal, from the generation settings and the
proposal's shape.

Greedy decoding matches drafts against the target's argmax; sampling runs lossless rejection sampling with the
user's generator; `lossy_typical_acceptance` (opt-in, named lossy) runs Medusa's typical acceptance instead. A chain
(a host fact of the proposal's tree) takes the chain arithmetic of `hf_specdec.verify.chain`, any other tree the
walk of `hf_specdec.verify.tree`; both return the same `VerificationResult`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_specdec.step.proposal import Proposal
from hf_specdec.step.result import VerificationResult
from hf_specdec.verify.chain import greedy_verify, rejection_sample
from hf_specdec.verify.tree import greedy_tree_verify, tree_rejection_sample
from hf_specdec.verify.typical import typical_chain_verify_lossy, typical_tree_verify_lossy


@dataclass(frozen=True)
class TypicalAcceptance:
    """LOSSY: Medusa's typical acceptance thresholds (see `hf_specdec.verify.typical`)."""

    posterior_threshold: float
    posterior_alpha: float


@dataclass(frozen=True)
class Verifier:
    do_sample: bool
    generator: torch.Generator | None = None
    # None: lossless; set: the opt-in lossy rule (sampling only)
    typical: TypicalAcceptance | None = None

    def __call__(
        self,
        proposal: Proposal,
        # [B, N, V]: processed target scores at every node of the proposal
        scores: torch.Tensor,
    ) -> VerificationResult:
        tree = proposal.tree
        if not self.do_sample:
            target_ids = scores.argmax(dim=-1)
            if tree.is_chain:
                return greedy_verify(tree.token_ids[:, 1:], proposal.num_draft_tokens, target_ids)
            return greedy_tree_verify(tree, target_ids)
        target_probs = torch.softmax(scores, dim=-1)
        if self.typical is not None:
            threshold, alpha = self.typical.posterior_threshold, self.typical.posterior_alpha
            if tree.is_chain:
                return typical_chain_verify_lossy(tree.token_ids[:, 1:], proposal.num_draft_tokens, target_probs,
                                                  threshold, alpha, self.generator)
            return typical_tree_verify_lossy(tree, target_probs, threshold, alpha, self.generator)
        if tree.is_chain:
            return rejection_sample(tree.token_ids[:, 1:], proposal.num_draft_tokens, tree.draft_probs, target_probs,
                                    self.generator)
        return tree_rejection_sample(tree, target_probs, self.generator)
