"""Dynamic trees sized by the schedule's width against full-size trees, interleaved in one process.

    python benchmarks/tree_size_ab.py [--cases eagle auto] [--rounds 2] [--prompts 6] [--json PATH]

Under the adaptive schedule a step narrowed to d < k levels keeps ceil(tree_total_tokens * d / k) nodes (`scaled`,
what the library does). `full` keeps `tree_total_tokens` at every width, as the library did before, emulated here by
forcing the node count given to `Candidates.select`. SmolLM2-135M-Instruct with its committed EAGLE-1/2 head (and
token map), one Spec-Bench question per category, greedy, batch 1, k = 5, top-w 4, 16 nodes. Each mode has its own
head object, so it keeps its own step-time table (the schedule's table is kept per drafter). A warm-up round, then
`--rounds` timed rounds; each round runs every case in both modes, in alternating order. Printed per round: tokens
per second, tokens per target forward, and the ratio scaled / full.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed import drafters
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts
from hf_specdec.tree import dynamic

K, WIDTH, NODES = 5, 4, 16
MODES = ("scaled", "full")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=("eagle", "auto"), default=["eagle", "auto"],
                        help="the EAGLE-1/2 head alone, and method='auto' with it (default: both)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=6,
                        help="the first N of the six questions, one per Spec-Bench category (default 6)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the per-round results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_real_model(dtype=getattr(torch, args.dtype))
    heads = {mode: drafters.load_drafter("smollm2", "eagle", target) for mode in MODES}
    prompts = [torch.tensor([ids]) for _, ids in spec_bench_prompts(tokenizer, num_per_category=1)][: args.prompts]
    select, current = dynamic.Candidates.select, {"mode": "scaled"}

    def select_for_mode(self, root_token_ids, total, budget, device):
        return select(self, root_token_ids, NODES if current["mode"] == "full" else total, budget, device)

    dynamic.Candidates.select = select_for_mode

    def config(case: str, mode: str) -> SpeculativeConfig:
        common = dict(heads=heads[mode], num_speculative_tokens=K, tree_width=WIDTH, tree_total_tokens=NODES)
        if case == "auto":
            return SpeculativeConfig(method="auto", suffix_cache=SuffixCache(), **common)
        return SpeculativeConfig(method="eagle", **common)

    results = []
    try:
        for round_index in range(args.rounds + 1):
            for case in args.cases:
                for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                    current["mode"] = mode
                    speculative, tokens, forwards = config(case, mode), 0, 0
                    start = time.perf_counter()
                    for ids in prompts:
                        out = hf_specdec.generate(target, ids, speculative=speculative,
                                                  max_new_tokens=args.max_new_tokens, do_sample=False,
                                                  pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
                        tokens += out.sequences.shape[1] - ids.shape[1]
                        forwards += out.spec_stats.target_forward_passes
                    seconds = time.perf_counter() - start
                    results.append(dict(round=round_index, case=case, mode=mode, tokens_per_second=tokens / seconds,
                                        tokens_per_forward=tokens / forwards))
                    print(f"round {round_index}{' (warm-up)' if round_index == 0 else ''} {case:5s} {mode:6s} "
                          f"{tokens / seconds:6.2f} tok/s  {tokens / forwards:.2f} tok/fwd", flush=True)
    finally:
        dynamic.Candidates.select = select
    for case in args.cases:
        rate = {(r["round"], r["mode"]): r["tokens_per_second"] for r in results if r["case"] == case}
        ratios = [rate[(r, "scaled")] / rate[(r, "full")] for r in range(1, args.rounds + 1)]
        print(f"{case}: scaled / full tokens per second, timed rounds: {', '.join(f'{x:.3f}' for x in ratios)}")
    write_report(args, results, target.device, target.dtype)


if __name__ == "__main__":
    main()
