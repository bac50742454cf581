"""Write the training prompts the SmolLM2-135M-Instruct drafters learn from (`prompts.jsonl`, one chat-template
rendering per line), disjoint from every evaluation workload.

    python examples/drafters/smollm2/make_prompts.py [--out examples/drafters/smollm2/prompts.jsonl]

More prompts later, none of those already written: another `--seed`, `--exclude` the earlier files, another `--out`.

Three sources, none of them Spec-Bench or the coding requests the benchmarks use:
* **Self-instruct (Magpie).** The target itself writes user requests: given only its chat template up to the user
  turn (`<|im_start|>user\\n`), an instruction-tuned model samples a user message. A system prompt steers each batch
  towards one kind of request (general chat, math word problems, translation, summarisation of a pasted text,
  Python coding, short factual questions); the stored prompt renders the request with the model's default template,
  as the benchmarks do. Sampled at temperature 1.0 from the 50 most likely tokens, seeded; requests that do not end within
  `MAX_REQUEST_TOKENS` tokens, shorter than 4 words, or repeated are dropped.
* **Coding requests from the standard library's training split** (the test bed's split: held-out files excluded):
  "Write a Python function `name(signature)` that <the first sentence of its docstring>".
* **Summaries of documentation prose**: "Summarize: <a passage of the Python language reference>" (`pydoc_data`).

Every prompt sharing an 8-word run with any Spec-Bench question (both turns) or coding request is dropped; the
count is printed (and a test checks the committed file stays disjoint).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
from pathlib import Path

import torch

from hf_specdec.testbed.corpus import read_source, split_corpus
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import code_requests, load_spec_bench

HERE = Path(__file__).resolve().parent
MAX_REQUEST_TOKENS = 160
OVERLAP_WORDS = 8
# system prompt -> share of the self-instruct requests
STEERING = {
    None: 0.35,  # the template's own system prompt: general chat
    "You are a helpful assistant. Users give you math word problems and you solve them step by step.": 0.15,
    "You are a translator. Users ask you to translate sentences and short texts between languages.": 0.1,
    "You are a helpful assistant. Users paste an article or a document and ask you to summarize it or to answer "
    "a question about it.": 0.15,
    "You are an expert Python programmer. Users ask you to write, explain or fix code.": 0.1,
    "You are a knowledgeable assistant. Users ask short factual questions about the world.": 0.15,
}


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = OVERLAP_WORDS) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def evaluation_ngrams() -> set[tuple[str, ...]]:
    """Every 8-word run of every Spec-Bench turn and coding request."""
    found: set[tuple[str, ...]] = set()
    for question in [*load_spec_bench(), *code_requests()]:
        for turn in question.turns:
            found |= ngrams(turn)
    return found


@torch.no_grad()
def self_instruct(model, tokenizer, count: int, seed: int, batch_size: int) -> list[str]:
    """`count` user requests the model writes itself, split across the steering system prompts."""
    requests: list[str] = []
    torch.manual_seed(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for system, share in STEERING.items():
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "X"}]
        prefix = tokenizer.apply_chat_template(messages, tokenize=False).rsplit("X", 1)[0]
        ids = tokenizer(prefix, return_tensors="pt", add_special_tokens=False).input_ids
        wanted = round(count * share)
        for start in range(0, wanted, batch_size):
            n = min(batch_size, wanted - start)
            out = model.generate(ids.repeat(n, 1), attention_mask=torch.ones(n, ids.shape[1], dtype=torch.long),
                                 do_sample=True, temperature=1.0, top_k=50, top_p=1.0,
                                 max_new_tokens=MAX_REQUEST_TOKENS, eos_token_id=end, pad_token_id=end)
            for row in out[:, ids.shape[1] :].tolist():
                if end not in row:
                    continue  # did not finish within MAX_REQUEST_TOKENS
                text = tokenizer.decode(row[: row.index(end)], skip_special_tokens=True).strip()
                if len(words(text)) >= 4:
                    requests.append(text)
            print(f"  self-instruct: {len(requests)} requests", flush=True)
    return requests


def coding_requests(count: int, seed: int) -> list[str]:
    """'Write a Python function ...' from documented functions of the standard library's training split."""
    split = split_corpus()
    found = []
    for path in split.train:
        try:
            tree = ast.parse(read_source(split.root, path))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            sentence = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0].rstrip(".")
            if not 4 <= len(sentence.split()) <= 40:
                continue
            arguments = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            found.append(f"Write a Python function `{node.name}({arguments})` that does the following: "
                         f"{sentence[0].lower() + sentence[1:]}. Include a docstring.")
    return random.Random(seed).sample(sorted(set(found)), min(count, len(found)))


def summaries(count: int, seed: int) -> list[str]:
    """'Summarize: ...' over passages (60-300 words) of the Python language reference."""
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(paragraph.split())
            if 60 <= len(text.split()) <= 300 and not text.startswith(("*", ">>>", "|")):
                passages.append(text)
    chosen = random.Random(seed).sample(passages, min(count, len(passages)))
    return [f"Summarize: {text}" for text in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "prompts.jsonl")
    parser.add_argument("--self-instruct", type=int, default=3000, help="requests the model writes (before filtering)")
    parser.add_argument("--coding", type=int, default=500)
    parser.add_argument("--summaries", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--exclude", type=Path, nargs="*", default=[],
                        help="prompt files written before (e.g. prompts.jsonl): their requests are not written again")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model(dtype=torch.bfloat16)
    requests = [*self_instruct(model, tokenizer, args.self_instruct, args.seed, args.batch_size),
                *coding_requests(args.coding, args.seed), *summaries(args.summaries, args.seed)]
    forbidden, kept, overlapping = evaluation_ngrams(), [], 0
    seen = {" ".join(words(json.loads(line)["request"])) for path in args.exclude
            for line in path.read_text().splitlines() if line.strip()}
    excluded = len(seen)
    for text in requests:
        key = " ".join(words(text))
        if key in seen:
            continue
        seen.add(key)
        if ngrams(text) & forbidden:
            overlapping += 1
            continue
        kept.append(text)
    with args.out.open("w") as handle:
        for text in kept:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False)
            handle.write(json.dumps({"request": text, "text": prompt}, sort_keys=True) + "\n")
    repeats = len(requests) - (len(seen) - excluded)
    print(f"{len(kept)} prompts written to {args.out} ({repeats} repeats and {overlapping} "
          f"sharing an {OVERLAP_WORDS}-word run with an evaluation prompt dropped)")


if __name__ == "__main__":
    main()
