"""Token recycling's trees replayed on recorded greedy answers: how often each rank of the recycled candidates is the
next token (the rank priors its default tree is built from), and the tokens per target forward of chains and trees
of each size, in seconds of CPU instead of a bench run per shape.

    python benchmarks/recycling_replay.py record --out recycling_replay.json
    python benchmarks/recycling_replay.py replay recycling_replay.json --nodes 4 8 12 16 24 32

`record` (SmolLM2-135M-Instruct in bf16) takes each prompt's greedy answer of --max-new-tokens tokens and one
forward over prompt and answer, and keeps the target's top 8 tokens at every position. `replay` walks each answer
as the engine would: at each step the draft tree is read from a table of the top 8 after each token (recycled from
the positions seen so far, after the prompt seeded it as the engine does: each prompt token's row takes its followers
in the prompt first, `RecycledTokens.seed`), the step keeps the longest path that matches the answer plus one
token, and the table takes the top 8 of the root and the kept positions; `--no-prompt-seed` leaves the prompt out.
It counts only what the answer's own positions show, so it leaves out the candidates the engine also recycles from
rejected nodes: its tokens per forward are a lower bound of the engine's. Calls run in the recording's order with
the table kept across them, as in one process, unless
`--cold` (each call starts empty). It also replays n-gram lookup (the most recent match of the longest suffix
n-gram, n = 3 down to 1, continued for k tokens) for comparison.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from hf_specdec.config import RECYCLED_CANDIDATES
from hf_specdec.proposers.ngram import find_ngram_continuation
from hf_specdec.proposers.recycling import RecycledTokens, recycling_tree
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts
from hf_specdec.tree.template import TreeTemplate


def record(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model(dtype=torch.bfloat16)
    prompts = spec_bench_prompts(tokenizer, num_per_category=args.num_prompts)
    prompts += spec_bench_prompts(tokenizer, num_per_category=args.code_prompts, categories=["code"])
    calls = []
    for category, ids in prompts:
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
            top = model(out).logits[0].float().topk(RECYCLED_CANDIDATES, dim=-1).indices
        calls.append({"category": category, "prompt_length": len(ids), "tokens": out[0].tolist(),
                      "top": top.tolist()})
    args.out.write_text(json.dumps({"model": "smollm2", "dtype": "bfloat16", "max_new_tokens": args.max_new_tokens,
                                    "calls": calls}, sort_keys=True))
    print(f"{len(calls)} answers written to {args.out}")


def _accepted(template: TreeTemplate | None, table: np.ndarray, tokens: list[int], root: int, ngram: list[int],
              ) -> int:
    """The longest draft path the answer keeps after position `root`: the template's paths read from `table`, and
    the n-gram chain `ngram` (when given)."""
    best, end = 0, len(tokens) - 1
    for depth, token in enumerate(ngram, start=1):
        if root + depth > end or tokens[root + depth] != token:
            break
        best = depth
    if template is not None:
        node_tokens = [tokens[root]]
        matched = [True]
        for node in range(1, template.num_nodes):
            parent, depth = template.parents[node], template.depths[node]
            token = table[node_tokens[parent], template.ranks[node]] if node_tokens[parent] >= 0 else -1
            node_tokens.append(int(token))
            matched.append(matched[parent] and token >= 0 and root + depth <= end and tokens[root + depth] == token)
            if matched[-1]:
                best = max(best, depth)
    return min(best, end - root - 1)  # the step's own token must lie within the answer too


def replay_one(calls: list[dict], template: TreeTemplate | None, ngram_k: int, cold: bool, prompt_seed: bool = True,
               ) -> tuple[float, dict[str, float], list[float]]:
    """(tokens per forward overall, per category, how often rank r at the root was the next token)."""
    vocab = 1 + max(max(call["tokens"]) for call in calls)
    recycled = RecycledTokens(vocab, torch.device("cpu"))
    table = recycled.successors.numpy()  # the same memory
    totals, per_category = [0, 0], {}
    hits = np.zeros(RECYCLED_CANDIDATES)
    for call in calls:
        if cold:
            table.fill(-1)
        tokens, top = call["tokens"], np.asarray(call["top"])
        root = call["prompt_length"] - 1
        if prompt_seed:
            recycled.seed([np.asarray(tokens[: root + 1])])
        steps = emitted = 0
        while root < len(tokens) - 1:
            ngram = (find_ngram_continuation(np.asarray(tokens[: root + 1]), 1, 3, ngram_k).tolist()
                     if ngram_k else [])
            accepted = _accepted(template, table, tokens, root, ngram)
            hits += table[tokens[root]] == tokens[root + 1]
            table[tokens[root: root + accepted + 1]] = top[root: root + accepted + 1]
            steps, emitted, root = steps + 1, emitted + accepted + 1, root + accepted + 1
        totals[0], totals[1] = totals[0] + steps, totals[1] + emitted
        counts = per_category.setdefault(call["category"], [0, 0])
        counts[0], counts[1] = counts[0] + steps, counts[1] + emitted
    return (totals[1] / totals[0], {c: e / s for c, (s, e) in per_category.items()},
            (hits / totals[0]).round(3).tolist())


def replay(args: argparse.Namespace) -> None:
    calls = json.loads(args.recording.read_text())["calls"]
    # name: (the recycled tree or None, the n-gram chain's k or 0)
    cases = {f"chain k={k}": (TreeTemplate.chain(k), 0) for k in args.ks}
    cases |= {f"tree n={n}": (recycling_tree(n, args.depth), 0) for n in args.nodes}
    cases |= {f"n-gram k={k}": (None, k) for k in args.ks}
    cases |= {f"n-gram k={args.ks[-1]} + tree n={n}": (recycling_tree(n, args.depth), args.ks[-1]) for n in args.nodes}
    results, rank_hits = {}, {}
    for name, (template, ngram_k) in cases.items():
        tau, categories, rank_hits[name] = replay_one(calls, template, ngram_k, args.cold, not args.no_prompt_seed)
        results[name] = {"tokens_per_forward": round(tau, 3),
                         "per_category": {c: round(v, 2) for c, v in categories.items()}}
        print(f"{name:28s} {tau:.3f}  " + " ".join(f"{c} {v:.2f}" for c, v in categories.items()))
    largest = f"tree n={max(args.nodes)}"
    print(f"how often rank r at the root was the next token ({largest}): {rank_hits[largest]}")
    if args.json is not None:
        args.json.write_text(json.dumps({"cold": args.cold, "prompt_seed": not args.no_prompt_seed, "depth": args.depth,
                                         "rank_hit_rates": rank_hits[largest], "cases": results},
                                        indent=1, sort_keys=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--num-prompts", type=int, default=2, help="Spec-Bench questions per category")
    rec.add_argument("--code-prompts", type=int, default=4)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--out", type=Path, required=True)
    rep = commands.add_parser("replay")
    rep.add_argument("recording", type=Path)
    rep.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 12, 16, 24, 32])
    rep.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    rep.add_argument("--depth", type=int, default=5, help="the trees' deepest level (k)")
    rep.add_argument("--cold", action="store_true", help="every call starts from an empty table")
    rep.add_argument("--no-prompt-seed", action="store_true", help="the prompt does not seed the table")
    rep.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
