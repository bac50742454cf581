"""The proposer interface every speculation method implements, and the registry that builds them by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList

from hf_specdec.compile import CompileSettings
from hf_specdec.config import SpeculativeConfig
from hf_specdec.schedule.lookahead import LookaheadTree, ShippedTrees
from hf_specdec.step import DecodeState, Proposal, VerificationResult
from hf_specdec.tree.tree import TokenTree


@dataclass(frozen=True)
class DraftSampling:
    """How a proposer that samples should draw its tokens (from the target's generation settings)."""

    do_sample: bool
    # the target's prefix-free processors (temperature, top-k, top-p, ...), applied to draft logits
    warpers: LogitsProcessorList
    generator: torch.Generator | None


class Proposer(ABC):
    """Guesses the next tokens of every row.

    The engine calls `start` once after the target's prefill, then per step `propose` and, after verification,
    `commit`, so a proposer with state (a KV cache) can keep what the target kept. A step where no row may draft
    (a schedule's plain step, or every row one token from its length limit) calls `skip` instead of both, and
    verifies `Proposal.no_draft`: `propose` always has a row with a draft budget.

    Proposers that read the target's hidden states get them from the verify forward (no extra pass): with
    `target_feature_layers` set (entries of the target's `hidden_states`; -1 is the final one),
    `state.target_features` holds them for the step's committed tokens, and `state.target_hidden` those of the
    last committed token. With `needs_prompt_features`, `start` finds the prompt's features in
    `state.target_features`.

    Host facts come from `state.host` (lengths, finished rows, what the last step emitted and accepted), refreshed
    by the engine once per step; a proposer reads the device only where the host cannot know (and says so). With
    `reads_emitted_tokens`, `state.host.emitted` holds the tokens each step emitted when `commit` is called.
    """

    target_feature_layers: tuple[int, ...] | None = None
    needs_prompt_features: bool = False
    reads_emitted_tokens: bool = False
    # static shapes (`fix_shapes`): widths from the config, never from the host's lengths
    fixed_shapes: bool = False
    # why this proposer cannot run with static shapes (the error `fix_shapes` raises), or None
    static_shapes_refusal: str | None = None
    # why this proposer's drafter cannot be compiled (the error `fix_shapes` raises with a compile config), or None
    compile_refusal: str | None = None

    def draft_depth(self, config: SpeculativeConfig) -> int:
        """The deepest draft token a step proposes (`spec_stats` counts acceptance per position up to it)."""
        return config.max_draft_depth

    def num_nodes(self, config: SpeculativeConfig) -> int:
        """Nodes of a proposal under fixed shapes, the root included (the width of every verify forward)."""
        if config.tree_total_tokens is not None:
            return 1 + config.tree_total_tokens
        if config.tree_paths is not None:
            return len(config.tree_paths) + 1
        return 1 + config.tree_width * config.num_speculative_tokens

    def cost_key(self, config: SpeculativeConfig, static_shapes: bool) -> str:
        """Names what a step of this proposer costs, for the schedule's step-time table (kept per target model
        for the life of the process): the method, its drafter and the shape settings."""
        drafter = config.draft_model if config.draft_model is not None else config.heads
        shapes = "static" if static_shapes else "dynamic"
        # drafting over part of the vocabulary is cheaper
        token_map = config.draft_token_map if config.draft_token_map is not None else getattr(drafter, "token_map",
                                                                                               None)
        vocabulary = "" if token_map is None else f"/map{token_map.numel()}-{id(token_map)}"
        return (f"{config.method}/{type(self).__name__}/{id(drafter)}/w{config.tree_width}/t{config.tree_total_tokens}"
                f"/c{config.draft_confidence}/{shapes}{vocabulary}")

    def fix_shapes(self, max_length: int, compile_settings: CompileSettings | None) -> None:
        """Propose with the same shapes at every step, so compiled forwards are reused (see `hf_specdec.compile`):
        widths from the config; a drafter's cache of fixed capacity for `max_length` tokens per row; its forwards
        compiled with `compile_settings` when given. Called before `start`, before any forward; raises ValueError
        for a drafter that cannot be compiled, or with `static_shapes_refusal`."""
        if self.static_shapes_refusal is not None:
            raise ValueError(self.static_shapes_refusal)
        if compile_settings is not None and self.compile_refusal is not None:
            raise ValueError(self.compile_refusal)
        self.fixed_shapes = True

    def start(
        self,
        state: DecodeState,
        # [B, P] or None
        attention_mask: torch.Tensor | None,
    ) -> None:
        """Called once with the prompt, before the first proposal."""

    @abstractmethod
    def propose(self, state: DecodeState) -> Proposal:
        """Up to `state.draft_budget()` draft tokens per row (per branch of a tree); finished rows get none."""

    def skip(self, state: DecodeState) -> None:
        """Called instead of `propose` (and then no `commit`) for a step this proposer does not draft (no row
        drafts, or another proposer drafts: `method="auto"`, a hybrid's fallback), with `state` as `propose` would
        see it. It is called every such step: a proposer that keeps a copy of the text catches up with the last
        step's tokens here (`state.host.emitted` holds only those). A proposer with a cache may catch up here or at
        its next proposal."""

    # drafts without a model, cheaply enough to say, for rows that decode plainly, what it would draft
    # (`lookahead`; the schedule checks it against `state.host.emitted`, so only with `reads_emitted_tokens`)
    looks_ahead: bool = False

    def lookahead(self, state: DecodeState, rows: list[int]) -> list[LookaheadTree] | ShippedTrees:
        """For a proposer that `looks_ahead`, called after `propose` or `skip` in a step where `rows` draft nothing:
        for each, the chain or tree it would draft now (up to k tokens deep; empty: none), or, for trees built on
        the device, those trees shipped with the step's host read (`ShippedTrees`). The adaptive schedule walks them
        down with the tokens the rows then emit, so their acceptance estimates stay current without drafting (see
        `hf_specdec.schedule.controller`). Proposes nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not look ahead")

    # for a proposer that drafts on the host: how many kinds of draft `draft_classes` tells apart (0: it does not)
    num_draft_classes: int = 0

    def draft_classes(self, state: DecodeState) -> np.ndarray:
        """[B] int: the kind of draft each row has now, before the schedule decides (0: none; 1 to
        `num_draft_classes`: a kind whose acceptance the adaptive schedule estimates apart, e.g. the length of the
        n-gram an n-gram lookup matched; 0 for finished rows). Reads the committed text on the host only."""
        raise NotImplementedError(f"{type(self).__name__} does not tell its drafts apart")

    # whether `draft_depths` says, before the schedule decides, how deep each row's draft goes
    knows_draft_depths: bool = False

    def draft_depths(self, state: DecodeState) -> np.ndarray:
        """[B] int: how deep each row's draft goes now, before the schedule decides (after `draft_classes` in the
        same step, for a proposer with classes; suffix decoding: its best tree's depth, often shorter than k; token
        recycling: none where the table has nothing after the row's last token; 0 for no draft). Reads the host
        only."""
        raise NotImplementedError(f"{type(self).__name__} does not know its draft depths before drafting")

    # reads the target's scores at every verified node, every step (`observe_scores`)
    reads_target_scores: bool = False

    def observe_scores(
        self,
        state: DecodeState,
        # the step's verified tree (this proposer's proposal, or each row's last token alone on a step it skipped)
        tree: TokenTree,
        # [B, N, V]: the target's processed scores at every node of `tree`
        scores: torch.Tensor,
    ) -> None:
        """For a proposer that `reads_target_scores`: called every step after verification, before `commit` or
        after `skip`, with what the target scored at each node (token recycling keeps its top candidates)."""

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        """Called after `state` took the step's tokens (finished rows are marked in `state.finished`, and
        `state.host` is up to date), with what the target accepted (`result.num_accepted`, and the accepted path
        `result.path_nodes`)."""

    def carry(self, state: DecodeState) -> tuple:
        """What this proposer leaves for a later call continuing from the cache this one returns
        (`hf_specdec.cache.carried`; that call finds it in `DecodeState.carried`): called after the last step, before
        `finish`, when the output includes the cache. Empty by default."""
        return ()

    def finish(self, state: DecodeState | None) -> None:
        """Called once when the call ends (normally or not), after the last step, with the state as it ends (None
        when the call failed before the prompt's): a proposer that keeps a copy of the text reads the last step's
        tokens here, if it skipped that step."""


ProposerFactory = Callable[[SpeculativeConfig, torch.nn.Module, DraftSampling], Proposer]
_REGISTRY: dict[str, ProposerFactory] = {}


def register_proposer(method: str, factory: ProposerFactory) -> None:
    if method in _REGISTRY:
        raise ValueError(f"a proposer is already registered for method {method!r}")
    _REGISTRY[method] = factory


def build_proposer(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    if config.method not in _REGISTRY:
        raise ValueError(f"SpeculativeConfig.method: no proposer registered for {config.method!r}")
    return _REGISTRY[config.method](config, target, sampling)
