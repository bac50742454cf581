"""Static tree shapes, written as Medusa-style path lists.

A path lists child ranks from the root: `(0,)` is the root's best child, `(0, 1)` the second-best child of that
child. Node 0 is the root (the last committed token); the other nodes follow in breadth-first order (by depth,
then path), so every parent comes before its children and depth never decreases with the node index.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# One verify forward over more nodes than this is past any useful budget (Medusa's largest preset has 63, EAGLE-2 60).
MAX_TREE_NODES = 512


@dataclass(frozen=True)
class TreeTemplate:
    # per node (node 0 = root): parent index, -1 for the root
    parents: tuple[int, ...]
    # per node: rank of the node among its parent's candidates (0 = best); -1 for the root
    ranks: tuple[int, ...]
    # per node: distance from the root
    depths: tuple[int, ...]

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]]) -> TreeTemplate:
        """Validate a path list and lay it out breadth first. Errors name the offending path."""
        seen: set[tuple[int, ...]] = set()
        normalized = []
        for raw in paths:
            path = tuple(raw)
            if not path:
                raise ValueError("tree paths: the empty path is the root, which is implicit; remove it")
            if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
                raise ValueError(f"tree paths: {path} must hold non-negative int ranks")
            if path in seen:
                raise ValueError(f"tree paths: duplicate path {path}")
            seen.add(path)
            normalized.append(path)
        if not normalized:
            raise ValueError("tree paths: expected at least one path")
        for path in normalized:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree paths: {path} needs its prefix {path[:-1]} (a path list must be a tree)")
        if len(normalized) + 1 > MAX_TREE_NODES:
            raise ValueError(f"tree paths: {len(normalized) + 1} nodes exceed the budget of {MAX_TREE_NODES}")
        ordered = sorted(normalized, key=lambda p: (len(p), p))
        index = {(): 0} | {path: i + 1 for i, path in enumerate(ordered)}
        return cls(
            parents=(-1, *(index[p[:-1]] for p in ordered)),
            ranks=(-1, *(p[-1] for p in ordered)),
            depths=(0, *(len(p) for p in ordered)),
        )

    @classmethod
    def chain(cls, length: int) -> TreeTemplate:
        """The root followed by `length` nodes in one line (0: the root alone)."""
        if length < 0:
            raise ValueError(f"chain length: expected >= 0, got {length}")
        return cls(parents=tuple(range(-1, length)), ranks=(-1,) + (0,) * length, depths=tuple(range(length + 1)))

    @classmethod
    def full(cls, width: int, depth: int) -> TreeTemplate:
        """Every node has `width` children, `depth` levels deep (top-`width` branching everywhere)."""
        if width < 1 or depth < 1:
            raise ValueError(f"tree width and depth: expected >= 1, got width={width}, depth={depth}")
        level: list[tuple[int, ...]] = [()]
        paths = []
        for _ in range(depth):
            level = [p + (r,) for p in level for r in range(width)]
            paths.extend(level)
        return cls.from_paths(paths)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.num_nodes - 1))

    @property
    def max_children(self) -> int:
        """The most children any node has (at least 1)."""
        counts = [0] * self.num_nodes
        for parent in self.parents[1:]:
            counts[parent] += 1
        return max(max(counts), 1)

    @property
    def max_rank(self) -> int:
        """Largest candidate rank used (the proposer needs top-(max_rank + 1) candidates)."""
        return max(self.ranks)


def rank_budget_paths(depth: int, rank_budget: int) -> list[tuple[int, ...]]:
    """Every path up to `depth` whose ranks sum to at most `rank_budget`: candidates of combined rank r are
    kept at every depth, and the list is prefix-closed by construction (a prefix never sums to more)."""
    level: list[tuple[int, ...]] = [()]
    paths: list[tuple[int, ...]] = []
    for _ in range(depth):
        level = [p + (r,) for p in level for r in range(rank_budget - sum(p) + 1)]
        paths.extend(level)
    return paths


def likeliest_rank_paths(
    # [D][R]: at each depth d, the chance that the rank-r candidate there is the next token
    rank_accuracy: Sequence[Sequence[float]],
    num_nodes: int,
) -> list[tuple[int, ...]]:
    """The `num_nodes` rank paths (at most D deep) most likely to be accepted whole, a path's chance being the
    product of its ranks' accuracies at their depths (taken as independent). A path is never likelier than its
    prefix, and ties go to the shorter path, then the lower ranks, so the result is a tree, likeliest first."""
    scored: list[tuple[float, tuple[int, ...]]] = []
    level: list[tuple[float, tuple[int, ...]]] = [(1.0, ())]
    for accuracy in rank_accuracy:
        # only the num_nodes likeliest paths of a level can have children among the num_nodes likeliest overall
        level = sorted(((p * a, path + (r,)) for p, path in level for r, a in enumerate(accuracy)),
                       key=lambda item: (-item[0], item[1]))[:num_nodes]
        scored.extend(level)
    scored.sort(key=lambda item: (-item[0], len(item[1]), item[1]))
    return [path for _, path in scored[:num_nodes]]


# 4 heads, ranks summing to <= 2: 3 + 6 + 10 + 15 = 34 draft nodes (Medusa's preset trees use about 60)
DEFAULT_MEDUSA_TREE = tuple(rank_budget_paths(depth=4, rank_budget=2))


@functools.lru_cache(maxsize=64)
def level_ends(template: TreeTemplate) -> tuple[int, ...]:
    """Where each depth's nodes end in the breadth-first order: depth d is nodes [ends[d - 1], ends[d]), ends[0] = 1
    (the root alone); the nodes at most d deep are the first ends[d] (built once per template)."""
    return tuple(bisect.bisect_right(template.depths, depth) for depth in range(template.max_depth + 1))


@functools.lru_cache(maxsize=64)
def up_to_depth(template: TreeTemplate, depth: int) -> TreeTemplate:
    """The template's nodes at most `depth` deep: a prefix of its breadth-first order, so node indices keep their
    meaning (built once per template and depth)."""
    keep = level_ends(template)[min(max(depth, 0), template.max_depth)]
    return TreeTemplate(parents=template.parents[:keep], ranks=template.ranks[:keep], depths=template.depths[:keep])


@functools.lru_cache(maxsize=16)
def branch_template(width: int, depth: int) -> TreeTemplate:
    """w chains of `depth` tokens under the root, node (d, r) = 1 + (d - 1) * w + r (built once per shape)."""
    return TreeTemplate.from_paths([(r,) + (0,) * d for d in range(depth) for r in range(width)])
