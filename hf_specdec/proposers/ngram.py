"""N-gram (prompt lookup) proposer: copy what followed the longest earlier match of the text's suffix.

For each row, the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are searched for in the
row's prompt and generated text; at the longest n that matches, the earliest match wins (vLLM's rule: it has the
longest continuation) and up to k of the tokens that followed it become the draft. The draft is a point mass, so
verification needs no draft probabilities. Matching runs in NumPy on the host, one row at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_specdec.config import SpeculativeConfig
from hf_specdec.decoding.state import DecodeState, Proposal
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer


def find_ngram_continuation(
    # [L] the row's tokens (no padding)
    tokens: np.ndarray,
    min_n: int,
    max_n: int,
    max_tokens: int,
) -> np.ndarray:
    """Tokens that followed the earliest occurrence of the longest matching suffix n-gram ([] when none)."""
    length = tokens.shape[0]
    if max_tokens <= 0:
        return tokens[:0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-n-1: each is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + max_tokens]
    return tokens[:0]


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, state: DecodeState) -> Proposal:
        budget = state.draft_budget().clamp(max=self.k).tolist()
        sequences = state.sequences.cpu().numpy()
        starts = state.pad_lengths.tolist()
        ends = state.lengths.tolist()
        drafts = np.zeros((state.batch_size, self.k), dtype=np.int64)
        counts = np.zeros(state.batch_size, dtype=np.int64)
        for row in range(state.batch_size):
            found = find_ngram_continuation(sequences[row, starts[row] : ends[row]], self.min_n, self.max_n, budget[row])
            drafts[row, : found.size] = found
            counts[row] = found.size
        device = state.sequences.device
        width = int(counts.max()) if counts.size else 0
        return Proposal(
            draft_token_ids=torch.from_numpy(drafts[:, :width]).to(device),
            num_draft_tokens=torch.from_numpy(counts).to(device),
            draft_probs=None,
        )


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    return NgramProposer(config)


register_proposer("ngram", _build)
