"""examples/quickstart.py runs, and labels tokens per target forward and mean acceptance length apart."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


@pytest.fixture
def one_thread():
    """One torch thread: on a shared machine, threads fighting over cores make this run many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quickstart_prints_tokens_per_forward_and_mean_acceptance_length(capsys, one_thread):
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    text = capsys.readouterr().out
    per_row = re.search(r"tokens per target forward, per row: ([\d. ]+?)  \(", text)
    mean_length = re.search(r"mean acceptance length: ([\d.]+)", text)
    assert per_row and mean_length, text
    values = [float(v) for v in per_row.group(1).split()]
    assert len(values) == 3  # one per prompt
    # The n-gram drafts at most 5 tokens (SpeculativeConfig's default k), so a forward emits at most 6; the first
    # row has steps where it finds no match, which the mean acceptance length leaves out.
    assert all(1.0 <= v <= 6.0 for v in values)
    assert values[0] < float(mean_length.group(1))
