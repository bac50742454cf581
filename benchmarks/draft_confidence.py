"""What `SpeculativeConfig(draft_confidence=c)` (a row's chain stops where the drafter's running confidence falls
below c) does to speed and acceptance of the committed SmolLM2 drafters, under a fixed k and under the adaptive
schedule, on Spec-Bench, in one run, interleaved.

    python benchmarks/draft_confidence.py --kinds eagle draft --confidences none 0.06 --schedules fixed adaptive \\
        --num-prompts 1 --max-new-tokens 128 --repeats 2 --json benchmarks/results/draft_confidence_smollm2_bf16_cpu.json

`--calibration` first measures how well the drafters' confidence predicts acceptance: every drafting step of a
fixed chain of k (no stop), the first drafted position's peak probability against whether the target kept the
token, in bins of the peak and per category, and the mean running confidence against the share kept at each depth.

Each case (kind, schedule, confidence) drafts with a drafter object of its own, so the adaptive schedule's
step-time table and estimates (kept per drafter for the process) are each case's own. Every case runs every prompt
once per repeat, cases interleaved prompt by prompt, after a warm-up call each; speedups are ratios of tokens per
second against plain `generate` over the same prompts and repeats. Greedy; every output is compared with plain
`generate`'s (in bfloat16 outputs may part at near-ties, see the README's Low precision).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import add_run_arguments, report_results
from hf_specdec.cli.timing import CallTotals
from hf_specdec.testbed import drafters
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts

KINDS = ("eagle", "eagle3", "draft")
PEAK_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)


def calibration(target, tokenizer, kind: str, prompts, k: int, max_new_tokens: int) -> dict:
    """Per drafting step of a fixed chain of k (every position drafted): the running confidence (product of the
    peaks) at each depth and the tokens accepted, summarised by bins of the first peak, by category and by depth."""
    from hf_specdec.proposers.confidence import peak_probability
    from hf_specdec.proposers.draft_model import DraftModelProposer
    from hf_specdec.proposers.eagle import EagleProposer

    proposer = DraftModelProposer if kind == "draft" else EagleProposer  # the class whose commit runs

    steps: list[tuple[str, list[float], int]] = []  # (category, peaks by position, accepted)
    peaks: list[float] = []
    draw, commit = DraftModelProposer._draw, proposer.commit

    def recording_draw(self, logits):
        token, probs = draw(self, logits)
        peaks.append(float(peak_probability(logits, False)[0]))
        return token, probs

    def recording_commit(self, state, result):
        if peaks:
            steps.append((category, peaks[:], int(result.num_accepted[0])))
        peaks.clear()
        return commit(self, state, result)

    config = config_for(kind, drafters.load_drafter("smollm2", kind, target), k, "fixed", None)
    DraftModelProposer._draw, proposer.commit = recording_draw, recording_commit
    try:
        for category, prompt in prompts:
            peaks.clear()
            hf_specdec.generate(target, torch.tensor([prompt], device=target.device), speculative=config,
                                max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id)
    finally:
        DraftModelProposer._draw, proposer.commit = draw, commit
    first = [(p[0], accepted >= 1) for _, p, accepted in steps]
    bins = []
    for low, high in itertools.pairwise(PEAK_BINS):
        inside = [kept for peak, kept in first if low <= peak < high or (high == 1.0 and peak == 1.0)]
        if inside:
            bins.append({"first_peak": [low, high], "steps": len(inside), "kept": round(sum(inside) / len(inside), 3)})
    categories = {}
    for name in dict.fromkeys(c for c, _, _ in steps):
        mine = [(p[0], accepted >= 1) for c, p, accepted in steps if c == name]
        categories[name] = {"steps": len(mine), "mean_first_peak": round(sum(p for p, _ in mine) / len(mine), 3),
                            "first_kept": round(sum(kept for _, kept in mine) / len(mine), 3)}
    depths = []
    for depth in range(1, k + 1):
        reach = [torch.tensor(p[:depth]).prod().item() for _, p, _ in steps if len(p) >= depth]
        kept = [accepted >= depth for _, p, accepted in steps if len(p) >= depth]
        if not reach:  # no step drafted this deep (the length limit)
            break
        depths.append({"depth": depth, "mean_running_confidence": round(sum(reach) / len(reach), 3),
                       "kept": round(sum(kept) / len(kept), 3)})
    return {"kind": kind, "drafting_steps": len(steps), "by_first_peak": bins, "by_category": categories,
            "by_depth": depths}


def parse_confidence(value: str) -> float | None:
    return None if value == "none" else float(value)


def config_for(kind: str, drafter, k: int, schedule: str, confidence: float | None) -> SpeculativeConfig:
    """A chain of the committed drafter `kind`."""
    if kind == "draft":
        return SpeculativeConfig(method="draft", draft_model=drafter, num_speculative_tokens=k, schedule=schedule,
                                 draft_confidence=confidence)
    return SpeculativeConfig(method="eagle", heads=drafter, num_speculative_tokens=k, schedule=schedule,
                             draft_confidence=confidence)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["eagle", "draft"], choices=KINDS)
    parser.add_argument("--confidences", nargs="+", default=["none", "0.06"], type=str,
                        help="draft_confidence values; 'none' drafts every position the schedule allows")
    parser.add_argument("--schedules", nargs="+", default=["fixed", "adaptive"], choices=["fixed", "adaptive"])
    parser.add_argument("-k", type=int, default=5)
    add_run_arguments(parser)
    parser.add_argument("--calibration", action="store_true",
                        help="first measure each kind's confidence against acceptance (see the module docstring)")
    args = parser.parse_args(argv)
    confidences = [parse_confidence(value) for value in args.confidences]
    torch.set_num_threads(args.threads)
    target, tokenizer = load_real_model(dtype=getattr(torch, args.dtype), progress=False)
    target = target.to(args.device)
    prompts = spec_bench_prompts(tokenizer, args.num_prompts, args.categories)
    calibrations = []
    if args.calibration:
        for kind in args.kinds:
            calibrations.append(calibration(target, tokenizer, kind, prompts, args.k, args.max_new_tokens))
            print(json.dumps(calibrations[-1], sort_keys=True), flush=True)
    cases = {"plain": None}
    for kind in args.kinds:
        for schedule in args.schedules:
            for confidence in confidences:
                drafter = drafters.load_drafter("smollm2", kind, target)  # its own: its own schedule tables
                cases[f"{kind}/{schedule}/{confidence}"] = config_for(kind, drafter, args.k, schedule, confidence)
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}

    def run(config: SpeculativeConfig | None, prompt: list[int]):
        ids = torch.tensor([prompt], device=args.device)
        start = time.perf_counter()
        with torch.no_grad():
            if config is None:
                out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            else:
                out = hf_specdec.generate(target, ids, attention_mask=torch.ones_like(ids), speculative=config,
                                          return_dict_in_generate=True, **kwargs)
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    for config in cases.values():  # warm-up
        run(config, prompts[0][1])
    totals = {case: CallTotals() for case in cases}
    identical = dict.fromkeys(cases, 0)
    expected: dict[int, torch.Tensor] = {}
    for repeat in range(args.repeats):
        for index, (category, prompt) in enumerate(prompts):
            for case, config in cases.items():
                seconds, out = run(config, prompt)
                new = (out if config is None else out.sequences)[0, len(prompt):]
                totals[case].add(seconds, int(new.numel()), None if config is None else out.spec_stats)
                expected.setdefault(index, new)  # plain runs first
                identical[case] += int(torch.equal(new, expected[index]))
            print(f"repeat {repeat} prompt {index} ({category}) done", flush=True)
    plain_rate = totals["plain"].rate
    results = []
    for case, row in totals.items():
        kind, schedule, confidence = (case, None, None) if case == "plain" else case.split("/")
        result = {"case": case, "kind": kind, "schedule": schedule,
                  "draft_confidence": None if confidence in (None, "None") else float(confidence),
                  "tokens_per_second": round(row.rate, 3), "speedup_vs_plain": round(row.rate / plain_rate, 3),
                  "tokens_per_target_forward": round(row.tokens_per_forward, 3),
                  "tau": None if row.tau is None else round(row.tau, 3),
                  "draft_tokens": row.draft_tokens if case != "plain" else None,
                  "identical_to_plain": f"{identical[case]}/{len(prompts) * args.repeats}" if case != "plain" else None}
        results.append(result)
    report_results(args, results, torch.device(args.device), getattr(torch, args.dtype),
                   calibration=calibrations)


if __name__ == "__main__":
    main()
