"""Draft-model proposer: a small causal LM with the target's tokenizer drafts k tokens on its own KV cache.

The draft runs its own forward passes (no nested `generate()`, which costs about 2 ms a round on CPU) on a
`RaggedKVCache`, so it is batched with ragged acceptance exactly like the target. Each step first feeds the
committed tokens the draft has not seen (one, or two after a fully accepted step), then drafts one token per
forward, all into one region of its cache. After verification the cache keeps the fed tokens and the drafts the
target accepted, moved after each row's tokens in one commit, and drops the rest. Under static shapes (see
`hf_specdec.compile`) every step drafts k tokens and feeds a fixed width, so its forwards compile once per shape.

With `tree_width` w > 1 it drafts a token tree: the w best first tokens (deterministic top-w candidates), each
continued as a chain, one forward per depth for all branches at once; a branch's tokens see only their own branch
(the cache's tree region). With `tree_total_tokens` it builds a dynamic tree instead (EAGLE-2, Li et al. 2024):
at each depth the w frontier nodes with the best cumulative log-probability are fed and each offers its top-w
children; at the end the best `tree_total_tokens` nodes by cumulative log-probability form the tree (closed under
ancestry, since a child never scores above its parent); a step the adaptive schedule narrows to d < k levels keeps
ceil(tree_total_tokens * d / k) of them. Either way, after verification the draft keeps the KV
of the accepted path's nodes that it fed, and nothing else.

Vocabularies that differ only by padded rows (32000 vs 32064) work on the shared ids: the draft never proposes an
id the target lacks, and ids the draft lacks get draft probability 0.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from dataclasses import dataclass

import torch

from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.cache.reach import DrafterReach, embedding_rows
from hf_specdec.compile import CompileSettings, check_compilable, compiled_forward
from hf_specdec.config import SpeculativeConfig
from hf_specdec.heads.token_map import TokenMapLMHead, token_map_lm_head
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.confidence import ConfidenceCut, peak_probability
from hf_specdec.proposers.int8_drafter import COMPILE_REFUSAL, int8_view
from hf_specdec.sampling import draw_draft, fit_vocab, warp
from hf_specdec.step import DecodeState, Proposal, VerificationResult
from hf_specdec.tree.dynamic import Candidates, kept_nodes, settles_on
from hf_specdec.tree.template import branch_template
from hf_specdec.tree.tree import template_tensors

# Vocabulary sizes of one tokenizer padded for kernels differ by a few dozen rows (Phi-3: 32064 vs Llama-2: 32000,
# Qwen2.5-7B: 152064 vs 0.5B: 151936); a bigger gap means another tokenizer.
MAX_VOCAB_PADDING = 512
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def vocab_size(model: torch.nn.Module) -> int:
    return int(model.config.get_text_config(decoder=True).vocab_size)


def parallel_mask_token(config: SpeculativeConfig, draft: torch.nn.Module) -> int:
    """The mask token id a parallel draft fills: `config.pard_token`, else the draft config's `pard_token` (PARD
    checkpoints) or `mask_token_id`; it must be one of the draft's ids."""
    draft_config = draft.config.get_text_config(decoder=True)
    token = config.pard_token
    for name in ("pard_token", "mask_token_id"):
        if token is None:
            token = getattr(draft_config, name, None)
    if token is None:
        raise ValueError(
            "SpeculativeConfig.parallel_drafting: the draft model's config names no mask token (PARD checkpoints "
            "give it as `pard_token`); pass SpeculativeConfig(pard_token=<the id its training filled>), or use a "
            "draft trained for parallel drafting")
    rows = embedding_rows(draft)
    if not isinstance(token, int) or token < 0 or (rows is not None and token >= rows):
        raise ValueError(f"SpeculativeConfig.parallel_drafting: mask token {token!r} is not one of the draft model's "
                         f"{rows} token ids")
    return token


def check_draft_compatible(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Raise ValueError unless the draft can share the target's tokenizer."""
    target_vocab, draft_vocab = vocab_size(target), vocab_size(draft)
    if abs(target_vocab - draft_vocab) > MAX_VOCAB_PADDING:
        raise ValueError(
            f"SpeculativeConfig.draft_model: vocabulary size {draft_vocab} does not match the target's "
            f"{target_vocab}; a draft with another tokenizer needs both tokenizers: "
            "SpeculativeConfig(method='draft', draft_model=..., draft_tokenizer=<the draft's tokenizer>, "
            "tokenizer=<the target's tokenizer>)"
        )
    for name in SPECIAL_TOKEN_FIELDS:
        target_id, draft_id = _special_ids(target, name), _special_ids(draft, name)
        if target_id and draft_id and target_id != draft_id:
            raise ValueError(
                f"SpeculativeConfig.draft_model: {name} {sorted(draft_id)} does not match the target's "
                f"{sorted(target_id)}; a draft with another tokenizer needs both tokenizers: "
                "SpeculativeConfig(method='draft', draft_model=..., draft_tokenizer=..., tokenizer=...)"
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


# per draft model: (the sliced lm_head, the draft projecting with it), so later calls reuse it and its compiled
# forward
_MAPPED_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAPPED_DRAFTS_LOCK = threading.Lock()


def mapped_draft(
    draft: torch.nn.Module,
    # [D] token ids, ascending
    token_map: torch.Tensor,
    target_vocab: int,
) -> torch.nn.Module:
    """The draft projecting onto its lm_head's rows at `token_map` only (logits -inf elsewhere): a shallow copy that
    shares every module with `draft` but its output embeddings; the user's draft model is not changed."""
    lm_head = draft.get_output_embeddings()
    if isinstance(lm_head, TokenMapLMHead):
        raise ValueError(f"SpeculativeConfig.draft_token_map: this draft already drafts over a token map of its own "
                         f"({len(lm_head.ids)} ids, saved with it); leave draft_token_map None")
    rows = None if lm_head is None else lm_head.weight.shape[0]
    if rows is None or int(token_map[-1]) >= min(rows, target_vocab):
        raise ValueError(
            f"SpeculativeConfig.draft_token_map: ids up to {int(token_map[-1])}, but the draft's lm_head has "
            f"{rows} rows and the target's vocabulary {target_vocab} ids; give ids both have"
        )
    sliced = token_map_lm_head(lm_head, token_map)
    with _MAPPED_DRAFTS_LOCK:
        kept = _MAPPED_DRAFTS.get(draft)
        if kept is not None and kept[0] is sliced:
            return kept[1]
        view = copy.copy(draft)
        view._modules = dict(draft._modules)  # its own module table: every module but the lm_head stays shared
        view.set_output_embeddings(sliced)
        if view.get_output_embeddings() is not sliced or draft.get_output_embeddings() is not lm_head:
            raise ValueError(f"SpeculativeConfig.draft_token_map: {type(draft).__name__} keeps its lm_head where a "
                             "token map cannot replace it; leave draft_token_map None for this draft")
        _MAPPED_DRAFTS[draft] = (sliced, view)
        return view


@dataclass(frozen=True)
class DrafterContext:
    """A drafter's keys and values over a call's text, carried with the cache that call returned
    (`hf_specdec.cache.carried`): a call continuing from that cache starts from them instead of encoding the text
    again (a draft model), or at all (an EAGLE head: a filled target cache keeps no features to rebuild them from)."""

    drafter: weakref.ref  # the drafter module that computed it
    # per layer of the drafter ([B, H, L, D] keys, values): its cache's `layers_by_order(L)`
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    lengths: torch.Tensor  # [B] long: slots of each row
    lengths_on_host: list[int]
    next_position: torch.Tensor  # [B] long: each row's next position id
    valid: torch.Tensor  # [B, L] bool: slots holding a real token (False at the prompt's padding)
    seen: list[int]  # per row: the text's tokens (its first columns, padding included) the drafter had seen


class DraftModelProposer(Proposer):
    """Drafts with a causal LM on its own ragged KV cache. Subclasses drafting with another model (EAGLE heads)
    override `_drafter` and give each forward extra inputs through `_feed_inputs` / `_draft_inputs`.

    Each step writes one region of the draft cache: the unseen committed tokens (the feed, `_feed_width` slots),
    then the drafted nodes it feeds; `_node_slots` names the region slot (after the feed) of every fed node."""

    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> None:
        self.draft = self._drafter(config, target)
        if config.draft_quantization == "int8":
            self.draft = int8_view(self.draft, self.role)
            self.compile_refusal = COMPILE_REFUSAL
        self.k = config.num_speculative_tokens
        self.tree_width = config.tree_width
        self.total_tokens = config.tree_total_tokens
        self.sampling = sampling
        # the running confidence below which a row's chain stops (`hf_specdec.proposers.confidence`; chains only:
        # the config refuses it with trees), or None
        self.confidence = config.draft_confidence
        self.target_vocab = vocab_size(target)
        # [D] long: the ids a greedy dynamic tree scores, when the drafter projects onto a token map (its logits
        # elsewhere are -inf; ranking the map's alone is the same and costs D / V); None: the whole vocabulary
        lm_head = self.draft.get_output_embeddings()
        self._tree_ids = lm_head.ids if isinstance(lm_head, TokenMapLMHead) and not sampling.do_sample else None
        self.cache = RaggedKVCache(self.draft)
        self.cache.reach = DrafterReach.of(self.draft, self.target_vocab)
        self.cached_lengths: torch.Tensor | None = None  # [B]: tokens of each row the draft has seen
        self.cached_host: list[int] = []  # the same on the host
        self._fed: torch.Tensor | None = None  # [B]: committed tokens fed at the start of this step
        self._fed_host: list[int] = []
        self._feed_width = 0
        self._drafted_depth = 0  # positions (chains) or levels (trees) drafted this step: what `commit` can keep
        self._node_slots: torch.Tensor | None = None  # [B, N]: region slot (after the feed) of each node, or -1
        self._root_hidden: torch.Tensor | None = None  # [B, F]: the drafter's output after the fed tokens, if kept
        # a parallel draft's mask token id (`SpeculativeConfig.parallel_drafting`), else None
        self.mask_token = parallel_mask_token(config, self.draft) if config.parallel_drafting else None
        if self.mask_token is not None:
            self.static_shapes_refusal = (
                "SpeculativeConfig.parallel_drafting: a parallel draft's feed is as wide as each row's unseen tokens "
                "and mask tokens, which static shapes (a static cache or compile_config) cannot take; drop one of them")

    def _drafter(self, config: SpeculativeConfig, target: torch.nn.Module) -> torch.nn.Module:
        check_draft_compatible(target, config.draft_model)
        if config.draft_token_map is None:
            return config.draft_model
        return mapped_draft(config.draft_model, config.draft_token_map, vocab_size(target))

    # how the drafter is named in errors
    role = "the draft model"
    # whether the drafter takes `logits_at` (the positions whose logits it computes); else it computes every one's
    selects_logits = False

    def _max_feed(self) -> int:
        """Committed tokens a step can feed: after a chain or fixed branches the draft has seen all but the last one
        or two; after a dynamic tree, whose unfed nodes may be accepted, up to k + 1."""
        return self.k + 1 if self.total_tokens is not None else 2

    def fix_shapes(self, max_length: int, compile_settings: CompileSettings | None) -> None:
        super().fix_shapes(max_length, compile_settings)
        if self.confidence is not None:
            raise ValueError(
                f"SpeculativeConfig.draft_confidence={self.confidence!r}: stops each row's chain where the drafter is "
                "unsure, a width that changes from step to step, and static shapes (a static cache or compile_config) "
                "verify a fixed width; drop draft_confidence, or the static cache"
            )
        if compile_settings is not None:
            check_compilable(self.draft, self.role)
        model_call = None if compile_settings is None else compiled_forward(self.draft, compile_settings)
        self.cache.make_static(max_length, self._region(), model_call)

    def _expect_call(self, state: DecodeState) -> None:
        """Tell the draft cache the most slots a row can need this call (its sequence capacity, then one step's
        region), so its first allocation is no larger."""
        self.cache.expected_slots = state.sequences.shape[1] + self._region()

    def _region(self) -> int:
        """Draft cache slots a step writes at most: the feed, then the drafted nodes it feeds, k - 1 per branch
        (one per level for a dynamic tree's frontier)."""
        return self._max_feed() + (self.k - 1) * self.tree_width

    def _feed_inputs(self, state: DecodeState, width: int) -> dict:
        """Extra inputs of the forward that feeds each row's unseen committed tokens (`width` per row)."""
        return {}

    def _draft_inputs(
        self,
        # [B, W, F]: the drafter's output at each new token's parent (None when the drafter keeps none)
        parent_hidden: torch.Tensor | None,
        # the draft depth of the fed tokens (1 for the first drafted token)
        depth: int,
    ) -> dict:
        """Extra inputs of a drafting forward."""
        return {}

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        """Encode the prompt but its last token, which is left for the first proposal (every proposal has a token to
        feed); after the drafter's context carried with a filled cache (`carry`), only the columns it had not seen."""
        device = self.draft.device
        self._expect_call(state)
        context = self._carried(state)
        if context is None:
            self._prefill(state, None if attention_mask is None else attention_mask[:, :-1].to(device))
        else:
            self._restore(context)
            self._prefill_unseen(state, attention_mask, context.seen)
        self.cached_lengths = state.lengths - 1
        self.cached_host = [length - 1 for length in state.host.lengths]

    def carry(self, state: DecodeState) -> tuple:
        """The drafter's keys and values over this call's text (`DrafterContext`), for a call continuing from the
        output cache."""
        cache = self.cache
        if cache.lengths is None:
            return ()
        lengths = cache.host_lengths if cache.host_lengths is not None else cache.lengths.tolist()
        width = max(lengths, default=0)
        layers = cache.layers_by_order(width)
        if not layers:  # the drafter never ran
            return ()
        return (DrafterContext(weakref.ref(self.draft), layers, cache.lengths.clone(), list(lengths),
                               cache.next_position.clone(), cache.valid[:, :width].clone(), list(self.cached_host)),)

    def _carried(self, state: DecodeState) -> DrafterContext | None:
        """This drafter's context carried with the prompt's cache, if any."""
        return next((kept for kept in state.carried if isinstance(kept, DrafterContext)
                     and kept.drafter() is self.draft and kept.lengths.shape[0] == state.batch_size), None)

    def _restore(self, context: DrafterContext) -> None:
        self.cache.prefill_from(context.layers, context.lengths, context.lengths_on_host, context.next_position,
                                context.valid)

    def _prefill_unseen(
        self,
        state: DecodeState,
        # [B, P] or None
        attention_mask: torch.Tensor | None,
        # per row: the columns the carried context covers
        seen: list[int],
    ) -> None:
        """Encode each row's prompt columns from `seen` on but the last, after the restored context: its real tokens
        as one chain (its padding is not encoded)."""
        end = state.prompt_length - 1
        width = end - min(seen)
        if width <= 0:
            return
        device = self.draft.device
        here = state.sequences.device
        columns = torch.tensor(seen, device=here)[:, None] + torch.arange(width, device=here)[None, :]
        inside = columns < end
        columns = columns.clamp(max=end - 1)
        real = inside
        if attention_mask is not None:
            real = inside & attention_mask.to(here).gather(1, columns).bool()
        order = (~real).long().argsort(dim=1, stable=True)  # each row's real tokens first, in order
        last_only = {"logits_to_keep": 1} if getattr(self.draft, "_supports_logits_to_keep", lambda: False)() else {}
        self.cache.prefill_chain(state.sequences.gather(1, columns).gather(1, order).to(device),
                                 real.gather(1, order).to(device), real.sum(dim=1).tolist(), **last_only)

    def _prefill(
        self,
        state: DecodeState,
        # [B, P - 1] or None
        attention_mask: torch.Tensor | None,
    ) -> None:
        """Encode every prompt token but the last in the draft cache."""
        # the last position fed is the one before the call's last
        self.cache.reach.warn_past_positions(state.max_length - 2, f"{state.max_length} (prompt and max_new_tokens)",
                                             stacklevel=2)
        self.cache.prefill(state.sequences[:, : state.prompt_length - 1].to(self.draft.device), attention_mask)

    def propose(self, state: DecodeState) -> Proposal:
        budget = state.draft_budget().clamp(max=self.k)
        budget_host = [min(b, self.k) for b in state.host_draft_budget()]
        depth = state.step_width(self.k) if self.fixed_shapes else max(budget_host)  # the step's draft depth
        if self.mask_token is not None:
            return self._propose_parallel(state, depth, budget, budget_host)
        logits = self._feed_unseen(state)
        if self.total_tokens is not None:
            return self._propose_dynamic_tree(state, depth, budget, logits)
        if self.tree_width > 1:
            return self._propose_tree(state, depth, budget, logits)
        return self._propose_chain(state, depth, budget, budget_host, logits)

    def finish(self, state: DecodeState | None) -> None:
        self.cache.release()  # the call is over: the draft's buffers go (`RaggedKVCache.release`)

    def skip(self, state: DecodeState) -> None:
        """Under fixed shapes the feed has a fixed width, so the unseen tokens are fed now; else at the next
        proposal, in one forward."""
        if self.fixed_shapes:
            self._feed_unseen(state)
            self._keep_feed(state)

    def _keep_feed(self, state: DecodeState) -> None:
        """End the step keeping the committed tokens fed at its start (a row's that finished this step too: they
        are its text, which the context carried with the output cache holds), and no draft."""
        self.cache.commit(self._fed.to(self.draft.device), kept_on_host=self._fed_host)
        self.cached_lengths = self.cached_lengths + self._fed
        self.cached_host = [n + k for n, k in zip(self.cached_host, self._fed_host)]

    def _propose_chain(
        self,
        state: DecodeState,
        depth: int,
        # [B]
        budget: torch.Tensor,
        budget_host: list[int],
        # [B, V_draft]: the draft's logits after the fed tokens
        logits: torch.Tensor,
    ) -> Proposal:
        """`depth` drafts, one forward each after the first; draft d (d < depth) is fed at region slot d - 1. With a
        confidence floor a row stops at its first position whose running confidence falls below the floor, and drafting
        stops when no row goes on (`ConfidenceCut`)."""
        cut = None if self.confidence is None else ConfidenceCut(float(self.confidence), budget_host)
        tokens, probs = [], []
        device = self.draft.device
        hidden = self._root_hidden
        fed = self._fed.to(device)[:, None]  # [B, 1]
        computed = 0  # positions whose distribution the drafter computed
        for step in range(depth):
            if step > 0:
                if cut is not None and not cut.may_draft(step):
                    break
                parent = None if hidden is None else hidden[:, None]
                logits = self.cache.forward(tokens[-1].to(device)[:, None], fed + step - 1,
                                            **self._draft_inputs(parent, step))[:, 0]
                hidden = None if self.cache.hidden_states is None else self.cache.hidden_states[:, 0]
            token, token_probs = self._draw(logits)
            computed += 1
            if cut is not None:
                peaks = peak_probability(logits if token_probs is None else token_probs, token_probs is not None)
                cut.observe(step, peaks.tolist())  # one read per drafted position
                if cut.depth <= step:  # no row drafts this position
                    break
            tokens.append(token)
            probs.append(token_probs)
        self._drafted_depth = len(tokens)
        target_device = state.sequences.device
        self._node_slots = _chain_slots(self._drafted_depth, target_device).expand(state.batch_size, -1)
        counts = budget_host
        if cut is not None:
            counts = cut.kept
            if not tokens:
                return Proposal.no_draft(state).with_host_depths(counts, computed)
            budget = torch.minimum(budget, torch.tensor(counts, device=budget.device))
        drafts = torch.stack(tokens, dim=1)
        draft_probs = None if probs[0] is None else torch.stack(probs, dim=1).to(target_device)
        proposal = Proposal.chain(state.last_tokens(), drafts.to(target_device), budget, draft_probs,
                                  dense=all(count == self._drafted_depth for count in counts))
        return proposal if cut is None else proposal.with_host_depths(counts, computed)

    def _propose_parallel(
        self,
        state: DecodeState,
        depth: int,
        # [B]
        budget: torch.Tensor,
        budget_host: list[int],
    ) -> Proposal:
        """A parallel draft's chain: `depth` drafts from one forward, the one after each row's last committed token
        and one after each of the `depth - 1` mask tokens fed behind it. The draft keeps none of them: `commit`
        keeps the fed tokens only, and the next step feeds the accepted ones."""
        logits = self._feed_unseen(state, masks=depth - 1)  # [B, depth, V_draft]
        batch = state.batch_size
        tokens, probs = self._draw(logits.reshape(batch * depth, -1))
        target_device = state.sequences.device
        self._drafted_depth = 0  # no drafted token was fed
        self._node_slots = torch.full((batch, 1 + depth), -1, dtype=torch.long, device=target_device)  # none fed
        draft_probs = None if probs is None else probs.reshape(batch, depth, -1).to(target_device)
        return Proposal.chain(state.last_tokens(), tokens.reshape(batch, depth).to(target_device), budget,
                              draft_probs, dense=all(b == depth for b in budget_host))

    def _feed_unseen(self, state: DecodeState, masks: int = 0) -> torch.Tensor:
        """Feed each row's committed tokens the draft has not seen (at least its last token), and `masks` mask
        tokens right after them (a parallel draft's); returns the draft's logits after the last committed token
        [B, V_draft], or with masks after it and after each mask [B, 1 + masks, V_draft]."""
        host = state.host
        self._fed_host = [0 if done else length - seen
                          for length, seen, done in zip(host.lengths, self.cached_host, host.finished)]
        fed = torch.where(state.finished, 0, state.lengths - self.cached_lengths)  # >= 1 for unfinished rows
        feed = self._max_feed() if self.fixed_shapes else max(1, max(self._fed_host, default=0))
        width = self._feed_width = feed + masks
        column = _arange(width, fed.device)[None, :]
        index = (self.cached_lengths[:, None] + column).clamp(max=state.sequences.shape[1] - 1)
        unseen = state.sequences.gather(1, index)
        if masks:
            unseen = torch.where(column < fed[:, None], unseen, self.mask_token)
        device = self.draft.device
        self._fed = fed
        dense = not self.fixed_shapes and all(n == feed for n in self._fed_host)
        # a row's real tokens: its unseen ones, then its masks (none for a finished row, which feeds nothing)
        real = None
        if not dense:
            ends = torch.where(fed > 0, fed + masks, 0) if masks else fed
            real = (column < ends[:, None]).to(device)
        last = (fed.clamp(min=1) - 1).to(device)[:, None]  # [B, 1]: each row's last fed token
        if masks:  # [B, 1 + masks]: and its mask tokens
            last = last + _arange(1 + masks, device)[None, :]
        selected = {"logits_at": last} if self.selects_logits else {}
        logits = self.cache.forward(unseen.to(device), column.to(device).expand(unseen.shape[0], -1), real,
                                    **self._feed_inputs(state, width), **selected)
        logits = logits if selected else select_positions(logits, last)
        if masks:
            return logits
        hidden = self.cache.hidden_states
        self._root_hidden = None if hidden is None else select_positions(hidden, last)[:, 0]
        return logits[:, 0]

    def _propose_tree(self, state: DecodeState, depth: int, budget: torch.Tensor, logits: torch.Tensor) -> Proposal:
        """Top-w first tokens, each continued as a chain of `depth`: one draft forward per depth for all branches."""
        width, batch = self.tree_width, state.batch_size
        self._drafted_depth = depth
        device = self.draft.device
        first = self._scores(logits).topk(width, dim=-1).indices  # [B, w]
        levels = [first.to(state.sequences.device)]
        level_probs = [None if not self.sampling.do_sample else _one_hot(levels[0], self.target_vocab)]
        hidden = None if self._root_hidden is None else self._root_hidden[:, None].expand(-1, width, -1)
        fed = self._fed.to(device)[:, None]
        for d in range(1, depth):
            logits = self.cache.forward(
                levels[-1].to(device),
                (fed + d - 1).expand(-1, width),
                visible=_branch_visible(width, self._feed_width, d, device).expand(batch, -1, -1),
                **self._draft_inputs(hidden, d),
            )
            hidden = self.cache.hidden_states
            tokens, probs = self._draw(logits.reshape(batch * width, -1))
            levels.append(tokens.reshape(batch, width).to(state.sequences.device))
            level_probs.append(None if probs is None else probs.reshape(batch, width, -1).to(state.sequences.device))
        self._node_slots = _branch_slots(width, depth, state.sequences.device).expand(batch, -1)
        root = state.last_tokens()[:, None]
        draft_probs = torch.cat(level_probs, dim=1) if self.sampling.do_sample else None
        return Proposal.from_template(branch_template(width, depth), torch.cat([root, *levels], dim=1), budget,
                                      draft_probs)

    def _scores(
        self,
        # [B, V_draft]
        logits: torch.Tensor,
    ) -> torch.Tensor:
        """[B, V_target] float scores: the draft's logits on the target vocabulary, warped when sampling."""
        scores = fit_vocab(logits.float(), self.target_vocab)
        return warp(scores, self.sampling.warpers) if self.sampling.do_sample else scores

    def _draw(
        self,
        # [B, V_draft]
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row, and its distribution over the target vocabulary (None when greedy)."""
        sampling = self.sampling
        return draw_draft(fit_vocab(logits.float(), self.target_vocab), sampling.do_sample, sampling.warpers,
                          sampling.generator)

    def _propose_dynamic_tree(self, state: DecodeState, depth: int, budget: torch.Tensor, logits: torch.Tensor
                              ) -> Proposal:
        """EAGLE-2 style dynamic tree of up to `depth` levels (see the module docstring); nodes are deterministic
        top-w candidates. Each depth feeds the frontier, each node seeing the feed and its fed ancestors."""
        width, batch = self.tree_width, state.batch_size
        self._drafted_depth = depth
        device = self.draft.device
        candidates = Candidates(self._log_probs(logits), width, self._tree_ids)
        sees = torch.zeros(batch, 1 + width, 0, dtype=torch.bool, device=device)  # [B, nodes, slots after the feed]
        node_slots = torch.full((batch, 1 + width), -1, dtype=torch.long, device=device)
        feed = _all_true(width, self._feed_width, device).expand(batch, -1, -1)  # fed tokens: ancestors
        fed = self._fed.to(device)[:, None]
        # [B, w, F]: the drafter's output at each frontier node's parent (None when the drafter keeps none)
        frontier_parent_hidden = None if self._root_hidden is None else self._root_hidden[:, None].expand(-1, width, -1)
        kept = kept_nodes(self.total_tokens, depth, self.k)
        # levels stop once no deeper node can be kept (`Candidates.settled`: the same tree, fewer drafting forwards)
        settles = settles_on(device) and not self.fixed_shapes
        for d in range(1, depth):
            if settles and candidates.settled(kept):
                self._drafted_depth = d
                break
            region, frontier = sees.shape[2], candidates.frontier
            visible = torch.cat([feed, _rows(sees, frontier), sees.new_zeros(batch, width, width)], dim=2)
            logits = self.cache.forward(
                candidates.frontier_tokens,
                (fed + d - 1).expand(-1, width),
                visible=visible,
                **self._draft_inputs(frontier_parent_hidden, d),
            )
            own = torch.zeros(batch, sees.shape[1], width, dtype=torch.bool, device=device)
            # frontier node i sees the region slot it was just fed in (column i)
            own.scatter_(1, frontier[:, :, None].expand(-1, -1, width),
                         _eye(width, device).expand(batch, -1, -1))
            sees = torch.cat([sees, own], dim=2)  # fed frontier nodes now see their own slot too
            node_slots.scatter_(1, frontier, region + _arange(width, device).expand(batch, -1))
            best = candidates.expand(self._log_probs(logits.reshape(batch * width, -1)).reshape(batch, width, -1))
            parents = candidates.parents[-1]  # the new children's
            sees = torch.cat([sees, _rows(sees, parents)], dim=1)
            node_slots = torch.cat([node_slots, torch.full_like(parents, -1)], dim=1)
            if self.cache.hidden_states is not None:  # a child's parent is the frontier node it came from
                frontier_parent_hidden = _rows(self.cache.hidden_states, best // width)
        # a step the schedule narrows to d < k levels keeps fewer nodes (`kept_nodes`): the schedule's width buys a
        # cheaper step, as it does for chains
        tree, chosen = candidates.select(state.last_tokens(), kept, budget, state.sequences.device)
        self._node_slots = torch.cat([torch.full_like(chosen[:, :1], -1), node_slots.gather(1, chosen)], dim=1)
        return Proposal(tree)

    def _log_probs(
        self,
        # [B, V_draft]
        logits: torch.Tensor,
    ) -> torch.Tensor:
        """Log-probabilities over the target vocabulary, after the sampling warpers when sampling; over the ids
        `_tree_ids` when given."""
        if self._tree_ids is not None:
            return torch.log_softmax(logits.index_select(-1, self._tree_ids.to(logits.device)).float(), dim=-1)
        return torch.log_softmax(self._scores(logits), dim=-1)

    def commit(self, state: DecodeState, result: VerificationResult) -> None:
        """Keep the fed tokens, then the accepted path's leading nodes that the draft fed (a node it never fed ends
        what it can keep): the cache moves them after each row's committed tokens."""
        path = result.path_nodes[:, 1:].to(self._node_slots.device)  # [B, D]: tree nodes along the walk
        step = _arange(path.shape[1], path.device)[None, :]
        slots = self._node_slots.gather(1, path)  # [B, D]: region slot after the feed, or -1
        fed = self._fed.to(path.device)
        kept_drafts = ((step < result.num_accepted.to(path.device)[:, None]) & (slots >= 0)).long().cumprod(1).sum(1)
        num_kept = torch.where(state.finished.to(path.device), 0, fed + kept_drafts)
        host = state.host
        # every shape feeds its nodes above the deepest (a tree its frontier); a chain cut to nothing fed none. A
        # dynamic tree under static shapes drafts every level even where it keeps fewer nodes than levels (3 nodes
        # over k = 5): its path is no deeper than the tree
        fed_depth = min(max(self._drafted_depth - 1, 0), path.shape[1])
        if self.total_tokens is None:  # chains and fixed branches feed every node above the deepest
            kept_host = [0 if done else n + min(a, fed_depth)
                         for n, a, done in zip(self._fed_host, host.num_accepted, host.finished)]
        elif self.fixed_shapes:  # fixed shapes need no exact lengths on the host
            kept_host = None
        else:  # a dynamic tree feeds the frontier only, which the host does not know: one read
            kept_host = num_kept.tolist()
        in_order = self.tree_width == 1 and self.total_tokens is None and not self.fixed_shapes and all(
            done or n == self._feed_width for n, done in zip(self._fed_host, host.finished))
        sources = None
        if not in_order:
            # slot i < fed: the feed; then the kept nodes' slots, after the feed. A row keeps at most the feed and
            # fed_depth nodes, so the move reads and writes no more columns than the region has; a column past a row's
            # kept slots reads any region slot (an unfed node's -1 gives the feed's last)
            columns = _arange(self._feed_width + fed_depth, path.device)[None, :]
            along = (columns - fed[:, None]).clamp(min=0, max=max(fed_depth - 1, 0))
            node_slot = slots.gather(1, along) if fed_depth else torch.full_like(along, -1)
            sources = torch.where(columns < fed[:, None], columns, self._feed_width + node_slot)
        device = self.draft.device
        self.cache.commit(num_kept.to(device), None if sources is None else sources.to(device), kept_on_host=kept_host)
        self.cached_lengths = self.cached_lengths + num_kept.to(self.cached_lengths.device)
        if kept_host is not None:
            self.cached_host = [n + k for n, k in zip(self.cached_host, kept_host)]


def select_positions(
    # [B, W, ...]
    values: torch.Tensor,
    # [B, N] long or None (every position)
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """[B, N, ...]: each row's values at its `positions`."""
    if positions is None:
        return values
    index = positions.to(values.device).reshape(*positions.shape, *[1] * (values.dim() - 2))
    return values.gather(1, index.expand(*positions.shape, *values.shape[2:]))


def _rows(
    # [B, N, ...]
    values: torch.Tensor,
    # [B, K]
    index: torch.Tensor,
) -> torch.Tensor:
    """values[b, index[b, k]] for every b, k: [B, K, ...]."""
    return values[_arange(values.shape[0], values.device)[:, None], index]


# Constant tensors a step reads, built once per shape and device (read only: never written in place).


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """[n]: 0, 1, ..., n - 1."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=16)
def _eye(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool identity."""
    return torch.eye(n, dtype=torch.bool, device=device)


@functools.lru_cache(maxsize=64)
def _all_true(rows: int, columns: int, device: torch.device) -> torch.Tensor:
    """[rows, columns] bool, all True."""
    return torch.ones(rows, columns, dtype=torch.bool, device=device)


@functools.lru_cache(maxsize=128)
def _branch_visible(width: int, feed_width: int, depth: int, device: torch.device) -> torch.Tensor:
    """[w, F + depth * w]: what each of w branches sees when its depth-`depth` token is fed: every fed token (an
    ancestor), then its own branch's slot at each depth so far."""
    return torch.cat([_all_true(width, feed_width, device), _eye(width, device).repeat(1, depth)], dim=1)


@functools.lru_cache(maxsize=16)
def _chain_slots(num_drafted: int, device: torch.device) -> torch.Tensor:
    """[1 + n]: each chain node's region slot (draft d is fed at slot d - 1); -1 for the root and the last draft,
    which are never fed."""
    slots = torch.arange(-1, num_drafted, device=device)
    return torch.where(slots < num_drafted - 1, slots, -1)


@functools.lru_cache(maxsize=16)
def _branch_slots(width: int, depth: int, device: torch.device) -> torch.Tensor:
    """[N]: each node's region slot in a tree of w branches of `depth` tokens: node (depth d, branch r) =
    1 + (d - 1) * w + r sits in slot (d - 1) * w + r if it was fed (d < depth), else -1 (the root too)."""
    template = branch_template(width, depth)
    node_depths = template_tensors(template, device).depths
    slots = torch.arange(template.num_nodes, device=device) - 1
    return torch.where((node_depths >= 1) & (node_depths < depth), slots, -1)


def _one_hot(
    # [B, w]
    tokens: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    return torch.zeros(*tokens.shape, vocab, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    from hf_specdec.proposers.cross_tokenizer import CrossTokenizerProposer, same_vocabulary

    if config.draft_tokenizer is not None and not same_vocabulary(config.draft_tokenizer, config.tokenizer):
        return CrossTokenizerProposer(config, target, sampling)
    return DraftModelProposer(config, target, sampling)


register_proposer("draft", _build)
