"""How often greedy speculative output differs from plain `generate` in low precision, and why.

A verify forward scores several positions at once; in bf16/fp16 its matrix kernels round differently from the
one-token forwards of plain decoding, so where plain decoding's two best scores are (nearly) tied the argmax can
flip and the two continuations part. This script counts, per method and with or without logits processors, the
prompts whose output differs from plain `generate` in the given dtype, and for each difference how far below its
best score plain `generate` scored the token the method took at the first differing token (in units of the dtype's
spacing at the best score; `hf_specdec.lossless`, which `hf-specdec demo` reports the same way), and how many of
the differences are near-ties (at most `TIE_SPACINGS` spacings). The same runs in float32 must all be identical.

With `--dynamic-int8` the target's linear layers are quantized with torch.ao's dynamic int8 quantization (float32
otherwise), which scales each forward's whole input at once: a token's logits then depend on the other tokens in
its forward, and the counts say how often that parts a method's output from plain `generate`'s (the gaps are in
float32 spacings).

Run: python benchmarks/low_precision_ties.py [--model testbed|smollm2|PATH] [--dtype bfloat16 | --dynamic-int8]
     [--prompts 32] [--max-new-tokens 64] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.lossless import divergences
from hf_specdec.testbed import drafters

PROCESSORS = {
    "none": {},
    "processors": dict(repetition_penalty=1.2, no_repeat_ngram_size=4),
}


def load(model: str, dtype: torch.dtype):
    """(target, the methods to compare with plain generate, prompts as lists of token ids). The committed drafters
    of the test bed or of SmolLM2 join n-gram lookup when they are there."""
    if model == "testbed":
        from hf_specdec.testbed.loading import load_testbed
        from hf_specdec.testbed.workloads import load_workload

        tokenizer, target, _ = load_testbed(dtype=dtype)
        prompts = [tokenizer(p).input_ids for p in load_workload("completion") + load_workload("edit")]
    else:
        from hf_specdec.testbed.real_model import load_real_model
        from hf_specdec.testbed.spec_bench import spec_bench_prompts

        target, tokenizer = load_real_model(model, dtype=dtype)
        prompts = [ids for _, ids in spec_bench_prompts(tokenizer, num_per_category=8)]
    return target, methods(model, target), prompts


def methods(model: str, target) -> dict[str, SpeculativeConfig]:
    found = {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=5),
             "ngram_tree": SpeculativeConfig(method="ngram", num_speculative_tokens=4, tree_width=3)}
    if model not in drafters.MODELS:
        return found
    have = {kind: drafters.load_drafter(model, kind, target) for kind in drafters.KINDS
            if drafters.has_drafter(model, kind)}
    if "draft" in have:
        found["draft"] = SpeculativeConfig(method="draft", draft_model=have["draft"], num_speculative_tokens=5)
    if "medusa" in have:
        found["medusa_tree"] = SpeculativeConfig(method="medusa", heads=have["medusa"], tree_paths="default")
    if "eagle" in have:
        found["eagle_tree"] = SpeculativeConfig(method="eagle", heads=have["eagle"], top_k=4, depth=5,
                                                total_tokens=24)
    if "eagle3" in have:
        found["eagle3_tree"] = SpeculativeConfig(method="eagle", heads=have["eagle3"], top_k=4, depth=5,
                                                 total_tokens=24)
    if "mlp_speculator" in have:
        found["mlp_speculator"] = SpeculativeConfig(method="mlp_speculator", heads=have["mlp_speculator"],
                                                    num_speculative_tokens=3)
    return found


def run(target, methods: dict[str, SpeculativeConfig], prompts, dtype, max_new_tokens: int) -> dict:
    results = {}
    pad = target.generation_config.pad_token_id or target.generation_config.eos_token_id
    for processors, extra in PROCESSORS.items():
        for name, config in methods.items():
            differing, gaps, ties = 0, [], 0
            for ids in prompts:
                prompt = torch.tensor([ids])
                kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **extra)
                plain = target.generate(prompt, return_dict_in_generate=True, output_scores=True, **kwargs)
                ours = hf_specdec.generate(target, prompt, speculative=config, **kwargs)
                if torch.equal(plain.sequences, ours):
                    continue
                differing += 1
                found, = divergences(plain.sequences, ours, prompt.shape[1], plain.scores, dtype)
                ties += found.near_tie
                gaps.append(math.inf if found.gap_in_spacings is None else found.gap_in_spacings)
            results[f"{name}/{processors}"] = {
                "prompts": len(prompts),
                "differing": differing,
                "near_ties": ties,
                "rate": differing / len(prompts),
                "gap_in_spacings": sorted(round(g, 2) for g in gaps),
            }
            print(f"{name:>10} {processors:>10}: {differing}/{len(prompts)} differ, {ties} at near-ties; plain's "
                  f"score of the token taken below its best at the first difference, in {dtype} spacings: "
                  f"{sorted(round(g, 2) for g in gaps)}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="testbed", help="testbed, smollm2, a folder or a Hub id")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dynamic-int8", action="store_true",
                        help="quantize the float32 target's linear layers with torch.ao dynamic int8 (instead of "
                             "--dtype)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {}
    runs = {"dynamic_int8": torch.float32} if args.dynamic_int8 else {
        str(dtype).removeprefix("torch."): dtype for dtype in (getattr(torch, args.dtype), torch.float32)}
    for label, dtype in runs.items():
        target, found, prompts = load(args.model, dtype)
        if args.dynamic_int8:
            torch.ao.quantization.quantize_dynamic(target, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        print(f"{args.model} in {label}, {min(args.prompts, len(prompts))} prompts, {args.max_new_tokens} new tokens")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".* is dynamically quantized")  # what this run measures
            report[label] = run(target, found, prompts[: args.prompts], dtype, args.max_new_tokens)
    write_report(args, [{"dtype": dtype, "case": case, **cell} for dtype, cells in report.items()
                        for case, cell in cells.items()], torch.device("cpu"), None)


if __name__ == "__main__":
    main()
