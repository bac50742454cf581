"""Smoke test of benchmarks/bench_tree_mask.py: without a CUDA device it says so and exits 0."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tree_mask.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the benchmark times the kernel")
def test_bench_without_cuda_skips_with_a_message(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_tree_mask", BENCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_bench_inputs_are_a_consistent_tree_and_cache():
    spec = importlib.util.spec_from_file_location("bench_tree_mask_inputs", BENCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    valid, positions, query_positions, ancestor_bits = module.make_inputs(2, 65, 30, torch.device("cpu"))
    assert ancestor_bits.shape == (2, 65, 2)
    assert torch.equal(query_positions[:, 0], valid.sum(dim=1))  # the root follows the cached tokens
    assert (positions[valid] >= 0).all()
