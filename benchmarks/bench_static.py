"""Static shapes and compiled forwards against transformers' own fastest plain path, on the same prompts.

Cases, each the wall time of generating every prompt one at a time (batch 1, greedy), interleaved over repeats
(the first round warms up and compiles; so do the next ones, up to four rounds in all, as long as a graph compiled
in them: a width the adaptive schedule first reaches in one cache bucket rounds later is a new graph there):

- `plain`: transformers' `generate`, eager;
- `plain-compiled`: transformers' `generate` with `cache_implementation="static"` and a `CompileConfig` (on a CPU
  with `_compile_all_devices`, which transformers needs to compile there);
- `<method>`: hf_specdec, eager; `<method>-compiled`: hf_specdec with the same two switches;
- with `--baseline PATH`, `<method>@baseline`: the eager case run by another checkout of hf_specdec (its own
  process, one round of it before each round here), so "before and after" share the machine's state.

Reported: tok/s per case (median of repeats), the ratios of tok/s the goals name (compiled hf_specdec / compiled plain,
eager / baseline eager) as medians of the per-round paired ratios and as ratios of the best rounds, tokens per
target forward, and for hf_specdec cases the engine's share of a step outside model forwards (timed in a separate
pass around every model call the cache makes: target and drafter). Every output is checked against plain's.

    python benchmarks/bench_static.py [--model testbed|smollm2|PATH] [--methods ngram eagle medusa]
        [--prompts 4] [--max-new-tokens 48] [--repeats 3] [--threads 1] [--baseline /path/to/other/checkout]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters  # not hf_specdec.compile.graphs_compiled: a --baseline may predate it
from transformers import CompileConfig

import hf_specdec
from hf_specdec import SpeculativeConfig

# rounds that may warm up: the first, and the next ones as long as a graph compiled in them
MAX_WARMUP_ROUNDS = 4
METHODS = ("ngram", "suffix", "draft", "medusa", "eagle", "eagle3")
# the settings measured best per method on the test bed (greedy, batch 1, CPU; benchmarks/RESULTS.md); suffix
# decoding with n-gram lookup's k (its verify width under static shapes)
SETTINGS = {"ngram": dict(num_speculative_tokens=5), "suffix": dict(num_speculative_tokens=5),
            "draft": dict(num_speculative_tokens=3),
            "medusa": dict(num_speculative_tokens=3), "eagle": dict(num_speculative_tokens=5),
            "eagle3": dict(num_speculative_tokens=5)}


def load(model: str, device: torch.device, dtype: torch.dtype):
    """(tokenizer, target, {method: drafter or None}, prompts as token-id lists): the test bed's completion
    workload, or one Spec-Bench question per category through a chat model's template."""
    has_drafter, load_drafter = _committed_drafters()
    if model == "testbed":
        from hf_specdec.testbed import load_testbed
        from hf_specdec.testbed.workloads import load_workload

        tokenizer, target, _ = load_testbed(dtype=dtype)
        prompts = [tokenizer(text).input_ids for text in load_workload("completion")]
    else:
        from hf_specdec.testbed.real_model import load_real_model
        from hf_specdec.testbed.spec_bench import spec_bench_prompts

        target, tokenizer = load_real_model(model, dtype=dtype)
        prompts = [ids for _, ids in spec_bench_prompts(tokenizer, num_per_category=1)]
    target = target.to(device).eval()
    drafters = {"ngram": None, "suffix": None}
    for method in METHODS[2:]:
        if model in ("testbed", "smollm2") and has_drafter(model, method):
            drafters[method] = load_drafter(model, method, target).to(device, dtype).eval()
    return tokenizer, target, drafters, prompts


def _committed_drafters():
    """`has_drafter`, `load_drafter`; a checkout older than `hf_specdec.testbed.drafters` (a `--baseline`) has the
    test bed's only, in their older places."""
    try:
        from hf_specdec.testbed.drafters import has_drafter, load_drafter
    except ImportError:
        from hf_specdec.heads import EagleHead, MedusaHeads
        from hf_specdec.testbed import load_testbed
        from hf_specdec.testbed.loading import heads_dir

        def has_drafter(model: str, kind: str) -> bool:
            return model == "testbed"

        def load_drafter(model: str, kind: str, target):
            if kind == "draft":
                return load_testbed(dtype=target.dtype)[2]
            return (MedusaHeads if kind == "medusa" else EagleHead).from_pretrained(heads_dir(kind))
    return has_drafter, load_drafter


def speculative(method: str, drafter, suffix_cache=None) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig(method="ngram", **SETTINGS[method])
    if method == "suffix":
        return SpeculativeConfig(method="suffix", suffix_cache=suffix_cache, **SETTINGS[method])
    if method == "draft":
        return SpeculativeConfig(method="draft", draft_model=drafter, **SETTINGS[method])
    kind = "medusa" if method == "medusa" else "eagle"
    return SpeculativeConfig(method=kind, heads=drafter, **SETTINGS[method])


def compile_switches(device: torch.device) -> dict:
    config = CompileConfig()
    config._compile_all_devices = True  # transformers compiles on a CPU only with this flag
    return dict(cache_implementation="static", compile_config=config)


class Runner:
    def __init__(self, model: str, device: torch.device, dtype: torch.dtype, prompts: int, max_new_tokens: int,
                 methods: list[str]):
        self.tokenizer, self.target, self.drafters, all_prompts = load(model, device, dtype)
        missing = [m for m in methods if m not in self.drafters]
        if missing:
            raise ValueError(f"--methods {missing}: no committed drafter for {model!r}")
        self.device = device
        self.prompts = [torch.tensor([ids], device=device) for ids in all_prompts[:prompts]]
        self.max_new_tokens = max_new_tokens
        self.expected: list[torch.Tensor] = []

    def generate(self, case: str) -> tuple[float, list[torch.Tensor], int]:
        """(seconds, outputs, target forwards) of one pass over the prompts."""
        method, _, variant = case.partition("-")
        options = dict(max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
        if variant == "compiled":
            options |= compile_switches(self.device)
        outputs, forwards = [], 0
        # suffix decoding: a cache of its own per pass (never an earlier pass's answers to the same prompts)
        suffix_cache = None
        if method == "suffix":
            from hf_specdec.suffix import SuffixCache  # imported here: a `--baseline` checkout may predate it

            suffix_cache = SuffixCache()
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for ids in self.prompts:
            mask = torch.ones_like(ids)
            if method == "plain":
                out = self.target.generate(ids, attention_mask=mask, **options)
                forwards += out.shape[1] - ids.shape[1]
            else:
                config = speculative(method, self.drafters[method], suffix_cache)
                result = hf_specdec.generate(self.target, ids, attention_mask=mask, speculative=config,
                                             return_dict_in_generate=True, use_cache=False, **options)
                out, forwards = result.sequences, forwards + result.spec_stats.target_forward_passes
            outputs.append(out)
        sync()
        return time.perf_counter() - start, outputs, forwards

    def outside_share(self, case: str) -> float:
        """The share of wall time outside model calls (a separate pass, with a timer around every model call)."""
        from hf_specdec.cache.ragged import RaggedKVCache

        inside = [0.0]
        original = RaggedKVCache._call_model
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        def timed(cache, *args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return original(cache, *args, **kwargs)
            finally:
                sync()
                inside[0] += time.perf_counter() - start

        RaggedKVCache._call_model = timed
        try:
            seconds, _, _ = self.generate(case)
        finally:
            RaggedKVCache._call_model = original
        return 1 - inside[0] / seconds


def worker(args: argparse.Namespace) -> None:
    """One round of the eager hf_specdec cases (for `--baseline`), printed as JSON."""
    runner = Runner(args.model, torch.device(args.device), getattr(torch, args.dtype), args.prompts,
                    args.max_new_tokens, args.methods)
    runner.generate(args.methods[0])  # warm-up
    rounds = {}
    for method in args.methods:
        seconds, outputs, forwards = runner.generate(method)
        rounds[method] = {"seconds": seconds, "forwards": forwards, "outside": runner.outside_share(method),
                          "tokens": [o[0].tolist() for o in outputs]}
    print("WORKER " + json.dumps(rounds))


def run_baseline(args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).resolve()), "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--device",
               args.device, "--dtype", args.dtype, "--prompts", str(args.prompts), "--max-new-tokens",
               str(args.max_new_tokens), "--threads", str(args.threads), "--methods", *args.methods]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=args.baseline)
    line = next(line for line in out.stdout.splitlines() if line.startswith("WORKER "))
    return json.loads(line.removeprefix("WORKER "))


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="testbed", help="testbed, smollm2, or a model folder")
    parser.add_argument("--methods", nargs="+", default=["ngram", "medusa", "eagle"], choices=METHODS)
    parser.add_argument("--prompts", type=int, default=4,
                        help="the first N prompts (a chat model: one Spec-Bench question per category in Spec-Bench's "
                             "order, mt_bench, translation, summarization, qa, math_reasoning, rag; 6 for all)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--baseline", default=None, help="another hf_specdec checkout: its eager cases run alongside")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled cases")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return None
    runner = Runner(args.model, torch.device(args.device), getattr(torch, args.dtype), args.prompts,
                    args.max_new_tokens, args.methods)
    cases = ["plain"] + args.methods
    if not args.no_compiled:
        cases += ["plain-compiled"] + [f"{m}-compiled" for m in args.methods]
    rounds: list[dict] = []
    round_index = compiled_while_timed = 0
    while len(rounds) < args.repeats:
        # round 0 warms up; so does every later round in which a graph compiled (a shape first met: the adaptive
        # schedule can reach a width in one cache bucket only rounds later), up to MAX_WARMUP_ROUNDS in all
        graphs = counters["stats"]["unique_graphs"]
        timings = {}
        if args.baseline:
            for method, entry in run_baseline(args).items():
                timings[f"{method}@baseline"] = entry
        for case in cases:
            seconds, outputs, forwards = runner.generate(case)
            if case == "plain":
                runner.expected = outputs
            same = all(torch.equal(a, b) for a, b in zip(outputs, runner.expected))
            new_tokens = sum(o.shape[1] - p.shape[1] for o, p in zip(outputs, runner.prompts))
            timings[case] = {"seconds": seconds, "forwards": forwards, "identical": same, "new_tokens": new_tokens}
        for case, entry in timings.items():
            if case.endswith("@baseline"):
                expected = [e[0].tolist() for e in runner.expected]
                produced = entry.pop("tokens")
                entry["identical"] = produced == expected
                entry["new_tokens"] = sum(len(o) - p.shape[1] for o, p in zip(produced, runner.prompts))
        compiled = counters["stats"]["unique_graphs"] != graphs
        warm_up = round_index == 0 or (compiled and round_index < MAX_WARMUP_ROUNDS)
        if not warm_up:
            rounds.append(timings)
            compiled_while_timed += compiled  # past the warm-up rounds a round that compiled is timed all the same
        print(f"round {round_index}{' (warm-up)' if warm_up else ''}: "
              + ", ".join(f"{c} {t['seconds']:.2f}s" for c, t in timings.items()), flush=True)
        round_index += 1
    tokens = sum(int(e.shape[1] - p.shape[1]) for e, p in zip(runner.expected, runner.prompts))
    report = summarise(args, runner, rounds, tokens)
    report["warm_up_rounds"], report["timed_rounds_that_compiled"] = round_index - len(rounds), compiled_while_timed
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def _rate(timing: dict) -> float:
    """New tokens per second of one case in one round: outputs that differ (bf16 near-ties) differ in length, so
    ratios are of rates, not of times."""
    return timing["new_tokens"] / timing["seconds"]


def summarise(args, runner: Runner, rounds: list[dict], tokens: int) -> dict:
    from hf_specdec.cli.environment import environment

    cases = list(rounds[0])
    results = {}
    print(f"\n{'case':>26} {'tok/s':>8} {'tok/forward':>11} {'outside forwards':>16} {'identical':>9}")
    for case in cases:
        seconds = [r[case]["seconds"] for r in rounds]
        entry = {"tok_per_s": statistics.median(_rate(r[case]) for r in rounds), "seconds": seconds,
                 "new_tokens": [r[case]["new_tokens"] for r in rounds],
                 "tokens_per_forward": rounds[0][case]["new_tokens"] / rounds[0][case]["forwards"],
                 "identical": all(r[case]["identical"] for r in rounds)}
        if case.endswith("@baseline"):
            entry["outside_forwards"] = statistics.median(r[case]["outside"] for r in rounds)
        elif not case.startswith("plain"):
            entry["outside_forwards"] = runner.outside_share(case)
        results[case] = entry
        outside = entry.get("outside_forwards")
        print(f"{case:>26} {entry['tok_per_s']:>8.1f} {entry['tokens_per_forward']:>11.2f} "
              f"{'' if outside is None else f'{outside:.1%}':>16} {str(entry['identical']):>9}")
    ratios = {}

    def ratio(name: str, numerator: str, denominator: str) -> None:
        if numerator in results and denominator in results:
            paired = statistics.median(_rate(r[numerator]) / _rate(r[denominator]) for r in rounds)
            best = max(map(_rate, (r[numerator] for r in rounds))) / max(map(_rate, (r[denominator] for r in rounds)))
            ratios[name] = {"paired_median": paired, "best_of_rounds": best}
            print(f"{name}: {paired:.2f}x paired median, {best:.2f}x best rounds")

    print()
    for method in args.methods:
        ratio(f"{method}-compiled / plain-compiled", f"{method}-compiled", "plain-compiled")
        ratio(f"{method} / {method}@baseline", method, f"{method}@baseline")
        ratio(f"{method}-compiled / {method}", f"{method}-compiled", method)
    ratio("plain-compiled / plain", "plain-compiled", "plain")
    device = torch.device(args.device)
    return {"environment": environment(device, getattr(torch, args.dtype)), "results": results, "ratios": ratios,
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "worker")} | {"tokens": tokens}}


if __name__ == "__main__":
    main()
