"""The ragged cache: after arbitrary per-row regions (chains and trees, with dummies) and commits of a prefix or a
root-to-node path, logits equal a fresh forward of what each row kept."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.cache import ragged
from hf_specdec.cache.ragged import AttentionLayout, RaggedKVCache
from tests.conftest import make_model, padded_batch


def _reference_next_logits(model, rows: list[list[int]]) -> torch.Tensor:
    """[B, V]: logits after each row's kept tokens, from one left-padded forward without any cache tricks."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
        mask[b, width - len(r) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]


def _random_tree(batch: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents [B, W], ancestors-or-self [B, W, W]) of a random tree per row (node 0 the root)."""
    parents = torch.full((batch, width), -1, dtype=torch.long)
    ancestors = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
    for node in range(1, width):
        parents[:, node] = torch.randint(0, node, (batch,), generator=generator)
        ancestors[:, node] |= ancestors[torch.arange(batch), parents[:, node]]
    return parents, ancestors


def _path(parents: torch.Tensor, row: int, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[row, node])
    return path[::-1]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_regions_and_commits_match_fresh_forward(arch):
    model = make_model(arch)
    ids, mask = padded_batch([9, 4, 7], seed=1)
    kept = [ids[b, mask[b].bool()].tolist() for b in range(3)]
    cache = RaggedKVCache(model)
    generator = torch.Generator().manual_seed(0)
    moved = []
    with torch.no_grad():
        cache.prefill(ids, mask)
        for step in range(12):
            width = 6
            block = torch.randint(3, 100, (3, width), generator=generator)
            num_real = torch.randint(1, width + 1, (3,), generator=generator)
            real = torch.arange(width)[None, :] < num_real[:, None]
            if step % 2:  # a tree: every node sees its ancestors
                parents, ancestors = _random_tree(3, width, generator)
                depths = ancestors.sum(dim=2) - 1
                logits = cache.forward(block, depths, real, ancestors)
            else:  # a chain
                parents = torch.arange(-1, width - 1).expand(3, -1)
                logits = cache.forward(block, torch.arange(width).expand(3, -1), real)
            # the last real node of every row sees exactly its kept tokens plus its path
            last = num_real - 1
            expect = [kept[b] + block[b, _path(parents, b, int(last[b]))].tolist() for b in range(3)]
            torch.testing.assert_close(logits[torch.arange(3), last], _reference_next_logits(model, expect),
                                       rtol=1e-4, atol=1e-4)
            # each row keeps a root-to-node path of real nodes (a chain's prefix, or a tree's path), maybe empty
            ends = [int(torch.randint(-1, int(num_real[b]), (1,), generator=generator)) for b in range(3)]
            paths = [_path(parents, b, end) if end >= 0 else [] for b, end in enumerate(ends)]
            counts = [len(p) for p in paths]
            sources = torch.tensor([p + [0] * (width - len(p)) for p in paths])
            moved.append(step % 2 == 1 or len(set(cache.host_lengths)) > 1)
            cache.commit(torch.tensor(counts), sources if step % 2 else None, kept_on_host=counts)
            for b in range(3):
                kept[b] += block[b, paths[b]].tolist()
            assert cache.lengths.tolist() == [ids.shape[1] - len(kept0) + len(k) for kept0, k in
                                              zip([ids[b, mask[b].bool()].tolist() for b in range(3)], kept)]
            assert cache.width == max(cache.host_lengths) == max(cache.lengths.tolist())
    assert any(moved)


def test_layout_from_config():
    assert AttentionLayout.from_model(make_model("llama")) == AttentionLayout(sliding_window=None, per_layer_type=False)
    assert AttentionLayout.from_model(make_model("mistral")) == AttentionLayout(sliding_window=5, per_layer_type=False)
    assert AttentionLayout.from_model(make_model("gemma2")) == AttentionLayout(sliding_window=6, per_layer_type=True)


def test_an_attention_without_a_stand_in_is_refused_with_an_actionable_error():
    model = make_model("llama")
    model.config._attn_implementation = "paged|eager"
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|eager'.*attn_implementation='sdpa'"):
        AttentionLayout.from_model(model)
    model.config._attn_implementation = "flash_attention_2"  # runs as SDPA (tests/cache/test_attention.py)
    assert AttentionLayout.from_model(model) == AttentionLayout(sliding_window=None, per_layer_type=False)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_unpadded_chains_skip_the_ancestry_mask_and_match_fresh_forward(arch, monkeypatch):
    """With no padding, rows of one length and chains without dummies the cache builds a plain causal mask (or
    none for one query per row) instead of the ancestry mask; every position's logits still equal a fresh
    forward's."""
    model = make_model(arch)
    built = []
    monkeypatch.setattr(ragged, "ancestry_attention_mask", lambda *args: built.append(args))
    generator = torch.Generator().manual_seed(3)
    kept = torch.randint(3, 100, (2, 7), generator=generator)
    cache = RaggedKVCache(model)
    with torch.no_grad():
        cache.prefill(kept, None)
        for width, num_kept in [(1, 1), (4, 2), (1, 0), (5, 5), (3, 1)]:
            block = torch.randint(3, 100, (2, width), generator=generator)
            logits = cache.forward(block, torch.arange(width).expand(2, -1))
            full = torch.cat([kept, block], dim=1)
            expect = model(input_ids=full, position_ids=torch.arange(full.shape[1])[None].expand(2, -1)).logits
            torch.testing.assert_close(logits, expect[:, -width:], rtol=1e-4, atol=1e-4)
            cache.commit(torch.full((2,), num_kept), kept_on_host=[num_kept] * 2)
            kept = torch.cat([kept, block[:, :num_kept]], dim=1)
    assert not built


def test_selected_rows_go_on_as_if_alone():
    model = make_model("llama")
    ids, mask = padded_batch([9, 4, 7], seed=2)
    kept = [ids[b, mask[b].bool()].tolist() for b in range(3)]
    cache = RaggedKVCache(model)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        cache.prefill(ids, mask)
        block = torch.randint(3, 100, (3, 3), generator=generator)
        cache.forward(block, torch.arange(3).expand(3, -1), torch.arange(3)[None, :] < torch.tensor([[3], [1], [2]]))
        cache.commit(torch.tensor([1, 1, 2]), kept_on_host=[1, 1, 2])
        kept = [kept[b] + block[b, :count].tolist() for b, count in enumerate([1, 1, 2])]
        cache.select_rows(torch.tensor([2, 0]), [2, 0])
        kept = [kept[2], kept[0]]
        assert cache.host_lengths == cache.lengths.tolist() == [ids.shape[1] + 2, ids.shape[1] + 1]
        block = torch.randint(3, 100, (2, 2), generator=generator)
        logits = cache.forward(block, torch.arange(2).expand(2, -1))
        expect = _reference_next_logits(model, [kept[b] + block[b].tolist() for b in range(2)])
        torch.testing.assert_close(logits[:, -1], expect, rtol=1e-4, atol=1e-4)


def test_first_allocation_follows_the_expected_length():
    """A call that says how many slots a row can need gets no more at the prefill than that (a long prompt with few
    new tokens does not allocate twice the prompt); without it, twice the prompt; more room still comes by growing."""
    model = make_model("llama")
    ids, mask = padded_batch([40, 33], seed=3)
    for expected_slots, capacity in ((48, 48), (None, 80), (1000, 80)):
        cache = RaggedKVCache(model)
        cache.expected_slots = expected_slots
        with torch.no_grad():
            cache.prefill(ids, mask)
        assert cache.kv.capacity == capacity, expected_slots
        assert cache.kv.buffers()[0][0].shape[2] == capacity
    cache = RaggedKVCache(model)
    cache.expected_slots = 48
    with torch.no_grad():
        cache.prefill(ids, mask)
        logits = cache.forward(ids[:, :12], torch.arange(12).expand(2, -1))  # past the 48 expected: grows
    assert cache.kv.capacity >= 52
    rows = [[int(t) for t, m in zip(i, k) if m] + [int(t) for t in i[:12]] for i, k in zip(ids, mask)]
    torch.testing.assert_close(logits[:, -1], _reference_next_logits(model, rows), rtol=1e-4, atol=1e-4)


def test_one_query_per_row_takes_the_mask_the_ancestry_construction_builds():
    """A step without drafts (one query per row, after rows of different lengths and prompt padding) gets its mask
    directly: the same additive mask as the general construction from each query's ancestry."""
    model = make_model("llama")
    ids, mask = padded_batch([9, 4, 7], seed=5)
    cache = RaggedKVCache(model)
    with torch.no_grad():
        cache.prefill(ids, mask)
        block = torch.randint(3, 100, (3, 3), generator=torch.Generator().manual_seed(6))
        cache.forward(block, torch.arange(3).expand(3, -1))
        cache.commit(torch.tensor([3, 1, 2]), kept_on_host=[3, 1, 2])
    depths = torch.zeros(3, 1, dtype=torch.long)
    cache.region, cache.region_orders = 1, cache.lengths[:, None] + depths
    cache.region_real = torch.ones(3, 1, dtype=torch.bool)
    direct = cache._mask(cache.region_orders, None, 0)
    committed = cache.valid[:, : cache.width] & (cache._slot_orders(cache.width) < cache.lengths[:, None])
    general = ragged.ancestry_attention_mask(committed, cache._slot_orders(cache.width), cache.region_orders,
                                             torch.ones(3, 1, 1, dtype=torch.bool), None, model.dtype,
                                             cache.region_orders, 0)
    assert direct.shape == general.shape == (3, 1, 1, cache.width + 1)
    torch.testing.assert_close(direct, general, rtol=0, atol=0)
    assert (direct[1, 0, 0] < 0).sum() == cache.width - cache.host_lengths[1] + int((mask[1] == 0).sum())
