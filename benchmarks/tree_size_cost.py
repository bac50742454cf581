"""What `tree_total_tokens="auto"` costs once per process: the timed forwards that size the tree, against a plain
`generate` call for scale.

    python benchmarks/tree_size_cost.py --dtype bfloat16 float32 --batch-size 1 4 --max-new-tokens 128

For SmolLM2-135M-Instruct in each dtype and at each batch size: seconds of the first `auto_tree_size` call (the
128-token prefill and the ladder of timed forwards, `hf_specdec.schedule.tree_size`), the size it chose and the
widths it timed, seconds of a second call (answered from the process's table), and seconds of one plain greedy
`generate` of --max-new-tokens tokens on a Spec-Bench question at that batch size. The sizing is that of an EAGLE-2
tree of top_k --tree-width and depth k (at most its candidates, or 64 nodes).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hf_specdec.cli.environment import write_report
from hf_specdec.schedule import tree_size
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts
from hf_specdec.tree.dynamic import candidate_count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=("bfloat16", "float32"))
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--tree-width", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtype:
        model, tokenizer = load_real_model("smollm2", dtype=getattr(torch, dtype), progress=False)
        prompt = torch.tensor([spec_bench_prompts(tokenizer, 1, categories=["mt_bench"])[0][1]])
        for batch_size in args.batch_size:
            widths: list[int] = []

            def measure(*measure_args, **kwargs):  # the widths the first call timed
                costs = tree_size.measure_verify_costs(*measure_args, **kwargs)
                widths.extend(costs)
                return costs

            max_nodes = candidate_count(args.tree_width, args.k)
            start = time.perf_counter()
            size = tree_size.auto_tree_size(model, batch_size, args.k, max_nodes, measure=measure)
            first = time.perf_counter() - start
            start = time.perf_counter()
            tree_size.auto_tree_size(model, batch_size, args.k, max_nodes, measure=measure)
            second = time.perf_counter() - start
            ids = prompt.expand(batch_size, -1)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                           min_new_tokens=args.max_new_tokens, do_sample=False)
            plain = time.perf_counter() - start
            row = dict(dtype=dtype, batch_size=batch_size, size=size, widths_timed=widths, first_call_s=first,
                       second_call_s=second, plain_generate_s=plain)
            rows.append(row)
            print(f"{dtype:9s} batch {batch_size:2d}: {size:2d} nodes, widths timed {widths}, first call {first:.2f} s,"
                  f" second {second * 1e6:.0f} us; plain generate of {args.max_new_tokens} tokens {plain:.2f} s "
                  f"(the sizing: {first / plain:.1%} of it)", flush=True)
    write_report(args, rows, torch.device("cpu"), getattr(torch, args.dtype[0]) if len(args.dtype) == 1 else None)


if __name__ == "__main__":
    main()
