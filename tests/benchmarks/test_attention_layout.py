"""benchmarks/attention_layout.py: every case measured, on both layouts, and a bad head count refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def test_rows_cover_every_case(benchmark_script, tmp_path):
    module = benchmark_script("attention_layout")
    out = tmp_path / "layout.json"
    rows = module.main(["--dtype", "float32", "--context", "5", "--widths", "1", "3", "--heads", "4", "--kv-heads",
                        "2", "--head-dim", "8", "--repeats", "1", "--calls", "1", "--json", str(out)])
    assert [(row["width"], row["masked"]) for row in rows] == [(1, False), (1, True), (3, True)]
    assert all(row["sdpa_ms"] > 0 and row["packed_ms"] > 0 for row in rows)
    report = json.loads(out.read_text())
    assert report["results"] == rows and report["environment"]["device"] == "cpu"


def test_both_layouts_compute_the_same_attention(benchmark_script):
    """What is timed is the same attention: the engine's packed layout against transformers' sdpa path."""
    module = benchmark_script("attention_layout")
    for width, masked in ((1, False), (1, True), (4, True)):
        inputs = module.step_inputs(6, 2, 8, 11, width, masked, torch.float32)
        expected, _ = sdpa_attention_forward(*inputs)
        torch.testing.assert_close(module._packed(*inputs), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv", [["--heads", "5", "--kv-heads", "2"], ["--device", "cuda"]])
def test_bad_options_are_refused(benchmark_script, argv):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit):
        benchmark_script("attention_layout").main(argv)
