"""How well the committed SmolLM2 drafters carry over from their training requests to new ones: per-position
acceptance of greedy chains on requests they were trained on, on held-out requests of the same file, and on
Spec-Bench.

    python benchmarks/drafter_generalization.py --kinds eagle3 eagle medusa mlp_speculator draft \\
        --num-prompts 12 --json benchmarks/results/drafter_generalization_smollm2_cpu.json

Each drafter learned the target's answers to a seeded sample of its prompt files (`train.sh`: the records of its
PROMPTS files, `examples/drafters/smollm2/prompts.jsonl` by default, in one list; the first N of a permutation of
them drawn with seed 0, N in its SAMPLES). "trained" takes the first --num-prompts of that permutation (requests the
drafter trained on), "held-out" its last --num-prompts (requests it never saw), "spec-bench" --num-prompts / 6
questions per Spec-Bench category. Drafters with the same prompt files are measured on the same requests. Each request's
greedy answer (--max-new-tokens) is generated with a fixed chain of k draft tokens (the drafter's depth, at most
5) and the schedule fixed, so every step drafts. A drop from "trained" to "held-out" is what the drafter learned
of its rows by heart (more requests would close it); one from "held-out" to "spec-bench" is the shift from the
training requests' kind of text to the benchmark's (more varied requests would close it).

Spec-Bench's rows are also given per category (`per_category`). `--folder KIND=PATH` measures the drafter of that
kind in PATH (a training run's output, laid out as the committed folder) instead of the committed one, so a
retrained drafter is compared with the committed one without replacing it; `--sets` measures some of the three sets
only.

    python benchmarks/drafter_generalization.py --kinds eagle3 --sets spec-bench --num-prompts 24 \\
        --folder eagle3=/path/to/trained/eagle3

`--head-window N` lets the EAGLE heads attend to their last N positions only (a sliding window on the head's own
cache), to see whether the distances that training never showed them (its rows hold at most --seq-len tokens, while
Spec-Bench's long documents put the head's keys further back) cost acceptance.

`--training-forward` also checks, for the EAGLE heads on the trained requests, that drafting is the head's training
forward: each step's first drafted token against the guess of one forward of the head over the whole greedy text
with the target's features from one forward over it (as the trainer computes step 0), at the same position.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.environment import write_report
from hf_specdec.proposers.eagle import EagleProposer
from hf_specdec.testbed import drafters
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import SPEC_BENCH_CATEGORIES, spec_bench_prompts

HERE = Path(__file__).resolve().parents[1] / "examples" / "drafters" / "smollm2"
KINDS = ("eagle3", "eagle", "medusa", "mlp_speculator", "draft")
MAX_K = 5
SETS = ("trained", "held-out", "spec-bench")


def train_settings() -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """Requests each drafter was trained on (train.sh's SAMPLES) and its prompt files (PROMPTS; prompts.jsonl
    where it names none)."""
    script = (HERE / "train.sh").read_text()
    samples = re.search(r"declare -A SAMPLES=\(([^)]*)\)", script)
    if samples is None:
        raise SystemExit(f"error: no SAMPLES in {HERE / 'train.sh'}")
    counts = {kind: int(count) for kind, count in re.findall(r"\[(\w+)\]=(\d+)", samples.group(1))}
    prompts = re.search(r"declare -A PROMPTS=\(([^)]*)\)", script)
    named = {} if prompts is None else dict(re.findall(r'\[(\w+)\]="([^"]*)"', prompts.group(1)))
    return counts, {kind: tuple(named.get(kind, "prompts.jsonl").split()) for kind in counts}


def request_sets(tokenizer, count: int, names=SETS, files: tuple[str, ...] = ("prompts.jsonl",),
                 trained_on: int | None = None) -> dict[str, list[tuple[str | None, list[int]]]]:
    """(set name: (Spec-Bench category or None, prompt token ids)): of the sets `names` (trained, held-out,
    Spec-Bench requests), `count` requests each, for a drafter trained on the first `trained_on` records of the
    seeded permutation of `files`' records."""
    records = [json.loads(line) for file in files for line in (HERE / file).read_text().splitlines()
               if line.strip()]
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(0)).tolist()
    most = min(trained_on or len(records), len(records) - (trained_on or 0))
    if count > most and {"trained", "held-out"} & set(names):
        raise SystemExit(f"error: --num-prompts {count}: at most {most} (requests the drafter trained on, and "
                         f"requests it never saw, in {list(files)})")

    def ids(index: int) -> list[int]:
        return tokenizer(records[index]["text"], add_special_tokens=False)["input_ids"]

    per_category = max(1, count // len(SPEC_BENCH_CATEGORIES))
    sets = {"trained": lambda: [(None, ids(i)) for i in order[:count]],
            "held-out": lambda: [(None, ids(i)) for i in order[-count:]],
            "spec-bench": lambda: [(category, list(p)) for category, p in spec_bench_prompts(
                tokenizer, num_per_category=per_category)]}
    return {name: sets[name]() for name in names}


def parse_folders(values: list[str], kinds: list[str]) -> dict[str, Path]:
    """`--folder KIND=PATH` values as {kind: folder}; a kind not measured, twice, or a malformed value is an error."""
    folders: dict[str, Path] = {}
    for value in values:
        kind, separator, path = value.partition("=")
        if not separator or not path:
            raise SystemExit(f"error: --folder {value!r}: expected KIND=PATH, e.g. eagle3=/path/to/eagle3")
        if kind not in kinds:
            raise SystemExit(f"error: --folder {value!r}: {kind!r} is not one of the --kinds measured {kinds}")
        if kind in folders:
            raise SystemExit(f"error: --folder {value!r}: a second folder for {kind!r}")
        folders[kind] = Path(path)
    return folders


def config_for(kind: str, target, folder: Path | None = None, head_window: int | None = None) -> SpeculativeConfig:
    drafter = drafters.load_drafter("smollm2", kind, target, folder=folder)
    if head_window is not None and kind in ("eagle", "eagle3"):  # the drafter's cache masks by the window
        drafter.llama_config.sliding_window = head_window
    if kind == "draft":
        return SpeculativeConfig(method="draft", draft_model=drafter, num_speculative_tokens=MAX_K, schedule="fixed")
    if kind == "medusa":
        depth = drafter.config.num_heads
    elif kind == "mlp_speculator":
        depth = drafter.config.n_predict
    else:
        depth = MAX_K
    method = "eagle" if kind in ("eagle", "eagle3") else kind
    return SpeculativeConfig(method=method, heads=drafter, num_speculative_tokens=min(MAX_K, depth),
                             schedule="fixed")


def measure(target, tokenizer, config: SpeculativeConfig, prompts: list[tuple[str | None, list[int]]],
            max_new_tokens: int) -> dict:
    """Drafting steps, mean acceptance length and acceptance by draft position over `prompts` ((category or None,
    token ids)), and the same per category where the prompts have them (`per_category`)."""
    totals: dict[str | None, list] = {}  # category -> [drafting steps, accepted tokens, accepted per position]
    for category, ids in prompts:
        out = hf_specdec.generate(target, torch.tensor([ids]), speculative=config, max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
        stats = out.spec_stats
        for key in {None, category}:
            total = totals.setdefault(key, [0, 0, [0] * len(stats.accepted_per_position)])
            total[0] += stats.num_drafts
            total[1] += stats.num_accepted_tokens
            total[2] = [a + b for a, b in zip(total[2], stats.accepted_per_position)]

    def summary(drafts: int, accepted: int, per_position: list[int]) -> dict:
        return {"drafting_steps": drafts, "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                "accepted_at_position": [count / max(drafts, 1) for count in per_position]}

    row = summary(*totals.pop(None))
    if totals:
        row["per_category"] = {category: summary(*total) for category, total in totals.items()}
    return row


def training_forward_agreement(target, tokenizer, config: SpeculativeConfig, prompts: list[list[int]],
                               max_new_tokens: int) -> tuple[int, int]:
    """(steps whose first drafted token equals the head's training-forward guess at its position, steps)."""
    head, firsts = config.heads, []
    propose = EagleProposer.propose

    def recording(self, state):
        proposal = propose(self, state)
        if proposal.tree.token_ids.shape[1] > 1 and bool(proposal.tree.valid[0, 1]):
            firsts.append((int(state.host.lengths[0]), int(proposal.tree.token_ids[0, 1])))
        return proposal

    agree = steps = 0
    EagleProposer.propose = recording
    try:
        for _, ids in prompts:
            firsts.clear()
            text = hf_specdec.generate(target, torch.tensor([ids]), speculative=config, max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=tokenizer.pad_token_id)
            with torch.no_grad():
                states = target(text, output_hidden_states=True).hidden_states
                features = torch.cat([states[i] for i in head.target_feature_layers(target)], dim=-1)
                length = text.shape[1]
                causal = torch.full((length - 1, length - 1), torch.finfo(head.dtype).min).triu(1)[None, None]
                # index i feeds token i + 1 with the feature at i and guesses token i + 2
                hidden = head(target.get_input_embeddings()(text[:, 1:]), features[:, :-1],
                              torch.arange(1, length)[None], causal.to(head.dtype), cache=None, from_target=True)
                guesses = head.logits(hidden, target.get_output_embeddings()).argmax(-1)[0]
            for position, token in firsts:  # a draft for sequence index `position`
                if position < length:
                    steps += 1
                    agree += int(guesses[position - 2]) == token
    finally:
        EagleProposer.propose = propose
    return agree, steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--folder", nargs="+", default=[], metavar="KIND=PATH",
                        help="measure the drafter of KIND in PATH instead of the committed one")
    parser.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--head-window", type=int, default=None,
                        help="the EAGLE heads attend to their last N positions only (default: all)")
    parser.add_argument("--training-forward", action="store_true",
                        help="check the EAGLE heads' drafting against their training forward (trained requests)")
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        raise SystemExit(f"error: --num-prompts: expected >= 1, got {args.num_prompts}")
    if args.head_window is not None and args.head_window < 1:
        raise SystemExit(f"error: --head-window: expected >= 1, got {args.head_window}")
    folders = parse_folders(args.folder, args.kinds)
    if args.training_forward and "trained" not in args.sets:
        raise SystemExit(f"error: --training-forward checks the trained requests: add 'trained' to --sets {args.sets}")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_real_model(dtype=torch.bfloat16, progress=False)
    counts, files = train_settings()
    results = []
    print(f"{'drafter':<15} {'requests':<15} {'steps':>6} {'tau':>5}  accepted at position 1..k (share of steps)")
    for kind in args.kinds:
        config = config_for(kind, target, folders.get(kind), args.head_window)
        sets = request_sets(tokenizer, args.num_prompts, args.sets, files.get(kind, ("prompts.jsonl",)),
                            counts.get(kind))
        for name, prompts in sets.items():
            start = time.perf_counter()
            row = {"drafter": kind, "requests": name, "num_prompts": len(prompts),
                   "trained_on": None if kind in folders else counts.get(kind),
                   "prompt_files": list(files.get(kind, ("prompts.jsonl",))),
                   "folder": str(folders.get(kind, drafters.drafter_dir("smollm2", kind))),
                   "k": config.num_speculative_tokens, **measure(target, tokenizer, config, prompts,
                                                                  args.max_new_tokens)}
            row["seconds"] = time.perf_counter() - start
            results.append(row)
            for label, part in [(name, row), *row.get("per_category", {}).items()]:
                print(f"{kind:<15} {label:<15} {part['drafting_steps']:>6} {part['mean_acceptance_length']:>5.2f}  "
                      + " ".join(f"{p:.3f}" for p in part["accepted_at_position"]), flush=True)
        if args.training_forward and kind in ("eagle", "eagle3"):
            agree, steps = training_forward_agreement(target, tokenizer, config, sets["trained"],
                                                      args.max_new_tokens)
            results.append({"drafter": kind, "requests": "trained", "training_forward_agreement": agree,
                            "training_forward_steps": steps})
            print(f"{kind}: first drafted token = the training forward's guess in {agree} of {steps} steps")
    write_report(args, results, target.device, target.dtype)


if __name__ == "__main__":
    main()
