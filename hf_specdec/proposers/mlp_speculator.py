"""MLP speculator proposer (`method="mlp_speculator"`): an `hf_specdec.heads.MlpSpeculator` guesses the tokens after
each row's last committed token from the target's final hidden state at the position that produced it (kept from
the verify forward: no extra target pass), stage by stage, each stage reading the token the previous one chose.

The speculator keeps no cache: a stage is one small MLP step on a state vector, so every shape below costs k stages
of [rows, nodes at that depth] states and no bookkeeping after verification.

* Chain (`tree_width=1`): one token per stage. Greedy decoding takes each stage's argmax; sampling draws each token
  from the stage's distribution after the target's warpers (temperature, top-k, top-p, ...) and hands that
  distribution to verification, so drafts that follow the target's law are accepted at its rate.
* Branches (`tree_width=w`): stage 0's top-w tokens, each continued by its own stage-by-stage argmax.
* Dynamic tree (`tree_width=w`, `tree_total_tokens=n`): IBM fms-extras expands the top `top_k_tokens_per_head[i]`
  tokens of every candidate at stage i and keeps the `n_candidates` best whole paths, whose number grows as the
  product of the per-stage counts (5 x 4 x 3 = 60 paths for three stages). Here the expansion is EAGLE-2's, the one
  the draft model and EAGLE heads use: at each depth the w best nodes by cumulative log-probability offer their
  top-w tokens, and the best n nodes of all form the tree, so a stage costs w states per row whatever the depth.
  The speculator's own `top_k_tokens_per_head` and `n_candidates` are kept in its files (vLLM and fms-extras read
  them) but do not shape our trees.

Tree nodes are deterministic candidates (point masses), so verification stays lossless under sampling.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from hf_specdec.config import SpeculativeConfig
from hf_specdec.heads.target_weights import layer_spec
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.int8_drafter import COMPILE_REFUSAL, int8_view
from hf_specdec.sampling import draw_draft, fit_vocab, warp
from hf_specdec.step import DecodeState, Proposal
from hf_specdec.tree.dynamic import Candidates, candidate_count, kept_nodes, settles_on
from hf_specdec.tree.template import branch_template


class MlpSpeculatorProposer(Proposer):
    target_feature_layers = (-1,)  # the final (normed) hidden state

    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> None:
        self.speculator = config.heads
        self.speculator.check_target(target)
        self.vocab = self.speculator.target_vocab(target)  # None, or the target's embedding and lm_head it shares
        if config.draft_quantization == "int8":
            self.speculator = int8_view(self.speculator, "the MLP speculator")
            self.compile_refusal = COMPILE_REFUSAL
            if self.vocab is not None:
                lm_head = int8_view(self.vocab.lm_head, "the lm_head the MLP speculator shares")
                self.vocab = dataclasses.replace(self.vocab, lm_head=lm_head)
        n_predict = self.speculator.config.n_predict
        self.k = min(config.num_speculative_tokens, n_predict)
        if config.num_speculative_tokens > n_predict:
            warnings.warn(
                f"SpeculativeConfig.num_speculative_tokens={config.num_speculative_tokens}: this MLP speculator has "
                f"n_predict={n_predict} stages, so each step drafts {n_predict} (spec_stats.num_speculative_tokens)",
                stacklevel=2,
            )
        self.width = config.tree_width
        self.total = config.tree_total_tokens
        self.sampling = sampling
        # the width of the target's logits, which drafted distributions must have
        self.target_vocab = layer_spec(target.get_output_embeddings()).shape[0]

    def draft_depth(self, config: SpeculativeConfig) -> int:
        return self.k

    def num_nodes(self, config: SpeculativeConfig) -> int:
        if self.total is not None:
            return 1 + min(self.total, candidate_count(self.width, self.k))
        return 1 + self.width * self.k

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        budget = state.draft_budget().clamp(max=self.k)
        root = state.last_tokens()
        speculator_state = self.speculator.input_state(state.target_hidden)  # [B, emb_dim]
        # [B, inner]: the state stage 0's guess is read from
        first = self.speculator.advance(0, speculator_state, root, self.vocab)
        if self.total is not None:
            return self._dynamic_tree(state, budget, first)
        if self.width > 1:
            return self._branches(state, budget, first)
        depth = state.step_width(self.k)  # k, or the width a schedule set for this step
        dense = all(b >= depth for b in state.host_draft_budget())  # every row takes every draft (a host fact)
        return self._chain(state, budget.clamp(max=depth), first, dense, depth)

    def _logits(
        self,
        stage: int,
        # [..., inner]
        speculator_state: torch.Tensor,
    ) -> torch.Tensor:
        """[..., V_target] scores of the stage's guess (unwarped: what an argmax reads)."""
        # a target whose lm_head has padded rows: never proposed
        return fit_vocab(self.speculator.stage_logits(stage, speculator_state, self.vocab), self.target_vocab)

    def _scores(
        self,
        stage: int,
        # [..., inner]
        speculator_state: torch.Tensor,
    ) -> torch.Tensor:
        """[..., V_target] scores of the stage's guess, warped by the target's warpers when sampling."""
        scores = self._logits(stage, speculator_state)
        return warp(scores, self.sampling.warpers) if self.sampling.do_sample else scores

    def _chain(self, state: DecodeState, budget: torch.Tensor, current: torch.Tensor, dense: bool,
               depth: int) -> Proposal:
        tokens, probs = [], []
        for stage in range(depth):
            if stage > 0:
                current = self.speculator.advance(stage, current, tokens[-1], self.vocab)
            token, stage_probs = draw_draft(self._logits(stage, current), self.sampling.do_sample,
                                            self.sampling.warpers, self.sampling.generator)
            tokens.append(token)
            probs.append(stage_probs)
        device = state.sequences.device
        draft_probs = torch.stack(probs, dim=1).to(device) if self.sampling.do_sample else None
        return Proposal.chain(state.last_tokens(), torch.stack(tokens, dim=1).to(device), budget, draft_probs,
                              dense=dense)

    def _branches(self, state: DecodeState, budget: torch.Tensor, current: torch.Tensor) -> Proposal:
        """Stage 0's top-w tokens, each continued by argmax: node (depth d, branch r) = 1 + (d - 1) * w + r."""
        levels = [self._scores(0, current).topk(self.width, dim=-1).indices]  # [B, w]
        current = current[:, None].expand(-1, self.width, -1)  # [B, w, inner]
        for stage in range(1, self.k):
            current = self.speculator.advance(stage, current, levels[-1], self.vocab)
            levels.append(self._logits(stage, current).argmax(dim=-1))  # unwarped: the warpers keep the best token
        device = state.sequences.device
        tokens = torch.cat([state.last_tokens()[:, None], *(level.to(device) for level in levels)], dim=1)
        return Proposal.from_template(branch_template(self.width, self.k), tokens, budget)

    def _dynamic_tree(self, state: DecodeState, budget: torch.Tensor, current: torch.Tensor) -> Proposal:
        """EAGLE-2 expansion (see the module docstring) over the stages the step drafts, keeping `kept_nodes` of
        them, as the draft model's and the EAGLE heads' trees do."""
        width, depth = self.width, state.step_width(self.k)
        candidates = Candidates(torch.log_softmax(self._scores(0, current), dim=-1), width)
        current = current[:, None].expand(-1, width, -1)  # [B, w, inner]: the state each frontier token came from
        kept = kept_nodes(self.total, depth, self.k)
        settles = settles_on(current.device) and not self.fixed_shapes  # the same tree, fewer stages
        for stage in range(1, depth):
            if settles and candidates.settled(kept):
                break
            current = self.speculator.advance(stage, current, candidates.frontier_tokens, self.vocab)  # [B, w, inner]
            best = candidates.expand(torch.log_softmax(self._scores(stage, current), dim=-1))  # [B, w]
            current = current.gather(1, (best // width)[:, :, None].expand(-1, -1, current.shape[-1]))
        tree, _ = candidates.select(state.last_tokens(), kept, budget, state.sequences.device)
        return Proposal(tree)


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    return MlpSpeculatorProposer(config, target, sampling)


register_proposer("mlp_speculator", _build)
