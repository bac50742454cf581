"""The repeated-task workload: fixed by its seed, first passes first, variations small, second turns after the
model's own first answers."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from hf_specdec.testbed import loading
from hf_specdec.testbed.repeated_tasks import CATEGORY, repeated_task_prompts, vary

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(loading.testbed_dir() / "tokenizer")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_variations_change_numbers_identifiers_or_one_word():
    rng = random.Random(0)
    assert vary("Return the n-th value; handle n = 0 and 12 items.", rng) != "Return the n-th value; handle n = 0 and 12 items."
    changed = vary("Write a Python class BankAccount with deposit, using collections.OrderedDict.", random.Random(1))
    assert "BankAccount" in changed and changed != "Write a Python class BankAccount with deposit, using collections.OrderedDict."
    assert "collections.OrderedDict" in changed  # library names stay
    assert vary("Write a Python function that sorts a list.", random.Random(2)) != "Write a Python function that sorts a list."


def test_session_is_fixed_and_ordered(tokenizer):
    answers = []

    def answer(ids):
        answers.append(ids)
        return f"answer {len(answers)}"

    prompts = repeated_task_prompts(tokenizer, answer, num_per_part=3)
    assert len(prompts) == 12 and {category for category, _ in prompts} == {CATEGORY}
    texts = [tokenizer.decode(ids) for _, ids in prompts]
    assert answers == [ids for _, ids in prompts[3:6]]  # the MT-bench first turns were answered
    for number in (1, 2, 3):
        assert f"answer {number}" in texts[8 + number]  # each second turn holds its first answer
    for first, again in zip(texts[:3], texts[6:9]):  # each coding request again, slightly varied
        assert first != again and abs(len(first) - len(again)) < 40
    assert repeated_task_prompts(tokenizer, lambda ids: "x", num_per_part=3)[:9] == prompts[:9]


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match=r"num_per_part: expected an int in \[1, 40\]"):
        repeated_task_prompts(tokenizer, lambda ids: "", num_per_part=0)
    plain = AutoTokenizer.from_pretrained(loading.testbed_dir() / "tokenizer")
    plain.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        repeated_task_prompts(plain, lambda ids: "")
