"""benchmarks/attention_layout.py: every case measured, on both layouts, and a bad head count refused."""

from __future__ import annotations

import pytest


def test_rows_cover_every_case(benchmark_script):
    module = benchmark_script("attention_layout")
    rows = module.main(["--dtype", "float32", "--context", "5", "--widths", "1", "3", "--heads", "4", "--kv-heads",
                        "2", "--head-dim", "8", "--repeats", "1", "--calls", "1"])
    assert [(row["width"], row["masked"]) for row in rows] == [(1, False), (1, True), (3, True)]
    assert all(row["sdpa_ms"] > 0 and row["packed_ms"] > 0 for row in rows)


def test_heads_must_group(benchmark_script):
    module = benchmark_script("attention_layout")
    with pytest.raises(SystemExit):
        module.main(["--heads", "5", "--kv-heads", "2"])
