"""Draft vocabularies for heads that project with the target's lm_head (a "token map", as FR-Spec, Zhao et al. 2025,
and vLLM's Medusa `token_map` call it).

An EAGLE-1/2 head or Medusa heads that share the target's lm_head spend most of a drafting step in that projection:
on SmolLM2-135M a full lm_head (49152 x 576) holds eight times the weights of an EAGLE head's decoder layer and took
7.5 ms per head forward against the layer's 2.6 ms (`benchmarks/head_step_profile.py --whole-vocabulary`). Drafting
over the `D` most frequent tokens of the training data instead (the rows of the lm_head those ids name) cuts its
weights by V / D (at D = 8192 it took 1.4 ms in the same profile without the flag). Drafts are
still verified by the target over its whole vocabulary, so output stays exactly the target's: a token outside the
map simply is never drafted (its draft probability is 0, which speculative sampling allows).

A head stores its map as a `token_map` buffer [D] (target ids, ascending) with `token_map_size` in its config;
`TokenMapMixin` gives it `set_token_map` and `draft_lm_head`, and `most_frequent_tokens` builds a map from token ids.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from hf_specdec.heads.target_weights import bias_of, layer_spec, weight_of, weight_version


def most_frequent_tokens(
    # [...] token ids (any shape), e.g. the target's answers a head trains on
    token_ids: torch.Tensor,
    vocab_size: int,
    size: int,
) -> torch.Tensor:
    """[size] long, ascending: the `size` most frequent ids in `token_ids` (ties broken by the smaller id, so the
    choice is deterministic; ids never seen fill the map last)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"most_frequent_tokens: size: expected 1 to vocab_size {vocab_size}, got {size}")
    counts = torch.bincount(token_ids.flatten().long().cpu(), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size)), descending=True)
    return torch.sort(order[:size]).values


def check_token_map(
    # [D] target ids
    token_map: torch.Tensor,
    vocab_size: int | None,
    where: str,
) -> torch.Tensor:
    """The map as a long tensor on the CPU, ascending; ValueError naming `where` unless it is 1-D, non-empty, of
    distinct integer ids in [0, vocab_size) (ids >= 0 only, when the vocabulary is not known yet)."""
    if not isinstance(token_map, torch.Tensor) or token_map.dim() != 1 or token_map.numel() == 0:
        raise ValueError(f"{where}: expected a non-empty 1-D tensor of target token ids, got "
                         f"{type(token_map).__name__}{tuple(token_map.shape) if hasattr(token_map, 'shape') else ''}")
    if token_map.dtype.is_floating_point or token_map.dtype.is_complex or token_map.dtype == torch.bool:
        raise ValueError(f"{where}: expected integer token ids, got dtype {token_map.dtype}")
    ids = torch.sort(token_map.long().cpu()).values
    if int(ids[0]) < 0 or (vocab_size is not None and int(ids[-1]) >= vocab_size):
        bound = "" if vocab_size is None else f", {vocab_size}) (the target's vocabulary"
        raise ValueError(f"{where}: token ids must lie in [0{bound}), got {int(ids[0])} to {int(ids[-1])}")
    if bool((ids[1:] == ids[:-1]).any()):
        raise ValueError(f"{where}: token ids must be distinct")
    return ids


class TokenMapLMHead(nn.Module):
    """The rows of an lm_head at a token map: logits [..., V] (float) over the whole vocabulary, -inf outside the
    map, computed with a [D, H] projection; or, `compact`, the [..., D] logits of the map's ids (as training
    learns over them, the labels renumbered by `map_index`)."""

    def __init__(
        self,
        lm_head: nn.Module,
        # [D] target ids
        token_map: torch.Tensor,
        vocab_size: int,
        compact: bool = False,
    ) -> None:
        super().__init__()
        weight = weight_of(lm_head)
        ids = token_map.to(weight.device)
        self.vocab_size, self.compact = vocab_size, compact
        self.register_buffer("ids", ids)
        self.register_buffer("weight", weight.detach().index_select(0, ids))
        bias = bias_of(lm_head)
        self.register_buffer("bias", None if bias is None else bias.detach().index_select(0, ids))
        # a module computing the [..., D] projection in place of `linear(hidden, weight, bias)` (an int8 copy of
        # the rows: `hf_specdec.proposers.int8_drafter`), or None
        self.projection: nn.Module | None = None

    def forward(
        self,
        # [..., H]
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        if self.projection is None:
            logits = nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()  # [..., D]
        else:
            logits = self.projection(hidden).float()
        if self.compact:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, logits)


def map_mask(
    # [D] target ids
    token_map: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """[V] bool: the target ids in the map."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=token_map.device)
    return mask.index_fill_(0, token_map, True)


def map_index(
    # [D] target ids
    token_map: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """[V] long: each target id's index in the map, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=token_map.device)
    return index.index_copy_(0, token_map, torch.arange(len(token_map), device=token_map.device))


# per lm_head, per map (by identity; the map is kept, so its id stays its own): (the weight's and map's versions, the
# map, the sliced head), so later calls reuse the slice; at most `SLICES_PER_LM_HEAD` maps per lm_head
_SLICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SLICES_LOCK = threading.Lock()  # generate calls in threads share the slices
SLICES_PER_LM_HEAD = 4


def token_map_lm_head(
    lm_head: nn.Module,
    # [D] target ids, ascending
    token_map: torch.Tensor,
) -> TokenMapLMHead:
    """The lm_head's rows at `token_map`, sliced once per lm_head and map (again after either changes)."""
    version = (*weight_version(lm_head), token_map._version)
    with _SLICES_LOCK:
        slices = _SLICES.setdefault(lm_head, {})
        kept = slices.get(id(token_map))
        if kept is not None and kept[0] == version:
            return kept[2]
        sliced = TokenMapLMHead(lm_head, token_map, layer_spec(lm_head).shape[0])
        slices.pop(id(token_map), None)
        while len(slices) >= SLICES_PER_LM_HEAD:
            del slices[next(iter(slices))]  # the oldest
        slices[id(token_map)] = (version, token_map, sliced)
        return sliced


class TokenMapMixin:
    """For a head that projects with the target's lm_head: an optional draft vocabulary (`token_map` buffer [D],
    `config.token_map_size`). The head's own forward takes whichever lm_head it is given (training passes the map's
    rows of the target's, `compact`); proposers draft with `draft_lm_head`."""

    config: object

    def _init_token_map(self, vocab_size: int | None) -> None:
        size = self.config.token_map_size
        self.register_buffer("token_map", None if size is None else torch.arange(size))
        self._token_map_vocab = vocab_size

    def token_map_refusal(self) -> str | None:
        """Why these heads cannot take a token map, or None."""
        return None

    def set_token_map(
        self,
        # [D] target ids (e.g. `most_frequent_tokens` of the training data), or None for the whole vocabulary
        token_map: torch.Tensor | None,
        vocab_size: int | None = None,
    ) -> None:
        """Draft over these target ids only (saved with the head), or over the whole vocabulary (None)."""
        refusal = self.token_map_refusal()
        if refusal is not None:
            raise ValueError(f"{type(self).__name__}.set_token_map: {refusal}")
        if token_map is None:
            self.token_map = None
            self.config.token_map_size = None
            return
        vocab = vocab_size or self._token_map_vocab
        if vocab is None:
            raise ValueError(f"{type(self).__name__}.set_token_map: vocab_size: these heads do not record the "
                             "target's vocabulary size; pass it")
        ids = check_token_map(token_map, vocab, f"{type(self).__name__}.set_token_map")
        device = next(self.parameters()).device
        self.token_map = ids.to(device)
        self.config.token_map_size = int(ids.numel())

    def draft_lm_head(self, target_lm_head: nn.Module) -> nn.Module:
        """The projection drafts use: the target's lm_head at the token map, or all of it without one."""
        if self.token_map is None:
            return target_lm_head
        vocab, last = layer_spec(target_lm_head).shape[0], int(self.token_map[-1])  # ascending: the largest id
        if last >= vocab:
            raise ValueError(f"{type(self).__name__}: its token map holds ids up to {last}, past the target's "
                             f"vocabulary ({vocab}); these heads were made for another model")
        return token_map_lm_head(target_lm_head, self.token_map)
