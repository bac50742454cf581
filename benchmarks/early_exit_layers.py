"""Which layer early-exit self-speculation should draft from: acceptance and cost of every candidate layer.

For each exit layer N, hf_specdec drafts k tokens a step with the target's first N layers (its final norm and
lm_head on top) over Spec-Bench prompts (greedy, batch 1), and this reports the mean acceptance length, the mean
cost of one draft forward and of one verify forward (measured inside the forwards), and from them the predicted
speedup over plain decoding:

    predicted = mean acceptance length * t_plain / (t_verify + draft forwards per step * t_draft)

where t_plain is one plain decode forward of the target (one token; measured here too); every mean leaves out the
prompt's prefill (each generate call's first forward of the target and of the draft). It leaves out what the
engine spends outside forwards, so it ranks layers by the work they cause rather than by wall time (which a busy
machine makes noisy); `hf-specdec bench --method early_exit hf-early-exit --early-exit-layer N` measures wall time.

Run (from the repository root): python benchmarks/early_exit_layers.py [--layers 4 6 8 10 12 16] [-k 4] [--per-category 1]
     [--max-new-tokens 48] [--threads 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.cli.runs import SPECULATIVE_OUTPUTS, ForwardTimer
from hf_specdec.proposers.early_exit import early_exit_draft
from hf_specdec.testbed.real_model import SMOLLM2, load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts


class CallTimes(ForwardTimer):
    """A ForwardTimer that keeps every call's duration, so a call's first forward (the prefill) can be left out."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.durations: list[float] = []

    def _post(self, *args) -> None:
        before = self.seconds
        super()._post(*args)
        self.durations.append(self.seconds - before)

    def decode_ms(self, first_calls: list[int]) -> float:
        """Mean duration of the calls other than those at `first_calls` (each generate call's prefill)."""
        prefills = set(first_calls)
        kept = [d for i, d in enumerate(self.durations) if i not in prefills]
        return 1000 * sum(kept) / len(kept)


def measure(target, prompts: list[list[int]], layer: int, k: int, max_new_tokens: int) -> dict:
    config = SpeculativeConfig(method="early_exit", early_exit_layer=layer, num_speculative_tokens=k)
    target_timer, draft_timer = CallTimes(target), CallTimes(early_exit_draft(target, layer))
    drafts = accepted = steps = 0
    target_firsts, draft_firsts = [], []
    try:
        for ids in prompts:
            target_firsts.append(target_timer.calls)
            draft_firsts.append(draft_timer.calls)
            out = hf_specdec.generate(target, torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      speculative=config, **SPECULATIVE_OUTPUTS)
            stats = out.spec_stats
            drafts += stats.num_drafts
            accepted += stats.num_accepted_tokens
            steps += stats.target_forward_passes - 1  # verify forwards (the prefill excluded)
    finally:
        target_timer.close()
        draft_timer.close()
    return {"layer": layer, "mean_acceptance_length": 1 + accepted / drafts,
            "draft_forward_ms": draft_timer.decode_ms(draft_firsts),
            "target_forward_ms": target_timer.decode_ms(target_firsts),
            "draft_forwards_per_step": (draft_timer.calls - len(prompts)) / steps}


def plain_forward_ms(target, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Mean time of plain generate's decode forwards (its prefills left out)."""
    timer, firsts = CallTimes(target), []
    try:
        for ids in prompts:
            firsts.append(timer.calls)
            target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        timer.close()
    return timer.decode_ms(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[4, 6, 8, 10, 12, 16])
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step (default 4)")
    parser.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_real_model(SMOLLM2, dtype=torch.bfloat16)
    prompts = [ids for _, ids in spec_bench_prompts(tokenizer, num_per_category=args.per_category)]
    t_plain = plain_forward_ms(target, prompts, args.max_new_tokens)
    rows = []
    print(f"plain forward {t_plain:.1f} ms; {len(prompts)} prompts, k={args.k}, {args.max_new_tokens} new tokens")
    print(f"{'layer':>5}{'mean len':>10}{'draft ms':>10}{'verify ms':>11}{'drafts/step':>13}{'predicted':>11}")
    for layer in args.layers:
        row = measure(target, prompts, layer, args.k, args.max_new_tokens)
        step_ms = row["target_forward_ms"] + row["draft_forwards_per_step"] * row["draft_forward_ms"]
        row["predicted_speedup"] = row["mean_acceptance_length"] * t_plain / step_ms
        rows.append(row)
        print(f"{layer:>5}{row['mean_acceptance_length']:>10.2f}{row['draft_forward_ms']:>10.1f}"
              f"{row['target_forward_ms']:>11.1f}{row['draft_forwards_per_step']:>13.2f}"
              f"{row['predicted_speedup']:>10.2f}x")
    write_report(args, rows, target.device, target.dtype, plain_forward_ms=t_plain)


if __name__ == "__main__":
    main()
