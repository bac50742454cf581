"""Chat workloads for chat models: Spec-Bench's 480 questions and 40 coding requests, through the chat template.

Spec-Bench (github.com/hemingkx/Spec-Bench, Apache-2.0; see `data/spec_bench/LICENSE-NOTICE.md`) has six categories
of 80 questions: multi-turn conversation (`mt_bench`: MT-bench's questions, recorded under their own MT-bench
categories in the file), translation, summarization, question answering (`qa`), mathematical reasoning
(`math_reasoning`) and retrieval-augmented generation (`rag`). The `code` category holds 40 chat-style coding
requests written for this library (`data/code_requests.jsonl`). A prompt is a question's first turn, rendered with
the tokenizer's chat template (with the generation prompt). Subsets are fixed by a seed: the same questions on every
machine. Benchmark results cite `WORKLOAD_VERSION`, which changes whenever the prompts a call returns change.
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
SPEC_BENCH_PER_CATEGORY = 80
NUM_CODE_REQUESTS = 40


@dataclass(frozen=True)
class SpecBenchQuestion:
    question_id: int
    category: str  # one of CATEGORIES (MT-bench's own categories read as "mt_bench")
    turns: tuple[str, ...]  # the user's turns; prompts use the first


def _read(path: Path, counts: dict[str, int]) -> list[SpecBenchQuestion]:
    """The questions of one JSONL file, checked line by line and against `counts` (questions per category)."""
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            record = json.loads(line)
            category, turns, question_id = record["category"], record["turns"], record["question_id"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a question record ({error!r}); the file is damaged: restore it "
                             "from the hf_specdec package") from error
        category = "mt_bench" if category in MT_BENCH_SUBCATEGORIES else category
        if (category not in counts or isinstance(question_id, bool) or not isinstance(question_id, int)
                or not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns)):
            raise ValueError(f"{path}:{number}: expected an int question_id, a category among {list(counts)} and "
                             f"non-empty text turns, got question_id={question_id!r}, category={category!r}, "
                             f"turns={str(turns)[:80]!r}; the file is damaged: restore it from the hf_specdec package")
        questions.append(SpecBenchQuestion(question_id, category, tuple(turns)))
    found = {category: sum(q.category == category for q in questions) for category in counts}
    ids = [q.question_id for q in questions]
    if found != counts or len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"{path}: expected {counts} questions with unique ids, found {found} (duplicate ids: "
                         f"{duplicates}); the file is damaged: restore it from the hf_specdec package")
    return questions


def load_spec_bench() -> list[SpecBenchQuestion]:
    """Spec-Bench's 480 questions in the file's order, 80 per category of `SPEC_BENCH_CATEGORIES`."""
    return _read(QUESTIONS, {category: SPEC_BENCH_PER_CATEGORY for category in SPEC_BENCH_CATEGORIES})


def code_requests() -> list[SpecBenchQuestion]:
    """The 40 chat-style coding requests (category `code`, ids 1001-1040), one turn each."""
    return _read(CODE_REQUESTS, {CODE_CATEGORY: NUM_CODE_REQUESTS})


def _check_arguments(tokenizer, num_per_category, categories, seed) -> tuple[str, ...]:
    if isinstance(categories, str):
        raise ValueError(f"categories: expected a sequence of category names, got the string {categories!r}; "
                         f"pass [{categories!r}]")
    chosen = tuple(SPEC_BENCH_CATEGORIES if categories is None else categories)
    unknown = [c for c in chosen if c not in CATEGORIES]
    if unknown or not chosen:
        raise ValueError(f"categories: unknown {unknown or 'none given'}; expected some of {list(CATEGORIES)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"categories: {list(chosen)} names a category twice; name each once")
    if num_per_category is not None and (isinstance(num_per_category, bool) or not isinstance(num_per_category, int)
                                         or num_per_category < 1):
        raise ValueError(f"num_per_category: expected an int >= 1 or None (every question), got {num_per_category!r}")
    sizes = {c: NUM_CODE_REQUESTS if c == CODE_CATEGORY else SPEC_BENCH_PER_CATEGORY for c in chosen}
    too_small = {c: size for c, size in sizes.items() if num_per_category is not None and size < num_per_category}
    if too_small:
        raise ValueError(f"num_per_category: {num_per_category} asked, but these categories hold fewer questions: "
                         f"{too_small}; pass at most {min(too_small.values())}, or None for every question")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer: {type(tokenizer).__name__} has no chat template; the Spec-Bench and code "
                         "workloads are for chat (instruct) models: load the model's chat tokenizer, or set "
                         "tokenizer.chat_template")
    return chosen


def spec_bench_prompts(
    tokenizer: PreTrainedTokenizerBase,
    num_per_category: int | None = None,
    categories: Sequence[str] | None = None,
    seed: int = 0,
) -> list[tuple[str, list[int]]]:
    """(category, prompt token ids) for each question's first turn through the chat template (no system prompt
    unless the template adds one), category by category in the order given (default: Spec-Bench's six; `"code"`
    adds the coding requests). `num_per_category` picks the same seeded subset of each category on every machine
    (questions sorted by id, then `random.Random(seed).sample`; kept in id order); None takes every question."""
    chosen = _check_arguments(tokenizer, num_per_category, categories, seed)
    questions = load_spec_bench() if set(chosen) & set(SPEC_BENCH_CATEGORIES) else []
    questions += code_requests() if CODE_CATEGORY in chosen else []
    prompts = []
    for category in chosen:
        mine = sorted((q for q in questions if q.category == category), key=lambda q: q.question_id)
        if num_per_category is not None:
            mine = sorted(random.Random(seed).sample(mine, num_per_category), key=lambda q: q.question_id)
        prompts += [(category, render_chat(tokenizer, [{"role": "user", "content": q.turns[0]}])) for q in mine]
    return prompts


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of a conversation (`{"role": ..., "content": ...}` messages) through the tokenizer's chat
    template, ending with the generation prompt (the assistant's turn to answer)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
