"""Any hf_specdec proposer as a transformers `CandidateGenerator`, for people on transformers' own assisted loop.

transformers' loop handles one row; it calls `get_candidates(input_ids)` with the committed sequence, verifies, and
reports `num_matches` through `update_candidate_strategy`, which is exactly our propose/commit cycle.

transformers 5.23 has no public argument that takes a candidate generator; the loop builds its own in the private
`GenerationMixin._get_candidate_generator`. To use one, override that method on the model to return this object
and switch assisted mode on (e.g. with `prompt_lookup_num_tokens`); `hf_specdec.generate` needs none of this.
Draft heads (Medusa, EAGLE) read the target's hidden states, which that loop does not hand over: refused up front.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer, build_proposer
from hf_specdec.sampling import prefix_free
from hf_specdec.step import DecodeState, VerificationResult
from hf_specdec.step.state import HostView


class ProposerCandidateGenerator(CandidateGenerator):
    def __init__(self, proposer: Proposer, max_length: int, pad_token_id: int = 0) -> None:
        if proposer.target_feature_layers is not None:
            raise ValueError(
                f"{type(proposer).__name__} reads the target's hidden states from hf_specdec's verify forward, which "
                "transformers' assisted loop does not pass to a candidate generator; use hf_specdec.generate (or "
                "model.generate(..., speculative=...) after hf_specdec.enable()) for draft heads"
            )
        self.proposer = proposer
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self._started = False
        self._seen = 0  # tokens of the row at the last proposal
        self._proposed = False  # whether the last candidates came from `propose` (else it skipped)

    @classmethod
    def from_config(
        cls,
        config: SpeculativeConfig,
        target: torch.nn.Module,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
    ) -> ProposerCandidateGenerator:
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device=target.device).manual_seed(config.seed)
        warpers = prefix_free(logits_processor if logits_processor is not None else LogitsProcessorList())
        sampling = DraftSampling(bool(generation_config.do_sample), warpers, generator)
        pad = generation_config.pad_token_id
        return cls(build_proposer(config, target, sampling), generation_config.max_length, 0 if pad is None else int(pad))

    def _state(
        self,
        # [1, L]
        input_ids: torch.Tensor,
        num_accepted: int = 0,
    ) -> DecodeState:
        """The state of transformers' one row; its host view names the tokens appended since the last proposal."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids: transformers' assisted loop handles one row, got batch {input_ids.shape[0]}")
        state = DecodeState.start(input_ids, None, self.max_length, extra_capacity=1, pad_token_id=self.pad_token_id)
        length = input_ids.shape[1]
        new = input_ids[:, min(self._seen, length) :]
        state.host = HostView([length], [False], [new.shape[1]], [num_accepted], new.cpu().numpy())
        return state

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        state = self._state(input_ids)
        if not self._started:
            self.proposer.start(state, None)
            self._started = True
        self._seen = input_ids.shape[1]
        self._proposed = any(state.host_draft_budget())
        if not self._proposed:  # one token left: nothing to draft
            self.proposer.skip(state)
            return input_ids, None
        tree = self.proposer.propose(state).tree
        if not tree.is_chain:
            raise ValueError("transformers' assisted loop verifies chains only; use tree_width=1")
        count = int(tree.valid[0, 1:].sum())
        candidates = torch.cat([input_ids, tree.token_ids[:, 1 : 1 + count].to(input_ids.device)], dim=1)
        if tree.draft_probs is None:
            return candidates, None
        # transformers takes softmax(candidate_logits) as the draft distribution: log-probabilities give it back
        return candidates, tree.draft_probs[:, :count].log()

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        accepted = torch.tensor([int(num_matches)], device=input_ids.device)
        outcome = VerificationResult.chain(input_ids[:, -int(num_matches) - 1 :], accepted)
        if self._proposed:
            self.proposer.commit(self._state(input_ids, int(num_matches)), outcome)
