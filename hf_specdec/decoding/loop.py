"""The speculative decoding loop: propose, verify, accept, commit.

`speculative_generate` is handed to transformers' `generate(custom_generate=...)`, so generate's own preparation
(generation-config merge, logits processors, stopping criteria, special tokens) is reused. Each step:

1. propose: the proposer drafts up to k tokens per row;
2. verify: one target forward over [last committed token, drafts] per row, on the ragged KV cache; the user's
   logits processors score every position with its true prefix;
3. accept: greedy argmax matching or lossless rejection sampling (`hf_specdec.verify.chain`);
4. commit: each row emits its accepted drafts plus one recovered/bonus token, cut at its first stopping token;
   the target cache and the proposer keep exactly what was accepted.

Batch rows advance independently (see `hf_specdec.cache.ragged` for how the cache stays ragged and bounded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.capabilities import check_generation_supported
from hf_specdec.config import SpeculativeConfig
from hf_specdec.decoding.scores import PositionScorer, prefix_free
from hf_specdec.decoding.state import DecodeState, Proposal
from hf_specdec.decoding.stopping import TokenStopper
from hf_specdec.proposers import DraftSampling, build_proposer
from hf_specdec.stats import SpecStats, SpecStatsRecorder
from hf_specdec.verify.chain import VerificationResult, greedy_verify, rejection_sample


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """`generate`'s output plus the speculation statistics."""

    spec_stats: SpecStats | None = None


class ScoreLog:
    """Collects per-token scores/logits and lays them out as plain generate does: one [B, V] tensor per step.
    Entries of a row after it finished are zeros (plain generate computed them on padding)."""

    def __init__(self, batch_size: int) -> None:
        self.rows: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]

    def add(self, values: torch.Tensor, num_emitted: torch.Tensor) -> None:
        for row, count in enumerate(num_emitted.tolist()):
            self.rows[row].extend(values[row, :count].unbind(0))

    def steps(self) -> tuple[torch.Tensor, ...]:
        longest = max(len(r) for r in self.rows)
        template = next(r[0] for r in self.rows if r)
        return tuple(
            torch.stack([r[t] if t < len(r) else torch.zeros_like(template) for r in self.rows]) for t in range(longest)
        )


class SpeculativeDecoder:
    def __init__(
        self,
        model: Any,
        config: SpeculativeConfig,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        streamer: Any,
    ) -> None:
        self.model = model
        self.do_sample = bool(generation_config.do_sample)
        self.generator = None
        if config.seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(config.seed)
        self.scorer = PositionScorer(logits_processor)
        self.stopper = TokenStopper(stopping_criteria, model.device)
        sampling = DraftSampling(self.do_sample, prefix_free(logits_processor), self.generator)
        self.proposer = build_proposer(config, model, sampling)
        self.cache = RaggedKVCache(model)
        self.k = config.num_speculative_tokens
        self.streamer = streamer
        self.generation_config = generation_config
        self.score_log = ScoreLog(0)
        self.logit_log = ScoreLog(0)

    def run(
        self,
        # [B, P]
        input_ids: torch.Tensor,
        # [B, P] or None
        attention_mask: torch.Tensor | None,
    ) -> tuple[DecodeState, SpecStats]:
        pad = self.generation_config._pad_token_tensor
        if pad is None and input_ids.shape[0] > 1:
            raise ValueError("pad_token_id is not set: batched generation needs it to pad finished rows")
        self.state = DecodeState.start(
            input_ids,
            attention_mask,
            max_length=self.stopper.max_length or self.generation_config.max_length,
            extra_capacity=self.k + 1,
            pad_token_id=0 if pad is None else int(pad),
        )
        self.stats = SpecStatsRecorder(input_ids.shape[0], self.k)
        self.stop_lengths = torch.full_like(self.state.lengths, -1)  # [B]: length at each row's first stop
        self.score_log, self.logit_log = ScoreLog(input_ids.shape[0]), ScoreLog(input_ids.shape[0])
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
        logits = self.cache.prefill(input_ids, attention_mask)
        self.proposer.start(self.state, attention_mask)
        empty = Proposal.empty(self.state.batch_size, input_ids.device)
        self.accept_and_commit(empty, logits, mark=None)
        while not bool(self.state.finished.all()):
            self.step()
        if self.streamer is not None:
            self.streamer.end()
        return self.state, self.stats.finish()

    def step(self) -> None:
        proposal = self.proposer.propose(self.state)
        mark = self.cache.mark()
        logits = self.verify(proposal)
        self.accept_and_commit(proposal, logits, mark)

    def verify(self, proposal: Proposal) -> torch.Tensor:
        """One target forward over each row's last committed token and its drafts; returns logits [B, k+1, V]."""
        block = torch.cat([self.state.last_tokens()[:, None], proposal.draft_token_ids], dim=1)
        num_real = torch.where(self.state.finished, 0, 1 + proposal.num_draft_tokens)
        return self.cache.forward(block, num_real)

    def accept_and_commit(self, proposal: Proposal, logits: torch.Tensor, mark) -> None:
        state = self.state
        active = ~state.finished
        state.write(proposal.draft_token_ids, proposal.num_draft_tokens)  # so processors see each true prefix
        scores = self.scorer(state, logits)
        result = self.accept(proposal, scores)
        num_emitted = torch.where(active, result.num_accepted + 1, 0)
        state.write(result.output_token_ids.clamp(min=0), num_emitted)
        decision = self.stopper.check(state, result.output_token_ids, num_emitted, scores)
        if self.stopper.pads_finished_rows:
            num_emitted = decision.num_emitted
        self.stop_lengths = torch.where(
            (self.stop_lengths < 0) & decision.stopped, state.lengths + decision.num_emitted, self.stop_lengths
        )
        self.emit(result.output_token_ids, num_emitted, scores, logits)
        self.stats.record(active, proposal.num_draft_tokens, result.num_accepted)
        state.commit(num_emitted, scratch_width=proposal.width + 1)
        state.finished |= self.finished_rows()
        if mark is not None:
            self.cache.rollback(mark, torch.where(state.finished, 0, 1 + result.num_accepted))
            self.proposer.commit(state, result.num_accepted)

    def finished_rows(self) -> torch.Tensor:
        """[B] bool. As in plain generate: with an EOS criterion a stopped row ends (and is padded); without one,
        a stopped row goes on generating until every row has stopped, and all are cut at the last stop."""
        stopped = self.stop_lengths >= 0
        if self.stopper.pads_finished_rows:
            return stopped
        at_limit = self.state.lengths >= self.state.max_length
        return at_limit | (stopped.all() & (self.state.lengths >= self.stop_lengths.max()))

    def output_length(self) -> int:
        return int(self.stop_lengths.max())

    def accept(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        if not self.do_sample:
            return greedy_verify(proposal.draft_token_ids, proposal.num_draft_tokens, scores.argmax(dim=-1))
        target_probs = torch.softmax(scores, dim=-1)
        return rejection_sample(
            proposal.draft_token_ids, proposal.num_draft_tokens, proposal.draft_probs, target_probs, self.generator
        )

    def emit(self, tokens: torch.Tensor, num_emitted: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> None:
        if self.generation_config.output_scores:
            self.score_log.add(scores, num_emitted)
        if self.generation_config.output_logits:
            self.logit_log.add(logits.float(), num_emitted)
        if self.streamer is not None:
            for token in tokens[0, : int(num_emitted[0])].tolist():
                self.streamer.put(torch.tensor([token]))


def speculative_generate(
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    speculative_config: SpeculativeConfig | None = None,
    spec_streamer: Any = None,
    **model_kwargs: Any,
):
    """The `custom_generate` callable: transformers has prepared everything, this runs the speculative loop."""
    if speculative_config is None:
        raise ValueError("speculative_config: hf_specdec's custom_generate needs a SpeculativeConfig")
    check_generation_supported(model, generation_config, model_kwargs, synced_gpus)
    decoder = SpeculativeDecoder(
        model, speculative_config, logits_processor, stopping_criteria, generation_config, spec_streamer
    )
    state, stats = decoder.run(input_ids, model_kwargs.get("attention_mask"))
    length = decoder.output_length()
    sequences = state.sequences[:, :length]
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = length - input_ids.shape[1]
    return SpeculativeGenerateOutput(
        sequences=sequences,
        scores=decoder.score_log.steps()[:steps] if generation_config.output_scores else None,
        logits=decoder.logit_log.steps()[:steps] if generation_config.output_logits else None,
        spec_stats=stats,
    )
