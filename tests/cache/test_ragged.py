"""The ragged cache: after arbitrary per-row rollbacks and compactions, logits equal a fresh forward of what was kept."""

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


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_ragged_rollbacks_match_fresh_forward(arch, monkeypatch):
    monkeypatch.setattr(ragged, "MIN_HOLES_BEFORE_COMPACTION", 4)
    model = make_model(arch)
    ids, mask = padded_batch([9, 4, 7], seed=1)
    kept = [ids[b, mask[b].bool()].tolist() for b in range(3)]
    cache = RaggedKVCache(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cache.prefill(ids, mask)
        compactions = 0
        for step in range(30):
            width = 6
            block = torch.randint(3, 100, (3, width), generator=generator)
            num_real = torch.randint(1, width + 1, (3,), generator=generator)
            mark = cache.mark()
            logits = cache.forward(block, num_real)
            # the last real position of every row sees exactly its kept tokens plus the block so far
            expect_rows = [kept[b] + block[b, : int(num_real[b])].tolist() for b in range(3)]
            last = logits[torch.arange(3), num_real - 1]
            torch.testing.assert_close(last, _reference_next_logits(model, expect_rows), rtol=1e-4, atol=1e-4)
            # one row in turn keeps a random prefix of its block, the others nothing: the slot axis grows about
            # three times faster than any row, so holes outnumber tokens and get compacted
            num_kept = torch.zeros(3, dtype=torch.long)
            num_kept[step % 3] = torch.randint(0, int(num_real[step % 3]) + 1, (1,), generator=generator)
            cache.rollback(mark, num_kept)
            for b in range(3):
                kept[b] += block[b, : int(num_kept[b])].tolist()
            compactions += cache.num_slots < mark.num_slots  # below where the step started: squeezed
            longest = max(len(r) for r in kept)
            assert cache.num_slots <= 2 * longest + ragged.MIN_HOLES_BEFORE_COMPACTION + width
            assert cache.next_position.tolist() == [len(r) for r in kept]
    assert compactions > 0, "the test should exercise compaction"


def test_layout_from_config():
    assert AttentionLayout.from_model(make_model("llama")) == AttentionLayout(sliding_window=None, per_layer_type=False)
    assert AttentionLayout.from_model(make_model("mistral")) == AttentionLayout(sliding_window=5, per_layer_type=False)
    assert AttentionLayout.from_model(make_model("gemma2")) == AttentionLayout(sliding_window=6, per_layer_type=True)


def test_flash_attention_is_refused_with_an_actionable_error():
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        AttentionLayout.from_model(model)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_unpadded_chains_skip_the_ancestry_mask_and_match_fresh_forward(arch, monkeypatch):
    """With no padding, holes or dummies the cache builds a plain causal mask (or none for one query per row)
    instead of the ancestry mask; every position's logits still equal a fresh forward's."""
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
            mark = cache.mark()
            logits = cache.forward(block, torch.full((2,), width))
            full = torch.cat([kept, block], dim=1)
            expect = model(input_ids=full, position_ids=torch.arange(full.shape[1])[None].expand(2, -1)).logits
            torch.testing.assert_close(logits, expect[:, -width:], rtol=1e-4, atol=1e-4)
            cache.rollback(mark, torch.full((2,), num_kept))
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
        mark = cache.mark()
        cache.forward(block, torch.tensor([3, 1, 2]))
        cache.rollback(mark, torch.tensor([1, 1, 2]))
        kept = [kept[b] + block[b, :count].tolist() for b, count in enumerate([1, 1, 2])]
        cache.select_rows(torch.tensor([2, 0]))
        kept = [kept[2], kept[0]]
        assert cache.next_position.tolist() == [len(r) for r in kept]
        block = torch.randint(3, 100, (2, 2), generator=generator)
        logits = cache.forward(block, torch.tensor([2, 2]))
        expect = _reference_next_logits(model, [kept[b] + block[b].tolist() for b in range(2)])
        torch.testing.assert_close(logits[:, -1], expect, rtol=1e-4, atol=1e-4)
