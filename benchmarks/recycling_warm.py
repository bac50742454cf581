"""Token recycling from a cold table and from a warm one, against plain generate and n-gram lookup, interleaved.

Token recycling's table belongs to the target model and lasts the process, so a server's later requests draft
from what the earlier ones recycled, while a script's first call starts empty. This measures both on
SmolLM2-135M-Instruct (bfloat16, batch 1, greedy):

    python benchmarks/recycling_warm.py --warm-per-category 6 --eval-per-category 1 --rounds 3 --json FILE

The table is first warmed by answering --warm-per-category Spec-Bench questions of each category that are not
evaluated (seed 1's sample without the evaluated ones), and kept. Then, in each round, every case runs once over
the evaluated questions (seed 0's sample), in turn: plain `generate`, n-gram lookup, token recycling from an empty
table (emptied at the start of its pass, so its questions draft from the ones before them in the pass), and token
recycling from the warm table (restored at the start of its pass). Reported per case: the speedup over plain (the
median over the timed rounds of the ratio of the passes' tokens per second; the first round is not timed), tokens
per target forward, and how many outputs part from plain's (in bfloat16 at near-ties only, see
`hf_specdec.lossless`; the bench's check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads.target_weights import layer_spec
from hf_specdec.proposers.recycling import forget_recycled_tokens, recycled_tokens
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-per-category", type=int, default=6)
    parser.add_argument("--eval-per-category", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--nodes", type=int, default=None, help="tree_total_tokens (default: the method's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model(dtype=torch.bfloat16)
    evaluated = spec_bench_prompts(tokenizer, num_per_category=args.eval_per_category, seed=0)
    seen = {tuple(ids) for _, ids in evaluated}
    warm = [(c, ids) for c, ids in spec_bench_prompts(tokenizer, num_per_category=args.warm_per_category, seed=1)
            if tuple(ids) not in seen]
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    recycling = SpeculativeConfig(method="recycling", tree_total_tokens=args.nodes)
    configs = {"plain": None, "ngram": SpeculativeConfig(method="ngram"), "recycling-cold": recycling,
               "recycling-warm": recycling}

    def run(config, ids):
        prompt = torch.tensor([ids])
        mask = torch.ones_like(prompt)
        if config is None:
            return model.generate(prompt, attention_mask=mask, **kwargs), None
        out = hf_specdec.generate(model, prompt, attention_mask=mask, speculative=config,
                                  return_dict_in_generate=True, **kwargs)
        return out.sequences, out.spec_stats

    forget_recycled_tokens(model)
    start = time.perf_counter()
    for _, ids in warm:
        run(recycling, ids)
    warmed_in = time.perf_counter() - start
    width = layer_spec(model.get_output_embeddings()).shape[0]  # the scores' width, which keys the table
    snapshot = recycled_tokens(model, width, model.device).successors.clone()
    print(f"table warmed on {len(warm)} questions in {warmed_in:.0f} s")
    plain_outputs, seconds = {}, {name: [] for name in configs}
    tokens, forwards, parted = dict.fromkeys(configs, 0), dict.fromkeys(configs, 0), dict.fromkeys(configs, 0)
    for round_ in range(args.rounds + 1):
        for name, config in configs.items():
            if name == "recycling-cold":
                forget_recycled_tokens(model)
            if name == "recycling-warm":
                forget_recycled_tokens(model)
                recycled_tokens(model, width, model.device).successors.copy_(snapshot)
            start = time.perf_counter()
            for index, (_, ids) in enumerate(evaluated):
                sequences, stats = run(config, ids)
                if round_ > 0:
                    continue
                new = sequences.shape[1] - len(ids)
                tokens[name] += new
                forwards[name] += new if stats is None else stats.target_forward_passes
                if name == "plain":
                    plain_outputs[index] = sequences
                elif not torch.equal(sequences, plain_outputs[index]):
                    parted[name] += 1
            if round_ > 0:
                seconds[name].append(time.perf_counter() - start)
    results = {}
    for name in configs:
        speedups = [plain / own for plain, own in zip(seconds["plain"], seconds[name])]
        results[name] = {"speedup": round(statistics.median(speedups), 3), "speedups": [round(s, 3) for s in speedups],
                         "tokens_per_forward": round(tokens[name] / forwards[name], 3),
                         "outputs_parting_from_plain": parted[name]}
        print(f"{name:16s} {results[name]['speedup']:.2f}x  tokens/forward {results[name]['tokens_per_forward']:.2f}"
              f"  rounds {results[name]['speedups']}  parted {parted[name]}/{len(evaluated)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "warm_questions": len(warm), "evaluated_questions": len(evaluated),
                                         "cases": results}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
