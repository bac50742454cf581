"""Hybrid drafting (`SpeculativeConfig(method="suffix", fallback=SpeculativeConfig(...))`): suffix drafts where the
suffix trees are confident, a model drafter (a draft model, Medusa heads or an EAGLE head) elsewhere, decided per
row and per step.

The rule (ArcticInference's): a row takes its suffix draft when the draft's score (the sum of its nodes' running
probabilities: the number of tokens the trees expect to be accepted) is at least `fallback_min_score`, by default
the fallback's draft depth k (the tokens a fully accepted model draft would give), and the fallback's draft
otherwise. The step's proposal holds each row's chosen tree (both padded to the wider one; a chain when both are
chains), so one verify forward checks suffix rows and fallback rows together. Drafts of the two kinds mix in one
proposal losslessly: suffix nodes are point masses, and where the fallback sampled its drafts the suffix rows
carry one-hot draft distributions, which verification treats exactly as point masses.

The fallback only drafts in a step where some row needs it; other steps it skips (`Proposer.skip`: a draft model
feeds the tokens it missed at its next proposal, in one forward; an EAGLE head feeds each step's tokens right away,
with that step's target features, without drafting; a draft with another tokenizer reads the step's text). After
verification the fallback keeps only what it drafted and the target accepted: rows that took the suffix draft count
as rows whose fallback draft was rejected at once.

Static shapes are refused: the fallback would feed a varying number of missed tokens.
"""

from __future__ import annotations

import torch

from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import Proposer
from hf_specdec.proposers.row_mix import commit_own_rows
from hf_specdec.proposers.suffix import SuffixProposer
from hf_specdec.step import DecodeState, Proposal, RowSet, VerificationResult
from hf_specdec.suffix import EMPTY_DRAFT
from hf_specdec.tree.merge import merge_trees


class HybridProposer(Proposer):
    reads_emitted_tokens = True
    static_shapes_refusal = (
        "SpeculativeConfig.fallback: hybrid drafting runs with dynamic shapes only (its fallback feeds the tokens of "
        "the steps it skipped); drop cache_implementation='static' / compile_config / the StaticCache, or the "
        "fallback"
    )

    def __init__(self, suffix: SuffixProposer, fallback: Proposer, config: SpeculativeConfig) -> None:
        self.suffix = suffix
        self.fallback = fallback
        self.fallback_config = config.fallback
        self.min_score = config.min_suffix_score
        self.target_feature_layers = fallback.target_feature_layers
        self.needs_prompt_features = fallback.needs_prompt_features
        self._fallback_rows: RowSet | None = None  # the rows that take the fallback's draft this step, if any
        self._fallback: Proposal | None = None  # the fallback's proposal this step
        # rows and steps that drafted from each source (host counts, for inspection and the tests)
        self.suffix_drafts = 0
        self.fallback_drafts = 0

    def draft_depth(self, config: SpeculativeConfig) -> int:
        return max(self.suffix.draft_depth(config), self.fallback.draft_depth(self.fallback_config))

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        self.suffix.start(state, attention_mask)
        self.fallback.start(state, attention_mask)

    def propose(self, state: DecodeState) -> Proposal:
        drafts = self.suffix.drafts(state)
        budgets = state.host_draft_budget()
        use = [budget > 0 and draft.score < self.min_score for draft, budget in zip(drafts, budgets)]
        self.fallback_drafts += sum(use)
        self.suffix_drafts += sum(d.num_tokens > 0 and not u for d, u in zip(drafts, use))
        self._fallback_rows = None
        if not any(use):
            self.fallback.skip(state)
            return self.suffix.proposal(state, drafts)
        fallback = self._fallback = self.fallback.propose(state)
        self._fallback_rows = RowSet(tuple(use), state.stage_rows([int(u) for u in use]).bool())
        # each row's draft depth (the fallback drafts at most its own depth, which the schedule's k may exceed)
        depths = [min(budget, fallback.tree.max_depth) if u else d.max_depth
                  for d, u, budget in zip(drafts, use, budgets)]
        if all(u or budget == 0 for u, budget in zip(use, budgets)):  # no row takes a suffix draft
            return fallback.with_host_depths(depths)  # (rows with no budget have no valid fallback node)
        suffix = self.suffix.proposal(state, [EMPTY_DRAFT if u else d for d, u in zip(drafts, use)])
        return Proposal(merge_trees((suffix.tree, fallback.tree), self._fallback_rows.mask.long()),
                        host_depths=tuple(depths))

    def skip(self, state: DecodeState) -> None:
        self.suffix.skip(state)
        self.fallback.skip(state)

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        self.suffix.commit(state, result)
        if self._fallback_rows is not None:
            commit_own_rows(self.fallback, state, result, self._fallback, self._fallback_rows)

    def carry(self, state: DecodeState) -> tuple:
        return self.suffix.carry(state) + self.fallback.carry(state)

    def finish(self, state: DecodeState | None) -> None:
        self.suffix.finish(state)
        self.fallback.finish(state)

