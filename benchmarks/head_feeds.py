"""How often the EAGLE head runs in steps it does not draft, under `method="auto"` with the committed EAGLE-3 head.

    python benchmarks/head_feeds.py --batch-size 4 --num-prompts 2 --max-new-tokens 64

runs SmolLM2-135M-Instruct (bfloat16, greedy, 1 thread) with `method="auto"` over n-gram lookup, suffix decoding and
the committed EAGLE-3 head, on `--num-prompts` Spec-Bench questions of each of `--categories`, `--batch-size` rows per
call, and counts (by hooking `EagleProposer.skip` and `_feed_unseen`) the steps the head skipped, the head forwards
that fed committed tokens, and how many of those ran inside a skipped step. Counts, not times: the machine's noise does
not move them (the schedule's choices, which read step times, still can).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.proposers.eagle import EagleProposer
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed.drafters import load_drafter
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts


def count_feeds(model, head, prompts: list[list[int]], pad_token_id: int, batch_size: int, max_new_tokens: int,
                k: int) -> dict[str, int]:
    """Generates `prompts` in left-padded batches under auto with `head`; the head's skipped steps and feeds."""
    counts = {"skipped_steps": 0, "feeds": 0, "feeds_in_skipped_steps": 0}
    skip, feed = EagleProposer.skip, EagleProposer._feed_unseen
    in_skip = [False]

    def counted_skip(self, state):
        counts["skipped_steps"] += 1
        in_skip[0] = True
        try:
            return skip(self, state)
        finally:
            in_skip[0] = False

    def counted_feed(self, state):
        counts["feeds"] += 1
        counts["feeds_in_skipped_steps"] += in_skip[0]
        return feed(self, state)

    EagleProposer.skip, EagleProposer._feed_unseen = counted_skip, counted_feed
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            config = SpeculativeConfig(method="auto", heads=head, num_speculative_tokens=k, prompt_lookup_max=3,
                                       suffix_cache=SuffixCache())
            hf_specdec.generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                speculative=config)
    finally:
        EagleProposer.skip, EagleProposer._feed_unseen = skip, feed
    return counts


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=2, help="Spec-Bench questions per category")
    parser.add_argument("--categories", nargs="+", default=["mt_bench", "translation", "qa", "math_reasoning"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_real_model("smollm2", torch.bfloat16)
    head = load_drafter("smollm2", "eagle3", model)
    prompts = [p for _, p in spec_bench_prompts(tokenizer, args.num_prompts, args.categories)]
    counts = count_feeds(model, head, prompts, tokenizer.pad_token_id, args.batch_size, args.max_new_tokens, args.k)
    print(json.dumps(counts, sort_keys=True))
    write_report(args, [counts], model.device, model.dtype)
    return counts


if __name__ == "__main__":
    main()
