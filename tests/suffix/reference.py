"""Brute-force suffix decoding, the slow and obvious version the suffix package is checked against: counts come
from scanning every text, drafts from trying every candidate at every step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hf_specdec.suffix import SuffixConfig
from hf_specdec.suffix.draft import SCORE_TIE


def string_counts(texts: Sequence[Sequence[int]], max_depth: int) -> Counter:
    """Occurrences of every string of at most `max_depth` tokens."""
    counts: Counter = Counter()
    for text in texts:
        for start in range(len(text)):
            for stop in range(start + 1, min(len(text), start + max_depth) + 1):
                counts[tuple(text[start:stop])] += 1
    return counts


def grow(counts: Counter, pattern: tuple[int, ...], budget: int, min_prob: float, max_depth: int,
         chain: bool = False):
    """(tokens, parents, depths, probs): repeatedly take the most probable candidate, ties by depth, parent index,
    token; with `chain`, each node's candidates are only its most frequent continuation (ties to the smaller
    token)."""
    def candidates(path, prob, parent, depth):
        if len(pattern) + len(path) + 1 > max_depth:
            return []
        total = counts[pattern + path]
        options = sorted((-count, string[-1]) for string, count in counts.items()
                         if len(string) == len(pattern) + len(path) + 1 and string[:-1] == pattern + path)
        found = []
        for negative_count, token in options[:1] if chain else options:
            child_prob = prob * (-negative_count / total)
            if child_prob >= min_prob:
                found.append((-child_prob, depth + 1, parent, token, path + (token,)))
        return found

    frontier = candidates((), 1.0, -1, 0)
    tokens, parents, depths, probs = [], [], [], []
    while frontier and len(tokens) < budget:
        best = min(frontier)
        frontier.remove(best)
        negative_prob, depth, parent, token, path = best
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        probs.append(-negative_prob)
        frontier += candidates(path, -negative_prob, len(tokens) - 1, depth)
    return tokens, parents, depths, probs


def best_draft(texts, context, max_tokens: int, config: SuffixConfig, to_beat: float = 0.0, chain: bool = False):
    """(tokens, parents, depths, probs, score, match_length) of the best draft beating `to_beat`, or None. Every
    match length is tried (no pruning)."""
    counts = string_counts(texts, config.max_depth)
    tried = []
    for m in range(1, min(len(context), config.max_depth) + 1):
        pattern = tuple(context[len(context) - m:])
        if not counts[pattern]:
            break
        budget = config.draft_budget(m, max_tokens)
        tokens, parents, depths, probs = grow(counts, pattern, budget, config.min_token_prob, config.max_depth, chain)
        tried.append((tuple(tokens), tuple(parents), tuple(depths), tuple(probs), sum(probs), m))
    best, best_score = None, to_beat
    for draft in reversed(tried):  # longest match first: a shorter one must beat it by more than a tie
        if draft[4] > best_score + SCORE_TIE:
            best, best_score = draft, draft[4]
    return best


def propose(local_texts, global_texts, context, max_tokens: int, config: SuffixConfig, chain: bool = False):
    """(tokens, parents, depths, probs, score, match_length, source); all empty when nothing matches."""
    local = best_draft(local_texts, context, max_tokens, config, chain=chain)
    found = best_draft(global_texts, context, max_tokens, config, to_beat=local[4] if local else 0.0, chain=chain)
    if found is not None:
        return found + ("global",)
    if local is not None:
        return local + ("local",)
    return (), (), (), (), 0.0, 0, None
