"""Where an EAGLE or Medusa step's time goes: the target's verify forward, the proposer (for EAGLE: its head
forwards, split into the decoder layer and the lm_head), and the rest (the engine's bookkeeping).

Greedy, batch 1, the committed heads; on the test bed (float32) the first prompts of the completion workload, with
`--model smollm2` SmolLM2-135M-Instruct (`--dtype`, default bfloat16) with its committed heads on the first Spec-Bench
question of each category. One warm-up pass, then one timed pass with wall-clock timers wrapped around the engine's
`verify`, the proposer's `propose`, the EAGLE head's forward and its `logits`. The schedule is fixed: every step
drafts k tokens.

Run: python benchmarks/head_step_profile.py [--model testbed|smollm2] [--method eagle|eagle3|medusa] [-k 5]
    [--top-k 1] [--prompts 4] [--whole-vocabulary]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.decoding.loop import SpeculativeDecoder
from hf_specdec.heads import EagleHead, MedusaHeads
from hf_specdec.proposers.eagle import EagleProposer
from hf_specdec.proposers.medusa import MedusaProposer
from hf_specdec.testbed import drafters
from hf_specdec.testbed.loading import heads_dir, load_testbed
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts
from hf_specdec.testbed.workloads import load_workload


def timed(owner, name: str, totals: dict, counts: dict, restore: list):
    """Wrap owner.name so its wall time and calls add up in totals[name], counts[name]; `restore` collects what
    puts it back."""
    original = getattr(owner, name)
    restore.append(lambda: setattr(owner, name, original))

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            counts[name] += 1

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("testbed", "smollm2"), default="testbed")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="with --model smollm2: the target's dtype (the test bed runs in float32)")
    parser.add_argument("--method", choices=("eagle", "eagle3", "medusa"), default="eagle")
    parser.add_argument("-k", type=int, default=5, help="draft depth (default 5)")
    parser.add_argument("--top-k", type=int, default=1, help="EAGLE: > 1 drafts a dynamic tree of k * top_k nodes")
    parser.add_argument("--prompts", type=int, default=4,
                        help="completion prompts, or with --model smollm2 Spec-Bench questions (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--whole-vocabulary", action="store_true",
                        help="EAGLE-1/2 and Medusa: draft over the whole vocabulary, not the heads' token map")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        target, tokenizer = load_real_model(dtype=getattr(torch, args.dtype))
        heads = drafters.load_drafter("smollm2", args.method, target)
        questions = spec_bench_prompts(tokenizer, num_per_category=1)[: args.prompts]
        prompts = [torch.tensor([ids]) for _, ids in questions]
    else:
        tokenizer, target, _ = load_testbed()
        kind = MedusaHeads if args.method == "medusa" else EagleHead
        heads = kind.from_pretrained(heads_dir(args.method)).eval()
        prompts = [tokenizer(p, return_tensors="pt").input_ids for p in load_workload("completion")[: args.prompts]]
    if args.whole_vocabulary and args.method != "eagle3":
        heads.set_token_map(None)
    if args.method == "medusa":
        config = SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=args.k, schedule="fixed")
    else:
        tree = dict(top_k=args.top_k, total_tokens=args.k * args.top_k) if args.top_k > 1 else {}
        config = SpeculativeConfig(method="eagle", heads=heads, num_speculative_tokens=args.k, schedule="fixed", **tree)

    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run() -> tuple[float, int]:
        steps = 0
        start = time.perf_counter()
        for ids in prompts:
            out = hf_specdec.generate(target, ids, speculative=config, max_new_tokens=args.max_new_tokens,
                                      do_sample=False, pad_token_id=pad_token_id, return_dict_in_generate=True)
            steps += out.spec_stats.target_forward_passes - 1  # the prefill is not a step
        return time.perf_counter() - start, steps

    run()  # warm-up
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    restore: list = []
    timed(SpeculativeDecoder, "verify", totals, counts, restore)
    proposer = MedusaProposer if args.method == "medusa" else EagleProposer
    timed(proposer, "propose", totals, counts, restore)
    if args.method != "medusa":
        timed(EagleHead, "forward", totals, counts, restore)
        timed(EagleHead, "logits", totals, counts, restore)
    try:
        wall, steps = run()
    finally:
        for undo in restore:
            undo()
    print(f"{args.method}, k={args.k}, top_k={args.top_k}: {steps} steps, {1000 * wall / steps:.2f} ms per step")
    print(f"  target verify forward  {1000 * totals['verify'] / steps:6.2f} ms per step")
    print(f"  proposer               {1000 * totals['propose'] / steps:6.2f} ms per step")
    if args.method != "medusa":
        calls = counts["forward"]
        print(f"    head forwards        {calls / steps:6.2f} per step, {1000 * totals['forward'] / calls:.2f} ms each "
              f"(decoder layer), lm_head {1000 * totals['logits'] / calls:.2f} ms each")
    rest = wall - totals["verify"] - totals["propose"]
    print(f"  everything else        {1000 * rest / steps:6.2f} ms per step (prefill, acceptance, bookkeeping)")


if __name__ == "__main__":
    main()
