"""N-gram (prompt lookup) proposer: copy what followed the most recent match of the text's suffix.

For each row, the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are searched for in the
row's prompt and generated text; at the longest n that matches, the most recent match wins and the k tokens that
followed it become the draft, read as an overlapping copy (LZ77's rule): where the copy runs past the end of the
text it goes on copying its own output, so a match d tokens back drafts the last d tokens repeated. The draft is a
point mass, so verification needs no draft probabilities. Matching runs in NumPy on the host, one row at a time,
on a host copy of the text that each step extends with the tokens it emitted.

Why not vLLM's rule (the earliest match, for its longer continuation)? With overlapping copies every match
continues for k tokens, and on repetitive text (runs, alternations, the lines of a list) the most recent match is
the better guess. Measured at k = 5: tokens per target forward at batch 1 went from 2.98 (the earliest-match rule,
which transformers' prompt lookup also uses) to 3.76 in `benchmarks/bench_engine.py`, and from 2.72 to 2.96 on the
test bed's edit workload (`hf-specdec bench --workload edit`; `benchmarks/results/testbed_cpu.json` before,
`testbed_ngram_cpu.json` after).

With `tree_width` w > 1 the proposer offers up to w different continuations (from different earlier matches of the
longest matching n-gram, most recent first) as the branches of a token tree: a trie, so continuations that share a
prefix share nodes, and one forward verifies them all. With `tree_total_tokens` (a count, or "auto": what a forward
verifies at about the chain's cost, `hf_specdec.schedule.tree_size`) the trie keeps that many draft nodes, the first
continuation's first tokens and the others' first tokens before long tails (`build_trie`).
"""

from __future__ import annotations

import numpy as np
import torch

from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import DraftSampling, Proposer, register_proposer
from hf_specdec.proposers.host_text import HostText
from hf_specdec.schedule.lookahead import LookaheadTree
from hf_specdec.step import DecodeState, Proposal
from hf_specdec.tree.dynamic import kept_nodes
from hf_specdec.tree.tree import TokenTree


def _longest_match(
    # [L] the row's tokens (no padding)
    tokens: np.ndarray,
    min_n: int,
    max_n: int,
) -> tuple[int, np.ndarray]:
    """(n, end indices ascending) of the earlier occurrences of the longest suffix n-gram, n in [min_n, max_n];
    (0, []) when none matches.

    Grows the match one token to the left at a time: the ends matching the last token, then those whose previous
    token matches too, and so on; one pass over the text, then work proportional to the matches."""
    length = tokens.shape[0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) if length > 1 else tokens[:0]
    best = (0, tokens[:0])
    for n in range(1, max_n + 1):
        if n >= min_n and ends.size:
            best = (n, ends)
        if n == max_n or not ends.size:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
    return best


def _copy_after(
    # [L] the row's tokens
    tokens: np.ndarray,
    end: int,
    max_tokens: int,
) -> np.ndarray:
    """The `max_tokens` tokens that follow index `end` (< L - 1), as an overlapping copy: past the text's end the
    copy reads its own output, i.e. the last L - 1 - end tokens repeat."""
    start = end + 1
    return tokens[start + np.arange(max_tokens) % (tokens.shape[0] - start)]


def find_ngram_continuation(
    # [L] the row's tokens (no padding)
    tokens: np.ndarray,
    min_n: int,
    max_n: int,
    max_tokens: int,
) -> np.ndarray:
    """The overlapping copy of `max_tokens` tokens after the most recent occurrence of the longest matching suffix
    n-gram ([] when none)."""
    return _first(continuations_after(tokens, _longest_match(tokens, min_n, max_n)[1], max_tokens, 1))


def matched_ngram_length(
    # [L] the row's tokens (no padding)
    tokens: np.ndarray,
    min_n: int,
    max_n: int,
) -> int:
    """The length of the longest suffix n-gram, n in [min_n, max_n], that occurred earlier (0: none): the draft
    class of `NgramProposer.draft_classes`."""
    return _longest_match(tokens, min_n, max_n)[0]


def find_ngram_continuations(
    # [L] the row's tokens (no padding)
    tokens: np.ndarray,
    min_n: int,
    max_n: int,
    max_tokens: int,
    max_branches: int,
) -> list[np.ndarray]:
    """Up to `max_branches` distinct continuations (overlapping copies) of the longest matching suffix n-gram, most
    recent match first."""
    return continuations_after(tokens, _longest_match(tokens, min_n, max_n)[1], max_tokens, max_branches)


# how many tokens further from the root each later continuation's nodes count, when a sized trie keeps its nodes
# (`build_trie`); 1 measured best of 0.5, 1 and 2 (`benchmarks/ngram_trie.py --rank-cost`)
TRIE_RANK_COST = 1.0
# occurrences read for a tree's branches, at most this many per distinct branch sought: a short n-gram in a long
# text occurs thousands of times, mostly with continuations already found
OCCURRENCES_PER_BRANCH = 8


def continuations_after(
    # [L] the row's tokens
    tokens: np.ndarray,
    # end indices (ascending) of a suffix n-gram's earlier occurrences (`_longest_match`)
    ends: np.ndarray,
    max_tokens: int,
    max_branches: int,
) -> list[np.ndarray]:
    """Up to `max_branches` distinct continuations of `max_tokens` tokens after those occurrences, most recent
    first (reading at most `OCCURRENCES_PER_BRANCH` occurrences per branch)."""
    found: list[np.ndarray] = []
    if max_tokens <= 0:
        return found
    for end in ends[::-1][: OCCURRENCES_PER_BRANCH * max_branches].tolist():
        continuation = _copy_after(tokens, end, max_tokens)
        if not any(np.array_equal(continuation, c) for c in found):
            found.append(continuation)
        if len(found) == max_branches:
            break
    return found


def _first(found: list[np.ndarray]) -> np.ndarray:
    """The first continuation found ([] when none)."""
    return found[0] if found else np.zeros(0, dtype=np.int64)


def build_trie(
    root_token: int,
    continuations: list[np.ndarray],
    num_nodes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, parents, valid), each [num_nodes]: the continuations merged into a trie under the root, cut to its
    `num_nodes - 1` likeliest-looking draft nodes; parents precede children; unused nodes are padding (a child of
    the root, not valid).

    A node's rank is the index of the first continuation through it (continuations come likeliest first); nodes are
    kept by depth + rank * `TRIE_RANK_COST`, then rank, then depth: each later continuation counts as one token
    further from the root, so a short tree keeps the first continuation's first tokens and the others' first tokens
    before any long tail. A parent's key is below its child's, so the kept nodes form a tree."""
    node_tokens, node_parents, keys = [root_token], [-1], [(0.0, 0, 0)]
    children: dict[tuple[int, int], int] = {}
    for rank, continuation in enumerate(continuations):
        node = 0
        for depth, token in enumerate(continuation.tolist(), start=1):
            child = children.get((node, token))
            if child is None:
                child = children[(node, token)] = len(node_tokens)
                node_tokens.append(token)
                node_parents.append(node)
                keys.append((depth + rank * TRIE_RANK_COST, rank, depth))
            node = child
    kept = sorted(sorted(range(1, len(node_tokens)), key=keys.__getitem__)[: num_nodes - 1])  # creation order
    new_index = {0: 0, **{old: new for new, old in enumerate(kept, start=1)}}
    tokens = np.zeros(num_nodes, dtype=np.int64)
    parents = np.zeros(num_nodes, dtype=np.int64)
    valid = np.zeros(num_nodes, dtype=bool)
    tokens[0], parents[0], valid[0] = root_token, -1, True
    for new, old in enumerate(kept, start=1):
        tokens[new], parents[new], valid[new] = node_tokens[old], new_index[node_parents[old]], True
    return tokens, parents, valid


class NgramProposer(Proposer):
    """Matches on a host copy of every row's text (`HostText`)."""

    reads_emitted_tokens = True
    looks_ahead = True

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.tree_width = config.tree_width
        # a trie's most draft nodes (None: every node of its tree_width continuations)
        self.total = config.tree_total_tokens
        self.text: HostText | None = None
        # per row: (text length, n, ends) of its last match (`_match`)
        self.matches: list[tuple[int, int, np.ndarray] | None] = []

    def start(self, state: DecodeState, attention_mask: torch.Tensor | None) -> None:
        self.text = HostText(state)
        self.matches = [None] * state.batch_size

    def _match(self, row: int) -> tuple[np.ndarray, int, np.ndarray]:
        """The row's text, and the length and earlier end indices of its longest matching suffix n-gram: matched
        once per text (a step's draft classes, proposal and lookahead share it; the text only grows)."""
        tokens = self.text.row(row)
        kept = self.matches[row]
        if kept is None or kept[0] != tokens.shape[0]:
            kept = self.matches[row] = (tokens.shape[0], *_longest_match(tokens, self.min_n, self.max_n))
        return tokens, kept[1], kept[2]

    def _continuations(self, row: int, max_tokens: int, max_branches: int) -> list[np.ndarray]:
        tokens, _, ends = self._match(row)
        return continuations_after(tokens, ends, max_tokens, max_branches)

    def _catch_up(self, state: DecodeState) -> None:
        self.text.catch_up(state)

    def skip(self, state: DecodeState) -> None:
        self._catch_up(state)

    def propose(self, state: DecodeState) -> Proposal:
        self._catch_up(state)
        budget = [min(b, self.k) for b in state.host_draft_budget()]
        if self.tree_width > 1:
            return self._propose_tree(state, budget)
        drafts = np.zeros((state.batch_size, self.k), dtype=np.int64)
        counts = np.zeros(state.batch_size, dtype=np.int64)
        for row in range(state.batch_size):
            found = _first(self._continuations(row, budget[row], 1))
            drafts[row, : found.size] = found
            counts[row] = found.size
        device = state.sequences.device
        longest = int(counts.max()) if counts.size else 0
        # fixed shapes: k drafts, or none when no row found a match (a second, one-token verify shape)
        width = (state.step_width(self.k) if longest else 0) if self.fixed_shapes else longest
        return Proposal.chain(state.last_tokens(), torch.from_numpy(drafts[:, :width]).to(device),
                              torch.from_numpy(counts).to(device),
                              dense=bool((counts == width).all())).with_host_depths(counts)

    def lookahead(self, state: DecodeState, rows: list[int]) -> list[LookaheadTree]:
        """The chain `propose` would draft for each row (its most recent match's continuation)."""
        return [LookaheadTree.chain(_first(self._continuations(row, self.k, 1))) for row in rows]

    @property
    def num_draft_classes(self) -> int:
        return self.max_n

    def draft_classes(self, state: DecodeState) -> np.ndarray:
        """[B] the length of the n-gram each row's text ends with that matched earlier (0: none): a draft that
        follows a longer match is accepted more often."""
        self._catch_up(state)
        finished = state.host.finished
        return np.asarray([0 if finished[row] else self._match(row)[1] for row in range(state.batch_size)],
                          dtype=np.int64)

    def _propose_tree(self, state: DecodeState, budget: list[int]) -> Proposal:
        depth = state.step_width(self.k)
        # a step the schedule narrows to fewer depths keeps proportionally fewer nodes, as a dynamic tree does
        num_nodes = 1 + (self.tree_width * depth if self.total is None else kept_nodes(self.total, depth, self.k))
        rows, depths = [], []
        for row in range(state.batch_size):
            tokens = self.text.row(row)
            found = self._continuations(row, budget[row], self.tree_width)
            depths.append(max((len(continuation) for continuation in found), default=0))
            rows.append(build_trie(int(tokens[-1]), found, num_nodes))
        device = state.sequences.device
        if not any(depths):
            return Proposal.no_draft(state)
        tokens, parents, valid = (torch.from_numpy(np.stack(column)).to(device) for column in zip(*rows))
        # a trie of w continuations of at most the step's width: no deeper, at most w children per node
        return Proposal(TokenTree(token_ids=tokens, parents=parents, valid=valid, max_depth=depth,
                                  max_children=self.tree_width), host_depths=tuple(depths))


def _build(config: SpeculativeConfig, target: torch.nn.Module, sampling: DraftSampling) -> Proposer:
    return NgramProposer(config)


register_proposer("ngram", _build)
