"""`SuffixTree`: how often every token string of at most `max_depth` tokens occurs in a set of growing token
sequences, and what follows it. The structure behind suffix decoding.

Design
------
* The tree indexes the *truncated suffixes* of the sequences: for every position i of a sequence of length L, the
  string seq[i : min(i + max_depth, L)]. A *point* of the tree is a string s of at most `max_depth` tokens; its
  count is the number of truncated suffixes that start with s, which is exactly the number of occurrences of s in
  the sequences. The count of s + t over the count of s is the empirical probability that t follows s.
* Path compression. A node is an edge of `length` tokens ending at string depth `depth`; every point of an edge
  has the node's count. Nodes exist only where a truncated suffix ends (an *endpoint*; `ends[v]` of them end at v)
  or where paths branch, so there are at most 2N nodes for N indexed tokens, whatever `max_depth`. Invariants:
  count[v] = ends[v] + the sum of the children's counts; every suffix ends at the end of a node, never inside an
  edge; a node other than the root is an endpoint or has two or more children.
* Edge labels are not copied. Node v spells seq[ref_end - depth : ref_end] of sequence `ref_seq[v]`, and ref_seq[v]
  is the newest sequence (largest id; ids grow in the order sequences are added) in which v's string occurs.
  Sequences are removed oldest first, so when the oldest goes, every node that points into it loses all its
  occurrences and is deleted with it: references never dangle and never need repointing.
* Appending a token to a sequence moves each of its unfinished suffixes (the ones shorter than `max_depth`, at most
  max_depth - 1, plus the new one-token suffix) one token down: into an existing child, by splitting an edge, by
  growing the suffix's own leaf, or into a new leaf; a node left with one child and no endpoint merges into that
  child. That is O(max_depth) dictionary operations per appended token and never a rebuild; sequences may grow
  interleaved.
* Removing the oldest sequence walks each of its truncated suffixes from the root: O(L x nodes on a path), at most
  O(L x max_depth).
* Lookups. `locate` finds the point of every suffix of a query context that occurs (O(max_depth^2) token
  comparisons, run as slice comparisons in C, and O(max_depth x nodes on a path) steps in Python);
  `continuations` lists what follows a point, in order of count. Drafting never takes a child holding less than
  `heavy_fraction` of its parent's count, so every node with more than HEAVY_LIST_DEGREE children keeps a list of
  its heavy children (`HeavyChildren`): complete above a threshold it records, kept so on every count increment,
  tightened by filtering as the parent's count grows and rebuilt by a scan only when evictions halve it. A lookup
  then reads a few dozen children, never thousands.
* Memory: the node fields are Python lists (fast to index), children are one dict per branching node, and the
  tokens are int32 arrays; `memory_bytes` estimates the total. Node ids of deleted nodes are reused.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

# Nodes with more children than this keep a list of their heavy children.
HEAVY_LIST_DEGREE = 16


class HeavyChildren:
    """The children of one node with a count of at least `threshold` (and possibly lighter ones, dropped when the
    list is tightened). Built with threshold = heavy_fraction x count / 2, so it stays complete for lookups
    (which need heavy_fraction x count) until the node's count halves."""

    __slots__ = ("members", "threshold")

    def __init__(self, threshold: float, members: list[int]) -> None:
        self.threshold = threshold
        self.members = members
# Bytes of a Python int object outside the small-int cache.
_INT_BYTES = 32


class SuffixTree:
    """Counts of the token strings (up to `max_depth` tokens) of sequences that grow token by token.

    Sequences are added with `new_sequence`, grown with `extend`, closed with `finish`, and removed oldest first
    with `remove_oldest`. Queries never change the counts."""

    def __init__(self, max_depth: int, heavy_fraction: float) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"SuffixTree.max_depth: expected an int >= 1, got {max_depth!r}")
        if not 0 < heavy_fraction <= 1:
            raise ValueError(f"SuffixTree.heavy_fraction: expected a number in (0, 1], got {heavy_fraction!r}")
        self.max_depth = max_depth
        self.heavy_fraction = heavy_fraction
        # node fields, indexed by node id; node 0 is the root (the empty string)
        self._parent: list[int] = [-1]
        self._length: list[int] = [0]
        self._depth: list[int] = [0]
        self._count: list[int] = [0]
        self._ends: list[int] = [0]
        self._ref_seq: list[int] = [-1]
        self._ref_end: list[int] = [0]
        # first token of the child's edge -> child; None for leaves
        self._children: list[dict[int, int] | None] = [{}]
        self._free: list[int] = []
        # sequence id -> its tokens, oldest sequence first
        self._tokens: dict[int, array] = {}
        # sequence id -> the nodes where its suffixes shorter than max_depth end, longest suffix first; only while
        # the sequence can still grow
        self._active: dict[int, list[int]] = {}
        # node -> its heavy children, for the nodes (other than the root) with more than HEAVY_LIST_DEGREE children
        self._heavy: dict[int, HeavyChildren] = {}
        self._next_sequence = 0
        self.num_tokens = 0

    # ------------------------------------------------------------------ sequences

    @property
    def num_sequences(self) -> int:
        return len(self._tokens)

    @property
    def num_nodes(self) -> int:
        return len(self._parent) - len(self._free)

    @property
    def num_strings(self) -> int:
        """Distinct token strings counted: the points of the tree other than the root. O(nodes)."""
        return sum(length for length, seq in zip(self._length[1:], self._ref_seq[1:]) if seq != -1)

    def sequence_ids(self) -> list[int]:
        """Ids of the sequences held, oldest first."""
        return list(self._tokens)

    def sequence(self, seq: int) -> array:
        """The tokens of sequence `seq` (an int32 array; do not modify it)."""
        return self._tokens[seq]

    def has_sequence(self, seq: int) -> bool:
        return seq in self._tokens

    def new_sequence(self) -> int:
        """Adds an empty sequence and returns its id (larger than every id before it)."""
        seq = self._next_sequence
        self._next_sequence += 1
        self._tokens[seq] = array("i")
        self._active[seq] = []
        return seq

    def finish(self, seq: int) -> None:
        """Sequence `seq` will not grow any more (its counts stay)."""
        self._active.pop(seq, None)

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        """Appends `tokens` to sequence `seq`, updating the counts: O(max_depth) per token."""
        active = self._active.get(seq)
        if active is None:
            state = "finished" if seq in self._tokens else "not in the tree"
            raise ValueError(f"SuffixTree.extend: sequence {seq} is {state}; it can no longer grow")
        text = self._tokens[seq]
        depth = self._depth
        max_depth = self.max_depth
        advance = self._advance
        for token in tokens:
            text.append(token)
            end = len(text)
            self._count[0] += 1
            self.num_tokens += 1
            moved = []
            for node in active:
                node = advance(seq, node, token, end)
                if depth[node] < max_depth:
                    moved.append(node)
            node = advance(seq, 0, token, end)  # the new one-token suffix
            if depth[node] < max_depth:
                moved.append(node)
            active = moved
        self._active[seq] = active

    def _advance(self, seq: int, node: int, token: int, end: int) -> int:
        """Moves a suffix of `seq` that ends at `node` one token down, by `token` (the one at end - 1); returns the
        node where it now ends."""
        children = self._children
        count = self._count
        ends = self._ends
        kids = children[node]
        child = None if kids is None else kids.get(token)
        if child is None:
            if kids is None:
                if node and ends[node] == 1:  # the suffix's own leaf: grow it
                    self._length[node] += 1
                    self._depth[node] += 1
                    self._ref_seq[node] = seq
                    self._ref_end[node] = end
                    return node
                kids = children[node] = {}
            child = self._new_node(node, 1, self._depth[node] + 1, 1, 1, seq, end)
            kids[token] = child
            if node:
                ends[node] -= 1  # the node keeps another endpoint or now has two children: no merge
                heavy = self._heavy.get(node)
                if heavy is not None:
                    if 1 >= heavy.threshold:
                        heavy.members.append(child)
                elif len(kids) > HEAVY_LIST_DEGREE:
                    self._build_heavy(node)
            return child
        length = self._length
        if length[child] > 1:  # split the edge after its first token
            edge = length[child]
            lower = child
            child = self._new_node(
                node, 1, self._depth[node] + 1, count[lower], 0, self._ref_seq[lower],
                self._ref_end[lower] - edge + 1,
            )
            children[child] = {self._tokens[self._ref_seq[lower]][self._ref_end[lower] - edge + 1]: lower}
            self._parent[lower] = child
            length[lower] = edge - 1
            kids[token] = child
            heavy = self._heavy.get(node)
            if heavy is not None and lower in heavy.members:
                heavy.members[heavy.members.index(lower)] = child
        count[child] += 1
        ends[child] += 1
        if seq >= self._ref_seq[child]:
            self._ref_seq[child] = seq
            self._ref_end[child] = end
        if node:
            heavy = self._heavy.get(node)
            if heavy is not None and count[child] >= heavy.threshold and child not in heavy.members:
                heavy.members.append(child)
                if 4 * heavy.threshold < self.heavy_fraction * count[node]:
                    self._tighten_heavy(node, heavy)
            ends[node] -= 1
            if ends[node] == 0 and len(kids) == 1:
                self._merge_into_child(node, child)
        return child

    def _new_node(self, parent: int, length: int, depth: int, count: int, ends: int, ref_seq: int,
                  ref_end: int) -> int:
        if self._free:
            node = self._free.pop()
            self._parent[node] = parent
            self._length[node] = length
            self._depth[node] = depth
            self._count[node] = count
            self._ends[node] = ends
            self._ref_seq[node] = ref_seq
            self._ref_end[node] = ref_end
            self._children[node] = None
            return node
        self._parent.append(parent)
        self._length.append(length)
        self._depth.append(depth)
        self._count.append(count)
        self._ends.append(ends)
        self._ref_seq.append(ref_seq)
        self._ref_end.append(ref_end)
        self._children.append(None)
        return len(self._parent) - 1

    def _first_token(self, node: int) -> int:
        return self._tokens[self._ref_seq[node]][self._ref_end[node] - self._length[node]]

    def _merge_into_child(self, node: int, child: int) -> None:
        """`node` (not the root) has one child and no endpoint: its edge joins the child's, which takes its place."""
        parent = self._parent[node]
        first = self._first_token(node)
        self._length[child] += self._length[node]
        self._parent[child] = parent
        self._children[parent][first] = child
        heavy = self._heavy.get(parent)
        if heavy is not None and node in heavy.members:
            heavy.members[heavy.members.index(node)] = child
        self._release(node)

    def _build_heavy(self, node: int) -> HeavyChildren:
        """A node's heavy list, from a scan of its children: O(children)."""
        count = self._count
        threshold = self.heavy_fraction * count[node] / 2
        members = [child for child in self._children[node].values() if count[child] >= threshold]
        heavy = HeavyChildren(threshold, members)
        self._heavy[node] = heavy
        return heavy

    def _tighten_heavy(self, node: int, heavy: HeavyChildren) -> None:
        """The node's count grew: raise the threshold to half of what lookups need and drop the members below it
        (no scan: every child above the new threshold is above the old one, so already a member)."""
        count = self._count
        heavy.threshold = self.heavy_fraction * count[node] / 2
        heavy.members = [child for child in heavy.members if count[child] >= heavy.threshold]

    def _release(self, node: int) -> None:
        self._heavy.pop(node, None)
        self._children[node] = None
        self._count[node] = 0
        self._ends[node] = 0
        self._ref_seq[node] = -1
        self._free.append(node)

    def remove_oldest(self) -> int:
        """Removes the oldest sequence and everything it counted; returns its id."""
        if not self._tokens:
            raise ValueError("SuffixTree.remove_oldest: the tree holds no sequence")
        seq = next(iter(self._tokens))
        text = self._tokens[seq]
        children = self._children
        count = self._count
        depth = self._depth
        size = len(text)
        for start in range(size):
            stop = min(self.max_depth, size - start)
            path = []
            node = 0
            reached = 0
            while reached < stop:
                node = children[node][text[start + reached]]
                count[node] -= 1
                path.append(node)
                reached = depth[node]
            self._ends[node] -= 1
            count[0] -= 1
            while path and count[path[-1]] == 0:
                gone = path.pop()
                parent = self._parent[gone]
                kids = children[parent]
                del kids[text[start + depth[gone] - self._length[gone]]]
                heavy = self._heavy.get(parent)
                if heavy is not None and gone in heavy.members:
                    heavy.members.remove(gone)
                if not kids and parent:
                    children[parent] = None
                self._release(gone)
            if path:
                last = path[-1]
                kids = children[last]
                if self._ends[last] == 0 and kids is not None and len(kids) == 1:
                    self._merge_into_child(last, next(iter(kids.values())))
        del self._tokens[seq]
        self._active.pop(seq, None)
        self.num_tokens -= size
        return seq

    # ------------------------------------------------------------------ queries

    def locate(self, context: Sequence[int]) -> list[int]:
        """Where the suffixes of `context` end: entry m - 1 is the node whose edge holds the point of the last m
        tokens (the point is at string depth m), for m = 1, 2, ... as long as they occur (at most max_depth)."""
        pattern = array("i", context[-self.max_depth:])
        size = len(pattern)
        children = self._children
        depth = self._depth
        ref_end = self._ref_end
        ref_seq = self._ref_seq
        tokens = self._tokens
        found = []
        for m in range(1, size + 1):
            start = size - m
            node = 0
            reached = 0
            while reached < m:
                kids = children[node]
                child = None if kids is None else kids.get(pattern[start + reached])
                if child is None:
                    return found
                stop = min(depth[child], m)
                if stop - reached > 1:
                    base = ref_end[child] - depth[child]
                    text = tokens[ref_seq[child]]
                    if pattern[start + reached + 1 : start + stop] != text[base + reached + 1 : base + stop]:
                        return found
                reached = stop
                node = child
            found.append(node)
        return found

    def find(self, pattern: Sequence[int]) -> tuple[int, int] | None:
        """The point of `pattern` as (node, string depth), or None when it does not occur (or is longer than
        max_depth); the empty pattern is the root."""
        if len(pattern) > self.max_depth:
            return None
        if not pattern:
            return 0, 0
        located = self.locate(pattern)
        return (located[-1], len(pattern)) if len(located) == len(pattern) else None

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of `pattern` in the sequences (for a pattern of at most max_depth tokens; 0 beyond)."""
        point = self.find(pattern)
        return 0 if point is None else self._count[point[0]]

    def node_count(self, node: int) -> int:
        """The count of every point on `node`'s edge."""
        return self._count[node]

    def continuations(self, node: int, depth: int, min_count: float) -> list[tuple[int, int, int, int]]:
        """What follows the point at string depth `depth` on `node`'s edge, keeping continuations with a count of
        at least `min_count` (never below heavy_fraction of the point's count): (count, token, node, depth) of
        each, by count (descending), then token."""
        if depth < self._depth[node]:  # inside an edge: one continuation, as frequent as the point
            text = self._tokens[self._ref_seq[node]]
            return [(self._count[node], text[self._ref_end[node] - self._depth[node] + depth], node, depth + 1)]
        kids = self._children[node]
        if not kids:
            return []
        count = self._count
        floor = self.heavy_fraction * count[node]
        if min_count < floor:
            raise ValueError(
                f"SuffixTree.continuations: min_count {min_count} is below heavy_fraction x count ({floor}); "
                "lighter children are not indexed"
            )
        if node and len(kids) > HEAVY_LIST_DEGREE:
            heavy = self._heavy.get(node)
            if heavy is None or heavy.threshold > floor:  # none yet, or evictions halved the count: scan
                heavy = self._build_heavy(node)
            elif 4 * heavy.threshold < floor:
                self._tighten_heavy(node, heavy)
            candidates = heavy.members
        else:
            candidates = kids.values()
        below = depth + 1
        found = [(count[c], self._first_token(c), c, below) for c in candidates if count[c] >= min_count]
        found.sort(key=_by_count_then_token)
        return found

    # ------------------------------------------------------------------ inspection

    def memory_bytes(self) -> int:
        """Estimated bytes held: node lists, children dicts, int objects and token arrays (within about 25% of
        what Python allocates, checked in the tests). O(nodes)."""
        lists = (self._parent, self._length, self._depth, self._count, self._ends, self._ref_seq, self._ref_end,
                 self._children, self._free)
        total = sum(sys.getsizeof(values) for values in lists)
        total += sum(map(sys.getsizeof, filter(None, self._children)))
        # int objects outside the small-int cache: about one per node (its id, shared by its parent's dict and its
        # children's parent entries); positions and sequence ids are shared by the nodes one step updates
        total += _INT_BYTES * self.num_nodes
        total += sum(sys.getsizeof(text) for text in self._tokens.values())
        total += sum(sys.getsizeof(active) for active in self._active.values())
        total += sum(sys.getsizeof(heavy.members) + 64 for heavy in self._heavy.values())
        return total

    def check(self) -> None:
        """Raises AssertionError if an invariant of the structure is broken (for tests and debugging; O(nodes))."""
        alive = [node for node in range(len(self._parent)) if node == 0 or self._ref_seq[node] != -1]
        assert len(alive) == self.num_nodes, "free list and live nodes disagree"
        assert self._count[0] == self.num_tokens == sum(len(t) for t in self._tokens.values()), "root count"
        for node in alive:
            kids = self._children[node] or {}
            assert self._count[node] == self._ends[node] + sum(self._count[c] for c in kids.values()), \
                f"node {node}: count is not endpoints plus children"
            heavy = self._heavy.get(node)
            # every node past HEAVY_LIST_DEGREE children has a list (kept, and maintained, if evictions thin it out)
            assert heavy is None if node == 0 else heavy is not None or len(kids) <= HEAVY_LIST_DEGREE, \
                f"node {node}: heavy list"
            if heavy is not None:
                assert set(heavy.members) <= set(kids.values()), f"node {node}: heavy list holds a non-child"
                assert all(c in heavy.members for c in kids.values() if self._count[c] >= heavy.threshold), \
                    f"node {node}: heavy list misses a child"
            for token, child in kids.items():
                assert self._parent[child] == node, f"node {child}: parent"
                assert self._first_token(child) == token, f"node {child}: keyed by another token"
                assert self._depth[child] == self._depth[node] + self._length[child], f"node {child}: depth"
            if node == 0:
                continue
            assert self._length[node] >= 1 and self._depth[node] <= self.max_depth, f"node {node}: length/depth"
            assert self._count[node] >= 1, f"node {node}: empty"
            assert self._ends[node] >= 1 or len(kids) >= 2, f"node {node}: unary without an endpoint"
            seq = self._ref_seq[node]
            text = self._tokens[seq]
            end = self._ref_end[node]
            assert self._depth[node] <= end <= len(text), f"node {node}: reference out of its sequence"
            parent = self._parent[node]
            if parent:
                ptext = self._tokens[self._ref_seq[parent]]
                pend = self._ref_end[parent]
                assert text[end - self._depth[node] : end - self._length[node]] == \
                    ptext[pend - self._depth[parent] : pend], f"node {node}: reference disagrees with the parent"
                assert self._ref_seq[parent] >= seq, f"node {node}: parent refers to an older sequence"
        for seq, active in self._active.items():
            size = len(self._tokens[seq])
            expected = [self._depth[node] for node in active]
            assert expected == list(range(min(size, self.max_depth - 1), 0, -1)), f"sequence {seq}: active suffixes"


def _by_count_then_token(item: tuple[int, int, int, int]) -> tuple[int, int]:
    return -item[0], item[1]
