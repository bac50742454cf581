"""SuffixTree against brute-force counts on random texts: growth in any order, removal, lookups, the node bound."""

from __future__ import annotations

import random

import pytest

from hf_specdec.suffix import SuffixTree
from hf_specdec.suffix.tree import HEAVY_LIST_DEGREE
from tests.suffix.reference import string_counts


def _assert_counts(tree: SuffixTree, texts, rng: random.Random, vocab: int) -> None:
    tree.check()
    expected = string_counts(texts, tree.max_depth)
    for string, count in expected.items():
        assert tree.count(string) == count, string
    assert tree.num_strings == len(expected)  # nothing extra
    for _ in range(20):
        string = tuple(rng.randrange(vocab + 1) for _ in range(rng.randint(1, tree.max_depth + 1)))
        assert tree.count(string) == expected.get(string, 0)


def test_counts_match_brute_force_under_interleaved_growth_and_removal():
    rng = random.Random(0)
    for _ in range(300):
        vocab, tree = rng.randint(1, 4), SuffixTree(rng.randint(1, 7), heavy_fraction=0.05)
        texts: dict[int, list[int]] = {}
        growing: set[int] = set()
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.15 and texts:
                removed = tree.remove_oldest()
                assert removed == min(texts)
                del texts[removed]
                growing.discard(removed)
            elif roll < 0.4 or not growing:
                seq = tree.new_sequence()
                texts[seq] = []
                growing.add(seq)
            else:
                seq = rng.choice(sorted(growing))
                tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
                tree.extend(seq, tokens)
                texts[seq] += tokens
                if rng.random() < 0.2:
                    tree.finish(seq)
                    growing.discard(seq)
            _assert_counts(tree, list(texts.values()), rng, vocab)


def test_incremental_growth_equals_one_build():
    rng = random.Random(1)
    for _ in range(100):
        max_depth, vocab = rng.randint(1, 8), rng.randint(1, 5)
        texts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 40))] for _ in range(3)]
        built = SuffixTree(max_depth, 0.05)
        for text in texts:
            built.extend(built.new_sequence(), text)
        grown = SuffixTree(max_depth, 0.05)
        seqs = [grown.new_sequence() for _ in texts]
        cursors = [0] * len(texts)
        while any(c < len(t) for c, t in zip(cursors, texts)):  # chunks of random sizes, sequences interleaved
            i = rng.randrange(len(texts))
            step = rng.randint(1, 5)
            grown.extend(seqs[i], texts[i][cursors[i] : cursors[i] + step])
            cursors[i] += step
        grown.check()
        # the compressed tree of a set of strings is unique: same nodes, same strings, same counts
        assert (grown.num_nodes, grown.num_strings, grown.num_tokens) == (built.num_nodes, built.num_strings,
                                                                           built.num_tokens)
        for string in string_counts(texts, max_depth):
            assert grown.count(string) == built.count(string)
        context = texts[0][-max_depth:]
        assert grown.locate(context) != [] or built.locate(context) == []
        assert len(grown.locate(context)) == len(built.locate(context))


def test_locate_finds_every_occurring_suffix_of_the_context():
    rng = random.Random(2)
    for _ in range(200):
        max_depth, vocab = rng.randint(1, 8), rng.randint(1, 4)
        text = [rng.randrange(vocab) for _ in range(rng.randint(0, 50))]
        tree = SuffixTree(max_depth, 0.05)
        tree.extend(tree.new_sequence(), text)
        counts = string_counts([text], max_depth)
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        located = tree.locate(context)
        longest = 0
        while longest < min(len(context), max_depth) and counts[tuple(context[len(context) - longest - 1:])]:
            longest += 1
        assert len(located) == longest
        for m, node in enumerate(located, start=1):
            assert tree.node_count(node) == counts[tuple(context[len(context) - m:])]


def test_continuations_follow_counts_also_through_heavy_lists():
    rng = random.Random(3)
    tree = SuffixTree(4, heavy_fraction=0.05)
    seqs = []
    text = []
    for _ in range(3):  # token 0 followed by many different tokens, a few of them often
        seqs.append(tree.new_sequence())
    for round_ in range(40):
        seq = seqs[round_ % 3]
        frequent = [1, 2, 3] if round_ < 10 else [7, 8]  # 7 and 8 become heavy after the list is built
        follow = [rng.choice(frequent) if rng.random() < 0.6 else rng.randrange(4, 200) for _ in range(25)]
        tokens = [t for f in follow for t in (0, f)]
        tree.extend(seq, tokens)
        text.append((seq, tokens))
        if round_ == 20:  # removal drops the heavy lists; they are rebuilt on the next lookup
            tree.finish(seqs[0])
            tree.remove_oldest()
            seqs[0] = tree.new_sequence()
            text = [(s, t) for s, t in text if s != 0]
        node, depth = tree.find([0])
        total = tree.node_count(node)
        by_seq: dict[int, list[int]] = {}
        for s, tokens in text:
            by_seq.setdefault(s, []).extend(tokens)
        counts = string_counts(list(by_seq.values()), 4)
        expected = sorted((c, s[1]) for s, c in counts.items() if len(s) == 2 and s[0] == 0 and c >= 0.06 * total)
        found = tree.continuations(node, depth, 0.06 * total)
        assert [(c, t) for c, t, _, _ in found] == sorted(expected, key=lambda ct: (-ct[0], ct[1]))
        tree.check()
        if round_ >= 3:  # white box: the lookup went through the heavy list
            assert len(tree._children[node]) > HEAVY_LIST_DEGREE and node in tree._heavy


def test_nodes_stay_within_two_per_token_and_removal_frees_everything():
    rng = random.Random(4)
    tree = SuffixTree(24, 0.05)
    for _ in range(30):
        tree.extend(tree.new_sequence(), [rng.randrange(50) for _ in range(rng.randint(50, 200))])
        assert tree.num_nodes <= 2 * tree.num_tokens + 1
    while tree.num_sequences:
        tree.remove_oldest()
    tree.check()
    assert (tree.num_nodes, tree.num_tokens, tree.num_strings) == (1, 0, 0)
    assert tree.count([1]) == 0 and tree.locate([1, 2]) == []


def test_misuse_is_refused():
    tree = SuffixTree(3, 0.1)
    with pytest.raises(ValueError, match="no sequence"):
        tree.remove_oldest()
    seq = tree.new_sequence()
    tree.extend(seq, [1, 2])
    tree.finish(seq)
    with pytest.raises(ValueError, match="sequence 0 is finished"):
        tree.extend(seq, [3])
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0, 0.1)
    with pytest.raises(ValueError, match="heavy_fraction"):
        SuffixTree(3, 0.0)


def test_heavy_lists_stay_complete_while_outputs_come_and_go():
    rng = random.Random(5)
    tree = SuffixTree(3, heavy_fraction=0.05)
    texts: dict[int, list[int]] = {}
    for round_ in range(40):
        hot = [1 + (round_ // 8 + i) % 12 for i in range(3)]  # the frequent successors change over time
        text = [t for _ in range(60) for t in (0, rng.choice(hot) if rng.random() < 0.5 else rng.randrange(13, 90))]
        seq = tree.new_sequence()
        tree.extend(seq, text)
        texts[seq] = text
        if len(texts) > 4:
            del texts[tree.remove_oldest()]
        tree.check()  # includes: every child above a heavy list's threshold is on it
        counts = string_counts(list(texts.values()), 3)
        node, depth = tree.find([0])
        total = tree.node_count(node)
        for fraction in (0.05, 0.1, 0.3):
            expected = sorted((-c, s[1]) for s, c in counts.items() if len(s) == 2 and s[0] == 0 and
                              c >= fraction * total)
            found = tree.continuations(node, depth, fraction * total)
            assert [(-c, t) for c, t, _, _ in found] == expected
    assert node in tree._heavy  # white box: the lookups went through the heavy list


def test_a_child_made_heavy_by_an_eviction_is_found():
    tree = SuffixTree(2, heavy_fraction=0.05)
    tree.extend(tree.new_sequence(), [t for r in range(100, 500) for t in (0, r)])  # 0, then 400 different tokens
    # 0 then 5 three times (light next to the 400), and 0 then 20 other tokens once each
    tree.extend(tree.new_sequence(), [0, 5] * 3 + [t for r in range(600, 620) for t in (0, r)])
    node, depth = tree.find([0])
    assert [t for _, t, _, _ in tree.continuations(node, depth, 0.05 * tree.node_count(node))] == []
    tree.remove_oldest()  # the 400 go: 5 now follows 0 in 3 of 23 cases
    node, depth = tree.find([0])
    assert len(tree._children[node]) > HEAVY_LIST_DEGREE  # white box: still answered from the heavy list
    assert [(c, t) for c, t, _, _ in tree.continuations(node, depth, 0.05 * tree.node_count(node))] == [(3, 5)]
    tree.check()
