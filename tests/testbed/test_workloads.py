"""The committed benchmark prompts."""

import json
import sys

import pytest
from transformers import AutoTokenizer

from hf_specdec.testbed.corpus import SplitConfig, split_corpus
from hf_specdec.testbed.loading import testbed_dir as find_testbed
from hf_specdec.testbed.workloads import (
    EDIT_INSTRUCTION,
    WORKLOAD_NAMES,
    WORKLOADS_VERSION,
    WorkloadConfig,
    build_workloads,
    load_workload,
    workloads_path,
)

EXPECTED_COUNTS = {"completion": 32, "edit": 32, "long": 8}


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_workload_counts(name: str) -> None:
    prompts = load_workload(name)
    assert len(prompts) == EXPECTED_COUNTS[name]
    assert all(isinstance(p, str) and p.strip() for p in prompts)


def test_json_version_and_metadata() -> None:
    data = json.loads(workloads_path().read_text(encoding="utf-8"))
    assert data["version"] == WORKLOADS_VERSION
    assert set(data["workloads"]) == set(WORKLOAD_NAMES)
    completion = [e["num_tokens"] for e in data["workloads"]["completion"]]
    long = [e["num_tokens"] for e in data["workloads"]["long"]]
    assert min(completion) >= 200 and max(completion) < 300
    assert min(long) >= 1500 and max(long) < 1700


def test_edit_prompts_restart_the_shown_function() -> None:
    for prompt in load_workload("edit"):
        shown, restart = prompt.split(EDIT_INSTRUCTION)
        assert restart.endswith("\n") and restart.count("\n") == 1
        assert shown.startswith(restart)


def test_prompts_end_at_a_line_boundary() -> None:
    assert all(p.endswith("\n") for name in ("completion", "long") for p in load_workload(name))


def test_unknown_workload_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")


def test_committed_workloads_match_a_rebuild() -> None:
    data = json.loads(workloads_path().read_text(encoding="utf-8"))
    if data["python_version"] != ".".join(map(str, sys.version_info[:3])):
        pytest.skip(f"workloads were built from the Python {data['python_version']} stdlib")
    tokenizer = AutoTokenizer.from_pretrained(find_testbed() / "tokenizer", local_files_only=True)
    split = split_corpus(SplitConfig(seed=data["seed"]))
    rebuilt = build_workloads(
        split.heldout, split.texts("heldout"), tokenizer, WorkloadConfig(seed=data["seed"]),
        python_version=data["python_version"],
    )
    assert rebuilt == data
