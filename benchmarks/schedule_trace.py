"""Why the adaptive schedule left steps plain: a trace of its decisions on the real model at batch 1.

    python benchmarks/schedule_trace.py --method eagle3 --workload random --num-prompts 32 --rounds 2

SmolLM2-135M-Instruct in bf16, 1 thread, greedy, k <= 5, each prompt one call, the calls in sequence as in one
process (`--rounds` passes over the prompts; the last is reported, the earlier ones warm the step-time table and
the estimates). It hooks the schedule's decision (`Schedule.plan`) and its step timing (`Schedule.observe`) and
prints: each width's measured step times (median, in ms and in plain steps; a call's first drafting steps, which
the table leaves out, apart), the table's step times at the end, the share of steps at which the table predicted a
width over 10% above its measured median, its predicted step times and the row's acceptance estimates averaged over
the steps the schedule left plain and over those it drafted, and the histogram of draft limits.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict

import numpy as np
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.bench import random_prompts
from hf_specdec.schedule import controller, estimates
from hf_specdec.testbed import drafters
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["eagle3", "ngram"], default="eagle3")
    parser.add_argument("--workload", choices=["random", "spec-bench"], default="random")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.num_prompts < 1 or args.rounds < 1:
        raise SystemExit("error: --num-prompts and --rounds: expected >= 1")
    torch.set_num_threads(1)
    target, tokenizer = load_real_model(dtype=torch.bfloat16, progress=False)
    if args.workload == "random":
        prompts = random_prompts(tokenizer, args.num_prompts)
    else:
        prompts = [list(ids) for _, ids in spec_bench_prompts(tokenizer, num_per_category=max(1, args.num_prompts // 6))]
    if args.method == "eagle3":
        config = SpeculativeConfig(method="eagle", heads=drafters.load_drafter("smollm2", "eagle3", target),
                                   num_speculative_tokens=5)
    else:
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=5)

    decisions: list[dict] = []
    # every step's time by width as the schedule measures it; a call's first drafting steps apart (left out of the
    # table: the drafter reads the prompt in them)
    seconds: dict[int, list[float]] = defaultdict(list)
    first_seconds: dict[int, list[float]] = defaultdict(list)
    plan, observe = controller.Schedule.plan, controller.Schedule.observe
    tables: list[estimates.CostTable] = []

    def traced_plan(self, state, rows_computed):
        decision = plan(self, state, rows_computed)
        times = self.step_times(rows_computed)[None]
        decisions.append({"limit": decision.limits[0], "times": times / times[0],
                          "estimate": self.acceptance[None].values[0].copy()})
        return decision

    def traced_observe(self, state, proposal):
        width = self.decision.width
        (first_seconds if width and not self.drafted else seconds)[width].append(self.clock() - self.started)
        tables[:] = [self.costs[None]]
        return observe(self, state, proposal)

    controller.Schedule.plan, controller.Schedule.observe = traced_plan, traced_observe
    try:
        for _ in range(args.rounds):
            decisions.clear()
            seconds.clear()
            first_seconds.clear()
            for ids in prompts:
                hf_specdec.generate(target, torch.tensor([ids]), speculative=config,
                                    max_new_tokens=args.max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
    finally:
        controller.Schedule.plan, controller.Schedule.observe = plan, observe

    plain_ms = statistics.median(seconds[0]) * 1000 if seconds[0] else float("nan")
    print(f"{args.method} on {args.workload}, last of {args.rounds} rounds: {len(decisions)} steps")
    print("measured step time by width (median): " + ", ".join(
        f"{w}: {statistics.median(s) * 1000:.1f} ms = {statistics.median(s) * 1000 / plain_ms:.2f} plain "
        f"({len(s)} steps)" for w, s in sorted(seconds.items())))
    print("a call's first drafting step by width (median, not in the table): " + ", ".join(
        f"{w}: {statistics.median(s) * 1000:.1f} ms = {statistics.median(s) * 1000 / plain_ms:.2f} plain "
        f"({len(s)} steps)" for w, s in sorted(first_seconds.items())))
    table = tables[0]
    print("the table's step times at the end (plain steps): " + ", ".join(
        f"{w}: {t / table.times[(1, 0)]:.2f}" for (_, w), t in sorted(table.times.items())))
    # how often the decision read a width's cost well above what its steps took over the round (a width read high
    # is left, and not measured again to correct it)
    print("steps at which a width's predicted time stood over 10% above its measured median: " + ", ".join(
        f"{w}: {np.mean([d['times'][w] > 1.1 * statistics.median(s) * 1000 / plain_ms for d in decisions]):.0%}"
        for w, s in sorted(seconds.items()) if w and w < len(decisions[0]["times"])))
    print("draft limits:", dict(sorted(Counter(d["limit"] for d in decisions).items())))
    for name, chosen in (("plain", [d for d in decisions if d["limit"] == 0]),
                         ("drafting", [d for d in decisions if d["limit"] > 0])):
        if chosen:
            times = np.mean([d["times"] for d in chosen], axis=0).round(3).tolist()
            estimate = np.mean([d["estimate"] for d in chosen], axis=0).round(3).tolist()
            print(f"at the {len(chosen)} {name} steps: predicted step times (plain steps) {times}, acceptance "
                  f"estimates {estimate}")


if __name__ == "__main__":
    main()
