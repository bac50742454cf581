"""What a static cache's capacity costs a short call: the same short prompt, compiled, with a cache sized for it
(hf_specdec's power-of-two bucket; transformers' cache for the call) and with one sized for a long prompt
(`max_cache_len`, which is what a cache that keeps the largest size any earlier call needed amounts to).
SmolLM2-135M-Instruct, batch 1, greedy, 1 thread; each case compiled in a warm-up round, then interleaved rounds,
minimum wall time per case.

    python benchmarks/static_capacity.py [--large 1024] [--max-new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_static import compile_switches

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", type=int, default=1024, help="max_cache_len of the large cache")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_real_model("smollm2", dtype=torch.bfloat16)
    ids = torch.tensor([next(iter(spec_bench_prompts(tokenizer, 1, ["mt_bench"])))[1]])
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id, **compile_switches(torch.device("cpu")))
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, schedule="fixed")
    cases = {}
    for label, extra in (("own size", {}), (f"max_cache_len={args.large}", {"max_cache_len": args.large})):
        cases[f"transformers plain, {label}"] = lambda extra=extra: model.generate(ids, **options, **extra)
        cases[f"hf_specdec ngram, {label}"] = lambda extra=extra: hf_specdec.generate(
            model, ids, speculative=config, **options, **extra)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(args.repeats + 1):  # round 0 compiles
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            if round_index:
                times[name].append(time.perf_counter() - start)
    print(f"prompt of {ids.shape[1]} tokens, {args.max_new_tokens} new tokens")
    for name, seconds in times.items():
        print(f"{name:>42}: {min(seconds):.2f} s (min of {len(seconds)})")


if __name__ == "__main__":
    main()
