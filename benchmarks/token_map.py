"""What a token map (drafting over the lm_head's rows at the most frequent tokens only) buys the committed SmolLM2
drafters whose lm_head is the target's: the EAGLE-1/2 head and the Medusa heads (`set_token_map`) and the draft model
(`SpeculativeConfig.draft_token_map`). Speed and acceptance with the whole vocabulary against maps of the most
frequent tokens of the drafters' training answers, on Spec-Bench, in one run, interleaved.

    python benchmarks/token_map.py --kinds eagle medusa draft --sizes 0 8192 --num-prompts 1 \\
        --max-new-tokens 128 --repeats 2 --json benchmarks/results/token_map_smollm2_chain_bf16_cpu.json

Size 0 is the whole vocabulary. The maps are built from `--answers` (the target's answers the drafters trained on,
as train.sh caches them). Every
case runs every prompt once per repeat, cases interleaved prompt by prompt; speedups are ratios of tokens per second
against plain `generate` over the same prompts and repeats; every output is compared with plain `generate`'s.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import report_results
from hf_specdec.cli.timing import CallTotals
from hf_specdec.heads.token_map import most_frequent_tokens
from hf_specdec.testbed import drafters
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts
from hf_specdec.training.generated import TrainingRows

ANSWERS = Path.home() / ".cache" / "hf_specdec" / "smollm2-drafters" / "generated_data_1920.safetensors"


def answer_tokens(path: Path) -> torch.Tensor:
    """[M] every trained token of the cached answers (what the heads learned from)."""
    tensors = load_file(path)
    rows = TrainingRows(tensors["input_ids"], tensors["lengths"], tensors["starts"])
    return rows.tokens()


def coverage(token_map: torch.Tensor | None, tokens: torch.Tensor) -> float:
    if token_map is None:
        return 1.0
    return float(torch.isin(tokens, token_map).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["eagle", "medusa", "draft"],
                        choices=["eagle", "medusa", "draft"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[0, 8192], help="0: the whole vocabulary")
    parser.add_argument("--tree-width", type=int, default=1,
                        help="> 1: EAGLE and the draft model draft an EAGLE-2 dynamic tree, Medusa its fitted tree")
    parser.add_argument("--tree-nodes", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=1, help="Spec-Bench questions per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--schedule", default="adaptive", choices=["adaptive", "fixed"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--answers", type=Path, default=ANSWERS,
                        help="the answers cache train.sh writes; where it is absent (a fresh machine), the map the "
                             "committed EAGLE-1/2 head ships with stands in for every size it has")
    parser.add_argument("--device", default="cpu", help="where the target and drafters run (cuda on a GPU)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_real_model(dtype=getattr(torch, args.dtype), progress=False)
    target = target.to(args.device)
    vocab = target.get_output_embeddings().weight.shape[0]
    heads = {kind: drafters.load_drafter("smollm2", kind, target) for kind in args.kinds}
    if args.answers.is_file():
        tokens = answer_tokens(args.answers)
        maps = {size: None if size == 0 else most_frequent_tokens(tokens, vocab, size) for size in args.sizes}
    else:
        shipped = drafters.load_drafter("smollm2", "eagle", target).token_map
        if any(size not in (0, len(shipped)) for size in args.sizes):
            raise SystemExit(f"error: no answers at {args.answers} (train.sh writes them); without them only the "
                             f"shipped map's size, {len(shipped)}, and 0 can be measured")
        tokens = None
        maps = {size: None if size == 0 else shipped.cpu() for size in args.sizes}
    prompts = spec_bench_prompts(tokenizer, args.num_prompts)

    def config(kind: str, size: int) -> SpeculativeConfig:
        tree = {}
        if kind in ("eagle", "draft") and args.tree_width > 1:
            tree = {"tree_width": args.tree_width, "tree_total_tokens": args.tree_nodes}
        if kind == "medusa" and args.tree_width > 1:
            tree = {"tree_paths": heads[kind].tree()}
        if kind == "draft":
            drafter = {"draft_model": heads[kind], "draft_token_map": maps[size]}
        else:
            heads[kind].set_token_map(maps[size])
            drafter = {"heads": heads[kind]}
        return SpeculativeConfig(method=kind, num_speculative_tokens=args.k, schedule=args.schedule, **drafter,
                                 **tree)

    cases = ["plain"] + [f"{kind}/{size}" for kind in args.kinds for size in args.sizes]
    totals = {case: CallTotals() for case in cases}
    identical = dict.fromkeys(cases, True)
    expected: dict[int, torch.Tensor] = {}
    for repeat in range(args.repeats):
        for index, (category, prompt) in enumerate(prompts):
            ids = torch.tensor([prompt], device=args.device)
            for case in cases:
                kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False,
                          "attention_mask": torch.ones_like(ids), "pad_token_id": tokenizer.pad_token_id}
                if case != "plain":
                    kind, size = case.split("/")
                    kwargs |= {"speculative": config(kind, int(size)), "return_dict_in_generate": True}
                start = time.perf_counter()
                with torch.no_grad():
                    out = (target.generate(ids, **kwargs) if case == "plain"
                           else hf_specdec.generate(target, ids, **kwargs))
                if torch.cuda.is_available() and args.device != "cpu":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                new = (out if case == "plain" else out.sequences)[0, ids.shape[1]:]
                totals[case].add(seconds, int(new.numel()), None if case == "plain" else out.spec_stats)
                expected.setdefault(index, new)  # plain runs first
                identical[case] &= torch.equal(new, expected[index])
            print(f"repeat {repeat} prompt {index} ({category}) done", flush=True)
    plain_rate = totals["plain"].rate
    results = []
    for case, row in totals.items():
        kind, size = ("plain", 0) if case == "plain" else (case.split("/")[0], int(case.split("/")[1]))
        token_map = None if size == 0 else maps[size]
        result = {"case": case, "kind": kind, "token_map_size": size, "tokens_per_second": round(row.rate, 3),
                  "speedup_vs_plain": round(row.rate / plain_rate, 3),
                  "tokens_per_target_forward": round(row.tokens_per_forward, 3),
                  "tau": None if row.tau is None else round(row.tau, 3),
                  "answer_coverage": None if tokens is None else round(coverage(token_map, tokens), 4),
                  "identical_to_plain": identical[case]}
        results.append(result)
    report_results(args, results, torch.device(args.device), getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
