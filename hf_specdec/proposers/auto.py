"""`method="auto"`: each step, each row drafts with the proposer the schedule expects to bring the most tokens per
second.

The candidates are the proposers of `SpeculativeConfig.auto_methods` (by default n-gram lookup and suffix decoding,
and a draft model and heads (Medusa heads, an EAGLE head or an MLP speculator) when given; token recycling when
listed), each built by its entry in `AUTO_CANDIDATES` (`register_auto_candidate`). The schedule
(`hf_specdec.schedule.controller`) keeps acceptance estimates and step times per candidate (by draft class for
n-gram lookup and suffix decoding: a lookup says before the step how long a context it matched, so a long match can
win over a model drafter) and names, per row, the proposer it drafts with in `state.draft_methods`. Rows that chose
different candidates draft in the same step: each candidate drafts for its own rows, the rows' trees are merged into
one proposal and verified in one forward, and each candidate commits what it drafted
(`hf_specdec.proposers.row_mix`). Candidates that drafted for no row are told of the step (`Proposer.skip`) so they
stay in step with the text (an EAGLE head keeps the committed tokens' features and feeds them at its next draft).
(Verifying a model drafter's chain and the n-gram continuation of the same row together, as one tree, was measured
and dropped: on SmolLM2 in bfloat16 on a CPU it raised tokens per target forward by 6% and took as long.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from hf_specdec.cache.recurrent import recurrent_layer_indices
from hf_specdec.compile import CompileSettings
from hf_specdec.config import (
    AUTO_METHODS,
    CONFIDENCE_METHODS,
    QUANTIZABLE_METHODS,
    SUFFIX_FIELDS,
    TREE_METHODS,
    SpeculativeConfig,
)
from hf_specdec.proposers.base import DraftSampling, Proposer, build_proposer, register_proposer
from hf_specdec.proposers.row_mix import commit_own_rows
from hf_specdec.step import DecodeState, Proposal, RowSet, VerificationResult
from hf_specdec.tree.merge import merge_trees
from hf_specdec.tree.tree import TokenTree

# name -> the config of that candidate built from an auto config, or None when the config does not make it available
AUTO_CANDIDATES: dict[str, Callable[[SpeculativeConfig], SpeculativeConfig | None]] = {}


def register_auto_candidate(method: str, make_config: Callable[[SpeculativeConfig], SpeculativeConfig | None]) -> None:
    """Let `method="auto"` choose `method` (a registered proposer, named in `AutoMethod` so that `auto_methods` may
    list it) when `make_config(auto_config)` gives a config."""
    if method not in AUTO_METHODS:
        raise ValueError(f"auto candidate {method!r}: not one of hf_specdec.config.AutoMethod {list(AUTO_METHODS)}")
    if method in AUTO_CANDIDATES:
        raise ValueError(f"an auto candidate is already registered for method {method!r}")
    AUTO_CANDIDATES[method] = make_config


def _as(method: str, config: SpeculativeConfig, **fields) -> SpeculativeConfig:
    """The candidate `method`'s config: the auto config's own settings (the suffix decoding ones for the suffix
    candidate only), its drafter among `fields`."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    values.update(draft_model=None, draft_token_map=None, heads=None, tree_paths=None, tree_total_tokens=None,
                  auto_methods=None,
                  schedule="fixed", disable_by_batch_size=None, num_speculative_tokens_per_batch_size=None)
    if method != "suffix":
        values.update({name: defaults[name] for name in (*SUFFIX_FIELDS, "suffix_cache")})
    if method not in QUANTIZABLE_METHODS:  # the lookups have no weights
        values.update(draft_quantization=None)
    if method not in CONFIDENCE_METHODS:  # nor a drafter's confidence
        values.update(draft_confidence=defaults["draft_confidence"])
    if method != "draft":  # a parallel draft model is the draft candidate's
        values.update({name: defaults[name] for name in ("parallel_drafting", "pard_token")})
    values.update(method=method, **fields)
    return SpeculativeConfig(**values)


register_auto_candidate("ngram", lambda config: _as(
    "ngram", config, tree_width=config.tree_width if config.tree_total_tokens is None else 1))
register_auto_candidate("draft", lambda config: None if config.draft_model is None else _as(
    "draft", config, draft_model=config.draft_model, draft_token_map=config.draft_token_map,
    tree_total_tokens=config.tree_total_tokens))
register_auto_candidate("medusa", lambda config: None if config.heads_method != "medusa" else _as(
    "medusa", config, heads=config.heads, tree_width=1))
register_auto_candidate("eagle", lambda config: None if config.heads_method != "eagle" else _as(
    "eagle", config, heads=config.heads, tree_total_tokens=config.tree_total_tokens))
register_auto_candidate("mlp_speculator", lambda config: None if config.heads_method != "mlp_speculator" else _as(
    "mlp_speculator", config, heads=config.heads, tree_total_tokens=config.tree_total_tokens))
register_auto_candidate("suffix", lambda config: _as("suffix", config, tree_width=1))
register_auto_candidate("recycling", lambda config: _as("recycling", config, tree_width=1))


class AutoProposer(Proposer):
    reads_emitted_tokens = True

    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> None:
        self.candidates: dict[str, Proposer] = {}
        self.configs: dict[str, SpeculativeConfig] = {}
        # a model with recurrent layers verifies chains: the candidates that draft only trees (token recycling) are
        # left out (named in `auto_methods`, they are refused before the call)
        chains_only = bool(recurrent_layer_indices(target))
        for method, make_config in AUTO_CANDIDATES.items():
            if chains_only and method in TREE_METHODS:
                continue
            sub = make_config(config) if method in config.auto_candidates else None
            if sub is not None:
                self.configs[method] = sub
                self.candidates[method] = build_proposer(sub, target, sampling)
        # the target features a candidate drafts from (an EAGLE head's layers, in its order; at most one candidate
        # reads any: auto takes one set of heads)
        readers = {m: p.target_feature_layers for m, p in self.candidates.items() if p.target_feature_layers}
        if len(readers) > 1:
            raise ValueError(f"SpeculativeConfig.method: 'auto' drafts with one candidate that reads the target's "
                             f"features at a time; candidates {sorted(readers)} each read some")
        self.target_feature_layers = next(iter(readers.values()), None)
        self.needs_prompt_features = any(p.needs_prompt_features for p in self.candidates.values())
        # the candidates that learn from the target's scores at every verified node (token recycling), in every
        # step whoever drafted it
        self.score_readers = [p for p in self.candidates.values() if p.reads_target_scores]
        self.reads_target_scores = bool(self.score_readers)
        # the candidates that drafted this step, each with (its proposal, its rows on the host and the device) where
        # rows drafted with several, else None
        self.drafting: dict[str, tuple[Proposal, list[bool], torch.Tensor] | None] = {}
        if "draft" in self.candidates:
            self.static_shapes_refusal = (
                "SpeculativeConfig.method: 'auto' with a draft model needs dynamic shapes (a step drafted by another "
                "proposer leaves the draft model's cache behind, which it catches up in one forward of free width); "
                "drop the static cache / compile_config, or use method='draft'"
            )

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self.candidates)

    def draft_depth(self, config: SpeculativeConfig) -> int:
        return max(p.draft_depth(self.configs[m]) for m, p in self.candidates.items())

    def num_nodes(self, config: SpeculativeConfig) -> int:
        return max(p.num_nodes(self.configs[m]) for m, p in self.candidates.items())

    def candidate_cost_key(self, method: str, static_shapes: bool) -> str:
        return "auto:" + self.candidates[method].cost_key(self.configs[method], static_shapes)

    def fix_shapes(self, max_length: int, compile_settings: CompileSettings | None) -> None:
        super().fix_shapes(max_length, compile_settings)
        for proposer in self.candidates.values():
            proposer.fix_shapes(max_length, compile_settings)

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        for proposer in self.candidates.values():
            proposer.start(state, attention_mask)

    def propose(self, state: DecodeState) -> Proposal:
        methods = state.draft_methods or (next(iter(self.candidates)),) * state.batch_size
        budgets = state.host_draft_budget()
        used = list(dict.fromkeys(m for m, budget in zip(methods, budgets) if budget > 0)) or [methods[0]]
        for method, proposer in self.candidates.items():
            if method not in used:
                proposer.skip(state)
        if len(used) == 1:
            self.drafting = {used[0]: None}
            return self.candidates[used[0]].propose(state)
        # rows drafting with different candidates: each drafts for its own rows, one tree per row (a row without a
        # budget drafts with none: it takes any candidate's tree, whose nodes are invalid there)
        index = {method: i for i, method in enumerate(used)}
        host_choice = [index.get(m, 0) for m in methods]
        choice = state.stage_rows(host_choice)  # [B] long
        self.drafting, proposals = {}, []
        for i, method in enumerate(used):
            own = RowSet(tuple(c == i for c in host_choice), choice == i)
            with state.limited_to(own):
                proposal = self.candidates[method].propose(state)
            self.drafting[method] = (proposal, own)
            proposals.append(proposal)
        depths = [_depth(proposals[i], row, budgets[row]) for row, i in enumerate(host_choice)]
        computed = [p.drafted_positions for p in proposals if p.drafted_positions is not None]
        return Proposal(merge_trees([p.tree for p in proposals], choice), host_depths=tuple(depths),
                        drafted_positions=max(computed) if computed else None)

    def observe_scores(
        self,
        state: DecodeState,
        # the verified tree (the candidates' merged trees, or the root alone on a step none drafted)
        tree: TokenTree,
        # [B, N, V]: the target's processed scores at every node
        scores: torch.Tensor,
    ) -> None:
        for proposer in self.score_readers:
            proposer.observe_scores(state, tree, scores)

    def skip(self, state: DecodeState) -> None:
        """A step no candidate drafts: each is told of it, as in a step another candidate drafts."""
        for proposer in self.candidates.values():
            proposer.skip(state)

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        for method, mixed in self.drafting.items():
            if mixed is None:
                self.candidates[method].commit(state, result)
            else:
                commit_own_rows(self.candidates[method], state, result, *mixed)

    def carry(self, state: DecodeState) -> tuple:
        return tuple(kept for proposer in self.candidates.values() for kept in proposer.carry(state))

    def finish(self, state: DecodeState | None) -> None:
        for proposer in self.candidates.values():
            proposer.finish(state)


def _depth(proposal: Proposal, row: int, budget: int) -> int:
    """How deep `row` drafted in `proposal` (as the proposer knows it, or as deep as its budget and tree allow)."""
    if proposal.host_depths is not None:
        return proposal.host_depths[row]
    return min(budget, proposal.tree.max_depth)


register_proposer("auto", AutoProposer)
