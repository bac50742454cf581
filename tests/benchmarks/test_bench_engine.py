"""Smoke test of benchmarks/bench_engine.py: a --quick run in-process reports every case, each equal to plain greedy.

It checks what the benchmark reports, never how fast anything was.
"""

from __future__ import annotations

import json
from pathlib import Path

DRAFTS = ("random", "distilled", "copy")


def expected_cases(batch_sizes: list[int]) -> set[tuple[int, str]]:
    cases = set()
    for batch in batch_sizes:
        cases |= {(batch, "plain"), (batch, "hf_specdec.ngram")}
        cases |= {(batch, f"hf_specdec.draft[{draft}]") for draft in DRAFTS}
    cases |= {(1, "prompt_lookup")} | {(1, f"assistant_model[{draft}]") for draft in DRAFTS}
    return cases


def test_quick_run_reports_every_case_equal_to_plain(tmp_path: Path, benchmark_script) -> None:
    out = tmp_path / "engine.json"
    assert benchmark_script("bench_engine").main(["--quick", "--json", str(out)]) == 0

    text = out.read_text()
    results = json.loads(text)
    assert text == json.dumps(results, indent=2, sort_keys=True) + "\n"
    records = results["results"]
    batch_sizes = results["settings"]["batch_sizes"]
    assert 1 in batch_sizes and max(batch_sizes) > 1
    assert {(r["batch_size"], r["case"]) for r in records} == expected_cases(batch_sizes)
    assert [r["case"] for r in records if not r["matches_plain"]] == []
    for record in records:
        assert len(record["seconds"]) == results["settings"]["repeats"]
        assert record["target_forwards"] >= 1
        if record["case"] == "plain":
            assert record["tokens_per_target_forward"] == 1.0
    assert {type(goal["passed"]) for goal in results["goals"]} == {bool}
    for goal in results["goals"]:  # a goal passes only by both statistics
        assert goal["passed"] == (min(goal["ratio_paired"], goal["ratio_best"]) >= goal["target"])
