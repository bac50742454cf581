"""Replays the adaptive schedule on recorded acceptance: how close it comes to the best fixed k, in seconds of CPU
instead of a bench run per setting.

Greedy drafts are a function of the committed text, so what a draft would have got accepted at each position of
a greedy output can be recorded once and any schedule replayed on it:

    python benchmarks/schedule_replay.py record --workload code --num-prompts 32 --out replay_code.json
    python benchmarks/schedule_replay.py replay replay_code.json --rates 0.3 0.1

`record` (SmolLM2-135M-Instruct in bf16, 1 thread) takes each prompt's greedy output of --max-new-tokens tokens and,
at every position of it, the accepted length of a k-token draft: for the committed EAGLE-3 head through the
engine's first drafting step after a prefill of the prompt and the output so far; for n-gram lookup on the host
(lookup depth, accepted). It also measures a step's wall time by width, as the schedule measures it (the host
clock around each step), from fixed-k runs on a few of the prompts. `replay` runs the real `Schedule` (estimates,
decision, probes, the step-time table) on those outcomes with a simulated clock, one row at a time, calls in
sequence as in one process, and prints adaptive (k <= 1, k <= 5) against every fixed k, in speedup over plain
steps (no per-call costs: the engine's prefill and setup are the same in every case) and as a share of the best
fixed k, for each value of `estimates.ACCEPTANCE_RATE` given. N-gram lookup runs as in the engine: the text of
each position (the prompt, rebuilt with the model's tokenizer, and the recorded output) gives the draft, which
plain steps look ahead with, and its class (the matched n-gram's length); `--step-slope s` replaces the recorded
step times by `plain * (1 + s * width)` (float32 on a CPU is about 0.135: a step of width 5 cost 1.67 plain steps).

`replay` prints, for adaptive k <= 5, its slowest call and each category's mean speedup beside the best fixed k's.
`--interleave` replays one call of each category in turn (as a bench over the categories runs them: a call starts
from what the previous, other category's call ended with) instead of category by category. Besides
`estimates.ACCEPTANCE_RATE` (`--rates`) it compares `estimates.CALL_PRIOR_WEIGHT` (`--call-weights`: how far one
call's ending acceptance moves the next calls' start) and a prior count for a call's rows (`--prior-counts`: their
starting estimates worth that many observations, so that a call's own first observations weigh more):

    python benchmarks/schedule_replay.py record --workload spec-bench --num-prompts 24 --max-new-tokens 64 \
        --out replay_specbench.json
    python benchmarks/schedule_replay.py replay replay_specbench.json --interleave --sampled-times 8 \
        --call-weights 0.5 0.1 --prior-counts none 1 2

Every step takes its width's median time unless `--sampled-times SEEDS`: then each step's time is drawn from the
recorded steps of its width (`record` keeps them all; `retime FILE [--timing-prompts N]` measures a recording's step
times again with them), stalls included, and the speedups are averaged over that many seeded replays:

    python benchmarks/schedule_replay.py retime replay_random.json --timing-prompts 16
    python benchmarks/schedule_replay.py replay replay_random.json --sampled-times 8
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.bench import random_prompts
from hf_specdec.proposers.ngram import find_ngram_continuation, matched_ngram_length
from hf_specdec.schedule import controller, estimates
from hf_specdec.schedule.estimates import CostTable
from hf_specdec.schedule.lookahead import LookaheadTree
from hf_specdec.step.state import HostView
from hf_specdec.testbed.drafters import load_drafter
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts

K = 5
METHODS = ("eagle3", "ngram")
SHORT_CATEGORIES = ["mt_bench", "qa", "math_reasoning", "translation"]
TIMING_PROMPTS = 4


def _prompts(tokenizer, workload: str, count: int) -> list[tuple[str, list[int]]]:
    """(category, prompt token ids) of the workload's first `count` prompts."""
    if workload == "random":  # as `hf-specdec bench --workload random`
        return [("random", ids) for ids in random_prompts(tokenizer, count)]
    if workload == "code":
        return spec_bench_prompts(tokenizer, count, ["code"])
    per_category = -(-count // len(SHORT_CATEGORIES))
    return spec_bench_prompts(tokenizer, per_category, SHORT_CATEGORIES)[:count]


class StepLog:
    """Wraps `Schedule.observe` while recording: each step's width (the width it verified, as the schedule records
    it: a lookup may draft fewer tokens than allowed), accepted count and wall time."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []
        self.original = controller.Schedule.observe
        log = self

        def observe(schedule, state, proposal):
            seconds = schedule.clock() - schedule.started
            width = min(schedule.decision.width, proposal.tree.max_depth)
            log.steps.append((width, int(state.host.num_accepted[0]), seconds))
            log.original(schedule, state, proposal)

        controller.Schedule.observe = observe

    def close(self) -> None:
        controller.Schedule.observe = self.original


def record(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_real_model("smollm2", dtype=torch.bfloat16)
    head = load_drafter("smollm2", "eagle3", model)
    prompts = _prompts(tokenizer, args.workload, args.num_prompts)
    greedy = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)

    def config(method: str, k: int, **extra) -> SpeculativeConfig:
        drafter = dict(method="eagle", heads=head) if method == "eagle3" else dict(method="ngram")
        return SpeculativeConfig(num_speculative_tokens=k, schedule="fixed", **drafter, **extra)

    log = StepLog()
    try:
        records = []
        for index, (category, prompt) in enumerate(prompts):
            output = model.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, **greedy)
            tokens = output[0, len(prompt):].tolist()
            # position n (tokens generated so far): a draft of the next K tokens
            eagle = []
            for n in range(1, len(tokens)):
                log.steps.clear()  # prefill prompt + tokens[:n-1]: it picks tokens[n-1], the first step drafts
                hf_specdec.generate(model, torch.tensor([prompt + tokens[: n - 1]]), max_new_tokens=K + 2,
                                    speculative=config("eagle3", K, disable_by_batch_size=100), **greedy)
                eagle.append(log.steps[0][1])
            ngram = []
            for n in range(1, len(tokens)):
                draft = find_ngram_continuation(np.array(prompt + tokens[:n]), 1, 3, K).tolist()
                accepted = 0
                while accepted < len(draft) and n + accepted < len(tokens) and draft[accepted] == tokens[n + accepted]:
                    accepted += 1
                ngram.append([len(draft), accepted])
            records.append({"category": category, "prompt_tokens": len(prompt), "tokens": tokens, "eagle3": eagle,
                            "ngram": ngram})
            print(f"prompt {index}: EAGLE-3 accepted {eagle}", flush=True)
        step_seconds, step_samples = measure_steps(model, [ids for _, ids in prompts[:TIMING_PROMPTS]],
                                                    args.max_new_tokens, config, log, greedy)
    finally:
        log.close()
    with open(args.out, "w") as f:
        json.dump({"workload": args.workload, "k": K, "step_seconds": step_seconds, "step_samples": step_samples,
                   "records": records}, f, sort_keys=True)


def measure_steps(model, prompts: list[list[int]], max_new_tokens: int, config, log: StepLog, greedy: dict
                  ) -> tuple[dict[str, list[float]], dict[str, list[list[float]]]]:
    """Per method: the median wall time of a step by width (made non-decreasing), and every step's time by width
    (width 0: speculation off; width w: fixed k = w), from one call per prompt and width."""
    step_seconds, step_samples = {}, {}
    for method in METHODS:
        samples = []
        for width in range(K + 1):
            extra = dict(disable_by_batch_size=1) if width == 0 else dict(disable_by_batch_size=100)
            log.steps.clear()
            for prompt in prompts:
                hf_specdec.generate(model, torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                    speculative=config(method, max(width, 1), **extra), **greedy)
            samples.append([s for w, _, s in log.steps if w == width])
        step_seconds[method] = np.maximum.accumulate([statistics.median(s) for s in samples]).tolist()
        step_samples[method] = samples
        print(f"{method} step seconds by width: {[round(t, 4) for t in step_seconds[method]]}", flush=True)
    return step_seconds, step_samples


def retime(args: argparse.Namespace) -> None:
    """Measure a recording's step times again (medians and every sample), from --timing-prompts of its prompts."""
    torch.set_num_threads(1)
    with open(args.file) as f:
        data = json.load(f)
    model, tokenizer = load_real_model("smollm2", dtype=torch.bfloat16)
    head = load_drafter("smollm2", "eagle3", model)
    prompts = [ids for _, ids in _prompts(tokenizer, data["workload"], max(args.timing_prompts, len(data["records"])))]

    def config(method: str, k: int, **extra) -> SpeculativeConfig:
        drafter = dict(method="eagle", heads=head) if method == "eagle3" else dict(method="ngram")
        return SpeculativeConfig(num_speculative_tokens=k, schedule="fixed", **drafter, **extra)

    greedy = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    log = StepLog()
    try:
        max_new_tokens = max(len(call["tokens"]) for call in data["records"])
        data["step_seconds"], data["step_samples"] = measure_steps(model, prompts[: args.timing_prompts],
                                                                   max_new_tokens, config, log, greedy)
    finally:
        log.close()
    with open(args.file, "w") as f:
        json.dump(data, f, sort_keys=True)


class StepClock:
    """A step's wall time by width: the recorded median, or (`rng` given) one of the recorded steps of that width
    drawn at random, so that the schedule meets the noise of a real run (stalls included)."""

    def __init__(self, medians: list[float], samples: list[list[float]] | None = None,
                 rng: np.random.Generator | None = None) -> None:
        self.medians, self.samples, self.rng = medians, samples, rng

    def __call__(self, width: int) -> float:
        if self.rng is None:
            return self.medians[width]
        drawn = self.samples[width]
        return drawn[self.rng.integers(len(drawn))]

    def plain(self) -> float:
        """The expected time of a plain step (what the draws of width 0 average to)."""
        return self.medians[0] if self.rng is None else float(np.mean(self.samples[0]))


class ReplayState:
    """The part of `DecodeState` the schedule reads and writes, for one row."""

    def __init__(self, generated: int, total: int) -> None:
        self.generated, self.total, self.max_length = generated, total, total
        self.host = SimpleNamespace(finished=[False], lengths=[generated], num_accepted=[0])
        self.draft_limits = None

    def host_draft_budget(self) -> list[int]:
        budget = max(self.total - self.generated - 1, 0)
        return [budget if self.draft_limits is None else min(budget, self.draft_limits[0])]

    def set_draft_limits(self, limits: list[int], width: int) -> None:
        self.draft_limits = limits


class Lookups:
    """N-gram lookup at every position of the recorded outputs, as the engine's proposer sees each row's text: the
    chain it would draft (k tokens) and its draft class."""

    def __init__(self, data: dict, tokenizer) -> None:
        prompts = _prompts(tokenizer, data["workload"], len(data["records"]))
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=data["k"])
        low, high = config.prompt_lookup_min, config.prompt_lookup_max
        self.chains, self.classes = [], []
        for (_, prompt), call in zip(prompts, data["records"]):
            if len(prompt) != call["prompt_tokens"]:
                raise SystemExit("error: the recording's prompts are not this tokenizer's")
            texts = [np.array(prompt + call["tokens"][:n]) for n in range(1, len(call["tokens"]) + 1)]
            self.chains.append([find_ngram_continuation(text, low, high, data["k"]) for text in texts])
            self.classes.append([matched_ngram_length(text, low, high) for text in texts])


def replay(data: dict, method: str, max_k: int, schedule: str, step_seconds: StepClock,
           lookups: Lookups | None = None, order: list[int] | None = None) -> tuple[float, np.ndarray]:
    """Speedup over plain steps of `schedule` with at most `max_k` drafts per step, over every recorded call (in
    `order`, default as recorded), and [calls] each call's own, in recorded order. With `lookups`, n-gram lookup
    runs as the engine runs it: plain steps look ahead, and drafts have classes."""
    clock = [0.0]
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=max_k, schedule=schedule,
                               disable_by_batch_size=100 if schedule == "fixed" else None)
    current = [0]  # the replayed row's draft class at this step
    chain = [np.zeros(0, dtype=np.int64)]  # the replayed row's lookahead chain at this step
    engine = dict(lookahead={None: lambda state, rows: [LookaheadTree.chain(chain[0]) for _ in rows]},
                  draft_classes={None: controller.DraftClasses(lambda state: np.array(current), 3)}
                  ) if lookups is not None else {}
    plan = controller.Schedule(config, max_k, {None: CostTable()}, static_shapes=False, clock=lambda: clock[0],
                               **engine)
    calls = data["records"]
    plain, spent = np.zeros(len(calls)), np.zeros(len(calls))
    for index in range(len(calls)) if order is None else order:
        call = calls[index]
        outcomes, tokens = call[method], call["tokens"]
        total = len(tokens)
        plain[index] = (total - 1) * step_seconds.plain()
        plan.start(1)
        generated = 1  # the prefill chose the first token
        while generated < total:
            state = ReplayState(generated, total)
            if lookups is not None:
                current[0] = lookups.classes[index][generated - 1]
            plan.plan(state, 1)
            allowed = state.host_draft_budget()[0]
            if method == "ngram":  # a lookup drafts what it found, at most what was allowed
                found, matched = outcomes[generated - 1]
                depth = min(found, allowed)
                accepted = min(matched, depth)
            else:
                depth = allowed
                accepted = min(outcomes[generated - 1], allowed)
            if lookups is not None:
                chain[0] = lookups.chains[index][generated - 1]
                plan.look_ahead(state)
            seconds = step_seconds(depth)
            clock[0] += seconds
            spent[index] += seconds
            emitted = tokens[generated : generated + accepted + 1]
            generated += accepted + 1
            state.host = HostView([generated], [generated >= total], [len(emitted)], [accepted],
                                  np.array([emitted + [0] * (max_k + 1 - len(emitted))]))
            plan.observe(state, SimpleNamespace(host_depths=(depth,) if method == "ngram" else None,
                                                drafted_positions=None, tree=SimpleNamespace(max_depth=depth)))
        plan.finish()
    return float(plain.sum() / spent.sum()), plain / spent


def replay_all(args: argparse.Namespace) -> None:
    with open(args.file) as f:
        data = json.load(f)
    if args.sampled_times and "step_samples" not in data:
        raise SystemExit(f"error: {args.file} has no step samples; run `retime {args.file}` first")
    defaults = estimates.ACCEPTANCE_RATE, estimates.CALL_PRIOR_WEIGHT, controller.AcceptanceEstimate
    _, tokenizer = load_real_model("smollm2", dtype=torch.bfloat16)
    lookups = Lookups(data, tokenizer)
    categories = [call.get("category", data["workload"]) for call in data["records"]]
    order = None
    if args.interleave:  # one call of each category in turn, as a bench over the categories runs them
        by_category = {c: [i for i, x in enumerate(categories) if x == c] for c in dict.fromkeys(categories)}
        order = [i for turn in itertools.zip_longest(*by_category.values()) for i in turn if i is not None]
    timing = (f"step times drawn from the recorded steps, mean of {args.sampled_times} seeds" if args.sampled_times
              else "median step times")
    print(f"workload {data['workload']}, {len(data['records'])} calls{', categories interleaved' * args.interleave}; "
          f"speedup over plain steps ({timing})")
    try:
        for method in METHODS:
            seconds = data["step_seconds"][method]
            if args.step_slope is not None:
                seconds = [seconds[0] * (1 + args.step_slope * width) for width in range(len(seconds))]
            engine = lookups if method == "ngram" else None

            def speedup(max_k: int, schedule: str) -> tuple[float, np.ndarray]:
                if not args.sampled_times:
                    return replay(data, method, max_k, schedule, StepClock(seconds), engine, order)
                samples = data["step_samples"][method]
                runs = [replay(data, method, max_k, schedule, StepClock(seconds, samples, np.random.default_rng(seed)),
                               engine, order) for seed in range(args.sampled_times)]
                return float(np.mean([total for total, _ in runs])), np.mean([calls for _, calls in runs], axis=0)

            fixed = {k: speedup(k, "fixed") for k in range(1, data["k"] + 1)}
            best = max(total for total, _ in fixed.values())
            print(f"{method}: fixed " + ", ".join(f"k={k} {v:.3f}x" for k, (v, _) in fixed.items()))
            for rate, weight, count in itertools.product(args.rates, args.call_weights, args.prior_counts):
                estimates.ACCEPTANCE_RATE, estimates.CALL_PRIOR_WEIGHT = rate, weight
                # a call's rows' estimates: their prior (what earlier calls ended with) worth `count` observations
                controller.AcceptanceEstimate = functools.partial(estimates.AcceptanceEstimate, prior_count=count)
                adaptive = {k: speedup(k, "adaptive") for k in (1, data["k"])}
                print(f"  acceptance weight {rate}, call prior weight {weight}, row prior count {count}: " + ", ".join(
                    f"adaptive k<={k} {v:.3f}x ({v / best:.3f} of the best fixed)" for k, (v, _) in adaptive.items()))
                calls = adaptive[data["k"]][1]
                worst = int(np.argmin(calls))
                print(f"    adaptive k<={data['k']}: slowest call {calls[worst]:.3f}x ({categories[worst]}); by "
                      "category (mean over its calls; best fixed k's): " + ", ".join(
                          f"{c} {np.mean(calls[mine]):.3f}x ({max(np.mean(v[mine]) for _, v in fixed.values()):.3f}x)"
                          for c in dict.fromkeys(categories)
                          for mine in [np.array([x == c for x in categories])]))
    finally:
        estimates.ACCEPTANCE_RATE, estimates.CALL_PRIOR_WEIGHT, controller.AcceptanceEstimate = defaults


def _prior_count(text: str) -> float | None:
    return None if text == "none" else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="record acceptance by position and step times")
    rec.add_argument("--workload", choices=["code", "spec-bench", "random"], default="code")
    rec.add_argument("--num-prompts", type=int, default=32)
    rec.add_argument("--max-new-tokens", type=int, default=32)
    rec.add_argument("--out", required=True)
    rep = commands.add_parser("replay", help="replay the schedule on a recording")
    rep.add_argument("file")
    rep.add_argument("--rates", type=float, nargs="+", default=[estimates.ACCEPTANCE_RATE],
                     help="values of the acceptance moving average's weight to compare")
    rep.add_argument("--call-weights", type=float, nargs="+", default=[estimates.CALL_PRIOR_WEIGHT],
                     help="values of the weight of a call's ending acceptance in the next calls' prior")
    rep.add_argument("--prior-counts", type=_prior_count, nargs="+", default=[None],
                     help="observations a call's rows' starting estimates are worth, their own first observations "
                          "averaging with them as a running mean does ('none', the schedule's: every observation "
                          "weighs the moving average's weight)")
    rep.add_argument("--interleave", action="store_true",
                     help="replay the calls one category at a time in turn instead of in recorded order")
    rep.add_argument("--step-slope", type=float, default=None,
                     help="step time of width w = plain * (1 + slope * w) instead of the recorded times")
    rep.add_argument("--sampled-times", type=int, default=0, metavar="SEEDS",
                     help="draw each step's time from the recorded steps of its width (their noise and stalls "
                          "included), averaging this many seeded replays; default: every step takes the median")
    ret = commands.add_parser("retime", help="measure a recording's step times again, keeping every step's time")
    ret.add_argument("file")
    ret.add_argument("--timing-prompts", type=int, default=TIMING_PROMPTS)
    args = parser.parse_args()
    if args.command == "record":
        record(args)
    elif args.command == "retime":
        retime(args)
    else:
        if args.sampled_times < 0 or (args.sampled_times and args.step_slope is not None):
            raise SystemExit("error: --sampled-times: expected >= 0, and not with --step-slope")
        replay_all(args)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - start:.0f} s")
