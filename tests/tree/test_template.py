"""Tree templates from path lists: breadth-first layout and clear errors for anything that is not a tree."""

import pytest

from hf_specdec.tree import MAX_TREE_NODES, TreeTemplate
from hf_specdec.tree.template import level_ends, up_to_depth


def test_breadth_first_layout():
    t = TreeTemplate.from_paths([(1, 0), (0,), (1,), (0, 0), (0, 1)])
    assert t.parents == (-1, 0, 0, 1, 1, 2)
    assert t.ranks == (-1, 0, 1, 0, 1, 0)
    assert t.depths == (0, 1, 1, 2, 2, 2)
    assert (t.num_nodes, t.max_depth, t.max_rank) == (6, 2, 1)


def test_chain_and_full():
    assert TreeTemplate.chain(3).parents == (-1, 0, 1, 2)
    full = TreeTemplate.full(width=2, depth=3)
    assert full.num_nodes == 1 + 2 + 4 + 8 and full.max_depth == 3


@pytest.mark.parametrize(
    ("paths", "match"),
    [
        ([(0,), (0, 1, 0)], r"\(0, 1, 0\) needs its prefix \(0, 1\)"),
        ([(0,), (0,)], r"duplicate path \(0,\)"),
        ([()], "the empty path is the root"),
        ([], "at least one path"),
        ([(0,), (-1,)], "non-negative int ranks"),
        ([(i,) for i in range(MAX_TREE_NODES)], "exceed the budget"),
    ],
)
def test_invalid_path_lists(paths, match):
    with pytest.raises(ValueError, match=match):
        TreeTemplate.from_paths(paths)


@pytest.mark.parametrize(("width", "depth"), [(0, 2), (2, 0)])
def test_full_tree_bounds(width, depth):
    with pytest.raises(ValueError, match="expected >= 1"):
        TreeTemplate.full(width=width, depth=depth)


def test_default_medusa_tree_is_a_prefix_closed_tree_of_34_nodes():
    from hf_specdec.tree.template import DEFAULT_MEDUSA_TREE, rank_budget_paths

    template = TreeTemplate.from_paths(DEFAULT_MEDUSA_TREE)
    assert template.num_nodes == 35 and template.max_depth == 4 and template.max_rank == 2
    assert rank_budget_paths(depth=2, rank_budget=1) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]


def test_up_to_depth_keeps_the_shallower_nodes_in_their_order():
    tree = TreeTemplate.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    cut = up_to_depth(tree, 2)
    assert cut.num_nodes == 6 and cut.max_depth == 2
    assert (cut.parents, cut.ranks) == (tree.parents[:6], tree.ranks[:6])
    assert up_to_depth(tree, 0).num_nodes == 1 and up_to_depth(tree, 3) == tree
    assert up_to_depth(tree, 5) == tree
    # depth d's nodes end at ends[d]: the root, 2 at depth 1, 3 at depth 2, 1 at depth 3
    assert level_ends(tree) == (1, 3, 6, 7)
