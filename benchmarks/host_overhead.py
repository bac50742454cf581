"""Where batch-1 time goes: inside the models' forwards vs. outside them (the engine's own work), and the best
ratio to transformers' path that forwards alone allow.

Same target, drafts and prompt as `bench_engine.py` (random Llama, hidden 256 x 4 layers; a repeating 97-token
prompt; 128 greedy tokens; k = 5): transformers' prompt lookup against hf_specdec's n-gram proposer, and
transformers' `assistant_model` (constant k, no confidence threshold) against hf_specdec's draft proposer, with the
`random` draft (acceptance 0) and the `copy` draft (the target itself, acceptance 1). Forward-hook timers
(`hf_specdec.cli.runs.ForwardTimer`) on the target and the draft split each run's wall time; the median of
--repeats runs is printed.

`bound` is transformers' wall time over the time hf_specdec's own path spends inside model forwards: the ratio
to transformers this path would reach if everything outside the forwards cost nothing.

Run: python benchmarks/host_overhead.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_llama, repeating_prompts  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec import SpeculativeConfig  # noqa: E402
from hf_specdec.cli.runs import ForwardTimer  # noqa: E402

K = 5


def paths(target: torch.nn.Module) -> list[tuple[str, str | None, torch.nn.Module | None, Callable[[], object]]]:
    """(name, the transformers path it is compared with, its draft model, run) for every path."""
    ids, mask = repeating_prompts(1, seed=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=0)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_max=3)
    found = [
        ("transformers prompt lookup", None, None,
         lambda: target.generate(ids, prompt_lookup_num_tokens=K, max_matching_ngram_size=3, **kwargs)),
        ("hf_specdec ngram", "transformers prompt lookup", None,
         lambda: hf_specdec.generate(target, ids, speculative=ngram, **kwargs)),
    ]
    drafts = {"random": build_llama(hidden=64, layers=1, heads=4, intermediate=128, seed=1),
              "copy": copy.deepcopy(target)}
    for name, draft in drafts.items():
        draft.generation_config.num_assistant_tokens = K
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=K)
        found += [
            (f"assistant_model[{name}]", None, draft,
             lambda draft=draft: target.generate(ids, assistant_model=draft, **kwargs)),
            (f"hf_specdec draft[{name}]", f"assistant_model[{name}]", draft,
             lambda config=config: hf_specdec.generate(target, ids, speculative=config, **kwargs)),
        ]
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs per path; the median is printed (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = build_llama(hidden=256, layers=4, heads=4, intermediate=512, seed=0)
    cases = paths(target)
    samples: dict[str, list[tuple[float, float, int, float, int]]] = {name: [] for name, *_ in cases}
    for *_, run in cases:
        run()  # warm-up
    for _ in range(args.repeats):
        for name, _, draft, run in cases:
            target_timer, draft_timer = ForwardTimer(target), ForwardTimer(draft)
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
            target_timer.close()
            draft_timer.close()
            samples[name].append((wall, target_timer.seconds, target_timer.calls, draft_timer.seconds,
                                  draft_timer.calls))
    header = ("path", "wall ms", "target fwd ms", "n", "draft fwd ms", "n", "outside ms", "per step", "bound")
    print(f"{header[0]:<26}" + "".join(f"{h:>14}" if len(h) > 2 else f"{h:>5}" for h in header[1:]))
    walls = {}
    for name, baseline, *_ in cases:
        runs = samples[name]
        wall, in_target, in_draft = (statistics.median(r[i] for r in runs) for i in (0, 1, 3))
        walls[name] = wall
        steps = runs[0][2]
        bound = "-" if baseline is None else f"{walls[baseline] / (in_target + in_draft):.2f}x"
        outside = wall - in_target - in_draft
        print(f"{name:<26}{1000 * wall:>14.1f}{1000 * in_target:>14.1f}{steps:>5}{1000 * in_draft:>14.1f}"
              f"{runs[0][4]:>5}{1000 * outside:>14.1f}{1000 * outside / steps:>12.2f}ms{bound:>14}")


if __name__ == "__main__":
    main()
