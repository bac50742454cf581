"""Suffix decoding against n-gram lookup on the repeated-task session, replayed on recorded greedy outputs: what
each drafts at every step of a fixed-k run, and what the target would accept, without running the target again.

    python benchmarks/suffix_replay.py record --num-per-part 3 --max-new-tokens 96 --out session.json
    python benchmarks/suffix_replay.py replay session.json -k 5 24 --min-score 0 1 2

`record` writes the prompts of `hf_specdec.testbed.repeated_tasks` (SmolLM2-135M-Instruct) and plain `generate`'s
greedy output for each, in float32, where every method's output is that same text (`suffix_repeat.py` checks it).
`replay` then runs each proposer as the engine runs it at batch 1 with a fixed k: at each step it drafts after the
committed text (n-gram lookup: `find_ngram_continuation`; suffix decoding: `propose_suffix_draft` over the request's
tree and a cache filled by the earlier requests, in session order), the target accepts the longest drafted path that
the recorded output follows, and the step commits that path and one more token (the prefill's forward emits the first token, as in the engine).
It prints, per part of the session
(`suffix_repeat.parts`), tokens per target forward (every step, plain ones included) and the mean acceptance length
(1 + accepted per drafting step: vLLM's definition, which counts only steps that drafted). `--min-score s` drafts a
suffix step only when its draft's score (its expected accepted tokens, `SuffixDraft.score`) reaches s, as a row with
nothing better to do than draft would not: it shows how the mean acceptance length answers to withholding drafts.
A replay takes seconds; on the default session it reproduces `suffix_repeat.py`'s engine counts to within 0.02.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suffix_repeat import parts  # noqa: E402

from hf_specdec import SpeculativeConfig  # noqa: E402
from hf_specdec.cli.environment import write_report  # noqa: E402
from hf_specdec.proposers.ngram import find_ngram_continuation  # noqa: E402
from hf_specdec.suffix import SuffixCache, SuffixConfig  # noqa: E402
from hf_specdec.suffix.draft import propose_suffix_draft  # noqa: E402

# n-gram lookup's matched n-gram lengths: the engine's defaults
NGRAM = SpeculativeConfig(method="ngram")


@dataclass(frozen=True)
class Counts:
    """One request's replay: tokens emitted, target forwards (steps), drafting steps and draft tokens accepted."""

    tokens: int
    forwards: int
    drafts: int
    accepted: int


def accepted_length(
    tokens: tuple[int, ...],  # the draft's nodes
    parents: tuple[int, ...],  # each node's parent index (-1: the committed text's last token)
    truth: list[int],  # what the target emits from here on
) -> int:
    """The length of the longest drafted path that `truth` follows (a chain is a tree of one branch)."""
    node, length = -1, 0
    while length < len(truth):
        child = next((i for i, (token, parent) in enumerate(zip(tokens, parents))
                      if parent == node and token == truth[length]), None)
        if child is None:
            return length
        node, length = child, length + 1
    return length


def ngram_draft(text: list[int], budget: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """n-gram lookup's chain after `text` (the engine's n-gram lengths), as (tokens, parents)."""
    tokens = tuple(find_ngram_continuation(np.asarray(text), NGRAM.prompt_lookup_min, NGRAM.prompt_lookup_max,
                                           budget).tolist())
    return tokens, tuple(range(-1, len(tokens) - 1))


def replay_output(
    prompt: list[int],
    output: list[int],
    k: int,
    # the draft after a text, at most `budget` tokens deep: (tokens, parents), () for none
    draft: Callable[[list[int], int], tuple[tuple[int, ...], tuple[int, ...]]],
    # told each run of tokens the output emits (a suffix request extends its tree), or None
    emitted: Callable[[list[int]], None] | None = None,
) -> Counts:
    """One request's fixed-k run at batch 1: the prefill's forward emits the first token; each step after it
    drafts after the committed text, never past the output's last token, and emits the drafted path the output
    follows plus one token."""
    position = forwards = min(1, len(output))
    drafts = accepted = 0
    if emitted is not None:
        emitted(output[:position])
    while position < len(output):
        budget = min(k, len(output) - position - 1)  # no draft past the output's last token
        tokens, parents = draft(prompt + output[:position], budget) if budget > 0 else ((), ())
        kept = accepted_length(tokens, parents, output[position:]) if tokens else 0
        drafts += bool(tokens)
        accepted += kept
        forwards += 1
        if emitted is not None:
            emitted(output[position : position + kept + 1])
        position += kept + 1
    return Counts(len(output), forwards, drafts, accepted)


def replay(prompts: list[list[int]], outputs: list[list[int]], method: str, k: int,
           config: SuffixConfig | None = None, min_score: float = 0.0) -> list[Counts]:
    """Each request's counts, in session order; for suffix decoding, one cache filled as the session goes."""
    cache = SuffixCache(config or SuffixConfig()) if method == "suffix" else None
    counts = []
    for prompt, output in zip(prompts, outputs):
        if cache is None:
            counts.append(replay_output(prompt, output, k, ngram_draft))
            continue
        request = cache.start_request(prompt)

        def suffix_draft(text: list[int], budget: int, request=request) -> tuple[tuple[int, ...], tuple[int, ...]]:
            found = propose_suffix_draft(cache, request, text, budget)
            return (found.tokens, found.parents) if found.score >= min_score else ((), ())

        counts.append(replay_output(prompt, output, k, suffix_draft, request.extend))
        request.finish()
    return counts


def summarize(counts: list[Counts], num_per_part: int) -> dict[str, dict[str, float]]:
    """Per part of the session: tokens per target forward and the mean acceptance length."""
    table = {}
    for part, rows in parts(num_per_part).items():
        chosen = counts[rows]
        drafts = sum(c.drafts for c in chosen)
        table[part] = {"tokens_per_forward": sum(c.tokens for c in chosen) / sum(c.forwards for c in chosen),
                       "mean_acceptance_length": 1 + sum(c.accepted for c in chosen) / max(drafts, 1)}
    return table


def record(args: argparse.Namespace) -> None:
    from hf_specdec.testbed.real_model import load_real_model
    from hf_specdec.testbed.repeated_tasks import greedy_answers, repeated_task_prompts

    torch.set_num_threads(args.threads)
    model, tokenizer = load_real_model(dtype=torch.float32, progress=False)
    prompts = [ids for _, ids in repeated_task_prompts(
        tokenizer, greedy_answers(model, tokenizer, args.max_new_tokens), num_per_part=args.num_per_part)]
    outputs = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        outputs.append(out[0, len(ids):].tolist())
    args.out.write_text(json.dumps({"num_per_part": args.num_per_part, "prompts": prompts, "outputs": outputs},
                                   sort_keys=True) + "\n")
    print(f"{len(prompts)} requests written to {args.out}")


def run_replay(args: argparse.Namespace) -> None:
    session = json.loads(args.session.read_text())
    prompts, outputs, num_per_part = session["prompts"], session["outputs"], session["num_per_part"]
    cases = []
    for k in args.k:
        cases.append({"method": "ngram", "k": k, "min_score": None,
                      **summarize(replay(prompts, outputs, "ngram", k), num_per_part)})
        for min_score in args.min_score:
            counts = replay(prompts, outputs, "suffix", k, SuffixConfig(max_spec_factor=args.max_spec_factor),
                            min_score)
            cases.append({"method": "suffix", "k": k, "min_score": min_score, **summarize(counts, num_per_part)})
    names = list(parts(num_per_part))
    print(f"{'method':<8}{'k':>4}{'min score':>10}  " + "".join(f"{name:>16}" for name in names))
    print(" " * 24 + "tok/fwd / mean acceptance length".rjust(16 * len(names)))
    for case in cases:
        score = "-" if case["min_score"] is None else f"{case['min_score']:g}"
        cells = "".join(f"{case[name]['tokens_per_forward']:>9.2f} / {case[name]['mean_acceptance_length']:.2f}"
                        for name in names)
        print(f"{case['method']:<8}{case['k']:>4}{score:>10}  {cells}")
    write_report(args, cases, torch.device("cpu"), torch.float32, session=str(args.session))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="record the session's greedy outputs (runs the model)")
    rec.add_argument("--num-per-part", type=int, default=3)
    rec.add_argument("--max-new-tokens", type=int, default=96)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--out", type=Path, required=True)
    rep = commands.add_parser("replay", help="replay n-gram lookup and suffix decoding on a recording")
    rep.add_argument("session", type=Path)
    rep.add_argument("-k", type=int, nargs="+", default=[5], help="draft tokens per step at most")
    rep.add_argument("--min-score", type=float, nargs="+", default=[0.0],
                     help="suffix: draft only when the draft's score reaches this (0: always, the engine's way)")
    rep.add_argument("--max-spec-factor", type=float, default=1.0, help="suffix (default 1.0, vLLM's)")
    rep.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    else:
        run_replay(args)


if __name__ == "__main__":
    main()
