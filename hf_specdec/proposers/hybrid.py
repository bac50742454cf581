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

import dataclasses

import torch

from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import Proposer
from hf_specdec.proposers.suffix import SuffixProposer
from hf_specdec.step import DecodeState, Proposal, VerificationResult
from hf_specdec.step.proposal import chain_template
from hf_specdec.suffix import EMPTY_DRAFT
from hf_specdec.tree.tree import TokenTree


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
        self._use_fallback: list[bool] = []  # per row, this step
        self._use_fallback_rows: torch.Tensor | None = None  # [B] bool: the same on the device, when any is True
        self._fallback_nodes = self._fallback_depth = 0  # the fallback's last proposal: nodes, deepest node
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
        self._use_fallback = use
        self.fallback_drafts += sum(use)
        self.suffix_drafts += sum(d.num_tokens > 0 and not u for d, u in zip(drafts, use))
        if not any(use):
            self.fallback.skip(state)
            return self.suffix.proposal(state, drafts)
        fallback = self.fallback.propose(state)
        self._fallback_nodes = fallback.tree.num_nodes
        self._fallback_depth = fallback.tree.max_depth
        self._use_fallback_rows = torch.tensor(use, device=state.sequences.device)
        # each row's draft depth (the fallback drafts at most its own depth, which the schedule's k may exceed)
        depths = [min(budget, self._fallback_depth) if u else d.max_depth
                  for d, u, budget in zip(drafts, use, budgets)]
        if all(u or budget == 0 for u, budget in zip(use, budgets)):  # no row takes a suffix draft
            return fallback.with_host_depths(depths)  # (rows with no budget have no valid fallback node)
        suffix = self.suffix.proposal(state, [EMPTY_DRAFT if u else d for d, u in zip(drafts, use)])
        return Proposal(merge_trees(suffix.tree, fallback.tree, self._use_fallback_rows), host_depths=tuple(depths))

    def skip(self, state: DecodeState) -> None:
        self.suffix.skip(state)
        self.fallback.skip(state)

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        self.suffix.commit(state, result)
        if not any(self._use_fallback):
            return
        use = self._use_fallback
        # the result as over the fallback's own tree: its columns (the merged tree may be wider), and rows that took
        # the suffix draft as rows whose fallback draft was rejected at once
        mine = self._use_fallback_rows
        columns = self._fallback_depth + 1
        kept = VerificationResult(
            output_token_ids=result.output_token_ids[:, :columns],
            num_accepted=torch.where(mine, result.num_accepted, 0),
            path_nodes=torch.where(mine[:, None], result.path_nodes[:, :columns], 0).clamp(
                max=self._fallback_nodes - 1),
            num_nodes=self._fallback_nodes,
        )
        host = state.host
        state.host = dataclasses.replace(host, num_accepted=[n if u else 0 for n, u in zip(host.num_accepted, use)])
        try:
            self.fallback.commit(state, kept)
        finally:
            state.host = host

    def finish(self, state: DecodeState | None) -> None:
        self.suffix.finish(state)
        self.fallback.finish(state)


def merge_trees(
    first: TokenTree,
    second: TokenTree,
    # [B] bool: rows that take `second`
    take_second: torch.Tensor,
) -> TokenTree:
    """Each row's tree from `first` or `second`, both padded to the wider one (padding: invalid children of the
    root). Both chains give a chain. Where one side carries draft distributions, the other side's deterministic
    nodes get one-hot ones (the same point masses to verification)."""
    width = max(first.num_nodes, second.num_nodes)
    batch = first.token_ids.shape[0]
    pick = take_second[:, None]

    def padded(tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        extra = width - tree.num_nodes
        tokens = torch.nn.functional.pad(tree.token_ids, (0, extra))
        parents = torch.nn.functional.pad(tree.parents.expand(batch, -1), (0, extra))
        valid = torch.nn.functional.pad(tree.valid, (0, extra))
        return tokens, parents, valid

    (tokens_a, parents_a, valid_a), (tokens_b, parents_b, valid_b) = padded(first), padded(second)
    tokens = torch.where(pick, tokens_b, tokens_a)
    valid = torch.where(pick, valid_b, valid_a)
    draft_probs = None
    if first.draft_probs is not None or second.draft_probs is not None:
        draft_probs = _merged_probs(((first, ~pick), (second, pick)), tokens)
    if first.is_chain and second.is_chain:
        return TokenTree.from_template(chain_template(width - 1), tokens, valid, draft_probs,
                                       dense=bool(first.dense and second.dense and first.num_nodes == width
                                                  and second.num_nodes == width))
    return TokenTree(token_ids=tokens, parents=torch.where(pick, parents_b, parents_a), valid=valid,
                     draft_probs=draft_probs, max_depth=max(first.max_depth, second.max_depth),
                     max_children=max(first.max_children, second.max_children, 1))


def _merged_probs(
    # each tree with [B, 1] bool: the rows that take it
    trees: tuple[tuple[TokenTree, torch.Tensor], ...],
    # [B, N]: the merged tree's tokens
    tokens: torch.Tensor,
) -> torch.Tensor:
    """[B, N - 1, V]: each row's draft distributions from the tree it takes, and a point mass at its token where
    that tree carries none (a deterministic tree, or the nodes past its own)."""
    carrying = [(tree.draft_probs, rows) for tree, rows in trees if tree.draft_probs is not None]
    probs = torch.zeros(*tokens[:, 1:].shape, carrying[0][0].shape[2], device=tokens.device)
    carried = torch.zeros(tokens[:, 1:].shape, dtype=torch.bool, device=tokens.device)
    for tree_probs, rows in carrying:
        known = tree_probs.shape[1]
        probs[:, :known] = torch.where(rows[:, :, None], tree_probs.to(probs.dtype), probs[:, :known])
        carried[:, :known] |= rows
    return probs.scatter_add_(2, tokens[:, 1:, None], (~carried).to(probs.dtype)[:, :, None])
