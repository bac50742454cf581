"""Benchmark prompts built from held-out stdlib files, committed as JSON.

Three workloads:

* ``completion``: a prefix of a held-out file (~200 tokens, cut at a line end);
* ``edit``: a function from a held-out file, then a comment asking for the same
  function again and its first line, so the continuation repeats the passage;
* ``long``: a longer prefix (~1500 tokens) of a held-out file.

The stdlib differs across Python versions, so prompts are read from the
committed ``workloads.json`` instead of being recomputed at run time.
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from hf_specdec.testbed.loading import testbed_dir

WORKLOADS_VERSION = 1
WORKLOAD_NAMES = ("completion", "edit", "long")
EDIT_INSTRUCTION = "\n# Same function, with the variable names unchanged:\n"


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes of the workloads and the seed that picks their sources."""

    seed: int = 0
    num_completion: int = 32
    completion_tokens: int = 200
    num_edit: int = 32
    edit_min_tokens: int = 100
    edit_max_tokens: int = 150
    num_long: int = 8
    long_tokens: int = 1500

    def __post_init__(self) -> None:
        counts = (self.num_completion, self.num_edit, self.num_long)
        lengths = (self.completion_tokens, self.edit_min_tokens, self.long_tokens)
        if min(counts) <= 0 or min(lengths) <= 0:
            raise ValueError("workload counts and token lengths must be positive")
        if self.edit_max_tokens < self.edit_min_tokens:
            raise ValueError("edit_max_tokens must be at least edit_min_tokens")


def _prefix_at_line(text: str, tokenizer: PreTrainedTokenizerBase, min_tokens: int) -> str | None:
    """The shortest whole-line prefix of ``text`` with at least ``min_tokens`` tokens, if any."""
    lines = text.splitlines(keepends=True)
    counted = 0
    for end, line in enumerate(lines, start=1):
        counted += len(tokenizer.encode(line, add_special_tokens=False))
        if counted >= min_tokens:
            prefix = "".join(lines[:end])
            if len(tokenizer.encode(prefix, add_special_tokens=False)) >= min_tokens:
                return prefix
    return None


def _prefix_prompts(
    texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, min_tokens: int, count: int, rng: random.Random
) -> list[dict[str, object]]:
    """``count`` line-cut prefixes of distinct texts, drawn in a seeded order."""
    order = list(range(len(texts)))
    rng.shuffle(order)
    prompts = []
    for index in order:
        prefix = _prefix_at_line(texts[index], tokenizer, min_tokens)
        if prefix is not None and len(texts[index]) > len(prefix):
            prompts.append({"source_index": index, "prompt": prefix})
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out files have {min_tokens} tokens; {count} needed")


def _functions(text: str) -> list[str]:
    """Dedented source of every function (decorators excluded) in ``text``."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            found.append(textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])))
    return found


def _edit_prompts(
    texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, config: WorkloadConfig, rng: random.Random
) -> list[dict[str, object]]:
    """Prompts that show a function and ask for it again, starting its first line."""
    candidates = []
    for index, text in enumerate(texts):
        for function in _functions(text):
            size = len(tokenizer.encode(function, add_special_tokens=False))
            if config.edit_min_tokens <= size <= config.edit_max_tokens:
                candidates.append((index, function))
    if len(candidates) < config.num_edit:
        raise ValueError(f"only {len(candidates)} functions of the wanted size; {config.num_edit} needed")
    chosen = rng.sample(candidates, config.num_edit)
    return [
        {
            "source_index": index,
            "prompt": function.rstrip("\n") + "\n" + EDIT_INSTRUCTION + function.splitlines(keepends=True)[0],
            "reference": function,
        }
        for index, function in chosen
    ]


def build_workloads(
    heldout_paths: Sequence[str],
    heldout_texts: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    config: WorkloadConfig = WorkloadConfig(),
    python_version: str = "",
) -> dict[str, object]:
    """Build all workloads from the held-out files; the result is ready for JSON."""
    if len(heldout_paths) != len(heldout_texts):
        raise ValueError("heldout_paths and heldout_texts must have the same length")
    rng = random.Random(config.seed)
    built = {
        "completion": _prefix_prompts(heldout_texts, tokenizer, config.completion_tokens, config.num_completion, rng),
        "edit": _edit_prompts(heldout_texts, tokenizer, config, rng),
        "long": _prefix_prompts(heldout_texts, tokenizer, config.long_tokens, config.num_long, rng),
    }
    for entries in built.values():
        for entry in entries:
            entry["source"] = heldout_paths[entry.pop("source_index")]
            entry["num_tokens"] = len(tokenizer.encode(entry["prompt"], add_special_tokens=False))
    return {"version": WORKLOADS_VERSION, "python_version": python_version, "seed": config.seed, "workloads": built}


def write_workloads(workloads: dict[str, object], path: Path) -> None:
    """Write workloads as sorted-key JSON."""
    path.write_text(json.dumps(workloads, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def workloads_path() -> Path:
    """Location of the committed ``workloads.json``."""
    return testbed_dir() / "workloads.json"


def load_workload(name: str, path: Path | None = None) -> list[str]:
    """The prompts of workload ``name`` from the committed JSON (or ``path``)."""
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOAD_NAMES}")
    data = json.loads((path or workloads_path()).read_text(encoding="utf-8"))
    if data.get("version") != WORKLOADS_VERSION:
        raise ValueError(f"workloads version {data.get('version')!r} is not {WORKLOADS_VERSION}")
    return [entry["prompt"] for entry in data["workloads"][name]]
