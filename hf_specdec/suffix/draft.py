"""Suffix drafts: the token tree a suffix tree proposes after a context, and how the best one is chosen.

For each m such that the last m context tokens occur in a tree (m = 1, 2, ... up to `max_depth`), the draft grows
best first from that point: a candidate's running probability is its parent's times count(child) / count(parent),
the most probable candidate joins next (ties: shallower, then the earlier parent, then the smaller token), and
growth stops at the budget min(max_tokens, floor(m * max_spec_factor + max_spec_offset)) or when no candidate
reaches `min_token_prob`. The first token of the most frequent continuation joins first, so a one-branch tree is
the chain "follow the most frequent continuation"; with a larger budget, frequent alternatives join as branches
and one forward verifies them all. A draft's score is the sum of its running probabilities (the number of tokens
the trees expect to be accepted). The best score wins; ties (within 1e-9) go to the longer match, and the
request's local tree beats the global tree on a tie.

Cost: `SuffixTree.locate` (O(max_depth^2) in C) plus, per match length tried, O(budget x log) heap steps. Match
lengths that cannot win are skipped: a draft has at most one unit of probability per level, so its score is at
most min(budget, max_depth - m).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from hf_specdec.suffix.config import SuffixConfig
from hf_specdec.suffix.tree import SuffixTree

if TYPE_CHECKING:
    from hf_specdec.suffix.cache import SuffixCache, SuffixRequest

# Scores closer than this are a tie.
SCORE_TIE = 1e-9

DraftSource = Literal["local", "global"]


@dataclass(frozen=True)
class SuffixDraft:
    """A draft token tree after the context: node i is `tokens[i]`, a child of node `parents[i]` (-1: of the
    context's last token); parents come before their children."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    # distance of each node from the context's last token (1 for the first draft token)
    depths: tuple[int, ...] = ()
    # running probability of each node: the product of count ratios from the match to it
    probs: tuple[float, ...] = ()
    # sum of `probs`
    score: float = 0.0
    # context tokens matched (0 for an empty draft)
    match_length: int = 0
    # which tree drafted it (None for an empty draft)
    source: DraftSource | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def paths(self) -> list[tuple[int, ...]]:
        """The token path from the context to every node, in node order."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        return paths


EMPTY_DRAFT = SuffixDraft()


def grow_draft(tree: SuffixTree, node: int, match_length: int, budget: int, min_token_prob: float,
               chain: bool = False) -> SuffixDraft:
    """The best-first draft of at most `budget` tokens after the point at string depth `match_length` on `node`'s
    edge (see the module docstring); with `chain`, each node offers only its most probable continuation (ties to the
    smaller token), so the draft is one path."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    probs: list[float] = []
    # (-probability, depth, parent index, token, tree node, string depth): the first four order the candidates
    # and never tie (a parent has one child per token)
    heap: list[tuple[float, int, int, int, int, int]] = []
    continuations = tree.continuations
    node_count = tree.node_count
    # a continuation of a point with probability p and count n needs a count >= min_token_prob * n / p; the
    # margin keeps rounding from dropping one that the exact test below admits
    margin = 1.0 - 1e-12

    def push(at: int, string_depth: int, prob: float, index: int, depth: int) -> None:
        total = node_count(at)
        found = continuations(at, string_depth, min_token_prob * total / prob * margin)
        if chain:
            found = found[:1]  # by count, then token
        for count, token, child, child_depth in found:
            child_prob = prob * (count / total)
            if child_prob >= min_token_prob:
                heapq.heappush(heap, (-child_prob, depth + 1, index, token, child, child_depth))

    if budget > 0:
        push(node, match_length, 1.0, -1, 0)
    while heap and len(tokens) < budget:
        negative_prob, depth, parent, token, child, child_depth = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        probs.append(-negative_prob)
        if len(tokens) < budget:
            push(child, child_depth, -negative_prob, len(tokens) - 1, depth)
    return SuffixDraft(tuple(tokens), tuple(parents), tuple(depths), tuple(probs), sum(probs), match_length)


def best_draft(
    tree: SuffixTree,
    context: Sequence[int],
    max_tokens: int,
    config: SuffixConfig,
    to_beat: float = 0.0,
    chain: bool = False,
) -> SuffixDraft | None:
    """The best draft `tree` makes after `context` (a list of token ids; only the last max_depth matter), if its
    score beats `to_beat` by more than SCORE_TIE; ties between match lengths go to the longer match. `chain`: one
    path (`grow_draft`)."""
    located = tree.locate(context)
    best = None
    best_score = to_beat
    for match_length in range(len(located), 0, -1):
        budget = config.draft_budget(match_length, max_tokens)
        if min(budget, tree.max_depth - match_length) <= best_score + SCORE_TIE:
            continue  # cannot win: at most one unit of probability per level
        draft = grow_draft(tree, located[match_length - 1], match_length, budget, config.min_token_prob, chain)
        if draft.score > best_score + SCORE_TIE:
            best, best_score = draft, draft.score
    return best


def propose_suffix_draft(
    cache: SuffixCache,
    request: SuffixRequest | None,
    context: Sequence[int],
    max_tokens: int,
    chain: bool = False,
) -> SuffixDraft:
    """The draft for a request: the better of its local tree's (prompt and output so far) and the cache's global
    tree's (outputs of earlier requests), local on a tie; `EMPTY_DRAFT` when neither matches. `request` None drafts
    from the global tree alone. `context` is the request's tokens (prompt and output, as its local tree holds them;
    a list, tuple or 1-D array of ids), `max_tokens` the node budget; `chain` drafts one path (each node's most probable
    continuation), for a target that verifies chains only. Reads only; the global tree is read under the cache's
    lock."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"propose_suffix_draft: max_tokens must be an int >= 0, got {max_tokens!r}")
    if request is not None and request.cache is not cache:
        raise ValueError("propose_suffix_draft: the request was started by another SuffixCache")
    config = cache.config
    tail = context[-config.max_depth:]
    tail = tail.tolist() if hasattr(tail, "tolist") else list(tail)
    best = EMPTY_DRAFT
    if request is not None:
        local = best_draft(request.local, tail, max_tokens, config, chain=chain)
        if local is not None:
            best = replace(local, source="local")
    with cache.reading() as tree:
        found = None if tree is None else best_draft(tree, tail, max_tokens, config, to_beat=best.score, chain=chain)
    if found is not None:
        best = replace(found, source="global")
    return best
