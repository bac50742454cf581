"""benchmarks/head_step_profile.py runs for EAGLE and Medusa and its parts add up (a smoke test; no speed is
asserted)."""

import re

import pytest


@pytest.mark.parametrize("argv", [["--method", "eagle", "--top-k", "2"], ["--method", "medusa", "-k", "3"]])
def test_head_step_profile_runs(capsys, argv, benchmark_script):
    benchmark_script("head_step_profile").main([*argv, "--prompts", "1", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    total = float(re.search(r"([\d.]+) ms per step\n", out).group(1))
    parts = [float(x) for x in re.findall(r"^  \S.*?\s([\d.]+) ms per step", out, flags=re.M)]
    assert len(parts) == 3 and abs(sum(parts) - total) < 0.05
