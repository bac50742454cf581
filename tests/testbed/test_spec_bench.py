"""The chat workloads: Spec-Bench's questions and the coding requests, fixed counts, seeded subsets, the chat
template applied, and clear errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hf_specdec.testbed import spec_bench
from hf_specdec.testbed import loading
from hf_specdec.testbed.spec_bench import CATEGORIES, SPEC_BENCH_CATEGORIES, load_questions, spec_bench_prompts

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(loading.testbed_dir() / "tokenizer")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_the_questions_and_their_categories():
    questions = load_questions()
    assert len(questions) == 520 and len({q.question_id for q in questions}) == 520
    counts = {c: sum(q.category == c for q in questions) for c in CATEGORIES}
    assert counts == {"mt_bench": 80, "translation": 80, "summarization": 80, "qa": 80, "math_reasoning": 80,
                      "rag": 80, "code": 40}
    mt_bench = [q for q in questions if q.category == "mt_bench"]
    assert {q.question_id for q in mt_bench} == set(range(81, 161)) and all(len(q.turns) == 2 for q in mt_bench)


def test_prompts_go_through_the_chat_template(tokenizer):
    prompts = spec_bench_prompts(tokenizer, num_per_category=3, categories=["translation", "code"])
    assert [c for c, _ in prompts] == ["translation"] * 3 + ["code"] * 3
    text = tokenizer.decode(prompts[-1][1])
    assert text.startswith("<|user|>Write a Python") and text.endswith("<|assistant|>")


def test_subsets_are_seeded(tokenizer):
    first = spec_bench_prompts(tokenizer, num_per_category=5)
    assert [c for c, _ in first] == [c for c in SPEC_BENCH_CATEGORIES for _ in range(5)]
    assert first == spec_bench_prompts(tokenizer, num_per_category=5)
    assert first != spec_bench_prompts(tokenizer, num_per_category=5, seed=1)
    assert len(spec_bench_prompts(tokenizer, categories=["qa"])) == 80


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(categories=["poetry"]), r"categories: unknown \['poetry'\]; expected some of"),
        (dict(categories=[]), "categories: unknown none given"),
        (dict(num_per_category=0), "num_per_category: expected an int >= 1 or None, got 0"),
    ],
)
def test_bad_arguments(tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        spec_bench_prompts(tokenizer, **kwargs)


def test_a_tokenizer_without_a_chat_template():
    plain = AutoTokenizer.from_pretrained(loading.testbed_dir() / "tokenizer")
    with pytest.raises(ValueError, match="has no chat template; Spec-Bench prompts are for chat"):
        spec_bench_prompts(plain)


def test_a_damaged_file_is_named(tmp_path, monkeypatch):
    damaged = tmp_path / "question.jsonl"
    damaged.write_text(spec_bench.QUESTIONS.read_text()[:5000])
    monkeypatch.setattr(spec_bench, "QUESTIONS", damaged)
    with pytest.raises(ValueError, match="question.jsonl"):
        load_questions()
