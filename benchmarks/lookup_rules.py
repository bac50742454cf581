"""hf_specdec's n-gram lookup against transformers' prompt lookup, replayed on recorded greedy outputs: which
continuation each rule drafts, and how many of its tokens the target would keep, with no timing (so no noise).

    python benchmarks/lookup_rules.py record --num-per-category 4 --out outputs.json
    python benchmarks/lookup_rules.py replay outputs.json -k 5 10 --json lookup_rules.json

`record` writes SmolLM2-135M-Instruct's plain greedy answers (float32, one prompt at a time) to Spec-Bench's
questions and the coding requests, `--num-per-category` of each category (the seeded subsets the bench takes).
`replay` then drafts at every step of a fixed-k run at batch 1 with each rule, after the committed text, and the
target keeps the drafted prefix the recorded answer follows, plus one token (the prefill's forward emits the first):

* `hf_specdec`: `find_ngram_continuation` with the engine's defaults (the most recent match of the longest suffix
  n-gram, n from 3 down to 1, continued as an overlapping copy);
* `hf_specdec, n <= 2` and `n <= 6`: the same with transformers' longest n-gram, to tell the two rules' differences
  apart, and with longer n-grams;
* `transformers`: transformers' own `PromptLookupCandidateGenerator` (`prompt_lookup_num_tokens=k`, its default
  `max_matching_ngram_size` of 2: the earliest match, cut at the end of the text).

Printed per category: tokens per target forward (every step, those without a draft included). In float32 the
drafts change no output, so every rule replays the same text the engine would produce.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suffix_replay import NGRAM, replay_output  # noqa: E402  (the engine's n-gram lengths)

from hf_specdec.cli.environment import write_report  # noqa: E402
from hf_specdec.proposers.ngram import find_ngram_continuation  # noqa: E402

CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "code")


def hf_specdec_rule(max_n: int) -> Callable[[np.ndarray, int], np.ndarray]:
    return lambda tokens, k: find_ngram_continuation(tokens, NGRAM.prompt_lookup_min, max_n, k)


def transformers_rule(tokens: np.ndarray, k: int) -> np.ndarray:
    """The continuation transformers' prompt lookup offers after `tokens` (its max_length set past the text, so that
    only the text's end cuts it)."""
    lookup = PromptLookupCandidateGenerator(num_output_tokens=k, max_length=len(tokens) + k + 1)
    candidates, _ = lookup.get_candidates(torch.from_numpy(tokens)[None, :])
    return candidates[0, len(tokens):].numpy()


RULES = {"hf_specdec": hf_specdec_rule(NGRAM.prompt_lookup_max), "hf_specdec, n <= 2": hf_specdec_rule(2),
         "hf_specdec, n <= 6": hf_specdec_rule(6), "transformers": transformers_rule}


def replay(
    # [P] the prompt's token ids, and [N] the recorded answer's
    prompt: list[int],
    answer: list[int],
    rule: Callable[[np.ndarray, int], np.ndarray],
    k: int,
) -> int:
    """Target forwards to emit `answer` at batch 1 with drafts of at most `k` tokens from `rule` (the prefill's
    included; a draft never runs past the answer's last token, as the engine's length budget cuts it): the fixed-k
    run of `suffix_replay.replay_output`, drafting chains."""

    def chain(text: list[int], budget: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        tokens = tuple(rule(np.asarray(text, dtype=np.int64), budget).tolist())
        return tokens, tuple(range(-1, len(tokens) - 1))

    return replay_output(prompt, answer, k, chain).forwards


def record(args: argparse.Namespace) -> None:
    from hf_specdec.testbed.real_model import load_real_model
    from hf_specdec.testbed.spec_bench import spec_bench_prompts

    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model("smollm2", dtype=torch.float32)
    rows = []
    for category, prompt in spec_bench_prompts(tokenizer, args.num_per_category, list(CATEGORIES)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        rows.append({"category": category, "prompt": prompt, "answer": out[0, len(prompt):].tolist()})
        print(f"{category}: {len(prompt)} prompt tokens, {len(rows[-1]['answer'])} answer tokens", flush=True)
    args.out.write_text(json.dumps({"rows": rows, "max_new_tokens": args.max_new_tokens}, sort_keys=True) + "\n")


def run_replay(args: argparse.Namespace) -> None:
    rows = json.loads(args.outputs.read_text())["rows"]
    categories = [c for c in CATEGORIES if any(r["category"] == c for r in rows)] + ["overall"]
    results = []
    for k in args.k:
        for name, rule in RULES.items():
            tokens, forwards = dict.fromkeys(categories, 0), dict.fromkeys(categories, 0)
            for row in rows:
                steps = replay(row["prompt"], row["answer"], rule, k)
                for category in (row["category"], "overall"):
                    tokens[category] += len(row["answer"])
                    forwards[category] += steps
            per_forward = {c: tokens[c] / forwards[c] for c in categories if forwards[c]}
            results.append({"k": k, "rule": name, "tokens_per_forward": per_forward, "target_forwards": forwards})
    print(f"{'k':>3} {'rule':20s}" + "".join(f"{c[:13]:>14s}" for c in categories))
    for result in results:
        print(f"{result['k']:>3} {result['rule']:20s}"
              + "".join(f"{result['tokens_per_forward'][c]:14.3f}" for c in categories))
    write_report(args, results, torch.device("cpu"), None, outputs=str(args.outputs), num_rows=len(rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="record SmolLM2's greedy answers")
    rec.add_argument("--num-per-category", type=int, default=4)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--out", type=Path, required=True)
    rep = commands.add_parser("replay", help="tokens per target forward of each lookup rule")
    rep.add_argument("outputs", type=Path)
    rep.add_argument("-k", type=int, nargs="+", default=[5], help="draft tokens per step at most")
    rep.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    record(args) if args.command == "record" else run_replay(args)


if __name__ == "__main__":
    sys.exit(main())
