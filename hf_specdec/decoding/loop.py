"""The speculative decoding loop: propose, verify, accept, commit.

`speculative_generate` is handed to transformers' `generate(custom_generate=...)`, so generate's own preparation
(generation-config merge, logits processors, stopping criteria, special tokens) is reused. `start` prefills the
target's cache with the prompt and chooses the first token (a step with no drafts); then each step:

1. propose: the proposer offers a token tree per row (a chain being the one-branch tree);
2. verify: one target forward over each row's last committed token and its draft nodes (a tree-attention mask,
   or a plain causal one for an unpadded chain), on the ragged KV cache; the user's logits processors score every
   node with its true prefix;
3. accept: greedy argmax matching or lossless rejection sampling (`hf_specdec.verify.verifier`);
4. emit: each row emits its accepted drafts plus one recovered/bonus token, cut at its first stopping token, to
   the outputs and the streamer;
5. commit: the state takes the emitted tokens; the target cache and the proposer keep exactly the accepted path.

Batch rows advance independently (see `hf_specdec.cache.ragged` for how the cache stays ragged and bounded).
Once enough rows have finished, the target's cache drops them (`drop_finished_rows`): the verify forward then
runs on the rows still generating, and its logits are put back in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StaticCache, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_specdec.cache.carried import attach, carried_by
from hf_specdec.cache.exchange import (
    entry_tensors,
    fill_static_cache,
    filled_layers,
    full_layers,
    layer_entries,
    recompute,
    take_rows,
    zeros_with_rows,
)
from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.cache.recurrent import recurrent_layer_indices
from hf_specdec.capabilities import (
    check_generation_supported,
    check_recurrent_supported,
    holds_tokens,
    multimodal_inputs,
)
from hf_specdec.compile import CompileSettings, check_compilable, compiled_forward, uses_static_shapes
from hf_specdec.config import TREE_SIZE_AUTO, SpeculativeConfig
from hf_specdec.decoding.outputs import OutputLog, over_static_cache
from hf_specdec.decoding.scores import PositionScorer
from hf_specdec.decoding.stopping import TokenStopper
from hf_specdec.proposers import DraftSampling, build_proposer
from hf_specdec.sampling import prefix_free
from hf_specdec.schedule.controller import build_schedule
from hf_specdec.schedule.tree_size import auto_tree_size
from hf_specdec.stats import SpecStats, SpecStatsRecorder
from hf_specdec.step import DecodeState, PromptInputs, Proposal, VerificationResult
from hf_specdec.verify.verifier import TypicalAcceptance, Verifier

# Finished rows leave the target's cache once they are this share of the rows it holds: dropping copies the cache
# once, and every later verify forward computes that many rows fewer.
DROP_FINISHED_SHARE = 0.25


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """`generate`'s output plus the speculation statistics."""

    spec_stats: SpecStats | None = None


class ScoreLog:
    """Collects per-token scores/logits and lays them out as plain generate does: one [B, V] tensor per step.
    Entries of a row after it finished are zeros (plain generate computed them on padding)."""

    def __init__(self, batch_size: int) -> None:
        self.rows: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]

    def add(
        self,
        # [B, W, V]
        values: torch.Tensor,
        # per row: how many of its entries to keep
        num_emitted: list[int],
    ) -> None:
        for row, count in enumerate(num_emitted):
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
        # an empty transformers StaticCache the caller passed, filled with the output at the end
        static_cache: StaticCache | None = None,
    ) -> None:
        self.model = model
        do_sample = bool(generation_config.do_sample)
        if config.lossy_typical_acceptance and not do_sample:
            raise ValueError(
                "SpeculativeConfig.lossy_typical_acceptance: only applies when sampling (do_sample=True); greedy "
                "decoding is exact already; drop the option or sample"
            )
        self.config = config
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device=model.device).manual_seed(config.seed)
        typical = None
        if config.lossy_typical_acceptance:
            typical = TypicalAcceptance(config.posterior_threshold, config.posterior_alpha)
        self.verifier = Verifier(do_sample, generator, typical)
        self.scorer = PositionScorer(logits_processor)
        self.stopper = TokenStopper(stopping_criteria, model.device)
        sampling = DraftSampling(do_sample, prefix_free(logits_processor), generator)
        self.proposer = build_proposer(config, model, sampling)
        self.cache = RaggedKVCache(model)
        self.cache.feature_layers = self.proposer.target_feature_layers
        self.cache.record_prompt_features = self.proposer.needs_prompt_features
        self.max_depth = self.proposer.draft_depth(config)
        self.streamer = streamer
        self.generation_config = generation_config
        self.state: DecodeState | None = None
        self.score_log = ScoreLog(0)
        self.logit_log = ScoreLog(0)
        self.rows: torch.Tensor | None = None  # [B_held]: the batch row of each row the target cache holds; None: all
        self.held_rows: list[int] = []  # the same on the host (all rows until some are dropped)
        # the host needs each step's tokens: to stream them, or for a proposer that matches on the text
        self.report_tokens = streamer is not None or self.proposer.reads_emitted_tokens
        # static shapes and compiled forwards (`hf_specdec.compile`); the compile checks come before any forward
        self.static_cache = static_cache
        self.static_shapes = uses_static_shapes(generation_config, static_cache)
        self.compile_settings = None
        if self.static_shapes:
            self.compile_settings = CompileSettings.from_generation(model, generation_config)
            if self.compile_settings is not None:
                check_compilable(model, "the target")
            max_length = self.stopper.max_length or generation_config.max_length
            self.proposer.fix_shapes(max_length, self.compile_settings)
        self.schedule = build_schedule(config, model, self.proposer, self.max_depth, self.static_shapes)
        self.carried: tuple = ()  # what the proposer leaves with the output cache (`hf_specdec.cache.carried`)

    def run(
        self,
        # [B, P] ([B, 0] when the prompt comes as `prompt.inputs_embeds`)
        input_ids: torch.Tensor,
        prompt: PromptInputs,
    ) -> DecodeState:
        try:
            self.start(input_ids, prompt)
            while not all(self.state.host.finished):
                self.step()
            if self.generation_config.return_dict_in_generate and self.generation_config.use_cache:
                self.carried = self.proposer.carry(self.state)  # goes with the output cache
        finally:
            self.proposer.finish(self.state)
        if self.streamer is not None:
            self.stream(until=self.output_length())
            self.streamer.end()
        return self.state

    def stream(self, until: int | None = None) -> None:
        """Take the step's emitted tokens (`state.host.emitted`) and put the output's columns that every generating
        row has now to the streamer, one column ([B] tokens) at a time, as plain generate puts each step's tokens
        (a finished row's are padding); `until`: every column up to that output length (the call's end)."""
        host = self.state.host
        if until is None:
            for pending, count, tokens in zip(self.unstreamed, host.num_emitted, host.emitted):
                pending.extend(tokens[:count].tolist())
            columns = min((len(pending) for pending, done in zip(self.unstreamed, host.finished) if not done),
                          default=0)
        else:
            columns = until - self.streamed
        pad = self.state.pad_token_id
        for column in range(columns):
            self.streamer.put(torch.tensor([pending[column] if column < len(pending) else pad
                                            for pending in self.unstreamed]))
        self.unstreamed = [pending[columns:] for pending in self.unstreamed]
        self.streamed += columns

    def start(
        self,
        # [B, P] ([B, 0] when the prompt comes as `prompt.inputs_embeds`)
        input_ids: torch.Tensor,
        prompt: PromptInputs,
    ) -> None:
        """Prefill the target's cache with the prompt, start the proposer, and choose each row's first token from
        the prompt's last logits (a step whose proposal has no drafts)."""
        pad = self.generation_config._pad_token_tensor
        if pad is None and input_ids.shape[0] > 1 and self.stopper.pads_finished_rows:
            raise ValueError("pad_token_id is not set: batched generation with an EOS needs it to pad finished rows; "
                             "pass pad_token_id=...")
        attention_mask = prompt.attention_mask
        if self.static_shapes:
            self.make_static(input_ids.shape[1] if prompt.inputs_embeds is None else prompt.inputs_embeds.shape[1])
        self.state = DecodeState.start(
            input_ids,
            attention_mask if input_ids.shape[1] else None,  # an embedded prompt without ids: no ids to mask
            max_length=self.stopper.max_length or self.generation_config.max_length,
            extra_capacity=self.max_depth + 1,
            pad_token_id=0 if pad is None else int(pad),
        )
        batch = input_ids.shape[0]
        self.held_rows = list(range(batch))
        self.stats = SpecStatsRecorder(batch, self.max_depth)
        if self.schedule is not None:
            self.schedule.start(batch)
        self.stop_lengths = torch.full_like(self.state.lengths, -1)  # [B]: length at each row's first stop
        self.score_log, self.logit_log = ScoreLog(batch), ScoreLog(batch)
        config = self.generation_config
        self.cache.output_hidden_states = bool(config.output_hidden_states)
        self.cache.output_attentions = bool(config.output_attentions)
        self.output_log = OutputLog(self.model, batch, self.cache.output_hidden_states,
                                    self.cache.output_attentions, whole_sequence=not config.use_cache)
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
            self.streamed = input_ids.shape[1]  # the output's columns the streamer has
            self.unstreamed: list[list[int]] = [[] for _ in range(input_ids.shape[0])]  # per row, tokens not put yet
        self.prompt, self.prompt_ids = prompt, input_ids
        self.cache.expected_slots = self.state.sequences.shape[1]
        logits = self.cache.prefill(input_ids, attention_mask, position_ids=prompt.position_ids,
                                    token_type_ids=prompt.token_type_ids, inputs_embeds=prompt.inputs_embeds,
                                    past_key_values=prompt.past_key_values, multimodal=prompt.multimodal)
        self.state.target_features = self.cache.hidden_states
        self.state.target_cache = self.cache
        if prompt.past_key_values is not None:
            self.state.carried = carried_by(prompt.past_key_values)
        self.proposer.start(self.state, attention_mask)
        proposal = Proposal.no_draft(self.state)
        scores = self.score(proposal, logits)
        result = self.verifier(proposal, scores)
        num_emitted = self.emit(result, scores, logits)
        self.commit_tokens(proposal, result, num_emitted, logits.shape[1])
        self.log(result, scores, logits)
        if self.cache.output_hidden_states or self.cache.output_attentions:
            self.output_log.prefill(self.cache.model_outputs, prompt.past_key_values)

    def make_static(self, prompt_length: int) -> None:
        """The target cache at a fixed capacity: every committed token (up to the length limit), then one verify
        region of the proposer's fixed width; a transformers StaticCache passed in must hold as much."""
        max_length = self.stopper.max_length or self.generation_config.max_length
        committed, nodes = max(max_length, prompt_length), self.proposer.num_nodes(self.config)
        if self.static_cache is not None:
            capacity = self.static_cache.get_max_length()
            if capacity < committed + nodes:
                raise ValueError(
                    f"{CACHE_KWARG}: a StaticCache of max_cache_len={capacity}; speculative decoding needs the "
                    f"prompt ({prompt_length}) + max_new_tokens ({committed - prompt_length}) + the draft budget "
                    f"({nodes} verified tokens per step) = {committed + nodes} slots; build it with max_cache_len "
                    f">= {committed + nodes}"
                )
        model_call = None if self.compile_settings is None else compiled_forward(self.model, self.compile_settings)
        # transformers' `max_cache_len` pre-sizes static caches for the largest call expected (the whole cache)
        self.cache.make_static(max(committed, (self.generation_config.max_cache_len or 0) - nodes), nodes, model_call)

    def step(self) -> None:
        """propose -> verify -> accept -> emit -> commit."""
        self.drop_finished_rows()
        lengths = self.state.host.lengths
        if self.schedule is not None:
            self.schedule.plan(self.state, len(self.held_rows))
        drafting = any(self.state.host_draft_budget())
        if drafting:
            proposal = self.proposer.propose(self.state)
        else:  # no row drafts (a schedule's plain step, or every row one token from its limit): verify the last tokens
            self.proposer.skip(self.state)
            proposal = Proposal.no_draft(self.state)
        if self.schedule is not None:
            self.schedule.look_ahead(self.state)
        logits = self.verify(proposal)
        scores = self.score(proposal, logits)
        result = self.verifier(proposal, scores)
        num_emitted = self.emit(result, scores, logits)
        self.commit(proposal, result, num_emitted, logits.shape[1], drafting)
        if self.schedule is not None:
            self.schedule.observe(self.state, proposal)
        self.log(result, scores, logits)
        if self.cache.output_hidden_states or self.cache.output_attentions:
            self.output_log.add(self.cache.model_outputs, result.path_nodes, self.state.host.num_emitted, lengths,
                                self.unheld)

    def verify(self, proposal: Proposal) -> torch.Tensor:
        """One target forward over each held row's last committed token and its draft nodes, in the target
        cache's region; returns logits [B, N, V] (zeros for rows the cache dropped)."""
        tree, held = proposal.tree, self.held
        all_real = tree.dense and not any(self.state.host.finished[row] for row in self.held_rows)
        logits = self.cache.forward(
            held(tree.token_ids),
            held(tree.depths),
            real=None if all_real else held(tree.valid & ~self.state.finished[:, None]),
            visible=None if tree.is_chain else held(tree.ancestors),
        )
        return self.unheld(logits)

    def score(
        self,
        proposal: Proposal,
        # [B, N, V]
        logits: torch.Tensor,
    ) -> torch.Tensor:
        """Processed scores [B, N, V] of every verified node, each with its true prefix; a proposer that reads the
        target's scores is shown them (`Proposer.observe_scores`)."""
        path_tokens, depths = proposal.path_tokens()
        template = proposal.tree.template
        scores = self.scorer(self.state, logits, path_tokens, depths, None if template is None else template.depths)
        if self.proposer.reads_target_scores:
            self.proposer.observe_scores(self.state, proposal.tree, scores)
        return scores

    def emit(
        self,
        result: VerificationResult,
        # [B, N, V]
        scores: torch.Tensor,
        # [B, N, V]
        logits: torch.Tensor,
    ) -> torch.Tensor:
        """Each row's accepted tokens plus one, cut at its first stopping token, written after its committed text.
        Returns [B] the tokens each row emits."""
        state = self.state
        num_emitted = torch.where(state.finished, 0, result.num_accepted + 1)
        self.unsampleable = unsampleable_rows(result, scores, num_emitted) if self.verifier.do_sample else None
        # the tokens each row emits go after its committed text (placeholders, -1, lie past each row's count), once
        # its stop is known; custom stopping criteria read each prefix there, so for them they go before as well
        early = self.stopper.needs_scores
        if early:
            state.write(result.output_token_ids, num_emitted)
        emitted_scores = scores_of_emitted(result, scores) if self.stopper.needs_scores else None
        decision = self.stopper.check(state, result.output_token_ids, num_emitted, emitted_scores)
        if self.stopper.pads_finished_rows:
            num_emitted = decision.num_emitted
        if not early or self.stopper.pads_finished_rows:  # cut at each row's stop, padding after
            state.write(result.output_token_ids, num_emitted)
        self.stop_lengths = torch.where(
            (self.stop_lengths < 0) & decision.stopped, state.lengths + decision.num_emitted, self.stop_lengths
        )
        return num_emitted

    def log(
        self,
        result: VerificationResult,
        # [B, N, V]
        scores: torch.Tensor,
        # [B, N, V]
        logits: torch.Tensor,
    ) -> None:
        """The emitted tokens' scores and logits (when asked for) and the streamer, from the host's counts."""
        host = self.state.host
        if self.generation_config.output_scores:
            self.score_log.add(scores_of_emitted(result, scores), host.num_emitted)
        if self.generation_config.output_logits:
            self.logit_log.add(scores_of_emitted(result, logits.float()), host.num_emitted)
        if self.streamer is not None:
            self.stream()

    def commit_tokens(
        self,
        proposal: Proposal,
        result: VerificationResult,
        # [B]
        num_emitted: torch.Tensor,
        num_verified: int,
    ) -> None:
        """The state takes the emitted tokens; rows that stopped are marked finished; the statistics count the
        step; the target's features where the tokens were chosen are kept for the proposer; the host learns the
        new lengths, the finished rows and what was emitted (the step's one host read)."""
        state = self.state
        generating = [not done for done in state.host.finished]  # the rows this step was for
        drafted = proposal.num_nodes > 1
        state.commit(num_emitted)
        state.finished |= self.finished_rows()
        if self.cache.hidden_states is not None:
            self.keep_target_features(result, num_verified)
        host = state.report(num_emitted, result.num_accepted,
                            result.output_token_ids if self.report_tokens else None, self.unsampleable,
                            num_draft_tokens=proposal.num_draft_tokens if drafted else None)
        if drafted:
            self.stats.record(generating, host.num_draft_tokens, host.num_accepted)
        else:  # nothing drafted: a forward for the rows generating
            self.stats.record_forward(generating)
        if host.unsampleable is not None and any(host.unsampleable):
            row = host.unsampleable.index(True)
            raise RuntimeError(
                f"sampling: row {row} has no token with a finite score to sample at new token "
                f"{host.lengths[row] - self.state.prompt_length} (the logits processors left every token at -inf, "
                "e.g. no_repeat_ngram_size=1 once every token has been used, or the model's logits are nan); plain "
                "generate stops there too (torch.multinomial: probability tensor contains inf, nan or element < 0)"
            )

    def commit(
        self,
        proposal: Proposal,
        result: VerificationResult,
        # [B]
        num_emitted: torch.Tensor,
        num_verified: int,
        # whether the proposer proposed this step (else it was told to skip it)
        proposed: bool,
    ) -> None:
        """`commit_tokens`, then the target cache keeps the fed nodes whose successors were emitted (the accepted
        path; a row that stopped mid-step keeps those before its stop, as plain generate's cache holds every token
        but the last), and the proposer keeps what was accepted."""
        self.commit_tokens(proposal, result, num_emitted, num_verified)
        path = None if proposal.tree.is_chain else self.held(result.path_nodes)
        kept_on_host = [self.state.host.num_emitted[row] for row in self.held_rows]
        self.cache.commit(self.held(num_emitted), path, kept_on_host=kept_on_host)
        if proposed:
            self.proposer.commit(self.state, result)

    def drop_finished_rows(self) -> None:
        """Drop finished rows from the target's cache once they are DROP_FINISHED_SHARE of the rows it holds
        (under static shapes every row keeps its slot: the shapes stay those the forwards were compiled for)."""
        if self.static_shapes:
            return
        finished = self.state.host.finished
        done = sum(finished[row] for row in self.held_rows)
        if done < max(1.0, DROP_FINISHED_SHARE * len(self.held_rows)):
            return
        keep = [i for i, row in enumerate(self.held_rows) if not finished[row]]
        self.held_rows = [self.held_rows[i] for i in keep]
        device = self.state.finished.device
        self.cache.select_rows(torch.tensor(keep, device=device), keep)
        self.rows = torch.tensor(self.held_rows, device=device)

    def held(
        self,
        # [B, ...]
        values: torch.Tensor,
    ) -> torch.Tensor:
        """[B_held, ...]: the entries of the rows the target cache holds."""
        return values if self.rows is None else values[self.rows.to(values.device)]

    def unheld(
        self,
        # [B_held, ...]
        values: torch.Tensor,
    ) -> torch.Tensor:
        """[B, ...]: entries of held rows put back in batch order, zeros for dropped rows."""
        if self.rows is None:
            return values
        full = values.new_zeros(self.state.batch_size, *values.shape[1:])
        full[self.rows.to(values.device)] = values
        return full

    def keep_target_features(self, result: VerificationResult, num_verified: int) -> None:
        """The target's features where this step's tokens were chosen (`DecodeState.target_features`), and where
        each row's last token was chosen (`target_hidden`)."""
        hidden = self.unheld(self.cache.hidden_states[:, -num_verified:])  # the prefill may have kept the whole prompt
        positions = result.path_nodes
        features = hidden.gather(1, positions[:, :, None].expand(-1, -1, hidden.shape[2]))
        self.state.target_features = features
        last = features.gather(1, result.num_accepted[:, None, None].expand(-1, 1, features.shape[2])).squeeze(1)
        self.state.target_hidden = last

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

    def output_cache(self, length: int) -> DynamicCache | StaticCache:
        """The cache plain generate returns with an output `length` tokens long (see `hf_specdec.cache.exchange`):
        rows whose cache is complete are gathered by order, the others computed again in one forward. A StaticCache
        passed in comes back filled, as plain generate returns it."""
        prompt = self.prompt
        # positions fed before the first output column: an embedded prompt without token ids has none there
        embedded = 0 if prompt.inputs_embeds is None else prompt.inputs_embeds.shape[1] - self.prompt_ids.shape[1]
        total = embedded + length - 1  # every position fed: all but the last output token
        batch = self.state.batch_size
        held = torch.arange(batch, device=self.state.lengths.device) if self.rows is None else self.rows
        complete = torch.zeros(batch, dtype=torch.bool, device=held.device)
        complete[held] = self.cache.lengths.to(held.device) == total
        held_layers = self.cache.layers_by_order(total)
        layers = [zeros_with_rows(entry, batch) for entry in held_layers]
        for layer, entry in zip(layers, held_layers):
            for full, part in zip(entry_tensors(layer), entry_tensors(entry)):
                full[held.to(full.device)] = part
        redo = (~complete).nonzero().squeeze(1)
        if redo.numel():
            # images are not split by row: a prompt with images has all its rows computed again, the complete ones kept
            every = bool(prompt.images)
            rows = (torch.arange(batch) if every else redo).to(self.prompt_ids.device)
            subset = replace(prompt, past_key_values=None) if every else prompt.select(rows)
            start = self.prompt_ids.shape[1]
            # continuing a filled cache: its positions are taken as they are, as plain generate keeps them (they
            # may hold what the text alone does not give, such as an earlier turn's images)
            past = prompt.past_key_values
            cached = None if past is None else [take_rows(entry, rows)
                                                for entry in filled_layers(past, past.get_seq_length())]
            again = recompute(self.model, self.state.sequences[rows, start : length - 1], subset, self.prompt_ids[rows],
                              cached)
            self.stats.record_forward((~complete).tolist())
            for layer, entry in zip(layers, layer_entries(again)):
                for full, part in zip(entry_tensors(layer), entry_tensors(entry)):
                    full[redo.to(full.device)] = part[redo.to(part.device)] if every else part
        if self.static_cache is not None:
            return fill_static_cache(self.static_cache, layers)
        return full_layers(layers, self.model.config)


def scores_of_emitted(
    result: VerificationResult,
    # [B, N, V]
    scores: torch.Tensor,
) -> torch.Tensor:
    """[B, D + 1, V]: the scores each emitted token was chosen under."""
    positions = result.path_nodes
    return scores.gather(1, positions[..., None].expand(-1, -1, scores.shape[2]))


def unsampleable_rows(
    result: VerificationResult,
    # [B, N, V]
    scores: torch.Tensor,
    # [B]: tokens each row emits
    num_emitted: torch.Tensor,
) -> torch.Tensor:
    """[B] bool: rows that emit a token chosen under scores with no finite maximum (every token at -inf, or nan):
    no distribution to sample from, where plain generate's `torch.multinomial` raises."""
    peaks = scores.amax(dim=-1).gather(1, result.path_nodes)  # [B, D + 1]
    column = torch.arange(peaks.shape[1], device=peaks.device)[None, :]
    return (~torch.isfinite(peaks) & (column < num_emitted[:, None])).any(dim=1)


def with_tree_size(config: SpeculativeConfig, model: Any, batch_size: int) -> SpeculativeConfig:
    """`config` with `tree_total_tokens="auto"` (its own, or its hybrid fallback's) resolved for `model` at this batch
    size (`hf_specdec.schedule.tree_size`)."""
    if config.fallback is not None and config.fallback.tree_total_tokens == TREE_SIZE_AUTO:
        config = replace(config, fallback=with_tree_size(config.fallback, model, batch_size))
    if config.tree_total_tokens != TREE_SIZE_AUTO:
        return config
    size = auto_tree_size(model, batch_size, config.num_speculative_tokens, config.max_tree_nodes)
    return replace(config, tree_total_tokens=size)


def speculative_generate(
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    speculative_config: SpeculativeConfig | None = None,
    spec_streamer: Any = None,
    spec_user_cache: Any = None,
    **model_kwargs: Any,
):
    """The `custom_generate` callable: transformers has prepared everything, this runs the speculative loop.
    `spec_user_cache` is the `past_key_values` the caller passed (a StaticCache `generate` prepared for
    `cache_implementation="static"` is not theirs: the engine sizes its own)."""
    if speculative_config is None:
        raise ValueError("speculative_config: hf_specdec's custom_generate needs a SpeculativeConfig")
    check_recurrent_supported(model, speculative_config, generation_config, model_kwargs.get(CACHE_KWARG),
                              model_kwargs.get("attention_mask"), input_ids.shape[1])
    if recurrent_layer_indices(model) and not holds_tokens(model_kwargs.get(CACHE_KWARG)):
        model_kwargs.pop(CACHE_KWARG, None)  # an empty cache generate prepared: the engine keeps its own
    check_generation_supported(model, generation_config, model_kwargs, synced_gpus,
                               speculative_config.drafting_methods, prompt_ids=input_ids.shape[1])
    speculative_config = with_tree_size(speculative_config, model, input_ids.shape[0])
    input_ids = input_ids.long()  # as plain generate's output, whatever the prompt's integer type
    past = model_kwargs.get(CACHE_KWARG)
    static_cache = past if isinstance(past, StaticCache) and past is spec_user_cache else None
    decoder = SpeculativeDecoder(
        model, speculative_config, logits_processor, stopping_criteria, generation_config, spec_streamer, static_cache
    )
    prompt = PromptInputs(
        attention_mask=model_kwargs.get("attention_mask"),
        position_ids=model_kwargs.get("position_ids"),
        token_type_ids=model_kwargs.get("token_type_ids"),
        inputs_embeds=model_kwargs.get("inputs_embeds"),
        past_key_values=past if holds_tokens(past) else None,
        multimodal=multimodal_inputs(model_kwargs),
    )
    try:
        state = decoder.run(input_ids, prompt)
        # the call ends for the schedule whatever the output: its rows' estimates start the next call's
        schedule_stats = None if decoder.schedule is None else decoder.schedule.finish()
        length = decoder.output_length()
        sequences = state.sequences[:, :length]
        if not generation_config.return_dict_in_generate:
            return sequences
        steps = length - input_ids.shape[1]
        # built before the statistics are read: rows that stopped early cost one more target forward here
        past_key_values = decoder.output_cache(length) if generation_config.use_cache else None
        if decoder.cache.layout.attends:  # (a cache of recurrent layers alone tells no length to check a later call by)
            attach(past_key_values, decoder.carried)
    finally:
        decoder.cache.release()  # the output holds copies, never the cache's buffers
    return SpeculativeGenerateOutput(
        sequences=sequences,
        scores=decoder.score_log.steps()[:steps] if generation_config.output_scores else None,
        logits=decoder.logit_log.steps()[:steps] if generation_config.output_logits else None,
        **{CACHE_KWARG: past_key_values},
        hidden_states=decoder.output_log.hidden_steps(steps),
        attentions=over_static_cache(decoder.output_log.attention_steps(steps),
                                     past if generation_config.use_cache else None),
        spec_stats=replace(decoder.stats.finish(schedule_stats), tree_total_tokens=speculative_config.tree_total_tokens),
    )
