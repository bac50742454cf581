"""`permuted`: the same segmentation under other ids, and a draft whose logits follow its tokens to their new ids."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.testbed import load_testbed
from hf_specdec.testbed.other_tokenizer import permuted

TEXTS = ["def parse_args(argv):\n    return argv[1:]\n", "import os, sys  # ünïcödé 日本語\n\tx = {'a': 1}"]


@pytest.fixture(scope="module")
def testbed_permuted():
    tokenizer, _, draft = load_testbed()
    other, moved = permuted(tokenizer, draft)
    return tokenizer, draft, other, moved


def test_segmentation_is_the_same_and_the_ids_differ(testbed_permuted):
    tokenizer, _, other, _ = testbed_permuted
    for text in TEXTS:
        ids, other_ids = tokenizer(text)["input_ids"], other(text)["input_ids"]
        assert tokenizer.convert_ids_to_tokens(ids) == other.convert_ids_to_tokens(other_ids)
        assert sum(a != b for a, b in zip(ids, other_ids)) > len(ids) // 2
        assert other.decode(other_ids) == text
    assert other.all_special_ids == tokenizer.all_special_ids
    assert (other.eos_token_id, other.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len(other) == len(tokenizer)


def test_draft_rows_follow_their_tokens_and_the_vocabularies_differ_in_size(testbed_permuted):
    tokenizer, draft, other, moved = testbed_permuted
    assert moved.config.vocab_size == len(tokenizer) + 64 != draft.config.vocab_size
    assert draft.get_input_embeddings().weight.shape[0] == len(tokenizer)  # the original is left as it was
    ids, other_ids = (t(TEXTS[0], return_tensors="pt")["input_ids"] for t in (tokenizer, other))
    to_other = torch.tensor(other.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(range(len(tokenizer)))))
    with torch.no_grad():
        logits, other_logits = draft(ids).logits, moved(other_ids).logits
    torch.testing.assert_close(other_logits[..., to_other], logits)
    # padded rows score the mean logit: below the best token's
    assert (other_logits[..., len(tokenizer):].amax(-1) < logits.amax(-1)).all()


def test_same_seed_same_ids_other_seed_other_ids(testbed_permuted):
    tokenizer, draft, other, _ = testbed_permuted
    again, _ = permuted(tokenizer, draft, seed=0)
    elsewhere, _ = permuted(tokenizer, draft, seed=1)
    assert again(TEXTS[0])["input_ids"] == other(TEXTS[0])["input_ids"] != elsewhere(TEXTS[0])["input_ids"]
