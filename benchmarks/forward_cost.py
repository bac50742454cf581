"""What a target forward costs as a function of the tokens it checks: the ratio that decides whether verifying k
draft tokens (or a tree) is almost free (a GPU; a CPU in bfloat16 with a model this size) or paid per token.

    python benchmarks/forward_cost.py --model smollm2 --dtype bfloat16 float32 --threads 1

For each dtype: the median time of one forward over W new tokens on top of a cached prefix of --context tokens
(interleaved over W, --repeats rounds), and its ratio to W = 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.testbed.loading import load_testbed
from hf_specdec.testbed.real_model import load_real_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(name: str, dtype: torch.dtype):
    if name == "testbed":
        _, model, _ = load_testbed(dtype=dtype)
        return model
    return load_real_model(name, dtype=dtype)[0]


@torch.no_grad()
def forward_seconds(model, context: int, widths: list[int], repeats: int) -> dict[int, float]:
    vocab = model.config.vocab_size
    prefix = torch.randint(10, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(prefix, **{CACHE_KWARG: cache}, use_cache=True)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats + 1):  # the first round warms up
        for width in widths:
            new = torch.randint(10, vocab, (1, width))
            start = time.perf_counter()
            model(new, **{CACHE_KWARG: cache}, use_cache=True)
            times[width].append(time.perf_counter() - start)
            cache.crop(-width)
    return {w: statistics.median(t[1:]) for w, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, testbed, or a model folder / Hub id")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 6, 8, 16, 32])
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the new ones (default 256)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.dtype:
        model = load(args.model, DTYPES[name]).eval()
        seconds = forward_seconds(model, args.context, args.widths, args.repeats)
        one = seconds[args.widths[0]]
        print(f"{args.model} {name}, {args.threads} thread(s), {args.context} cached tokens:")
        for width, value in seconds.items():
            print(f"  {width:>3} new tokens: {1000 * value:7.1f} ms  = {value / one:4.2f}x one token")


if __name__ == "__main__":
    main()
