"""The repeated-task workload: requests that come back, as in agent loops, code edits and multi-turn chat, where a
cache of earlier outputs (suffix decoding) has something to draft from that the request's own prompt lacks.

One session, in order (the cross-request effect needs the order: run it at batch size 1, or batches in order):

1. first pass: `num_per_part` coding requests (`data/code_requests.jsonl`) and `num_per_part` MT-bench questions
   (Spec-Bench's `mt_bench` category), first turns;
2. again: each coding request issued again with small variations (`vary`: its numbers changed, identifiers renamed,
   or one word swapped for a synonym: the same task reworded, as a user or an agent repeats it), and each MT-bench
   question's second turn after its first (the model's own answer to the first turn in the conversation; MT-bench's
   second turns mostly ask to rewrite, extend or critique that answer).

Subsets and variations are fixed by a seed, so every machine gets the same requests; the second turns hold the
target's own greedy answers (`answer`), so they depend on the model, as in any multi-turn benchmark. Benchmark
results cite `REPEATED_TASKS_VERSION`, which changes whenever the requests a call returns change.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from hf_specdec.testbed.spec_bench import SpecBenchQuestion, code_requests, load_spec_bench, render_chat

REPEATED_TASKS_VERSION = 1
CATEGORY = "repeat"
# words swapped for a synonym when a request has no number or identifier to change
SYNONYMS = {"list": "sequence", "string": "text", "returns": "gives back", "function": "helper function",
            "dictionary": "dict", "number": "value", "file": "document", "checks": "tests", "computes": "calculates",
            "Write": "Please write", "integer": "whole number", "words": "tokens"}
IDENTIFIER = re.compile(r"(?<!\.)\b(?:[A-Z][a-z]+[A-Z]\w*|[a-z]+_[a-z_]+|[A-Z][a-z]{3,}(?=\s+with\b))\b")
NUMBER = re.compile(r"(?<![\w.])\d+(?![\w.])")
RENAMES = ("New", "Custom", "Simple", "My")


def vary(text: str, rng: random.Random) -> str:
    """`text` with small changes: its numbers shifted, its identifiers (CamelCase, snake_case, a class name before
    "with") renamed; when it has neither, one word swapped for a synonym."""
    changed = NUMBER.sub(lambda match: str(int(match.group()) + rng.randint(1, 9)), text)
    prefix = rng.choice(RENAMES)
    changed = IDENTIFIER.sub(
        lambda match: (f"{prefix.lower()}_{match.group()}" if "_" in match.group() else prefix + match.group()),
        changed)
    if changed != text:
        return changed
    present = [word for word in SYNONYMS if re.search(rf"\b{word}\b", text)]
    word = rng.choice(present) if present else "Write"
    return re.sub(rf"\b{word}\b", SYNONYMS[word], text, count=1) if present else f"{text} Thanks."


def greedy_answers(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                   max_new_tokens: int) -> Callable[[list[int]], str]:
    """`answer` for `repeated_task_prompts`: `model`'s greedy answer text to a prompt (plain `generate`)."""

    def answer(ids: list[int]) -> str:
        prompt = torch.tensor([ids], device=model.device)
        out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return answer


def repeated_task_prompts(
    tokenizer: PreTrainedTokenizerBase,
    answer: Callable[[list[int]], str],
    num_per_part: int = 8,
    seed: int = 0,
) -> list[tuple[str, list[int]]]:
    """(CATEGORY, prompt token ids) for the session above: 4 * `num_per_part` requests, the first passes first.
    `answer(prompt ids)` gives the model's answer text to an MT-bench first turn (for the second turn's
    context)."""
    if isinstance(num_per_part, bool) or not isinstance(num_per_part, int) or not 1 <= num_per_part <= 40:
        raise ValueError(f"num_per_part: expected an int in [1, 40] (there are 40 coding requests), got "
                         f"{num_per_part!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer: {type(tokenizer).__name__} has no chat template; the repeated-task workload "
                         "is for chat (instruct) models")
    rng = random.Random(seed)
    code: list[SpecBenchQuestion] = sorted(rng.sample(code_requests(), num_per_part), key=lambda q: q.question_id)
    chat = [q for q in load_spec_bench() if q.category == "mt_bench" and len(q.turns) > 1]
    chat = sorted(rng.sample(chat, num_per_part), key=lambda q: q.question_id)
    first = [render_chat(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in code + chat]
    variants = [render_chat(tokenizer, [{"role": "user", "content": vary(q.turns[0], rng)}]) for q in code]
    second_turns = []
    for question, prompt in zip(chat, first[num_per_part:]):
        messages = [{"role": "user", "content": question.turns[0]},
                    {"role": "assistant", "content": answer(prompt)},
                    {"role": "user", "content": question.turns[1]}]
        second_turns.append(render_chat(tokenizer, messages))
    return [(CATEGORY, ids) for ids in first + variants + second_turns]
