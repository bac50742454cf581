"""`hf-specdec demo`: speculative decoding on the committed test bed, offline, on the CPU, in under a minute.

For each workload (code completion, and "edit" prompts whose continuation repeats a passage of the prompt) it
generates greedily with plain `generate` and with every proposer (chains and token trees: a dynamic draft tree, an
n-gram trie, the committed Medusa heads (`examples/heads/medusa`) as a chain and with the tree fitted to them, and
the committed EAGLE-1/2 head as a chain and an EAGLE-2 dynamic tree and EAGLE-3 head as a chain), shows a
continuation, the acceptance statistics, the speedup over plain `generate`, and checks that every output is
token-for-token plain generate's.
"""

from __future__ import annotations

import argparse

import torch

from hf_specdec import SpeculativeConfig
from hf_specdec.cli.runs import RunResult, timed_generate
from hf_specdec.heads import EagleHead, MedusaHeads
from hf_specdec.testbed.loading import heads_dir, load_testbed
from hf_specdec.testbed.workloads import load_workload

DEMO_WORKLOADS = ("completion", "edit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per workload, generated as one batch (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=5, help="draft tokens per step (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _configs(draft, heads: MedusaHeads, eagle: EagleHead, eagle3: EagleHead, k: int) -> dict[str, SpeculativeConfig]:
    return {
        "draft": SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=k),
        "draft-tree": SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=k, tree_width=2,
                                        tree_total_tokens=2 * k),
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3),
        "ngram-tree": SpeculativeConfig(method="ngram", num_speculative_tokens=k, tree_width=3),
        "medusa": SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=k),
        "medusa-tree": SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=k,
                                         tree_paths=heads.tree()),
        "eagle": SpeculativeConfig(method="eagle", heads=eagle, num_speculative_tokens=k),
        "eagle-tree": SpeculativeConfig(method="eagle", heads=eagle, top_k=2, depth=k, total_tokens=2 * k),
        "eagle3": SpeculativeConfig(method="eagle", heads=eagle3, num_speculative_tokens=k),
    }


def _row(result: RunResult, plain: RunResult) -> str:
    same = "yes" if torch.equal(result.sequences, plain.sequences) else "NO"
    accept = "-" if result.acceptance_rate is None else f"{result.acceptance_rate:.2f}"
    length = "-" if result.mean_acceptance_length is None else f"{result.mean_acceptance_length:.2f}"
    return (
        f"  {result.name:<11} {result.tokens_per_second:>8.1f} {plain.seconds / result.seconds:>7.2f}x "
        f"{result.tokens_per_forward:>8.2f} {accept:>8} {length:>8} {same:>10}"
    )


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise SystemExit("--num-prompts and --max-new-tokens must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print("Loading the test bed (tokenizer, target, draft, Medusa and EAGLE heads) ...", flush=True)
    tokenizer, target, draft = load_testbed()
    heads = MedusaHeads.from_pretrained(heads_dir("medusa"))
    eagle, eagle3 = (EagleHead.from_pretrained(heads_dir(kind)).eval() for kind in ("eagle", "eagle3"))
    tokenizer.padding_side = "left"
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(
        f"target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters, "
        f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M, "
        f"{heads.config.num_heads} Medusa heads, an EAGLE-1/2 and an EAGLE-3 head; greedy, "
        f"{args.num_prompts} prompts x {args.max_new_tokens} new tokens, k={args.num_speculative_tokens}\n"
    )
    all_identical = True
    for workload in DEMO_WORKLOADS:
        prompts = load_workload(workload)[: args.num_prompts]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        timed_generate("warm-up", target, ids[:1], mask[:1], {**kwargs, "max_new_tokens": 2})
        plain = timed_generate("plain", target, ids, mask, kwargs)
        results = [plain] + [
            timed_generate(name, target, ids, mask, kwargs, config)
            for name, config in _configs(draft, heads, eagle, eagle3, args.num_speculative_tokens).items()
        ]
        print(f"== workload '{workload}': {len(prompts)} prompts")
        tail = "\n".join(prompts[0].rstrip("\n").split("\n")[-3:])
        continuation = tokenizer.decode(results[1].sequences[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"-- prompt 1 (last lines) --\n{tail}\n-- continuation (draft method) --\n{continuation}\n--")
        print(f"  {'method':<11} {'tok/s':>8} {'speedup':>8} {'tok/fwd':>8} {'accept':>8} {'mean len':>8} {'identical':>10}")
        for result in results:
            print(_row(result, plain))
            all_identical &= torch.equal(result.sequences, plain.sequences)
        print()
    print("All outputs identical to plain generate." if all_identical else "MISMATCH: some output differs from plain generate.")
    return 0 if all_identical else 1
