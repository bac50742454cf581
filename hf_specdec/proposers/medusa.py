"""Medusa proposer: the heads read the target's hidden state at the position that produced the last committed
token (kept from the verify forward: no extra target pass) and guess the tokens after it.

Heads that share the target's lm_head ("version 2") are given it at every proposal: its rows at the heads' token map
when they have one (`hf_specdec.heads.token_map`), so a proposal projects onto the draft vocabulary only.

Chain: each head's top-1. Tree: a static path list (`tree_paths`, Medusa's `choices`): path (r0, r1, ...) is head
0's rank-r0 candidate, then head 1's rank-r1 candidate, and so on. Candidates are deterministic (point masses), so
verification stays lossless under sampling.
"""

from __future__ import annotations

import warnings

import torch

from hf_specdec.compile import CompileSettings, compiled_forward
from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.int8_drafter import COMPILE_REFUSAL, int8_view
from hf_specdec.step import DecodeState, Proposal
from hf_specdec.tree.template import TreeTemplate, up_to_depth
from hf_specdec.tree.tree import template_tensors


class MedusaProposer(Proposer):
    target_feature_layers = (-1,)  # the final hidden state

    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module) -> None:
        self.heads = config.heads
        self.heads_call = self.heads  # compiled under static shapes with a compile config
        self.heads.check_target(target)
        self.lm_head = self.heads.draft_lm_head(target.get_output_embeddings())
        if config.draft_quantization == "int8":
            self.heads_call = int8_view(self.heads, "the Medusa heads")
            if self.heads.config.shared_lm_head:  # else the heads' own lm_heads, in the view already
                self.lm_head = int8_view(self.lm_head, "the lm_head the Medusa heads share")
            self.compile_refusal = COMPILE_REFUSAL
        num_heads = self.heads.config.num_heads
        self.k = min(config.num_speculative_tokens, num_heads)
        self.template = None if config.tree_paths is None else TreeTemplate.from_paths(config.tree_paths)
        if self.template is None and config.num_speculative_tokens > num_heads:
            warnings.warn(
                f"SpeculativeConfig.num_speculative_tokens={config.num_speculative_tokens}: these Medusa heads guess "
                f"{num_heads} tokens ahead, so each step drafts {num_heads} (spec_stats.num_speculative_tokens)",
                stacklevel=2,
            )
        if self.template is not None and self.template.max_depth > self.heads.config.num_heads:
            raise ValueError(
                f"SpeculativeConfig.tree_paths: depth {self.template.max_depth} needs as many heads; "
                f"the heads have {self.heads.config.num_heads}"
            )

    def draft_depth(self, config: SpeculativeConfig) -> int:
        return self.k if self.template is None else self.template.max_depth

    def num_nodes(self, config: SpeculativeConfig) -> int:
        return 1 + self.k if self.template is None else self.template.num_nodes

    def fix_shapes(self, max_length: int, compile_settings: CompileSettings | None) -> None:
        super().fix_shapes(max_length, compile_settings)
        if compile_settings is not None:
            self.heads_call = compiled_forward(self.heads, compile_settings)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        budget = state.draft_budget()
        hidden = state.target_hidden.to(self.heads.device)
        logits = self.heads_call(hidden=hidden, lm_head=self.lm_head).float()  # [B, K, V]
        logits = logits.to(state.sequences.device)
        if self.template is None:  # a chain
            depth = state.step_width(self.k)
            dense = all(b >= depth for b in state.host_draft_budget())  # every row takes every node (a host fact)
            return Proposal.chain(state.last_tokens(), logits[:, :depth].argmax(dim=-1), budget.clamp(max=depth),
                                  dense=dense)
        # a step the schedule narrows verifies the tree's levels it allows (under static shapes, every level)
        template = self.template if self.fixed_shapes else up_to_depth(self.template, state.step_width(
            self.template.max_depth))
        dense = all(b >= template.max_depth for b in state.host_draft_budget())
        candidates = logits[:, : template.max_depth].topk(template.max_rank + 1, dim=-1).indices
        structure = template_tensors(template, logits.device)
        nodes = candidates[:, structure.depths[1:] - 1, structure.ranks[1:]]  # [B, N - 1]: each node's head, rank
        tokens = torch.cat([state.last_tokens()[:, None], nodes], dim=1)
        return Proposal.from_template(template, tokens, budget, dense=dense)


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    return MedusaProposer(config, target)


register_proposer("medusa", _build)
