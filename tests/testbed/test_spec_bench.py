"""The chat workloads: Spec-Bench's questions and the coding requests, fixed counts, seeded subsets, the chat
template applied, and clear errors."""

from __future__ import annotations

import copy
import json
import random

import pytest

from hf_specdec.testbed import load_testbed, spec_bench
from hf_specdec.testbed.spec_bench import (
    CODE_CATEGORY,
    SPEC_BENCH_CATEGORIES,
    WORKLOAD_VERSION,
    code_requests,
    load_spec_bench,
    spec_bench_prompts,
)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def plain_tokenizer():
    return load_testbed()[0]


@pytest.fixture(scope="module")
def tokenizer(plain_tokenizer):
    chat = copy.deepcopy(plain_tokenizer)
    chat.chat_template = TEMPLATE
    return chat


def test_spec_bench_counts_and_categories():
    questions = load_spec_bench()
    assert len(questions) == 480 and len({q.question_id for q in questions}) == 480
    assert SPEC_BENCH_CATEGORIES == ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
    assert {c: sum(q.category == c for q in questions) for c in SPEC_BENCH_CATEGORIES} == dict.fromkeys(
        SPEC_BENCH_CATEGORIES, 80)
    mt_bench = [q for q in questions if q.category == "mt_bench"]
    assert {q.question_id for q in mt_bench} == set(range(81, 161)) and all(len(q.turns) == 2 for q in mt_bench)
    assert all(len(q.turns) == 1 for q in questions if q.category != "mt_bench")
    with pytest.raises(AttributeError):
        questions[0].category = "qa"  # frozen


def test_code_requests():
    requests = code_requests()
    assert [q.question_id for q in requests] == list(range(1001, 1041))
    assert {q.category for q in requests} == {CODE_CATEGORY} and all(len(q.turns) == 1 for q in requests)
    assert len({q.turns[0] for q in requests}) == 40 and all(q.turns[0].startswith("Write a") for q in requests)
    assert not {q.question_id for q in requests} & {q.question_id for q in load_spec_bench()}


def test_prompts_go_through_the_chat_template(tokenizer):
    prompts = spec_bench_prompts(tokenizer, num_per_category=3, categories=["translation", "code"])
    assert [c for c, _ in prompts] == ["translation"] * 3 + ["code"] * 3
    assert WORKLOAD_VERSION == 1
    by_id = {q.question_id: q for q in code_requests()}
    chosen = sorted(random.Random(0).sample(sorted(by_id), 3))
    for (_, ids), question_id in zip(prompts[3:], chosen):
        expected = f"<|user|>{by_id[question_id].turns[0]}\n<|assistant|>"
        assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    # the multi-turn questions are prompted with their first turn only
    first = load_spec_bench()[0]
    text = tokenizer.decode(spec_bench_prompts(tokenizer, categories=["mt_bench"])[0][1])
    assert text == f"<|user|>{first.turns[0]}\n<|assistant|>"


def test_subsets_are_seeded(tokenizer):
    first = spec_bench_prompts(tokenizer, num_per_category=5)
    assert [c for c, _ in first] == [c for c in SPEC_BENCH_CATEGORIES for _ in range(5)]
    assert first == spec_bench_prompts(tokenizer, num_per_category=5)
    assert first != spec_bench_prompts(tokenizer, num_per_category=5, seed=1)
    # a category's subset does not depend on which other categories are asked for
    assert spec_bench_prompts(tokenizer, num_per_category=5, categories=["qa"]) == first[15:20]
    assert len(spec_bench_prompts(tokenizer, categories=["qa"])) == 80
    mixed = spec_bench_prompts(tokenizer, categories=["code", "rag"])
    assert [c for c, _ in mixed] == ["code"] * 40 + ["rag"] * 80  # in the order asked for


def test_the_subset_is_the_documented_one(tokenizer):
    """Sorted by question_id, then random.Random(seed).sample: what users can reproduce without the library."""
    rag = sorted((q for q in load_spec_bench() if q.category == "rag"), key=lambda q: q.question_id)
    picked = sorted(random.Random(7).sample(rag, 4), key=lambda q: q.question_id)
    texts = [tokenizer.decode(ids) for _, ids in spec_bench_prompts(tokenizer, 4, ["rag"], seed=7)]
    assert texts == [f"<|user|>{q.turns[0]}\n<|assistant|>" for q in picked]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(categories=["poetry"]), r"categories: unknown \['poetry'\]; expected some of \['mt_bench', "),
        (dict(categories=[]), "categories: unknown none given"),
        (dict(categories="qa"), r"categories: expected a sequence of category names, got the string 'qa'"),
        (dict(categories=["qa", "qa"]), r"names a category twice"),
        (dict(num_per_category=0), "num_per_category: expected an int >= 1 or None"),
        (dict(num_per_category=2.0), "num_per_category: expected an int >= 1 or None"),
        (dict(num_per_category=41, categories=["qa", "code"]),
         r"num_per_category: 41 asked, but these categories hold fewer questions: \{'code': 40\}"),
        (dict(seed="0"), "seed: expected an int, got '0'"),
    ],
)
def test_bad_arguments(tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        spec_bench_prompts(tokenizer, **kwargs)


def test_a_tokenizer_without_a_chat_template(plain_tokenizer):
    assert not plain_tokenizer.chat_template
    with pytest.raises(ValueError, match="has no chat template; the Spec-Bench and code workloads are for chat"):
        spec_bench_prompts(plain_tokenizer, categories=["code"])


def _damage(tmp_path, monkeypatch, edit):
    lines = spec_bench.QUESTIONS.read_text(encoding="utf-8").splitlines()
    damaged = tmp_path / "question.jsonl"
    damaged.write_text("\n".join(edit(lines)) + "\n", encoding="utf-8")
    monkeypatch.setattr(spec_bench, "QUESTIONS", damaged)


def _retag(line: str, **fields) -> str:
    return json.dumps({**json.loads(line), **fields})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda lines: lines[:-1], r"expected \{.*\} questions with unique ids, found \{.*'rag': 79\}"),
        (lambda lines: lines + lines[-1:], r"'rag': 81\} \(duplicate ids: \[560\]\)"),
        (lambda lines: lines[:5] + [lines[5][:40]] + lines[6:], r"question.jsonl:6: not a question record"),
        (lambda lines: [_retag(lines[0], category="poetry")] + lines[1:], r":1: expected an int question_id.*'poetry'"),
        (lambda lines: [_retag(lines[0], turns=[])] + lines[1:], r":1: expected an int question_id.*turns='\[\]'"),
        (lambda lines: [_retag(lines[0], question_id="81")] + lines[1:], r":1: .*question_id='81'"),
    ],
)
def test_a_damaged_file_is_refused(tmp_path, monkeypatch, edit, match):
    _damage(tmp_path, monkeypatch, edit)
    with pytest.raises(ValueError, match=match):
        load_spec_bench()


def test_the_subset_does_not_depend_on_the_file_order(tokenizer, tmp_path, monkeypatch):
    before = spec_bench_prompts(tokenizer, num_per_category=4, categories=["summarization"])
    _damage(tmp_path, monkeypatch, lambda lines: random.Random(3).sample(lines, len(lines)))
    assert spec_bench_prompts(tokenizer, num_per_category=4, categories=["summarization"]) == before
