"""EAGLE proposer: an EAGLE head (`hf_specdec.heads.EagleHead`) drafts from the target's own features.

The head is a one-layer model with its own ragged KV cache, driven exactly like a draft model
(`DraftModelProposer`): a chain, top-w branches, or an EAGLE-2 dynamic tree (`tree_width` = top_k,
`num_speculative_tokens` = depth, `tree_total_tokens` = total_tokens). What differs is what each forward reads:

* committed tokens are fed with the target's features at the position before each of them, which the verify
  forward already computed (`DecodeState.target_features`; the prompt's come from the prefill): no extra target
  pass;
* drafted tokens are fed with the head's own output at their parent node, which stands in for the target feature
  the head cannot see yet.

After verification the head keeps only the committed tokens' KV: the drafted entries were built on its own
guesses, and the tokens the target accepted are fed again next step with the target's true features (as EAGLE
does). A step the head does not draft (a plain step, or one another proposer drafts under `method="auto"`, where
rows commit different numbers of tokens) keeps each row's committed tokens' features instead of running the head:
the next proposal feeds them all in one forward (at most `BACKLOG_LIMIT` tokens wait per row), so a batch that
decodes plainly or with another drafter for a while pays almost nothing for the head. Candidates are deterministic in trees and sampled from the head's
distribution in chains, so verification stays lossless either way.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_specdec.config import SpeculativeConfig
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.draft_model import DraftModelProposer, select_positions
from hf_specdec.step import DecodeState, VerificationResult


class EagleDrafter(nn.Module):
    """An EAGLE head with the target's embeddings and lm_head (its rows at the head's token map, when it has one),
    called like a causal LM so a `RaggedKVCache` can drive it; `features` (and whether they are the target's) come as
    extra model inputs."""

    def __init__(self, head: EagleHead, target: nn.Module) -> None:
        super().__init__()
        self.head = head
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = head.draft_lm_head(target.get_output_embeddings())
        self.config = head.llama_config

    @property
    def dtype(self) -> torch.dtype:
        return self.head.dtype

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.head.device

    def forward(
        self,
        # [B, W]
        input_ids: torch.Tensor,
        # [B, W]
        position_ids: torch.Tensor,
        # [B, 1, W, S] additive
        attention_mask: torch.Tensor,
        cache,
        # [B, W, F]: the feature before each token (the target's, or the head's own output at the parent)
        features: torch.Tensor,
        from_target: bool,
        # [B, N] long or None: the positions whose logits are computed (None: every position)
        logits_at: torch.Tensor | None = None,
        use_cache: bool = True,
        output_hidden_states: bool = False,
        return_dict: bool = True,
    ) -> CausalLMOutputWithPast:
        embeds = self.embed_tokens(input_ids.to(self.embed_tokens.weight.device))
        hidden = self.head(embeds.to(self.device), features.to(self.device), position_ids.to(self.device),
                           attention_mask, cache, from_target=from_target)
        if logits_at is not None and logits_at.shape[1] == 0:  # a feed that needs none: no projection at all
            logits = hidden.new_empty(hidden.shape[0], 0, self.head.config.vocab_size, dtype=torch.float32)
        else:
            logits = self.head.logits(select_positions(hidden, logits_at), self.lm_head)
        return CausalLMOutputWithPast(logits=logits, hidden_states=(hidden,))


_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# committed tokens per row whose features may wait for the next feed (plain steps); more are fed at once
BACKLOG_LIMIT = 64


class EagleProposer(DraftModelProposer):
    needs_prompt_features = True

    def __init__(self, config: SpeculativeConfig, target: nn.Module, sampling: DraftSampling) -> None:
        super().__init__(config, target, sampling)
        self.target_feature_layers = self._target_features(config, target)
        self.cache.feature_layers = (-1,)  # the head's outputs: the features its drafted tokens are fed with

    def _target_features(self, config: SpeculativeConfig, target: nn.Module) -> tuple[int, ...]:
        """Entries of the target's `hidden_states` the drafter reads (-1: the final one)."""
        return config.heads.target_feature_layers(target)

    def _drafter(self, config: SpeculativeConfig, target: nn.Module) -> nn.Module:
        config.heads.check_target(target)
        # one drafter per (head, target), so a compiled forward of it is reused by later calls
        per_target = _DRAFTERS.setdefault(config.heads, weakref.WeakKeyDictionary())
        drafter = per_target.get(target)
        if drafter is None:
            drafter = per_target[target] = EagleDrafter(config.heads, target)
        else:  # the head's token map as it is now
            drafter.lm_head = config.heads.draft_lm_head(target.get_output_embeddings())
        return drafter

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        """Prompt token p is to be fed with the target's feature at p - 1 (p >= 1; a row's first real token has no
        feature before it, so it is never fed): in the head's first forward (`_feed_prompt`), so a call whose rows
        all decode plainly never runs the head over its prompt. A call continuing from a filled cache has the
        target's features of the new positions only: the head reads those after its own context over the earlier
        text, when the cache comes from a call with this head (`carry`); else it drafts from the new positions alone
        (a shorter context than the target's; its drafts are verified all the same)."""
        # the prompt's positions from the first one whose target feature the prefill computed
        start = state.prompt_length - state.target_features.shape[1]
        prompt = state.sequences[:, start : state.prompt_length]
        if attention_mask is not None:
            attention_mask = attention_mask[:, start:]
        device = self.draft.device
        self._expect_call(state)
        context = self._carried(state)
        if context is None:
            self.cache.prefill(prompt[:, :0].to(device), None)
        else:  # the head's context over the text before the cache's end, from the call that returned the cache
            self._restore(context)
        self.cached_lengths = state.lengths.clone()
        self.cached_host = list(state.host.lengths)
        # per step skipped since the last feed: [B, T, F] the features of its committed tokens, [B] the rows'
        # lengths after it (on the device), and per row how many of its tokens (the first ones) are the row's (host)
        self._backlog: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []
        self._prompt_feed: tuple | None = None  # the prompt's pairs, until the head's first forward feeds them
        if prompt.shape[1] < 2:
            return
        real = torch.ones_like(prompt[:, 1:], dtype=torch.bool)
        if attention_mask is not None:
            real = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
        order = (~real).long().argsort(dim=1, stable=True)  # each row's real pairs first, in order
        features = state.target_features[:, :-1]
        features = features.gather(1, order[:, :, None].to(features.device).expand(-1, -1, features.shape[2]))
        pairs = real.sum(dim=1).tolist()  # once per call, at the prompt
        self._prompt_feed = (prompt[:, 1:].gather(1, order).to(device), real.gather(1, order).to(device), pairs,
                             features)

    def carry(self, state: DecodeState) -> tuple:
        """The head's keys and values over this call's text, for a call continuing from the output cache. The
        committed tokens that wait for a feed (the last step's, those of steps the head skipped) are fed first, in
        one forward of the head, for the rows that took part in the last step; a row that finished before it lacks
        its last step's tokens (their features are gone). A call in which the head never ran (every step plain)
        carries nothing: the head is not run for a continuation that may never come."""
        if self.cache.lengths is None or self._prompt_feed is not None:
            return ()
        done = [emitted == 0 for emitted in state.host.num_emitted]  # the rows of the last step emitted its tokens
        if any(not row_done and length > seen
               for row_done, length, seen in zip(done, state.host.lengths, self.cached_host)):
            last_step = replace(state, finished=torch.tensor(done, device=state.finished.device),
                                host=replace(state.host, finished=done))
            self._feed_unseen(last_step)
            self._keep_feed(last_step)
        return super().carry(state)

    def _feed_prompt(self) -> None:
        """Feed the prompt's pairs, kept since `start`, to the head (before its first other forward)."""
        if self._prompt_feed is None:
            return
        input_ids, real, pairs, features = self._prompt_feed
        self._prompt_feed = None
        no_logits = input_ids.new_empty(input_ids.shape[0], 0)  # the feed needs none
        self.cache.prefill_chain(input_ids, real, pairs, features=features, from_target=True, logits_at=no_logits)

    role = "the EAGLE head"
    selects_logits = True

    def _max_feed(self) -> int:
        return self.k + 1  # the head keeps no draft: every committed token of a step is fed again

    def _feed_inputs(self, state: DecodeState, width: int) -> dict:
        features = state.target_features
        if self._backlog:  # each row's waiting tokens come first, then the step's own
            pieces = [kept for kept, _, _ in self._backlog] + [features.to(self._backlog[0][0].device)]
            ends = [self.cached_lengths] + [lengths for _, lengths, _ in self._backlog]
            index = backlog_index(pieces, ends, width)
            features = torch.cat(pieces, dim=1).gather(1, index[:, :, None].expand(-1, -1, features.shape[2]))
        features = features[:, :width]
        if features.shape[1] < width:  # fixed shapes: dummies after the real tokens
            features = torch.nn.functional.pad(features, (0, 0, 0, width - features.shape[1]))
        return {"features": features.contiguous(), "from_target": True}

    def _draft_inputs(self, parent_hidden: torch.Tensor | None, depth: int) -> dict:
        # contiguous: a compiled forward is specialised to its inputs' strides as well as their shapes
        return {"features": parent_hidden.contiguous(), "from_target": False}

    def skip(self, state: DecodeState) -> None:
        """Keep the last step's committed tokens' features for the next feed (each row's own number of them: their
        target features are kept for one step only); feed them now past `BACKLOG_LIMIT` waiting tokens in a row, or
        under fixed shapes (a feed of fixed width)."""
        host, waiting = state.host, self._waiting()
        counts = [0 if done else length - seen - wait
                  for length, seen, wait, done in zip(host.lengths, self.cached_host, waiting, host.finished)]
        if not self.fixed_shapes and max(w + c for w, c in zip(waiting, counts)) <= BACKLOG_LIMIT:
            self._backlog.append((state.target_features[:, : max(max(counts), 1)], state.lengths.clone(), counts))
            return
        self._feed_unseen(state)
        self._keep_feed(state)

    def _waiting(self) -> list[int]:
        """Per row: its committed tokens whose features wait in the backlog."""
        rows = len(self.cached_host)
        return [sum(column) for column in zip(*(counts for _, _, counts in self._backlog))] or [0] * rows

    def _feed_unseen(self, state: DecodeState) -> torch.Tensor:
        self._feed_prompt()
        logits = super()._feed_unseen(state)
        self._backlog = []  # fed with the step's own tokens
        return logits

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        """Keep the committed tokens fed this step and no draft: the accepted ones are fed again next step with
        the target's true features."""
        self._keep_feed(state)


def backlog_index(
    # [B, T_i, F] each: the features of the steps whose tokens wait, then the step's own
    pieces: list[torch.Tensor],
    # [B] each, on the device: the rows' lengths before the first of those steps and after each but the last
    ends: list[torch.Tensor],
    width: int,
) -> torch.Tensor:
    """[B, <= width] long: for each row, the columns of the pieces laid end to end that hold its tokens' features, in
    order (then other columns: past its last token a row's features are never read). Step i's first
    `ends[i + 1] - ends[i]` columns are the row's; all of the last piece's follow. Built on the device: no copy from
    the host."""
    device = pieces[0].device
    mine = [torch.arange(piece.shape[1], device=device)[None, :] < (after - before).to(device)[:, None]
            for piece, before, after in zip(pieces, ends, ends[1:])]
    mine.append(torch.ones(pieces[-1].shape[:2], dtype=torch.bool, device=device))
    # a stable sort puts each row's own columns first, in order
    return torch.argsort((~torch.cat(mine, dim=1)).to(torch.uint8), dim=1, stable=True)[:, :width]


def _build(config: SpeculativeConfig, target: nn.Module, sampling: DraftSampling) -> Proposer:
    return EagleProposer(config, target, sampling)


register_proposer("eagle", _build)
