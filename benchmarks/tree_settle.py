"""What stopping an EAGLE-2 expansion once it has settled (`Candidates.settled`: no deeper node can enter the kept
ones, so the tree is the one a full expansion chooses) saves: expanded levels (each a drafting forward) and time, the
committed SmolLM2 EAGLE-1/2 head's (or MLP speculator's) dynamic tree against the same tree drafted to its full
depth, in one run, interleaved.

    python benchmarks/tree_settle.py --methods eagle auto --schedules fixed adaptive --num-prompts 1 \\
        --max-new-tokens 128 --repeats 2 --json benchmarks/results/tree_settle_smollm2_bf16_cpu.json

With `--device cuda` the settled cases check for settling on the GPU too (`SETTLING_DEVICES` is the CPU's alone: a
read per level would stall the GPU's queue; this measures whether the forwards it saves pay for that).

Each case (method, schedule, settled or full) drafts with a head object of its own (the adaptive schedule keeps its
tables per drafter); `full` replaces `Candidates.settled` by a check that never settles. Every prompt runs each case
once per repeat, settled and full back to back. Under a fixed schedule both propose the same trees, so their
outputs must be identical (checked); under the adaptive one each case's step times steer its own widths.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import add_run_arguments, report_results
from hf_specdec.cli.timing import CallTotals
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed import drafters
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts
from hf_specdec.tree import dynamic
from hf_specdec.tree.dynamic import Candidates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["eagle", "auto"], choices=["eagle", "auto", "mlp_speculator"],
                        help="eagle: the EAGLE-1/2 head; auto: method='auto' with it; mlp_speculator: the MLP speculator")
    parser.add_argument("--schedules", nargs="+", default=["fixed", "adaptive"], choices=["fixed", "adaptive"])
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--tree-width", type=int, default=4)
    parser.add_argument("--tree-nodes", type=int, default=8)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_real_model(dtype=getattr(torch, args.dtype), progress=False)
    target = target.to(args.device)
    devices = dynamic.SETTLING_DEVICES
    dynamic.SETTLING_DEVICES = devices | {torch.device(args.device).type}
    prompts = spec_bench_prompts(tokenizer, args.num_prompts, args.categories)
    settled = Candidates.settled
    expand = Candidates.expand
    levels = [0]

    def counted(self, *inputs, **options):
        levels[0] += 1
        return expand(self, *inputs, **options)

    cases = {(method, schedule, mode): drafters.load_drafter("smollm2", "mlp_speculator" if method == "mlp_speculator"
                                                             else "eagle", target)
             for method in args.methods for schedule in args.schedules for mode in ("settled", "full")}

    def run(case: tuple[str, str, str], prompt: list[int]):
        method, schedule, mode = case
        Candidates.settled = settled if mode == "settled" else (lambda self, total: False)
        config = SpeculativeConfig(method=method, heads=cases[case], num_speculative_tokens=args.k,
                                   tree_width=args.tree_width, tree_total_tokens=args.tree_nodes, schedule=schedule,
                                   **({"suffix_cache": SuffixCache()} if method == "auto" else {}))
        levels[0] = 0
        start = time.perf_counter()
        out = hf_specdec.generate(target, torch.tensor([prompt], device=args.device), speculative=config,
                                  return_dict_in_generate=True, max_new_tokens=args.max_new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out, levels[0]

    Candidates.expand = counted
    try:
        for case in cases:  # warm-up
            run(case, prompts[0][1])
        totals = {case: CallTotals() for case in cases}
        expanded = dict.fromkeys(cases, 0)
        identical = dict.fromkeys(cases, 0)
        for repeat in range(args.repeats):
            for index, (category, prompt) in enumerate(prompts):
                outputs = {}
                for case in cases:
                    seconds, out, count = run(case, prompt)
                    totals[case].add(seconds, out.sequences.shape[1] - len(prompt), out.spec_stats)
                    expanded[case] += count
                    outputs[case] = out.sequences
                for method, schedule, mode in cases:
                    identical[(method, schedule, mode)] += int(torch.equal(outputs[(method, schedule, "settled")],
                                                                           outputs[(method, schedule, "full")]))
                print(f"repeat {repeat} prompt {index} ({category}) done", flush=True)
    finally:
        Candidates.settled, Candidates.expand = settled, expand
        dynamic.SETTLING_DEVICES = devices
    results = []
    for (method, schedule, mode), row in totals.items():
        full = totals[(method, schedule, "full")]
        result = {"method": method, "schedule": schedule, "expansion": mode, "tokens_per_second": round(row.rate, 3),
                  "speedup_vs_full": round(row.rate / full.rate, 3),
                  "levels_expanded": expanded[(method, schedule, mode)],
                  "tokens_per_target_forward": round(row.tokens_per_forward, 3),
                  "same_output_as_full": f"{identical[(method, schedule, mode)]}/{len(prompts) * args.repeats}"}
        results.append(result)
    report_results(args, results, torch.device(args.device), getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
