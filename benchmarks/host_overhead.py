"""Where batch-1 n-gram time goes: inside the target's forwards vs. outside them (the engine's own work).

Same target and prompt as `bench_engine.py` (random Llama, hidden 256 x 4 layers; a repeating 97-token prompt;
128 greedy tokens; k = 5); transformers' prompt lookup against hf_specdec's n-gram proposer. A forward-hook timer
(`hf_specdec.cli.runs.ForwardTimer`) splits each run's wall time; the median of --repeats runs is printed.

Run: python benchmarks/host_overhead.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_llama, repeating_prompts  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec import SpeculativeConfig  # noqa: E402
from hf_specdec.cli.runs import ForwardTimer  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs per path; the median is printed (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = build_llama(hidden=256, layers=4, heads=4, intermediate=512, seed=0)
    ids, mask = repeating_prompts(1, seed=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_max=3)
    paths = {
        "transformers prompt lookup": lambda: target.generate(ids, prompt_lookup_num_tokens=5,
                                                              max_matching_ngram_size=3, **kwargs),
        "hf_specdec ngram": lambda: hf_specdec.generate(target, ids, speculative=config, **kwargs),
    }
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in paths}
    for run in paths.values():
        run()  # warm-up
    for _ in range(args.repeats):
        for name, run in paths.items():
            timer = ForwardTimer(target)
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
            timer.close()
            samples[name].append((wall, timer.seconds, timer.calls))
    print(f"{'path':<28}{'wall ms':>9}{'in forwards':>13}{'outside':>9}{'forwards':>10}{'outside/step':>14}")
    for name, runs in samples.items():
        wall, inside = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        calls = runs[0][2]
        print(f"{name:<28}{1000 * wall:>9.1f}{1000 * inside:>13.1f}{1000 * (wall - inside):>9.1f}{calls:>10}"
              f"{1000 * (wall - inside) / calls:>12.2f}ms")


if __name__ == "__main__":
    main()
