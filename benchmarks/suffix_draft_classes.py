"""What tells suffix decoding's drafts apart: the first drafted token's acceptance by the length of the context the
draft matched, by the tree it came from, and by its first node's running probability.

    python benchmarks/suffix_draft_classes.py --num-per-part 3 --per-category 2 --max-new-tokens 96

runs SmolLM2-135M-Instruct (greedy, batch 1, float32 by default, a fixed k so every row-step with a match drafts)
with suffix decoding and one cache filled as the requests go, over the repeated-task session of
`hf_specdec.testbed.repeated_tasks` and `--per-category` Spec-Bench questions per category. It hooks the proposer
(`SuffixProposer.proposal`, which receives the rows' drafts, and `commit`, which receives what the target accepted)
and records every drafting row-step. The match-length buckets printed are the schedule's draft classes
(`hf_specdec.proposers.suffix.MATCH_CLASS_BOUNDS`).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.proposers.suffix import MATCH_CLASS_BOUNDS, SuffixProposer
from hf_specdec.suffix import SuffixCache, SuffixConfig
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.repeated_tasks import greedy_answers, repeated_task_prompts
from hf_specdec.testbed.spec_bench import spec_bench_prompts


def match_bucket(length: int) -> str:
    """The draft-class bucket of a match length, as a label ("1", "4-5", "14+")."""
    index = int(np.searchsorted(MATCH_CLASS_BOUNDS, length, side="right")) - 1
    low = MATCH_CLASS_BOUNDS[index]
    if index + 1 == len(MATCH_CLASS_BOUNDS):
        return f"{low}+"
    high = MATCH_CLASS_BOUNDS[index + 1] - 1
    return str(low) if high == low else f"{low}-{high}"


def probability_bucket(prob: float) -> str:
    """The quarter of [0, 1] a probability falls in, as a label ("0.50-0.75")."""
    low = min(int(prob * 4), 3) / 4
    return f"{low:.2f}-{low + 0.25:.2f}"


def label_order(label: str) -> tuple[str, float]:
    """Sorts "tree, bucket" and bucket labels by tree, then by the bucket's low end."""
    *tree, bucket = label.split(", ")
    return ("".join(tree), float(bucket.split("-")[0].rstrip("+")))


def summarize(records: list[dict], key) -> dict[str, dict]:
    """Per group of `key(record)`: row-steps, the share whose first drafted token was accepted, mean accepted."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    return {name: {"row_steps": len(rows), "first_accepted": float(np.mean([r["accepted"] >= 1 for r in rows])),
                   "mean_accepted": float(np.mean([r["accepted"] for r in rows]))}
            for name, rows in groups.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-per-part", type=int, default=3, help="requests per part of the repeated-task session")
    parser.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the tables here")
    args = parser.parse_args()
    if min(args.num_per_part, args.max_new_tokens, args.k) < 1 or args.per_category < 0:
        raise SystemExit("error: --num-per-part, --max-new-tokens and -k: expected >= 1; --per-category >= 0")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model(dtype=getattr(torch, args.dtype), progress=False)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    prompts = [list(ids) for _, ids in repeated_task_prompts(
        tokenizer, greedy_answers(model, tokenizer, args.max_new_tokens), num_per_part=args.num_per_part)]
    if args.per_category:
        prompts += [list(ids) for _, ids in spec_bench_prompts(tokenizer, num_per_category=args.per_category)]

    records: list[dict] = []
    pending: dict[int, list] = {}
    proposal, commit = SuffixProposer.proposal, SuffixProposer.commit

    def traced_proposal(self, state, drafts):
        pending[id(self)] = drafts
        return proposal(self, state, drafts)

    def traced_commit(self, state, result):
        drafts = pending.pop(id(self), None)
        if drafts is not None:
            for draft, accepted in zip(drafts, result.num_accepted.tolist()):
                if draft.num_tokens:
                    records.append({"match": draft.match_length, "source": draft.source,
                                    "first_prob": float(draft.probs[0]), "accepted": int(accepted)})
        return commit(self, state, result)

    cache = SuffixCache(SuffixConfig())
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=args.k, schedule="fixed", suffix_cache=cache)
    SuffixProposer.proposal, SuffixProposer.commit = traced_proposal, traced_commit
    try:
        for ids in prompts:
            hf_specdec.generate(model, torch.tensor([ids]), speculative=config, **kwargs)
    finally:
        SuffixProposer.proposal, SuffixProposer.commit = proposal, commit

    tables = {
        "match length": summarize(records, lambda r: match_bucket(r["match"])),
        "tree, match length": summarize(records, lambda r: f"{r['source']}, {match_bucket(r['match'])}"),
        "first node's probability": summarize(records, lambda r: probability_bucket(r["first_prob"])),
    }
    print(f"{len(records)} drafting row-steps over {len(prompts)} requests ({args.dtype}, k = {args.k})")
    for title, table in tables.items():
        print(f"by {title}:")
        for name in sorted(table, key=label_order):
            row = table[name]
            print(f"  {name:>14}: {row['row_steps']:5d} row-steps, first token accepted {row['first_accepted']:.0%}, "
                  f"mean accepted {row['mean_accepted']:.2f}")
    write_report(args, [tables], model.device, model.dtype, row_steps=len(records))


if __name__ == "__main__":
    main()
