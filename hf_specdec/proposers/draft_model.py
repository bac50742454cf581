"""Draft-model proposer: a small causal LM with the target's tokenizer drafts k tokens on its own KV cache.

The draft runs its own forward passes (no nested `generate()`, which costs about 2 ms a round on CPU) on a
`RaggedKVCache`, so it is batched with ragged acceptance exactly like the target. Each step first feeds the
committed tokens the draft has not seen (one, or two after a fully accepted step), then drafts one token per
forward. After verification it keeps the drafts the target accepted and drops the rest with one rollback.

With `tree_width` w > 1 it drafts a token tree: the w best first tokens (deterministic top-w candidates), each
continued as a chain, one forward per depth for all branches at once; a branch's tokens see only their own branch
(the cache's tree region). After verification the draft keeps the accepted branch's prefix and nothing else.

Vocabularies that differ only by padded rows (32000 vs 32064) work on the shared ids: the draft never proposes an
id the target lacks, and ids the draft lacks get draft probability 0.
"""

from __future__ import annotations

import torch

from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.config import SpeculativeConfig
from hf_specdec.decoding.state import DecodeState, Proposal, TreeProposal
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.tree.template import TreeTemplate
from hf_specdec.tree.tree import TokenTree
from hf_specdec.verify.chain import VerificationResult
from hf_specdec.verify.tree import TreeVerificationResult

# Vocabulary sizes of one tokenizer padded for kernels differ by a few dozen rows (Phi-3: 32064 vs Llama-2: 32000,
# Qwen2.5-7B: 152064 vs 0.5B: 151936); a bigger gap means another tokenizer.
MAX_VOCAB_PADDING = 512
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def vocab_size(model: torch.nn.Module) -> int:
    return int(model.config.get_text_config(decoder=True).vocab_size)


def check_draft_compatible(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Raise ValueError unless the draft can share the target's tokenizer."""
    target_vocab, draft_vocab = vocab_size(target), vocab_size(draft)
    if abs(target_vocab - draft_vocab) > MAX_VOCAB_PADDING:
        raise ValueError(
            f"SpeculativeConfig.draft_model: vocabulary size {draft_vocab} does not match the target's "
            f"{target_vocab}; a draft must use the target's tokenizer (sizes may differ only by up to "
            f"{MAX_VOCAB_PADDING} padded rows)"
        )
    for name in SPECIAL_TOKEN_FIELDS:
        target_id, draft_id = _special_ids(target, name), _special_ids(draft, name)
        if target_id and draft_id and target_id != draft_id:
            raise ValueError(
                f"SpeculativeConfig.draft_model: {name} {sorted(draft_id)} does not match the target's "
                f"{sorted(target_id)}; a draft must use the target's tokenizer"
            )
    if draft.config.is_encoder_decoder:
        raise ValueError("SpeculativeConfig.draft_model: expected a decoder-only causal LM, got an encoder-decoder")


def _special_ids(model: torch.nn.Module, name: str) -> set[int]:
    value = getattr(getattr(model, "generation_config", None), name, None)
    if value is None:
        value = getattr(model.config, name, None)
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> None:
        check_draft_compatible(target, config.draft_model)
        self.draft = config.draft_model
        self.k = config.num_speculative_tokens
        self.tree_width = config.tree_width
        self.sampling = sampling
        self.target_vocab = vocab_size(target)
        self.cache = RaggedKVCache(self.draft)
        self.cached_lengths: torch.Tensor | None = None  # [B]: tokens of each row the draft cache holds
        self._fed: torch.Tensor | None = None  # [B]: committed tokens fed at the start of this step
        self._num_drafted = 0
        self._mark = None
        self._region_start = 0

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        # The last prompt token is left for the first proposal, so every proposal has a token to feed.
        device = self.draft.device
        prompt = state.sequences[:, : state.prompt_length - 1].to(device)
        self.cache.prefill(prompt, None if attention_mask is None else attention_mask[:, :-1].to(device))
        self.cached_lengths = state.lengths - 1

    def propose(self, state: DecodeState) -> Proposal | TreeProposal:
        budget = state.draft_budget().clamp(max=self.k)
        self._num_drafted = int(budget.max())
        logits = self._feed_unseen(state)
        if self.tree_width > 1:
            return self._propose_tree(state, budget, logits)
        tokens, probs = [], []
        ones = torch.ones_like(self._fed, device=self.draft.device)
        for step in range(self._num_drafted):
            if step > 0:
                logits = self.cache.forward(tokens[-1].to(self.draft.device)[:, None], ones)[:, 0]
            token, token_probs = self._draw(logits)
            tokens.append(token)
            probs.append(token_probs)
        if self._num_drafted == 0:
            return Proposal.empty(state.batch_size, state.sequences.device)
        target_device = state.sequences.device
        return Proposal(
            draft_token_ids=torch.stack(tokens, dim=1).to(target_device),
            num_draft_tokens=budget,
            draft_probs=None if probs[0] is None else torch.stack(probs, dim=1).to(target_device),
        )

    def _feed_unseen(self, state: DecodeState) -> torch.Tensor:
        """Feed each row's committed tokens the draft has not seen (at least its last token); returns the draft's
        logits after them [B, V_draft]."""
        fed = torch.where(state.finished, 0, state.lengths - self.cached_lengths)  # >= 1 for unfinished rows
        width = max(1, int(fed.max()))
        column = torch.arange(width, device=fed.device)[None, :]
        index = (self.cached_lengths[:, None] + column).clamp(max=state.sequences.shape[1] - 1)
        unseen = state.sequences.gather(1, index)
        device = self.draft.device
        self._mark, self._fed = self.cache.mark(), fed
        logits = self.cache.forward(unseen.to(device), fed.to(device))
        last = (fed.clamp(min=1) - 1).to(device)[:, None, None].expand(-1, 1, logits.shape[-1])
        return logits.gather(1, last)[:, 0]

    def _propose_tree(self, state: DecodeState, budget: torch.Tensor, logits: torch.Tensor) -> TreeProposal:
        """Top-w first tokens, each continued as a chain: one draft forward per depth for all branches."""
        width, depth, batch = self.tree_width, max(self._num_drafted, 1), state.batch_size
        device = self.draft.device
        scores = self._to_target_vocab(logits.float())
        first = scores.topk(width, dim=-1).indices  # [B, w]
        levels = [first.to(state.sequences.device)]
        level_probs = [None if not self.sampling.do_sample else _one_hot(levels[0], self.target_vocab)]
        self._region_start = self.cache.num_slots
        branch = torch.eye(width, dtype=torch.bool, device=device)
        for d in range(1, depth):
            logits = self.cache.forward_tree(
                levels[-1].to(device),
                positions=self.cache.next_position[:, None].expand(-1, width) + (d - 1),
                real=torch.ones(batch, width, dtype=torch.bool, device=device),
                region_start=self._region_start,
                visible=branch.repeat(1, d).expand(batch, -1, -1),  # a branch sees its own earlier tokens
            )
            tokens, probs = self._draw(logits.reshape(batch * width, -1))
            levels.append(tokens.reshape(batch, width).to(state.sequences.device))
            level_probs.append(None if probs is None else probs.reshape(batch, width, -1).to(state.sequences.device))
        template = TreeTemplate.from_paths([(r,) + (0,) * d for d in range(depth) for r in range(width)])
        node_depths = torch.tensor(template.depths, device=state.sequences.device)
        root = state.last_tokens()[:, None]
        draft_probs = None
        if self.sampling.do_sample:
            root_probs = torch.zeros_like(level_probs[0][:, :1])
            draft_probs = torch.cat([root_probs, *level_probs], dim=1)
        return TreeProposal(TokenTree.from_template(
            template,
            torch.cat([root, *levels], dim=1),
            valid=node_depths[None, :] <= budget[:, None],
            draft_probs=draft_probs,
        ))

    def _draw(
        self,
        # [B, V_draft]
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row on the target's device, and its distribution over the target vocabulary."""
        scores = self._to_target_vocab(logits.float())
        if not self.sampling.do_sample:
            return scores.argmax(dim=-1), None
        flat_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
        probs = torch.softmax(self.sampling.warpers(flat_ids, scores), dim=-1)
        generator = self.sampling.generator
        if generator is not None:
            probs = probs.to(generator.device)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1), probs

    def _to_target_vocab(
        self,
        # [B, V_draft]
        scores: torch.Tensor,
    ) -> torch.Tensor:
        draft_vocab = scores.shape[-1]
        if draft_vocab >= self.target_vocab:
            return scores[:, : self.target_vocab]
        missing = scores.new_full((scores.shape[0], self.target_vocab - draft_vocab), float("-inf"))
        return torch.cat([scores, missing], dim=-1)

    def commit(self, state: DecodeState, result: VerificationResult | TreeVerificationResult) -> None:
        kept_drafts = result.num_accepted.clamp(max=max(self._num_drafted - 1, 0))
        kept = torch.where(state.finished, 0, self._fed + kept_drafts)
        device = self.draft.device
        if isinstance(result, TreeVerificationResult):
            self.cache.keep(self._mark, self._kept_tree_slots(result, kept_drafts, state.finished).to(device))
        else:
            self.cache.rollback(self._mark, kept.to(device))
        self.cached_lengths = self.cached_lengths + kept

    def _kept_tree_slots(
        self,
        result: TreeVerificationResult,
        # [B]: accepted tokens whose draft KV exists (the deepest level is drafted but never fed)
        kept_drafts: torch.Tensor,
        # [B] bool
        finished: torch.Tensor,
    ) -> torch.Tensor:
        """[B, slots since the mark] bool: the fed tokens, then the accepted branch's slots up to kept_drafts."""
        appended = self.cache.num_slots - self._mark.num_slots
        fed_slots = self._region_start - self._mark.num_slots
        column = torch.arange(appended, device=kept_drafts.device)[None, :]
        kept = column < self._fed[:, None]
        first_node = result.path_nodes[:, min(1, result.path_nodes.shape[1] - 1)]  # depth-1 node of the path
        branch = (first_node - 1).clamp(min=0) % self.tree_width  # [B]
        region = column - fed_slots  # slot (d - 1) * w + r holds depth d of branch r
        on_branch = (region >= 0) & (region % self.tree_width == branch[:, None])
        kept |= on_branch & (region // self.tree_width < kept_drafts[:, None])
        return kept & ~finished[:, None]


def _one_hot(
    # [B, w]
    tokens: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    return torch.zeros(*tokens.shape, vocab, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    return DraftModelProposer(config, target, sampling)


register_proposer("draft", _build)
