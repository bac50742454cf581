"""Drafts from a model with another tokenizer (`SpeculativeConfig(method="draft", draft_model=m,
draft_tokenizer=t, tokenizer=target_tokenizer)`): any small causal LM can draft, batched, and output stays exact.

The draft reads the text the target wrote, re-tokenised with its own tokenizer: each step the target tokens
committed since the last step are decoded to text (over a look-behind window, so a character split across tokens
is decoded whole; text ending in an incomplete character waits for the next step) and encoded with the draft's
tokenizer after the last characters the draft already read (the tokens of that tail are dropped), so word
boundaries are tokenised as the draft tokenizer tokenises running text. The draft keeps these committed tokens in
a ragged KV cache (`RaggedKVCache`, one row per batch row, each at its own length) and drafts k tokens a step
from them; it keeps no drafted token: the accepted ones come back as committed text next step.

How drafts become target tokens depends on the decoding mode, and that decides what is exact:

* greedy (universal assisted generation, as transformers' `AssistedCandidateGeneratorDifferentTokenizers`): the
  draft's k tokens are decoded to text and that text encoded with the target's tokenizer after the committed
  text's last tokens; the first k target tokens are the chain. The target's argmax decides every token, so the
  output is exactly plain greedy `generate`'s; re-tokenising only changes how many tokens are accepted. It reads
  the draft's tokens on the host: one more host sync per step.
* sampling (token-level intersection, arXiv 2502.05202, as transformers' `UniversalSpeculativeDecodingGenerator`):
  the draft's distribution is restricted to the tokens both vocabularies hold (same string, the byte-level space
  sign `Ġ` and SentencePiece's `▁` taken as one) and carried onto the target's ids, so each draft token is one
  target token drawn from a known distribution q, and standard rejection sampling keeps the target's law exactly.
  Tokens outside the intersection can still be emitted (from the target's residual or bonus distribution), only
  never drafted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.cache.reach import DrafterReach
from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer
from hf_specdec.proposers.draft_model import select_positions
from hf_specdec.proposers.host_text import HostText
from hf_specdec.proposers.int8_drafter import int8_view
from hf_specdec.sampling import draft_distribution, sample
from hf_specdec.step import DecodeState, Proposal, VerificationResult

# target tokens decoded before the new ones, so a character split across tokens decodes whole
LOOKBEHIND_TOKENS = 10
# characters of already-read text encoded before new text, so its first word is tokenised as in running text
TAIL_CHARACTERS = 16
SPACE_SIGNS = ("\u2581", "\u0120")  # SentencePiece's "▁", byte-level BPE's "Ġ"
REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 character gives


def _normalized(token: str) -> str:
    return token.replace(SPACE_SIGNS[0], SPACE_SIGNS[1])


@dataclass(frozen=True)
class VocabularyMap:
    """Tokens both tokenizers hold, matched by string (special tokens left out)."""

    # [S] long: the shared tokens' ids in each vocabulary, pairwise
    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    # [V_target] long: the draft id of each shared target token, -1 elsewhere
    target_to_draft: torch.Tensor

    @classmethod
    def build(cls, draft_tokenizer, target_tokenizer, target_vocab: int, draft_vocab: int) -> VocabularyMap:
        def strings(tokenizer, size: int) -> dict[str, int]:
            special = set(tokenizer.all_special_ids)
            return {_normalized(token): index for token, index in tokenizer.get_vocab().items()
                    if index not in special and index < size}

        draft, target = strings(draft_tokenizer, draft_vocab), strings(target_tokenizer, target_vocab)
        shared = sorted(set(draft) & set(target))
        if not shared:
            raise ValueError(
                f"SpeculativeConfig.draft_tokenizer: no token string is in both vocabularies ({len(draft)} draft "
                f"tokens, {len(target)} target tokens); sampling drafts only shared tokens, so this draft cannot "
                "draft for this target; use a draft whose tokenizer shares tokens with the target's"
            )
        draft_ids = torch.tensor([draft[s] for s in shared], dtype=torch.long)
        target_ids = torch.tensor([target[s] for s in shared], dtype=torch.long)
        target_to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
        target_to_draft[target_ids] = draft_ids
        return cls(draft_ids, target_ids, target_to_draft)

    def to(self, device: torch.device) -> VocabularyMap:
        return VocabularyMap(self.draft_ids.to(device), self.target_ids.to(device), self.target_to_draft.to(device))


def same_vocabulary(draft_tokenizer, target_tokenizer) -> bool:
    return draft_tokenizer.get_vocab() == target_tokenizer.get_vocab()


def continuation_ids(tokenizer, tail: str, text: str) -> list[int]:
    """`text` tokenised as it continues `tail` (the tokens of `tail` dropped); without a clean split (a token
    across the boundary), `text` on its own."""
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    ids = tokenizer.encode(tail + text, add_special_tokens=False)
    if ids[: len(tail_ids)] == tail_ids:
        return ids[len(tail_ids):]
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class RowText:
    """One row's text as the draft reads it (host); the row's target tokens are in the proposer's `HostText`."""

    read: int  # target tokens already turned into draft tokens
    tail: str  # the last characters of the text the draft read
    draft: list[int]  # the draft's tokens of that text
    cached: int  # draft tokens in the draft's cache (all but the last, which each step feeds again)


class CrossTokenizerProposer(Proposer):
    """See the module docstring."""

    reads_emitted_tokens = True
    role = "the draft model"
    static_shapes_refusal = (
        "a draft with another tokenizer re-tokenises text on the host each step, so its widths are not fixed: static "
        "caches and compiled forwards are not supported with draft_tokenizer; drop cache_implementation / "
        "compile_config"
    )

    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> None:
        from hf_specdec.proposers.draft_model import vocab_size

        if config.tree_width > 1 or config.tree_total_tokens is not None:
            raise ValueError(
                "SpeculativeConfig.tree_width: a draft with another tokenizer proposes chains only; drop "
                "tree_width / tree_total_tokens"
            )
        self.draft = config.draft_model
        if config.draft_quantization == "int8":
            self.draft = int8_view(self.draft, "the draft model")
        self.draft_tokenizer, self.tokenizer = config.draft_tokenizer, config.tokenizer
        self.k = config.num_speculative_tokens
        self.sampling = sampling
        self.target_vocab = vocab_size(target)
        self.vocab = VocabularyMap.build(self.draft_tokenizer, self.tokenizer, self.target_vocab,
                                         vocab_size(self.draft)).to(self.draft.device)
        self.draft_vocab = len(self.draft_tokenizer)
        self.cache = RaggedKVCache(self.draft)
        self.cache.reach = DrafterReach.of(self.draft, self.draft_vocab)
        # whether this call has nothing more to say of the draft's table of learned positions: it has none, or a
        # warning already said that the draft's text passed it
        self._positions_told = True
        self.text: HostText | None = None  # the target's tokens of every row
        self.rows: list[RowText] = []
        self._fed_host: list[int] = []  # draft tokens each row fed at the start of this step

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        self.text = HostText(state, attention_mask)  # the prompt without its padding, left or right
        self.rows = []
        self._positions_told = self.cache.reach.last_position is None
        for b in range(state.batch_size):
            ids = self.text.row(b).tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            draft = self.draft_tokenizer.encode(text, add_special_tokens=True) or self._fallback_ids()
            self.rows.append(RowText(read=len(ids), tail=text[-TAIL_CHARACTERS:], draft=draft,
                                     cached=len(draft) - 1))
        width = max(row.cached for row in self.rows)
        device = self.draft.device
        ids = torch.zeros(state.batch_size, width, dtype=torch.long)
        mask = torch.zeros(state.batch_size, width, dtype=torch.long)
        for b, row in enumerate(self.rows):  # left padded
            if row.cached:
                ids[b, width - row.cached:] = torch.tensor(row.draft[: row.cached])
                mask[b, width - row.cached:] = 1
        self.cache.prefill(ids.to(device), mask.to(device) if not bool(mask.all()) else None)

    def _fallback_ids(self) -> list[int]:
        """A row whose prompt is empty text for the draft starts from its BOS (or EOS) token."""
        token = self.draft_tokenizer.bos_token_id
        if token is None:
            token = self.draft_tokenizer.eos_token_id
        return [0 if token is None else int(token)]

    def _catch_up(self, state: DecodeState) -> None:
        """Turn the target tokens emitted since the last proposal into draft tokens (host)."""
        added_tokens = self.text.catch_up(state)
        for b, row in enumerate(self.rows):
            if state.host.finished[b] or not added_tokens[b].size:
                continue
            target = self.text.row(b)
            start = max(0, row.read - LOOKBEHIND_TOKENS)
            before = self.tokenizer.decode(target[start: row.read].tolist(), skip_special_tokens=True)
            text = self.tokenizer.decode(target[start:].tolist(), skip_special_tokens=True)
            if text.endswith(REPLACEMENT) or not text.startswith(before):
                continue  # an incomplete character: wait for the tokens that complete it
            added = text[len(before):]
            row.read = len(target)
            if added:
                row.draft.extend(continuation_ids(self.draft_tokenizer, row.tail, added))
                row.tail = (row.tail + added)[-TAIL_CHARACTERS:]

    def finish(self, state: DecodeState | None) -> None:
        self.cache.release()  # the call is over: the draft's buffers go (`RaggedKVCache.release`)

    def skip(self, state: DecodeState) -> None:
        """Read the last step's text (the draft's cache takes it at the next proposal)."""
        self._catch_up(state)

    def propose(self, state: DecodeState) -> Proposal:
        self._catch_up(state)
        budget_host = [min(b, self.k) for b in state.host_draft_budget()]  # 0 for finished rows
        num_drafted = max(budget_host)
        if not self._positions_told:  # the last position fed: the one before the last draft's
            longest = max(len(row.draft) for row in self.rows) + num_drafted - 1
            self._positions_told = self.cache.reach.warn_past_positions(
                longest - 1, f"{longest} tokens of the draft's tokenizer")
        logits, fed = self._feed(state)
        fed = fed[:, None]  # [B, 1]
        tokens, feeds, probs = [], [], []
        for step in range(num_drafted):
            if step > 0:
                logits = self.cache.forward(feeds[-1][:, None], fed + step - 1)[:, 0]
            token, feed, token_probs = self._draw(logits)
            tokens.append(token)
            feeds.append(feed)
            probs.append(token_probs)
        target_device = state.sequences.device
        drafts = torch.stack(tokens, dim=1)
        if self.sampling.do_sample:
            return Proposal.chain(state.last_tokens(), drafts.to(target_device), state.draft_budget().clamp(max=self.k),
                                  torch.stack(probs, dim=1).to(target_device))
        drafts, counts = self._retokenize(torch.stack(feeds, dim=1), budget_host)
        # re-tokenised on the host, so each row's draft depth is a host fact (the text may give fewer than k tokens)
        return Proposal.chain(state.last_tokens(), drafts.to(target_device),
                              torch.tensor(counts, device=target_device)).with_host_depths(counts)

    def _feed(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row's draft tokens not in the cache (at least its last one); the draft's logits after them
        [B, V_draft], and [B] how many each row fed, on the draft's device."""
        finished = state.host.finished
        self._fed_host = [0 if done else len(row.draft) - row.cached for row, done in zip(self.rows, finished)]
        width = max(1, max(self._fed_host, default=0))
        ids = torch.zeros(len(self.rows), width, dtype=torch.long)
        for b, row in enumerate(self.rows):
            if self._fed_host[b]:
                ids[b, : self._fed_host[b]] = torch.tensor(row.draft[row.cached:])
        device = self.draft.device
        fed = torch.tensor(self._fed_host).to(device)
        column = torch.arange(width, device=device)[None, :]
        dense = all(n == width for n in self._fed_host)
        real = None if dense else column < fed[:, None]
        logits = self.cache.forward(ids.to(device), column.expand(len(self.rows), -1), real)
        return select_positions(logits, (fed.clamp(min=1) - 1)[:, None])[:, 0], fed

    def _draw(
        self,
        # [B, V_draft]
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One draft token per row: (the proposed token, the draft id fed next, its distribution over the target's
        vocabulary). Greedy: the draft's own argmax (its target tokens come from re-tokenising); sampling: drawn
        from the draft's distribution on the shared tokens, carried to the target's ids."""
        if not self.sampling.do_sample:
            token = logits[:, : self.draft_vocab].argmax(dim=-1)  # ids the draft's tokenizer can decode
            return token, token, None
        scores = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"), dtype=torch.float32)
        scores[:, self.vocab.target_ids] = logits[:, self.vocab.draft_ids].float()
        probs = draft_distribution(scores, self.sampling.warpers, self.sampling.generator)
        token = sample(probs, self.sampling.generator).to(logits.device)
        return token, self.vocab.target_to_draft[token], probs

    def _retokenize(
        self,
        # [B, n] draft ids
        drafted: torch.Tensor,
        # each row's draft budget (0 for finished rows)
        budget: list[int],
    ) -> tuple[torch.Tensor, list[int]]:
        """The drafted text as target tokens after each row's committed ones, at most its budget: ([B, k] padded,
        each row's count on the host)."""
        drafted_host = drafted.tolist()  # re-tokenising needs the draft's tokens on the host: one read
        drafts = torch.zeros(len(self.rows), self.k, dtype=torch.long)
        counts = [0] * len(self.rows)
        for b in range(len(self.rows)):
            if budget[b] == 0:
                continue
            text = self.draft_tokenizer.decode(drafted_host[b], skip_special_tokens=True).rstrip(REPLACEMENT)
            tail = self.tokenizer.decode(self.text.row(b)[-LOOKBEHIND_TOKENS:].tolist(), skip_special_tokens=True)
            ids = [t for t in continuation_ids(self.tokenizer, tail, text) if t < self.target_vocab][: budget[b]]
            drafts[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            counts[b] = len(ids)
        return drafts, counts

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        """Keep the fed tokens but the last (fed again next step, so every step has one to feed); no draft."""
        kept_host = [0 if done else max(n - 1, 0) for n, done in zip(self._fed_host, state.host.finished)]
        self.cache.commit(torch.tensor(kept_host, device=self.draft.device), kept_on_host=kept_host)
        for row, kept in zip(self.rows, kept_host):
            row.cached += kept
