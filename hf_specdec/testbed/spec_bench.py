"""Chat workloads for chat models: Spec-Bench's 480 questions and 40 coding requests, through the chat template.

Spec-Bench (github.com/hemingkx/Spec-Bench, Apache-2.0; `data/spec_bench/NOTICE.md`) has six categories of 80
questions: multi-turn conversation (`mt_bench`: MT-bench's questions, recorded under their own MT-bench categories in
the file), translation, summarization, question answering (`qa`), mathematical reasoning (`math_reasoning`) and
retrieval-augmented generation (`rag`). The `code` category holds chat-style coding requests written for this
library (`data/code_requests.jsonl`). A prompt is a question's first turn, rendered with the tokenizer's chat
template (with the generation prompt). Subsets are fixed by a seed: the same questions on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

WORKLOAD_VERSION = 1
DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = DATA / "spec_bench" / "question.jsonl"
CODE_REQUESTS = DATA / "code_requests.jsonl"
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
CODE_CATEGORY = "code"
CATEGORIES = (*SPEC_BENCH_CATEGORIES, CODE_CATEGORY)
# MT-bench's own categories, which Spec-Bench's file keeps for its multi-turn questions
MT_BENCH_SUBCATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
PER_CATEGORY = {**{category: 80 for category in SPEC_BENCH_CATEGORIES}, CODE_CATEGORY: 40}


@dataclass(frozen=True)
class SpecBenchQuestion:
    question_id: int
    category: str  # one of CATEGORIES
    turns: tuple[str, ...]


def _read(path: Path) -> list[SpecBenchQuestion]:
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
            category = record["category"]
            turns = tuple(record["turns"])
            question_id = int(record["question_id"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a question record ({error}); the file is damaged") from error
        category = "mt_bench" if category in MT_BENCH_SUBCATEGORIES else category
        if category not in CATEGORIES or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}:{number}: unknown category {record['category']!r} or empty turns")
        questions.append(SpecBenchQuestion(question_id, category, turns))
    return questions


def load_questions() -> list[SpecBenchQuestion]:
    """Spec-Bench's 480 questions, then the 40 coding requests, checked for their counts per category."""
    questions = _read(QUESTIONS) + _read(CODE_REQUESTS)
    counts = {category: sum(q.category == category for q in questions) for category in CATEGORIES}
    if counts != PER_CATEGORY or len({q.question_id for q in questions}) != len(questions):
        raise ValueError(f"{DATA}: expected {PER_CATEGORY} questions with unique ids, found {counts}; the data files "
                         "are damaged")
    return questions


def spec_bench_prompts(
    tokenizer: PreTrainedTokenizerBase,
    num_per_category: int | None = None,
    categories: Sequence[str] | None = None,
    seed: int = 0,
) -> list[tuple[str, list[int]]]:
    """(category, prompt token ids) for each question's first turn through the chat template, category by category
    (default: Spec-Bench's six). `num_per_category` picks a seeded subset of each category (all when None)."""
    categories = tuple(SPEC_BENCH_CATEGORIES if categories is None else categories)
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown or not categories:
        raise ValueError(f"categories: unknown {unknown or 'none given'}; expected some of {list(CATEGORIES)}")
    if num_per_category is not None and (isinstance(num_per_category, bool) or not isinstance(num_per_category, int)
                                         or num_per_category < 1):
        raise ValueError(f"num_per_category: expected an int >= 1 or None, got {num_per_category!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer: {type(tokenizer).__name__} has no chat template; Spec-Bench prompts are for chat (instruct) "
            "models"
        )
    questions = load_questions()
    prompts = []
    for category in categories:
        mine = sorted((q for q in questions if q.category == category), key=lambda q: q.question_id)
        if num_per_category is not None and num_per_category < len(mine):
            chosen = set(random.Random(f"{seed}-{category}").sample(range(len(mine)), num_per_category))
            mine = [q for i, q in enumerate(mine) if i in chosen]
        for question in mine:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
            prompts.append((category, list(ids)))
    return prompts
