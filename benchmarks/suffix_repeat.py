"""Suffix decoding against n-gram lookup on the repeated-task session, part by part, in target forwards (no timing):

    python benchmarks/suffix_repeat.py --num-per-part 3 --max-new-tokens 96 --max-spec-factor 1 2

runs the session of `hf_specdec.testbed.repeated_tasks` (SmolLM2-135M-Instruct, greedy, batch 1, a fixed k so the
drafts are the proposers' own) once with n-gram lookup and once per suffix setting (each with a cache of its own,
filled by the session as it goes), and prints, for the whole session and for its parts (the first pass; the
requests again: the varied coding requests and the second turns), tokens per target forward (every forward, plain
ones included) and the mean acceptance length (1 + accepted per drafting step). In float32 (the default) every
method's outputs are the same text, so the parts compare like with like; in bfloat16 near-ties make them differ.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.suffix import SuffixCache, SuffixConfig
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.repeated_tasks import greedy_answers, repeated_task_prompts


def parts(count: int) -> dict[str, slice]:
    """The session's parts by request index (`repeated_task_prompts`: code, chat, varied code, second turns)."""
    return {"session": slice(0, 4 * count), "first pass": slice(0, 2 * count), "again": slice(2 * count, 4 * count),
            "varied code": slice(2 * count, 3 * count), "second turns": slice(3 * count, 4 * count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-per-part", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=5, help="draft tokens per step at most (default 5)")
    parser.add_argument("--max-spec-factor", type=float, nargs="+", default=[1.0],
                        help="suffix settings to run (default 1.0, vLLM's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model(dtype=getattr(torch, args.dtype), progress=False)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    prompts = [ids for _, ids in repeated_task_prompts(
        tokenizer, greedy_answers(model, tokenizer, args.max_new_tokens), num_per_part=args.num_per_part)]
    configs = {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=args.k, schedule="fixed")}
    for factor in args.max_spec_factor:
        cache = SuffixCache(SuffixConfig(max_spec_factor=factor))
        configs[f"suffix, max_spec_factor {factor:g}"] = SpeculativeConfig(
            method="suffix", num_speculative_tokens=args.k, schedule="fixed", max_spec_factor=factor,
            suffix_cache=cache)
    results = {}
    for name, config in configs.items():
        requests = []
        for ids in prompts:
            out = hf_specdec.generate(model, torch.tensor([ids]), speculative=config, return_dict_in_generate=True,
                                      **kwargs)
            stats = out.spec_stats
            requests.append({"tokens": out.sequences.shape[1] - len(ids), "forwards": stats.target_forward_passes,
                             "drafts": stats.num_drafts, "accepted": stats.num_accepted_tokens,
                             "output": out.sequences[0, len(ids):].tolist()})
        results[name] = requests
    reference = [r["output"] for r in results["ngram"]]
    print(f"{'part':<14}{'method':<30}{'tok/fwd':>9}{'mean len':>10}")
    table = {}
    for part, rows in parts(args.num_per_part).items():
        for name, requests in results.items():
            chosen = requests[rows]
            tokens = sum(r["tokens"] for r in chosen)
            per_forward = tokens / sum(r["forwards"] for r in chosen)
            mean_length = 1 + sum(r["accepted"] for r in chosen) / max(1, sum(r["drafts"] for r in chosen))
            table.setdefault(part, {})[name] = {"tokens_per_forward": per_forward, "mean_acceptance_length": mean_length}
            print(f"{part:<14}{name:<30}{per_forward:>9.2f}{mean_length:>10.2f}")
    same = {name: [r["output"] for r in requests] == reference for name, requests in results.items()}
    print("outputs identical to n-gram's:", same)
    write_report(args, [table], model.device, model.dtype, identical_outputs=same)


if __name__ == "__main__":
    main()
