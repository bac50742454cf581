"""Suffix decoding proposer (`SpeculativeConfig(method="suffix")`): drafts token trees from how often token strings
followed the current context, in the row's own prompt and output so far and in the outputs of earlier requests
(`hf_specdec.suffix`), with no draft model.

Every row is one request of a `SuffixCache` (the config's `suffix_cache`, else the process-wide one for these
settings, `SuffixCache.shared`): its local tree starts with its prompt, and each step adds the tokens the row
emitted to the local tree and to the row's output in the cache's global tree, from a host copy of its text that the
engine's one host read per step extends (`state.host.emitted`; no sequence is copied back). When the row finishes
(or the call ends, or fails) its output stays in the global tree for later requests, first in first out.

Each step drafts per row the best-scored tree of at most `num_speculative_tokens` nodes (`propose_suffix_draft`:
best first by running probability, above `min_token_prob`, at most `match length * max_spec_factor +
max_spec_offset` nodes), and the drafts go out as one token tree per row: a chain when every row's draft is one,
else the rows' trees padded to the widest. For a target with recurrent layers, which verifies chains, each row's
draft is one path: each node's most probable continuation. Drafts are deterministic (point masses), so verification
stays lossless when sampling.

For the adaptive schedule, each row's draft is looked up before the step's decision (`draft_classes`: which tree
drafted it and the bucket of the context length it matched, 0 for none), and the proposal and lookahead reuse that
lookup when the row's budget is the same.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_specdec.cache.recurrent import recurrent_layer_indices
from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.draft_model import vocab_size
from hf_specdec.proposers.host_text import HostText
from hf_specdec.schedule.lookahead import LookaheadTree
from hf_specdec.step import DecodeState, Proposal, VerificationResult
from hf_specdec.suffix import EMPTY_DRAFT, SuffixCache, SuffixDraft, SuffixRequest, propose_suffix_draft
from hf_specdec.tree.tree import TokenTree

# the draft classes the adaptive schedule estimates apart: by the tree that drafted (the request's own, then the
# global one) and the context length the draft matched, in buckets starting at these lengths. Both tell acceptance
# apart: recorded on SmolLM2 (`benchmarks/suffix_draft_classes.py`: the repeated-task session and Spec-Bench,
# float32, k = 5), a draft's first token was accepted 32% of the time after a one-token match in the request's own
# tree, 11% in the global tree, 68% after three tokens, 88% after 9 to 13 and 97% after 14 or more
MATCH_CLASS_BOUNDS = (1, 2, 3, 4, 6, 9, 14)


def match_class(draft: SuffixDraft) -> int:
    """The draft class of `draft` (0: no draft): 1 to len(MATCH_CLASS_BOUNDS) for a draft from the request's own
    tree, by the bucket of its match length, the next as many for one from the global tree."""
    bucket = int(np.searchsorted(MATCH_CLASS_BOUNDS, draft.match_length, side="right"))
    return bucket + len(MATCH_CLASS_BOUNDS) if bucket and draft.source == "global" else bucket


def suffix_cache_for(config: SpeculativeConfig, target: torch.nn.Module) -> SuffixCache:
    """The config's `suffix_cache`, tied to the target's vocabulary, else the process-wide cache for its
    settings."""
    vocab = vocab_size(target)
    if config.suffix_cache is None:
        return SuffixCache.shared(config.suffix_config(), vocab)
    try:
        config.suffix_cache.bind(vocab, None)
    except ValueError as error:
        raise ValueError(f"SpeculativeConfig.suffix_cache: {error}") from None
    return config.suffix_cache


class SuffixProposer(Proposer):
    reads_emitted_tokens = True
    looks_ahead = True

    def __init__(self, config: SpeculativeConfig, cache: SuffixCache, chain: bool = False) -> None:
        self.k = config.num_speculative_tokens
        self.cache = cache
        self.chain = chain  # one path per row (each node's most probable continuation), for a target of chains
        self.context = cache.config.max_depth  # the tokens a lookup reads
        self.text: HostText | None = None
        self.requests: list[SuffixRequest | None] = []
        # per row, its last lookup: (text length, node budget, draft); a step's classes, proposal and lookahead
        # share it (the text only grows)
        self.looked_up: list[tuple[int, int, SuffixDraft] | None] = []

    def draft_depth(self, config: SpeculativeConfig) -> int:
        # a match of m >= 1 tokens drafts at most max_depth - m tokens
        return max(1, min(self.k, self.context - 1))

    def num_nodes(self, config: SpeculativeConfig) -> int:
        return 1 + self.k

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        self._close()  # a proposer used for a second call starts clean
        self.text = HostText(state)
        self.requests = [self.cache.start_request(self.text.row(row)) for row in range(state.batch_size)]
        self.looked_up = [None] * state.batch_size

    def _catch_up(self, state: DecodeState) -> None:
        """Add what the last step emitted to each row's text and trees; finished rows leave the cache's requests."""
        for row, new in enumerate(self.text.catch_up(state)):
            request = self.requests[row]
            if request is None:
                continue
            if new.size:
                request.extend(new)
            if state.host.finished[row]:
                request.finish()
                self.requests[row] = None

    def skip(self, state: DecodeState) -> None:
        self._catch_up(state)

    def _draft(self, row: int, budget: int) -> SuffixDraft:
        """The row's best draft of at most `budget` nodes after its text as it stands (`EMPTY_DRAFT` for a
        finished row or no budget): looked up once per text and budget (or larger budget, see below)."""
        request = self.requests[row]
        if request is None or budget == 0:
            return EMPTY_DRAFT
        tokens = self.text.row(row)
        kept = self.looked_up[row]
        # a lookup with a larger budget whose draft fits this one is this budget's too: every match's draft with
        # the smaller budget is a prefix of its draft with the larger one (best first), so none scores more
        if kept is None or kept[0] != tokens.shape[0] or not (kept[1] == budget or
                                                             kept[1] > budget >= kept[2].num_tokens):
            draft = propose_suffix_draft(self.cache, request, tokens[-self.context :], budget, chain=self.chain)
            kept = self.looked_up[row] = (tokens.shape[0], budget, draft)
        return kept[2]

    def drafts(self, state: DecodeState) -> list[SuffixDraft]:
        """Each row's best suffix draft (`EMPTY_DRAFT` for finished rows and rows with no budget left)."""
        self._catch_up(state)
        return [self._draft(row, budget) for row, budget in enumerate(self._budgets(state))]

    def _budgets(self, state: DecodeState) -> list[int]:
        """Each row's node budget this step: k, or what is left before max_length."""
        return [min(budget, self.k) for budget in state.host_draft_budget()]

    def propose(self, state: DecodeState) -> Proposal:
        return self.proposal(state, self.drafts(state))

    def lookahead(self, state: DecodeState, rows: list[int]) -> list[LookaheadTree]:
        """Each row's best draft, the tree `propose` would verify (its every branch, as a real draft's)."""
        drafts = [self._draft(row, self.k) for row in rows]
        return [LookaheadTree(np.asarray(d.tokens, dtype=np.int64), np.asarray(d.parents, dtype=np.int64))
                for d in drafts]

    num_draft_classes = 2 * len(MATCH_CLASS_BOUNDS)

    def draft_classes(self, state: DecodeState) -> np.ndarray:
        """[B] each row's draft class (`match_class`: the tree its best draft came from and the length of the
        context it matched; 0: no draft, a finished row, or no budget left)."""
        self._catch_up(state)
        budgets = self._budgets(state)  # the proposal's: it reuses these lookups
        return np.asarray([match_class(self._draft(row, budget)) for row, budget in enumerate(budgets)],
                          dtype=np.int64)

    knows_draft_depths = True

    def draft_depths(self, state: DecodeState) -> np.ndarray:
        """[B] the depth of each row's best draft (the lookups `draft_classes` made this step)."""
        budgets = self._budgets(state)
        return np.asarray([self._draft(row, budget).max_depth for row, budget in enumerate(budgets)], dtype=np.int64)

    def proposal(self, state: DecodeState, drafts: list[SuffixDraft]) -> Proposal:
        """The rows' drafts as one proposal: none when no row drafts, a chain when every draft is one (unless
        shapes are fixed: then always a tree of 1 + k nodes), else a token tree padded to the widest row."""
        batch, device = state.batch_size, state.sequences.device
        widest = max((d.num_tokens for d in drafts), default=0)
        if widest == 0:
            return Proposal.no_draft(state)
        width = self.k if self.fixed_shapes else widest
        tokens = np.zeros((batch, 1 + width), dtype=np.int64)
        parents = np.zeros((batch, 1 + width), dtype=np.int64)
        valid = np.zeros((batch, 1 + width), dtype=bool)
        parents[:, 0], valid[:, 0] = -1, True
        max_children = 1
        for row, draft in enumerate(drafts):
            tokens[row, 0] = self.text.row(row)[-1]
            count = draft.num_tokens
            tokens[row, 1 : 1 + count] = draft.tokens
            parents[row, 1 : 1 + count] = np.asarray(draft.parents, dtype=np.int64) + 1
            valid[row, 1 : 1 + count] = True
            if count:
                max_children = max(max_children, int(np.bincount(parents[row, 1 : 1 + count]).max()))
        # parents come before their children, so at most one child per node makes every row a chain
        depths = [d.max_depth for d in drafts]
        if not self.fixed_shapes and max_children == 1:
            counts = torch.from_numpy(valid[:, 1:].sum(axis=1)).to(device)
            return Proposal.chain(torch.from_numpy(tokens[:, 0]).to(device),
                                  torch.from_numpy(tokens[:, 1:]).to(device), counts,
                                  dense=bool(valid.all())).with_host_depths(depths)
        return Proposal(TokenTree(
            token_ids=torch.from_numpy(tokens).to(device),
            parents=torch.from_numpy(parents).to(device),
            valid=torch.from_numpy(valid).to(device),
            max_depth=max(depths),
            max_children=max_children,
        ), host_depths=tuple(depths))

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        self._catch_up(state)

    def finish(self, state: DecodeState | None) -> None:
        if state is not None and self.requests:  # (none before `start`, or after the call's end)
            self._catch_up(state)
        self._close()

    def _close(self) -> None:
        """End every row's request: its output stays in the cache's global tree."""
        for request in self.requests:
            if request is not None:
                request.finish()
        self.requests = []
        self.looked_up = []


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    # a target with recurrent layers verifies chains (hf_specdec.cache.recurrent)
    suffix = SuffixProposer(config, suffix_cache_for(config, target), chain=bool(recurrent_layer_indices(target)))
    if config.fallback is None:
        return suffix
    from hf_specdec.proposers.base import build_proposer
    from hf_specdec.proposers.hybrid import HybridProposer  # it builds on this module

    return HybridProposer(suffix, build_proposer(config.fallback, target, sampling), config)


register_proposer("suffix", _build)
