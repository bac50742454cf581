"""N-gram lookup's chain against its trie of matched continuations, in target forwards (no timing):

    python benchmarks/ngram_trie.py --num-per-category 2 --max-new-tokens 128 --nodes 8 10 all --widths 4 \\
        --rank-cost 1 0.5 2

answers Spec-Bench's questions (--num-per-category of each category) and the coding requests with SmolLM2-135M-Instruct
(greedy, batch 1, the schedule fixed so that every step drafts what the lookup finds, k = 5), once with n-gram
lookup's chain and once per trie: tree_width w, --nodes draft nodes kept ('all': every node of its w
continuations) and, for sized tries, each --rank-cost (`hf_specdec.proposers.ngram.TRIE_RANK_COST`: how many tokens
further from the root a later continuation's nodes count when the trie keeps its best). It prints tokens per target
forward (every forward, the prefill included) and whether the text is the chain's. In float32 (the default) every
variant writes the same text, so they compare like with like; in bfloat16 near-ties make them differ.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.proposers import ngram
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import CODE_CATEGORY, SPEC_BENCH_CATEGORIES, spec_bench_prompts


def run(model, prompts: list[tuple[str, list[int]]], config: SpeculativeConfig, max_new_tokens: int,
        rank_cost: float) -> tuple[int, int, list[list[int]]]:
    """(new tokens, target forwards, the answers) over the prompts."""
    ngram.TRIE_RANK_COST, default = rank_cost, ngram.TRIE_RANK_COST
    try:
        tokens = forwards = 0
        answers = []
        for _, ids in prompts:
            prompt = torch.tensor([ids])
            out = hf_specdec.generate(model, prompt, speculative=config, max_new_tokens=max_new_tokens,
                                      do_sample=False, return_dict_in_generate=True)
            answers.append(out.sequences[0, prompt.shape[1]:].tolist())
            tokens += len(answers[-1])
            forwards += out.spec_stats.target_forward_passes
        return tokens, forwards, answers
    finally:
        ngram.TRIE_RANK_COST = default


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-per-category", type=int, default=2)
    parser.add_argument("--categories", nargs="+", default=[*SPEC_BENCH_CATEGORIES, CODE_CATEGORY])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--widths", type=int, nargs="+", default=[4])
    parser.add_argument("--nodes", nargs="+", default=["8", "all"], help="draft nodes a trie keeps, or 'all'")
    parser.add_argument("--rank-cost", type=float, nargs="+", default=[1.0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model("smollm2", dtype=getattr(torch, args.dtype), progress=False)
    prompts = spec_bench_prompts(tokenizer, args.num_per_category, categories=args.categories)
    base = dict(method="ngram", num_speculative_tokens=args.k, schedule="fixed")
    variants = [("chain", SpeculativeConfig(**base), 1.0)]
    for width in args.widths:
        for nodes in args.nodes:
            if nodes == "all":
                variants.append((f"w={width}, all {width * args.k} nodes", SpeculativeConfig(**base, tree_width=width),
                                 1.0))
                continue
            for cost in args.rank_cost:
                variants.append((f"w={width}, {nodes} nodes, rank cost {cost:g}",
                                 SpeculativeConfig(**base, tree_width=width, tree_total_tokens=int(nodes)), cost))
    rows, chain_answers = [], None
    print(f"{len(prompts)} prompts, {args.dtype}, k = {args.k}, {args.max_new_tokens} new tokens")
    for name, config, cost in variants:
        tokens, forwards, answers = run(model, prompts, config, args.max_new_tokens, cost)
        chain_answers = chain_answers or answers
        row = dict(variant=name, new_tokens=tokens, target_forwards=forwards,
                   tokens_per_target_forward=tokens / forwards, same_text_as_chain=answers == chain_answers)
        rows.append(row)
        print(f"{name:34s} {tokens:6d} tokens {forwards:5d} forwards {tokens / forwards:.3f} per forward"
              f"{'' if row['same_text_as_chain'] else '  (text differs)'}", flush=True)
    write_report(args, rows, torch.device("cpu"), getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
